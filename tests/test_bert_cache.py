"""BERT pretraining caches (data/bert_data.py, pretraining_datasets): the cached pairs equal an
independent reference written here (the documents, their split, the shards, and
create_pretraining_data.py's pairing per shard with the shard's own RNG) for text files of both
document layouts, TFDS records and a document larger than a shard; random next sentences never
leave their shard and NSP stays 50/50; a second run tokenizes and reads nothing; a damaged shard
is one DataError line."""
import hashlib
import os
import re

import numpy as np
import pytest

from configs import bert
from data import bert_data, sources, tokenizers
from data.sources import DataError

SEED = 3
SHARD_BYTES = 2097  # data.cache_shard_mb=0.002
WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho'.split()


def data_config(source, cache_dir, **overrides):
  """The tiny preset's data on `source`, cached under `cache_dir` in ~2 KB shards, every pair kept."""
  config = bert.get_config('tiny').data
  config.update({'source': source, 'cache_dir': str(cache_dir), 'max_examples': 0, 'dupe_factor': 2,
                 'cache_shard_mb': 0.002, **overrides})
  return config


def documents(count, seed=0, words=WORDS, sentences=(2, 9)):
  """`count` documents of capitalised sentences over `words`, one sentence a line."""
  rng = np.random.default_rng(seed)
  return ['\n'.join(' '.join(rng.choice(words, rng.integers(3, 12))).capitalize() + '.'
                    for _ in range(rng.integers(*sentences))) for _ in range(count)]


def write_files(directory, texts) -> str:
  os.makedirs(directory, exist_ok=True)
  for i, text in enumerate(texts):
    with open(os.path.join(directory, f'doc{i:03d}.txt'), 'w') as f:
      f.write(text)
  return f'text:{directory}/*.txt'


def stacked(rows) -> dict[str, np.ndarray]:
  """A Rows split stacked: {field: [N, ...]}."""
  items = [rows[i] for i in range(len(rows))]
  return {field: np.stack([item[field] for item in items]) for field in bert_data.FIELDS}


# ----------------------------------------------------------------------------- an independent reference
def in_pieces(raw: bytes, step: int) -> list[tuple[int, int]]:
  """[start, end) of a file read in pieces: cut after the first blank line (else line end) at or past
  every `step` bytes from the last cut."""
  cuts = [0]
  while len(raw) - cuts[-1] > step:
    match = re.compile(rb'\n\s*\n').search(raw, cuts[-1] + step) or re.compile(rb'\n').search(raw, cuts[-1] + step)
    cuts.append(match.end() if match else len(raw))
  cuts.append(len(raw))
  return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def grouped(pieces: list, size, shard_bytes: int, apart=lambda piece: False) -> list[list]:
  """Consecutive pieces in shards of at most `shard_bytes` of text (a larger one alone), a new shard
  where `apart` of a piece differs from the piece's before it."""
  shards, total = [[]], 0
  for piece in pieces:
    if shards[-1] and (total + size(piece) > shard_bytes or apart(piece) != apart(shards[-1][-1])):
      shards.append([])
      total = 0
    shards[-1].append(piece)
    total += size(piece)
  return shards


def split_of(key: str, carved: bool = True, held: frozenset = frozenset()) -> str:
  """'valid' when carved for the files `held` out, and for EVAL_FRACTION of the other keys (records,
  blank-line documents) by SHA-256 of (0, key); else 'train'."""
  share = int.from_bytes(hashlib.sha256(f'0:{key}'.encode()).digest()[:8], 'big') / 2**64
  return 'valid' if carved and (key in held if held else share >= 0.95) else 'train'


def held_files(paths) -> frozenset:
  """The files a carve holds out of a source far under sources.HELD_OUT_BYTES (the held-out rule of
  data/sources.py, written out here): in the order of SHA-256 of (0, name), until there are two
  (the floor) holding 5% of the bytes."""
  sizes = {os.path.basename(path): os.path.getsize(path) for path in paths}
  held, total = [], 0
  for name in sorted(sizes, key=lambda name: hashlib.sha256(f'0:{name}'.encode()).digest()):
    if len(held) >= 2 and total >= 0.05 * sum(sizes.values()):
      break
    held, total = held + [name], total + sizes[name]
  return frozenset(held)


