"""Batch plans and packers (data/batching.py): the batches every plan makes, pinned, and their
contracts (random access, the same global batch for any process count, what each plan groups)."""
import hashlib

import grain
import numpy as np
import pytest

from data import batching, lm, sources, token_cache
from data.tokenizers import CharTokenizer

PAD, BOS = 0, 1


def digest(batches) -> str:
  """A short hash of a sequence of batches (names, dtypes, shapes and values)."""
  h = hashlib.sha256()
  for batch in batches:
    for name in sorted(batch):
      array = np.ascontiguousarray(batch[name])
      h.update(f'{name}{array.dtype}{array.shape}'.encode())
      h.update(array.tobytes())
  return h.hexdigest()[:16]


def as_dataset(arrays):
  count = len(next(iter(arrays.values())))
  return grain.MapDataset.range(count).map(lambda i: {k: v[i] for k, v in arrays.items()})


def ragged_pairs(count, length, seed, max_tokens=None):
  """{'source', 'target_in', 'target_out'} [count, length] right-padded rows of 1 to `max_tokens`
  (default length - 1) tokens a side."""
  rng = np.random.default_rng(seed)
  examples = {name: np.full((count, length), PAD, np.int32) for name in ('source', 'target_in', 'target_out')}
  for row in range(count):
    s, t = rng.integers(1, max_tokens or length, 2)
    examples['source'][row, :s] = rng.integers(3, 50, s)
    target = rng.integers(3, 50, t)
    examples['target_in'][row, :t] = np.concatenate([[BOS], target[:-1]])
    examples['target_out'][row, :t] = target
  return examples


def draw(example, rng):
  return {**example, 'noise': rng.integers(0, 1 << 30, 2)}


TOY = as_dataset({'x': np.arange(37 * 3, dtype=np.int32).reshape(37, 3), 'y': np.arange(37, dtype=np.float32)})
PAIRS = as_dataset(ragged_pairs(300, 24, seed=1))
ROWS = as_dataset({'tokens': (np.arange(8 * 40, dtype=np.int32).reshape(8, 40) * 7) % 101})

# Batches 0..39 of global batch size 8, seed 5, and batch 33 read alone, for 1 and 2 processes:
# the hashes of what the code made before it moved here (train/task.py, train/tasks/transformer.py,
# train/tasks/rnn_lm.py, train/tasks/bert.py), so runs and resumes read the same batches.
PINNED = {
    'shuffled': (batching.Shuffled(), TOY, {
        (0, 1): ('4d4209381fd61557', '0cc24cf808302e7b'), (0, 2): ('9a62a4dd5bb899cc', 'ca44d8502e1b344a'),
        (1, 2): ('998a99e1f2df59e6', 'adbbf7f05ce0f786')}),
    'drawn': (batching.Shuffled(draw=draw, draw_seed_offset=3), TOY, {
        (0, 1): ('40c03469139904de', '92b42ac797278ae6'), (0, 2): ('73f0c927fbf437c1', 'b687ad41a00f8597'),
        (1, 2): ('29deb39414f76ecc', '9f51ea5c5ef9bf4e')}),
    'buckets': (batching.LengthBuckets(PAD, seq_len=24, smallest=8), PAIRS, {
        (0, 1): ('d74aa6bc9a21e569', 'd3acc8ce03dfb1b2'), (0, 2): ('69f7b91167883d8a', 'b21217050c0e899d'),
        (1, 2): ('ba8d34e1be129428', '6347c902f3e33086')}),
    'packed': (batching.Packed(PAD), PAIRS, {
        (0, 1): ('32558988cb172f9e', 'b94d564b37ff358b'), (0, 2): ('090c021a8899236c', 'bb5c1e51620012ca'),
        (1, 2): ('ffcd5aa706538a9b', '839e797fe9e73415')}),
    'stream': (batching.Stream(seq_len=5), ROWS, {
        (0, 1): ('0b5388179934c2d8', '3d5a0ef7eba518e4'), (0, 2): ('a371710bd0448683', '5937d31ccaef806d'),
        (1, 2): ('ceb990f11186f1c6', 'ca50f8a7582ead5b')}),
}


@pytest.mark.parametrize('name', PINNED)
def test_every_plan_makes_the_pinned_batches(name):
  plan, examples, expected = PINNED[name]
  for (index, count), (first_40, batch_33) in expected.items():
    batches = plan.global_batches(examples, 8, 5, index, count)
    assert (digest(batches[i] for i in range(40)), digest([batches[33]])) == (first_40, batch_33), (index, count)


@pytest.mark.parametrize('name', PINNED)
def test_two_processes_read_the_two_halves_of_each_global_batch(name):
  plan, examples, _ = PINNED[name]
  whole = plan.global_batches(examples, 8, 5, 0, 1)
  halves = [plan.global_batches(examples, 8, 5, index, 2) for index in (0, 1)]
  for i in (0, 7, 33):
    for key, value in whole[i].items():
      np.testing.assert_array_equal(np.concatenate([half[i][key] for half in halves]), value)