def reference_shards(layout: str, inputs, shard_bytes: int, held=frozenset()) -> list[list[tuple[str, str]]]:
  """Per shard, its (key, text) documents in order: TFDS records shard_bytes // 256 a shard; a
  file's pieces of about a quarter of a shard, each a document keyed by its file (every piece of
  it), the files `held` out last, in shards of their own; or its blocks between blank lines (keyed
  file:offset)."""
  if layout == 'tfds':
    step = shard_bytes // 256
    records = [(f'fake:train:{i}', r['text'].decode()) for i, r in enumerate(inputs)]
    return [records[a:a + step] for a in range(0, len(records), step)]
  inputs = sorted(inputs, key=lambda path: os.path.basename(path) in held)
  pieces = [(os.path.basename(path), open(path, 'rb').read(), start, end) for path in inputs
            for start, end in in_pieces(open(path, 'rb').read(), shard_bytes // 4)]
  shards = []
  for shard in grouped(pieces, lambda piece: piece[3] - piece[2], shard_bytes, lambda piece: piece[0] in held):
    shards.append([])
    for key, raw, start, end in shard:
      if layout == 'blank_line':
        breaks = list(re.finditer(rb'\n\s*\n', raw[start:end]))
        starts, ends = [start] + [start + m.end() for m in breaks], [start + m.start() for m in breaks] + [end]
        blocks = [(f'{key}:{a}', raw[a:b].decode().removeprefix('\ufeff')) for a, b in zip(starts, ends)]
      else:
        blocks = [(key, raw[start:end].decode())]
      shards[-1] += [(k, text) for k, text in blocks if text.strip()]
  return shards


def reference_pairs(documents, max_tokens, short_seq_prob, dupe, rng) -> list:
  """create_pretraining_data.py's pairs of `documents` (lists of sentence ids), written out here:
  for each of `dupe` random orders of the documents, sentences gathered up to a target length (a
  random shorter one with probability short_seq_prob), cut at a random sentence into A and B (a lone
  sentence inside it), B replaced half the time by text from a random sentence of another document
  (the unused sentences start the next chunk), the longer side trimmed at a random end until they
  fit; then shuffled. The orders and the shuffle come from `rng`; every other choice from two
  generators spawned from it, drawn one number at a time: uniforms (an integer in [lo, hi) is
  lo + floor(u * (hi - lo))) and the trimming's coins (front when < 0.5)."""
  uniforms, coins = rng.spawn(2)
  below = lambda n: int(uniforms.random() * n)
  pairs = []
  new_target = lambda: 2 + below(max_tokens - 1) if uniforms.random() < short_seq_prob else max_tokens
  for _ in range(dupe):
    for index in rng.permutation(len(documents)):
      document, target = documents[index], new_target()
      chunk, length, i = [], 0, 0
      while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
          random_next = uniforms.random() < 0.5
          if len(chunk) == 1:
            if len(chunk[0]) < 2:
              chunk, length, i = [], 0, i + 1
              continue
            cut = 1 + below(len(chunk[0]) - 1)
            a, b = list(chunk[0][:cut]), list(chunk[0][cut:])
          else:
            a_end = 1 + below(len(chunk) - 1)
            a, b = sum(map(list, chunk[:a_end]), []), sum(map(list, chunk[a_end:]), [])
            if random_next:
              i -= len(chunk) - a_end
          if random_next:
            other = below(len(documents) - 1)
            other += other >= index
            b = []
            for sentence in documents[other][below(len(documents[other])):]:
              b += list(sentence)
              if len(b) >= max(target - len(a), 1):
                break
          while len(a) + len(b) > max_tokens:
            longer = a if len(a) > len(b) else b
            if coins.random() < 0.5:
              del longer[0]
            else:
              longer.pop()
          if a and b:
            pairs.append((a, b, int(random_next)))
          chunk, length, target = [], 0, new_target()
        i += 1
  return [pairs[k] for k in rng.permutation(len(pairs))]


def reference_rows(shards, split, tokenizer, config, carved=True, held=frozenset()) -> dict[str, np.ndarray]:
  """The rows of `split`, shard after shard: each shard's documents of the split (one sentence a line)
  paired alone, with the RNG of (seed + 1 for validation, shard index)."""
  rows = {field: [] for field in bert_data.FIELDS}
  for index, shard in enumerate(shards):
    texts = [text for key, text in shard if split_of(key, carved, held) == split]
    tokenized = [[tokenizer.encode(line.strip()) for line in text.splitlines() if line.strip()] for text in texts]
    tokenized = [[ids for ids in document if ids] for document in tokenized]
    tokenized = [document for document in tokenized if document]
    if len(tokenized) < 2:
      continue
    rng = np.random.default_rng([SEED + (split == 'valid'), index])
    for a, b, random_next in reference_pairs(tokenized, config.seq_len - 3, config.short_seq_prob,
                                             config.dupe_factor if split == 'train' else 1, rng):
      tokens = [tokenizer.bos_id] + a + [tokenizer.eos_id] + b + [tokenizer.eos_id]
      pad = config.seq_len - len(tokens)
      rows['tokens'].append(tokens + [tokenizer.pad_id] * pad)
      rows['segments'].append([0] * (len(a) + 2) + [1] * (len(b) + 1) + [0] * pad)
      rows['valid'].append([True] * len(tokens) + [False] * pad)
      rows['next_sentence'].append(random_next)
  return {field: np.asarray(value) for field, value in rows.items()}


def in_file_order(rows) -> dict[str, np.ndarray]:
  shards = [s for s in range(len(rows.cache.shards)) if rows.counts[s]]
  return {field: np.concatenate([rows.cache.array(s, f'{rows.split}.{field}') for s in shards])
          for field in bert_data.FIELDS}


@pytest.mark.parametrize('layout', ['blank_line', 'file', 'tfds', 'one huge document'])
def test_the_bert_cache_equals_an_independent_reference(tmp_path, monkeypatch, capsys, layout):
  texts = documents(300)
  settings = {'cache_shard_mb': 0.016}  # ~16 KB shards: several, each with validation documents
  if layout == 'blank_line':  # one file: documents between blank lines (a CRLF one and a BOM too)
    path = tmp_path / 'corpus.txt'
    path.write_bytes(('\ufeff' + '\n\n'.join(texts[:150]) + '\r\n \r\n' + '\n\n\n'.join(texts[150:])).encode())
    source, inputs = f'text:{path}', [str(path)]
  elif layout == 'file':
    source = write_files(tmp_path / 'corpus', texts)
    inputs = sorted(str(tmp_path / 'corpus' / name) for name in os.listdir(tmp_path / 'corpus'))
  elif layout == 'one huge document':  # a file of ~19 shards without a blank line: its parts are the documents
    os.makedirs(tmp_path / 'corpus')
    (tmp_path / 'corpus' / 'book.txt').write_text('\n'.join(texts))
    (tmp_path / 'corpus' / 'preface.txt').write_text(texts[0])
    source = f'text:{tmp_path}/corpus/*.txt'
    inputs = [str(tmp_path / 'corpus' / name) for name in ('book.txt', 'preface.txt')]
    settings = {'cache_shard_mb': 0.004, 'eval_source': write_files(tmp_path / 'valid', documents(4, seed=1))}
  else:
    records = [{'text': text.encode()} for text in texts]
    monkeypatch.setattr(sources, 'tfds_records', lambda name, split: records)
    source, inputs = 'tfds:fake', records
  config = data_config(source, tmp_path / 'cache', **settings)
  samples, train_tokenizer = [], tokenizers.train_tokenizer
  monkeypatch.setattr(tokenizers, 'train_tokenizer', lambda kind, sample, *args: (
      samples.append(list(sample)), train_tokenizer(kind, samples[-1], *args))[1])
  tokenizer, examples, caches = bert_data.pretraining_datasets(config, str(tmp_path / 'run'), SEED)
  carved = layout != 'one huge document'
  held = held_files(inputs) if layout == 'file' else frozenset()
  shards = reference_shards('file' if layout == 'one huge document' else layout, inputs,
                            int(config.cache_shard_mb * 2**20), held)
  assert len(shards) >= 4 and all(len(shard) >= 2 for shard in shards)
  assert caches['train'].startswith('bert-v') and (caches['train'] == caches['valid']) == carved
  train_texts = [text for shard in shards for key, text in shard if split_of(key, carved, held) == 'train']
  counts = {'train': len(train_texts), 'valid': sum(map(len, shards)) - len(train_texts)}
  lines = [line for line in capsys.readouterr().out.splitlines() if ' split: ' in line]
  assert lines[0] == f'train split: {counts["train"]} documents from {source}, ' + (
      'the documents not held out' if carved else 'whole (data.source)')
  if carved:
    sizes = {os.path.basename(path): os.path.getsize(path) for path in inputs} if held else {}
    share = sum(sizes[name] for name in held) / max(sum(sizes.values()), 1)
    assert lines[1] == f'valid split: {counts["valid"]} documents from {source}, ' + (
        f'{len(held)} documents by hash, {sources.percent(share)} of the text' if held else 'a 5% hash split')
  assert samples == [train_texts]  # the tokenizer trained on the training documents, in order
  for split in ('train', 'valid') if carved else ('train',):
    expected, got = reference_rows(shards, split, tokenizer, config, carved, held), in_file_order(examples[split])
    assert len(expected['tokens']) > (50 if split == 'train' else 5)
    for field in bert_data.FIELDS:
      np.testing.assert_array_equal(got[field], expected[field].astype(got[field].dtype), err_msg=f'{split} {field}')
    assert stacked(examples[split])['tokens'].dtype == np.int32


def unique_words(count, rng) -> list[str]:
  words = set()
  while len(words) < count:
    words.add(''.join(rng.choice(list('bcdfghjklmnpqrstvwxz'), 6)))
  return sorted(words)


def test_shards_pair_their_own_documents(tmp_path):
  """~2 KB shards of 60 one-file documents, each with words of its own: every pair's A is one
  document, B the next sentences of it or (random) another document of the same shard."""
  rng = np.random.default_rng(0)
  vocabulary = unique_words(60 * 5, rng)
  texts = [documents(1, seed=d, words=vocabulary[5 * d:5 * d + 5])[0] for d in range(60)]
  source = write_files(tmp_path / 'corpus', texts)
  tokenizer = tokenizers.train_wordpiece(vocabulary * 2 + ['.'] * 2, vocab_size=3000)  # every word one id
  assert all(len(tokenizer.encode(word)) == 1 for word in vocabulary)
  config = data_config(source, tmp_path / 'cache', dupe_factor=3)
  _, examples, caches = bert_data.pretraining_datasets(config, str(tmp_path / 'run'), SEED, tokenizer)
  paths = sorted(str(tmp_path / 'corpus' / name) for name in os.listdir(tmp_path / 'corpus'))
  shards = reference_shards('file', paths, SHARD_BYTES, held_files(paths))
  shard_of = {key: index for index, shard in enumerate(shards) for key, _ in shard}
  assert len(set(shard_of.values())) >= 4
  document_of = {tokenizer.token_id(word): f'doc{i // 5:03d}.txt' for i, word in enumerate(vocabulary)}
  for split in ('train', 'valid'):
    got = stacked(examples[split])
    labels = got['next_sentence']
    assert len(labels) > 50 or split == 'valid'
    for tokens, segments, valid, random_next in zip(got['tokens'], got['segments'], got['valid'], labels):
      side = lambda segment: {document_of[t] for t in tokens[valid & (segments == segment)] if t in document_of}
      (a,), b = side(0), side(1)
      if not b:  # B cut down to its full stop
        continue
      assert len(b) == 1 and shard_of[next(iter(b))] == shard_of[a], (a, b)  # never another shard's
      assert (a in b) != bool(random_next)
    if split == 'train':
      assert abs(labels.mean() - 0.5) < 0.08, labels.mean()
  cache = os.path.join(config.cache_dir, caches['train'])
  assert len([name for name in os.listdir(cache) if name.endswith('.train.tokens.npy')]) >= 4


def test_a_second_run_tokenizes_and_reads_nothing(tmp_path, monkeypatch):
  path = tmp_path / 'corpus.txt'
  path.write_text('\n\n'.join(documents(80)))
  config = data_config(f'text:{path}', tmp_path / 'cache', cache_shard_mb=0.005)
  calls = []
  encode_sentences = tokenizers.HFTokenizer.encode_sentences
  monkeypatch.setattr(tokenizers.HFTokenizer, 'encode_sentences',
                      lambda self, documents: (calls.append(len(documents)), encode_sentences(self, documents))[1])
  first = bert_data.pretraining_datasets(config, str(tmp_path / 'run1'), SEED)
  assert calls
  calls.clear()
  monkeypatch.setattr(bert_data.Documents, 'records', lambda *args: pytest.fail('the corpus was read again'))
  # Another workdir: the tokenizer comes from the cache directory, the pairs too.
  second = bert_data.pretraining_datasets(config, str(tmp_path / 'run2'), SEED)
  assert calls == [] and second[2] == first[2]
  for split in ('train', 'valid'):
    np.testing.assert_array_equal(stacked(second[1][split])['tokens'], stacked(first[1][split])['tokens'])


def test_a_damaged_shard_is_one_line(tmp_path):
  source = write_files(tmp_path / 'corpus', documents(60))
  config = data_config(source, tmp_path / 'cache', cache_shard_mb=0.005)
  _, _, caches = bert_data.pretraining_datasets(config, str(tmp_path / 'run'), SEED)
  shard = os.path.join(config.cache_dir, caches['train'], '00001.train.tokens.npy')
  with open(shard, 'r+b') as f:
    f.truncate(100)
  with pytest.raises(DataError) as error:
    bert_data.pretraining_datasets(config, str(tmp_path / 'run'), SEED)
  message = str(error.value)
  assert '\n' not in message and shard in message and 'rebuild' in message, message