def test_shuffled_reads_every_example_once_an_epoch_and_draws_anew_each_epoch():
  batches = batching.Shuffled(draw=draw).global_batches(TOY, 8, 5, 0, 1)
  rows = [{k: v[r] for k, v in batches[i].items()} for i in range(9) for r in range(8)]  # 72 rows: ~2 epochs
  assert sorted(int(row['y']) for row in rows[:37]) == list(range(37))
  first, second = ({int(row['y']): tuple(row['noise']) for row in epoch} for epoch in (rows[:37], rows[37:72]))
  assert all(first[y] != second[y] for y in second)


def test_length_buckets_group_lengths_and_cover_each_window():
  examples = as_dataset(ragged_pairs(200, 32, seed=2))
  batch_size, window = 4, batching.BATCH_WINDOW
  batches = batching.LengthBuckets(PAD, seq_len=32, smallest=8).global_batches(examples, batch_size, 3, 0, 1)
  assert batching.bucket_lengths(32, 8) == [8, 12, 16, 24, 32]
  seen = []
  for i in range(window):
    b = batches[i]
    for name in ('source', 'target_in', 'target_out'):
      assert b[name].shape == (batch_size, b['source'].shape[1])
      assert b[name].shape[1] in batching.bucket_lengths(32, 8)
    # Nothing real is cut off: every row keeps its real tokens within the kept width.
    assert max((b[name] != PAD).sum(1).max() for name in ('source', 'target_out')) <= b['source'].shape[1]
    seen.extend(map(tuple, b['source'].tolist()))
  # The window's batches hold each of its examples once.
  assert len(set(seen)) == len(seen) == batch_size * window
  # Sorting by length inside a window makes batches much more uniform than random ones.
  lengths = lambda b: (b['source'] != PAD).sum(1)
  spread = np.mean([np.ptp(lengths(batches[i])) for i in range(window)])
  random_batches = examples.shuffle(seed=3).batch(batch_size)
  assert spread < np.mean([np.ptp(lengths(random_batches[i])) for i in range(window)])


def test_length_buckets_cut_texts_to_classify_and_keep_their_labels():
  """Classification rows: tokens, segments and valid [L] are cut together, the label [] stays
  with its text, and no real token is cut off."""
  rng = np.random.default_rng(6)
  count, length = 160, 40
  lengths = rng.integers(2, length + 1, count)
  tokens = np.where(np.arange(length) < lengths[:, None], rng.integers(3, 50, (count, length)), PAD).astype(np.int32)
  examples = as_dataset({'tokens': tokens, 'segments': np.zeros_like(tokens), 'valid': tokens != PAD,
                         'label': np.arange(count, dtype=np.int32)})  # the label names its row
  batches = batching.LengthBuckets(PAD, seq_len=length, smallest=8, length_fields=('tokens',)).global_batches(
      examples, 4, 3, 0, 1)
  widths = set()
  for i in range(batching.BATCH_WINDOW):
    b = batches[i]
    width = b['tokens'].shape[1]
    widths.add(width)
    assert b['segments'].shape == b['valid'].shape == (4, width) and b['label'].shape == (4,)
    for row, label in enumerate(b['label']):
      np.testing.assert_array_equal(b['tokens'][row], tokens[label, :width])
      assert lengths[label] <= width
      np.testing.assert_array_equal(b['valid'][row], np.arange(width) < lengths[label])
  assert widths <= set(batching.bucket_lengths(length, 8)) and len(widths) > 1


def test_packed_batches_have_one_shape_and_several_pairs_per_row():
  batches = batching.Packed(PAD).global_batches(as_dataset(ragged_pairs(300, 24, seed=4, max_tokens=8)), 4, 3, 0, 1)
  pairs = 0
  for i in range(batching.BATCH_WINDOW + 2):
    b = batches[i]
    assert all(v.shape == (4, 24) for v in b.values()), {k: v.shape for k, v in b.items()}
    np.testing.assert_array_equal(b['target_segments'] > 0, b['target_out'] != PAD)
    np.testing.assert_array_equal(b['source_segments'] > 0, b['source'] != PAD)
    pairs += int(b['target_segments'].max(1).sum())
  assert pairs > 2 * 4 * (batching.BATCH_WINDOW + 2)


def test_pack_pairs_places_each_pair_once_in_its_own_segment():
  examples = ragged_pairs(12, 24, seed=5, max_tokens=10)
  packed, left_out = batching.pack_pairs(examples, rows=5, pad_id=PAD)
  assert left_out == 0 and packed['source_segments'].max() >= 3
  for side, tokens in (('source', 'source'), ('target', 'target_out')):
    assert np.array_equal(packed[f'{side}_segments'] > 0, packed[tokens] != PAD)
    assert (packed[tokens] != PAD).sum() == (examples[tokens] != PAD).sum()
  _, left_out = batching.pack_pairs(examples, rows=1, pad_id=PAD)
  assert left_out > 0  # what finds no room is counted, not placed


# ----------------------------------------------------------------------------- token streams
DOCUMENTS = [(str(i), 'abcdefghij '[i % 7:] * (i % 5 + 1)) for i in range(40)]


def cached_stream(tmp_path, documents, tokenizer) -> token_cache.Stream:
  """The token stream of `documents` (one file each, in order) from a language-model cache, several
  shards of it."""
  (tmp_path / 'corpus').mkdir()
  for index, (_, text) in enumerate(documents):
    (tmp_path / 'corpus' / f'{index:02d}.txt').write_text(text)
  corpus, carve, _ = lm.plan_corpus(f'text:{tmp_path}/corpus/*.txt', False, 0, 'train', 40)
  assert len(corpus.shards) > 1
  token_cache.build(str(tmp_path / 'cache'), corpus, lm.Tokens(tokenizer), carve, {}, progress=False)
  return token_cache.Stream(token_cache.Cache(str(tmp_path / 'cache')), 'all')


def test_token_streams_and_their_windows_are_pinned(tmp_path):
  """The pins are those of the in-memory packer the cache replaced: the same tokens and windows."""
  tok = CharTokenizer.train(['abcdefgh ij'])
  cached = cached_stream(tmp_path, DOCUMENTS, tok)
  stream = cached.read(0, len(cached))
  windows = lambda limit=0: np.stack([w['tokens'] for w in token_cache.Windows(cached, 7, 7, limit)])
  pinned = {'lm.pack': ('2950fb25d0e84abf', windows()),
            'lm.pack.cap': ('97ead63ca109fe2e', windows(5)),
            'stream': ('cd11ac5ff29526ad', stream),
            'stream.cap': ('71ed88f651ae5de1', cached[:77][0:77]),
            'windows': ('17752b3ff70f09fb', batching.stream_windows(stream, 6, stride=6)),
            'rows': ('de2c4263cd4b16e6', batching.stream_rows(stream, 4, 6))}
  key = {'lm.pack': 'w', 'lm.pack.cap': 'w', 'stream': 's', 'stream.cap': 's', 'windows': 'w', 'rows': 'r'}
  for name, (expected, array) in pinned.items():
    assert digest([{key[name]: array}]) == expected, name


def test_token_stream_joins_documents_with_eos_and_reads_across_shards(tmp_path):
  tok = CharTokenizer.train(['abc'])
  a, b, c, eos = (*(tok.encode(x)[0] for x in 'abc'), tok.eos_id)
  stream = cached_stream(tmp_path, [('1', 'ab' * 30), ('2', 'c' * 30)], tok)
  expected = [a, b] * 30 + [eos] + [c] * 30 + [eos]
  np.testing.assert_array_equal(stream.read(0, len(stream)), expected)
  np.testing.assert_array_equal(stream[58:64][1:5], expected[59:63])  # a slice across the two shards
  assert stream.read(0, 0).dtype == np.int32 and stream.documents == 2


def test_stream_windows_disjoint_or_sharing_one_token():
  stream = np.arange(23, dtype=np.int32)
  disjoint = batching.stream_windows(stream, 5, stride=6)
  np.testing.assert_array_equal(disjoint, np.arange(18).reshape(3, 6))
  shared = batching.stream_windows(stream, 5, stride=5)
  assert shared.shape == (4, 6)
  np.testing.assert_array_equal(shared[:, 1:].ravel(), np.arange(1, 21))  # every target exactly once
  assert batching.stream_windows(stream, 5, stride=5, max_windows=2).shape == (2, 6)
  with pytest.raises(sources.DataError, match='fewer than one sequence'):
    batching.stream_windows(stream[:5], 5, stride=5)


def test_sequential_batches_continue_each_row():
  stream = np.arange(1000, dtype=np.int32)
  row_array = batching.stream_rows(stream, 4, 5)
  assert np.shape(row_array) == (4, 250)
  batches = batching.sequential_batches(row_array, 5, seed=0)
  per_pass = (250 - 5) // 5
  for k in range(per_pass - 1):
    now, after = batches[k]['tokens'], batches[k + 1]['tokens']
    assert now.shape == (4, 6)
    # Window k+1 of a row starts where window k's targets end: the carried state is its history.
    np.testing.assert_array_equal(after[:, 0], now[:, -1])
    np.testing.assert_array_equal(np.diff(now, axis=1), 1)
    assert batches[k + 1]['reset'].tolist() == [False] * 4
  assert batches[0]['reset'].all() and batches[per_pass]['reset'].all()
  # Rows are consecutive pieces of the stream, and each pass starts at a fresh offset below seq_len.
  np.testing.assert_array_equal(batches[0]['tokens'][:, 0] % 250, batches[0]['tokens'][0, 0])
  offsets = {int(batches[e * per_pass]['tokens'][0, 0]) for e in range(8)}
  assert offsets <= set(range(5)) and len(offsets) > 1


def test_stream_needs_one_example_per_row_and_enough_tokens():
  with pytest.raises(ValueError, match='one example per row'):
    batching.Stream(seq_len=5).global_batches(ROWS, 4, 0, 0, 1)
  with pytest.raises(sources.DataError, match='Sequential partitioning'):
    batching.stream_rows(np.arange(100, dtype=np.int32), 8, 5)
