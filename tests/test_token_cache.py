"""Token caches (data/token_cache.py) through the language-model family (data/lm.py): the cached
streams equal an independent reference (each split's documents tokenized whole and joined with
EOS), an interrupted build resumes to the cache built in one go, a restart tokenizes nothing, two
processes build one cache and draw the global batches, two processes needing one new tokenizer
train it once, and every bad input is one DataError line."""
import errno
import glob
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

import storage
import support
from configs.base import base_config
from data import batching, lm, token_cache, tokenizers
from data.sources import DataError

SEED = 0
SHARD_BYTES = 1500  # a few lines of support.write_corpus: every file is cut into shards


def data_config(source, cache_dir, **overrides):
  """configs/base.py's data schema on `source`, caching under `cache_dir` in ~2 KB shards."""
  config = base_config('test').data
  config.update({'source': source, 'cache_dir': str(cache_dir), 'cache_shard_mb': 0.002, 'tokenizer': 'char',
                 'vocab_size': 300, 'seq_len': 32, 'max_examples': 0, **overrides})
  return config


def cache_files(directory) -> dict[str, bytes]:
  """{name: bytes} of a cache's files, temporary files left out."""
  return {name: open(os.path.join(directory, name), 'rb').read() for name in sorted(os.listdir(directory))
          if not name.endswith('.tmp')}


def shard_jsons(directory) -> list[dict]:
  return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(directory, '[0-9]*[0-9].json')))]


def all_tokens(directory, split) -> np.ndarray:
  stream = token_cache.Stream(token_cache.Cache(str(directory)), split)
  return stream.read(0, len(stream))


def draw(examples, batch_size=8, seed=5, batches=6, process_index=0, process_count=1) -> np.ndarray:
  """The first `batches` training batches (this process's rows) of the default plan: int32 [batches, B, L]."""
  plan = batching.Shuffled().global_batches(examples, batch_size, seed, process_index, process_count)
  return np.stack([plan[b]['tokens'] for b in range(batches)])


def build(source, tokenizer, directory, carve_valid=True, shard_bytes=SHARD_BYTES, processor=None, **kwargs):
  """An LM cache of `source` built with `tokenizer` into `directory` (what lm_streams builds)."""
  corpus, carve, _ = lm.plan_corpus(source, carve_valid, SEED, 'train', shard_bytes)
  token_cache.build(str(directory), corpus, processor or lm.Tokens(tokenizer), carve, {}, progress=False, **kwargs)
  return corpus


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """8 files of ~2.4 KB: 16 shards of SHARD_BYTES, the held-out files' among them."""
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')), files=8, lines=60)


@pytest.fixture(scope='module')
def bpe(corpus):
  texts = [open(path).read() for path in sorted(glob.glob(corpus.removeprefix('text:')))]
  return tokenizers.train_tokenizer('bpe', texts, 300)


# ----------------------------------------------------------------------------- an independent reference
def reference_documents(source: str, seed: int, carve: bool) -> dict[str, list[str]]:
  """{split: document texts} by the rule of data/sources.py for a source far under its cap, written
  out here: the files (not blank) keyed by their path relative to their folder, held out whole in the
  order of SHA-256 of (seed, key) until they are 2 (or 5% of the files, at least one) holding
  EVAL_FRACTION of the bytes; a single file's tail from the first newline between two printable
  ASCII characters after 95% of its bytes (a CRLF: before its '\\r')."""
  paths = sorted(glob.glob(source.removeprefix('text:')))
  texts = {os.path.basename(p): open(p, 'rb').read().decode().removeprefix('\ufeff') for p in paths}
  texts = {key: text for key, text in texts.items() if text.strip()}
  if not carve:
    return {'all': list(texts.values())}
  if len(texts) == 1:
    [raw] = [open(p, 'rb').read() for p in paths]
    match = re.compile(rb'[!-~](\r?)\n[!-~]').search(raw, int(len(raw) * 0.95))
    cut = match.start(1) if match.group(1) else match.end() - 1
    return {'train': [raw[:cut].decode()], 'valid': [raw[cut:].decode()]}
  sizes = {os.path.basename(p): os.path.getsize(p) for p in paths if os.path.basename(p) in texts}
  floor, valid = min(2, math.ceil(0.05 * len(texts))), []
  for key in sorted(texts, key=lambda key: hashlib.sha256(f'{seed}:{key}'.encode()).digest()):
    if len(valid) >= floor and sum(sizes[k] for k in valid) >= 0.05 * sum(sizes.values()):
      break
    valid.append(key)
  return {'train': [t for k, t in texts.items() if k not in valid], 'valid': [texts[k] for k in valid]}


def reference_stream(documents: list[str], tokenizer) -> np.ndarray:
  return np.asarray([i for text in documents for i in tokenizer.encode(text) + [tokenizer.eos_id]], np.int32)


def write_one_file(path, lines=700) -> str:
  """One ~20 KB file of `lines` lines: in 4 KB shards, the held-out tail in the last."""
  support.write_corpus(str(path.parent / 'scratch'), files=1, lines=lines, seed=3)
  os.replace(path.parent / 'scratch' / 'doc0.txt', path)
  return f'text:{path}'


@pytest.mark.parametrize('kind', ['bpe', 'char'])
@pytest.mark.parametrize('layout', ['several files', 'one large file', 'named eval and test sources'])
def test_the_cached_streams_equal_an_independent_reference(layout, kind, tmp_path, monkeypatch):
  # Small items: a shard's text reaches the tokenizer in several, cut at safe places.
  monkeypatch.setattr(lm, 'PIECE_BYTES', 300)
  monkeypatch.setattr(token_cache, 'SAFE_CUT_SEARCH', 200)
  overrides = {'tokenizer': kind, 'cache_shard_mb': 0.004}
  if layout == 'several files':
    source = support.write_corpus(str(tmp_path / 'corpus'), files=8, lines=60)
    (tmp_path / 'corpus' / 'blank.txt').write_text('\ufeff\n \t\n\u00a0\r\n')  # no document
  elif layout == 'one large file':
    source = write_one_file(tmp_path / 'corpus.txt')
  else:
    source = support.write_corpus(str(tmp_path / 'corpus'), files=5, lines=60)
    overrides['eval_source'] = write_one_file(tmp_path / 'valid.txt', lines=150)
    overrides['test_source'] = support.write_corpus(str(tmp_path / 'test'), files=3, lines=30, seed=2)
  config = data_config(source, tmp_path / 'cache', **overrides)
  tokenizer, train, valid, test, caches = lm.lm_datasets(config, str(tmp_path / 'run'), SEED)
  directory = tmp_path / 'cache' / caches['train']
  jsons = shard_jsons(directory)
  assert len(jsons) >= 3  # several shards
  if layout == 'one large file':
    assert len(jsons) >= 4 and all(set(j['lengths']) == {'train.tokens'} for j in jsons[:-1])
    assert set(jsons[-1]['lengths']) == {'train.tokens', 'valid.tokens'}  # the tail, held out
    assert sum(j['info']['documents'].get('train', 0) for j in jsons) == 1  # the training text: one document

  carved = reference_documents(source, SEED, carve=layout != 'named eval and test sources')
  reference = {'train': carved.get('train', carved.get('all')), 'valid': carved.get('valid')}
  if layout == 'named eval and test sources':
    reference['valid'] = reference_documents(overrides['eval_source'], SEED, carve=False)['all']
    reference['test'] = reference_documents(overrides['test_source'], SEED, carve=False)['all']
  else:
    reference['test'] = reference['valid']
  cached = {'train': train, 'valid': valid, 'test': test}
  for split in ('train', 'valid', 'test'):
    stream = reference_stream(reference[split], tokenizer)
    windows = stream[:len(stream) // 33 * 33].reshape(-1, 33)
    assert len(cached[split]) == len(windows) > 8
    np.testing.assert_array_equal(np.stack([cached[split][i]['tokens'] for i in range(len(windows))]), windows)
  windows = reference_stream(reference['train'], tokenizer)
  windows = windows[:len(windows) // 33 * 33].reshape(-1, 33)
  for seed in (5, 6):
    np.testing.assert_array_equal(draw(train, seed=seed),
                                  draw(grain.MapDataset.source([{'tokens': row} for row in windows]), seed=seed))


TRICKY_LINES = [
    'alpha beta gamma\r\n',  # CRLF lines
    'delta epsilon\r\n',
    '    def indented(self):\n',
    '\treturn zeta + eta\n',
    'theta iota\u00a0\n',  # a non-breaking space before a newline
    '\u00a0kappa lambda\n',  # and after one
    '\n',
    '\n',
    'mu nu.  \n',  # trailing spaces
    "it's xi's omicron; don't\n",
    'pi caf\u00e9 na\u00efve \u6771\u4eac \U0001f642\n',
    '\u6771\u4eac\n',
    '12345 67.89 rho\n',
    '  sigma(tau, upsilon)\r\n',
]


def tricky_text() -> str:
  """~7 KB of the lines above in a seeded order, a very long line (~500 bytes) in the middle."""
  rng = np.random.default_rng(0)
  lines = [TRICKY_LINES[i] for i in rng.integers(len(TRICKY_LINES), size=400)]
  lines.insert(200, ' '.join(f'{w}{i}' for i, w in enumerate(support.WORDS * 3)) + '\n')
  return ''.join(lines)


def items(corpus) -> list[str]:
  """The texts the LM processor hands the tokenizer, every shard's in order."""
  return [text for shard in corpus.shards for piece in shard for _, (text, _) in lm.Tokens().records(piece, {})]


@pytest.mark.parametrize('kind', ['bpe', 'wordpiece', 'char'])
def test_text_tokenized_in_pieces_gives_the_tokens_of_the_whole_document(kind, tmp_path, monkeypatch):
  monkeypatch.setattr(lm, 'PIECE_BYTES', 48)
  monkeypatch.setattr(token_cache, 'SAFE_CUT_SEARCH', 600)  # more than the long line: cut at safe newlines only
  text = tricky_text()
  path = tmp_path / 'tricky.txt'
  path.write_bytes(('\ufeff' + text).encode())  # a byte-order mark: not text
  tokenizer = tokenizers.train_tokenizer(kind, [text], 400)
  corpus = build(f'text:{path}', tokenizer, tmp_path / 'cache', carve_valid=False, shard_bytes=1600)
  pieces = items(corpus)
  assert len(corpus.shards) >= 4 and len(pieces) >= 40  # cut into shards, and shards into pieces
  assert ''.join(pieces) == text
  np.testing.assert_array_equal(all_tokens(tmp_path / 'cache', 'all'), tokenizer.encode(text) + [tokenizer.eos_id])
  cuts = np.cumsum([len(piece) for piece in pieces])[:-1]
  assert any('\r\n' in text[cut - 2:cut + 2] for cut in cuts)  # some cuts fell at a CRLF


def test_a_stretch_without_a_safe_newline_is_cut_at_a_character_boundary(tmp_path, monkeypatch):
  """No byte lost, no character split: the characters' tokens are the whole text's."""
  monkeypatch.setattr(lm, 'PIECE_BYTES', 50)
  monkeypatch.setattr(token_cache, 'SAFE_CUT_SEARCH', 30)
  text = ('caf\u00e9 \u6771\u4eac\U0001f642 x' * 200 + '\n') * 3
  path = tmp_path / 'long.txt'
  path.write_text(text, encoding='utf-8')
  tokenizer = tokenizers.train_tokenizer('char', [text], 0)
  corpus = build(f'text:{path}', tokenizer, tmp_path / 'cache', carve_valid=False, shard_bytes=1000)
  assert len(corpus.shards) >= 10 and ''.join(items(corpus)) == text
  np.testing.assert_array_equal(all_tokens(tmp_path / 'cache', 'all'), tokenizer.encode(text) + [tokenizer.eos_id])


# ----------------------------------------------------------------------------- resumable building
class Counted(lm.Tokens):
  """The LM processor, noting the shards it encodes."""

  def __init__(self, tokenizer, built):
    super().__init__(tokenizer)
    self.built = built

  def encode(self, split, records, index, info):
    self.built.append(index)
    return super().encode(split, records, index, info)


def test_an_interrupted_build_resumes_at_its_first_unfinished_shard_and_equals_a_build_in_one_go(
    corpus, bpe, tmp_path, monkeypatch):
  whole = tmp_path / 'whole'
  plan = build(corpus, bpe, whole)
  count = len(plan.shards)
  assert count >= 10
  expected = cache_files(whole)
  assert len([name for name in expected if name.endswith('.npy')]) == count  # one split per shard here

  built, real_write = [], storage.write_atomically

  def interrupted_before_the_json_of_shard_2(location, data):
    if os.path.basename(str(location)) == '00002.json':
      raise KeyboardInterrupt  # Ctrl-C after shard 2's tokens were written, before the json that completes it
    return real_write(location, data)

  monkeypatch.setattr(storage, 'write_atomically', interrupted_before_the_json_of_shard_2)
  resumed = tmp_path / 'resumed'
  with pytest.raises(KeyboardInterrupt):
    build(corpus, bpe, resumed, processor=Counted(bpe, built))
  assert built == [0, 1, 2]
  assert sorted(os.listdir(resumed)) == ['00000.json', '00000.train.tokens.npy', '00001.json',
                                         '00001.train.tokens.npy', '00002.train.tokens.npy', 'manifest.json']
  # What a killed build leaves: a shard's arrays without its json (made garbage here) and a
  # temporary file. Neither is read: the cache is incomplete, and the build redoes shard 2.
  (resumed / '00002.train.tokens.npy').write_bytes(b'not an array')
  (resumed / '00003.json.4242.tmp').write_text(json.dumps({'lengths': {'train.tokens': 1}, 'info': {}}))
  with pytest.raises(DataError, match=re.escape(f'The token cache {resumed} is incomplete or corrupt (00002.json: ')):
    token_cache.Cache(str(resumed))

  monkeypatch.setattr(storage, 'write_atomically', real_write)
  built.clear()
  build(corpus, bpe, resumed, processor=Counted(bpe, built))
  assert built == list(range(2, count))  # shards 0 and 1 were complete: not tokenized again
  assert cache_files(resumed) == expected  # every .npy, every json and the manifest, byte for byte
  np.testing.assert_array_equal(all_tokens(resumed, 'train'), all_tokens(whole, 'train'))


# ----------------------------------------------------------------------------- a restart tokenizes nothing
def test_a_restart_and_another_workdir_reuse_the_tokenizer_and_the_cache_without_tokenizing(
    corpus, tmp_path, monkeypatch):
  encoded, trained = [], []
  real_encode_batch, real_train = tokenizers.HFTokenizer.encode_batch, tokenizers.train_tokenizer

  def counted_encode_batch(self, texts):
    encoded.append(len(texts))
    return real_encode_batch(self, texts)

  def counted_train(*args, **kwargs):
    trained.append(args[0])
    return real_train(*args, **kwargs)

  monkeypatch.setattr(tokenizers.HFTokenizer, 'encode_batch', counted_encode_batch)
  monkeypatch.setattr(tokenizers, 'train_tokenizer', counted_train)
  config = data_config(corpus, tmp_path / 'cache', tokenizer='bpe')
  first = lm.lm_datasets(config, str(tmp_path / 'run'), SEED)
  assert trained == ['bpe'] and sum(encoded) >= 8  # every file's text
  assert all(name.startswith(f'lm-v{token_cache.FORMAT}-') for name in first[4].values())  # never an older format's
  rows = lambda datasets: [np.stack([d[i]['tokens'] for i in range(len(d))]) for d in datasets[1:4]]
  for workdir in ('run', 'other-run'):  # a restart; a new run on the same corpus
    encoded.clear()
    again = lm.lm_datasets(config, str(tmp_path / workdir), SEED)
    assert encoded == [] and trained == ['bpe'], workdir
    assert again[4] == first[4]  # the same caches
    assert again[0].to_json() == first[0].to_json()
    for a, b in zip(rows(again), rows(first)):
      np.testing.assert_array_equal(a, b)
  assert (tmp_path / 'other-run' / tokenizers.TOKENIZER_FILE).read_text() == first[0].to_json()
  [shared] = glob.glob(str(tmp_path / 'cache' / f'tokenizers-v{token_cache.FORMAT}' / '*' / tokenizers.TOKENIZER_FILE))
  assert open(shared).read() == first[0].to_json()
  # Other tokenizer settings: another tokenizer, another cache.
  other = lm.lm_datasets(data_config(corpus, tmp_path / 'cache', tokenizer='bpe', vocab_size=280),
                         str(tmp_path / 'third-run'), SEED)
  assert trained == ['bpe', 'bpe'] and other[4]['train'] != first[4]['train']
  assert len(glob.glob(str(tmp_path / 'cache' / f'tokenizers-v{token_cache.FORMAT}' / '*' / 'tokenizer.json'))) == 2


TRAIN_ONE_TOKENIZER = textwrap.dedent('''
    import os, sys, time
    from configs.base import base_config
    from data import lm, token_cache  # lm registers the processor the tokenizer is keyed by
    cache_dir, workdir, marks = sys.argv[1:]
    config = base_config('test').data
    config.update({'cache_dir': cache_dir, 'tokenizer': 'bpe', 'vocab_size': 300})

    def sample():
      open(os.path.join(marks, f'trained-by-{os.getpid()}'), 'w').close()
      time.sleep(3)  # long enough that the other process asks for the tokenizer meanwhile
      yield 'alpha beta gamma delta ' * 200

    print(token_cache.shared_tokenizer(config, workdir, {'family': 'lm', 'corpus': 'one'}, sample).to_json())
''')


def test_two_processes_needing_one_new_tokenizer_train_it_once(tmp_path):
  (tmp_path / 'marks').mkdir()
  processes = [subprocess.Popen([sys.executable, '-c', TRAIN_ONE_TOKENIZER, str(tmp_path / 'cache'),
                                 str(tmp_path / f'run{i}'), str(tmp_path / 'marks')], cwd=support.REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = [process.communicate(timeout=120) for process in processes]
  for process, (_, stderr) in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  assert len(os.listdir(tmp_path / 'marks')) == 1  # one trained; the other waited on the lock and loaded it
  assert outputs[0][0] == outputs[1][0]


# ----------------------------------------------------------------------------- bad input: one line each
def one_line(error) -> str:
  message = str(error.value)
  assert '\n' not in message, message
  return message


def test_a_truncated_or_resized_shard_is_one_error_naming_it_and_how_to_rebuild(corpus, tmp_path):
  config = data_config(corpus, tmp_path / 'cache')
  caches = lm.lm_datasets(config, str(tmp_path / 'run'), SEED)[4]
  directory = tmp_path / 'cache' / caches['train']
  shard = next(directory / f'{i:05d}.train.tokens.npy' for i in range(3, 20)
               if (directory / f'{i:05d}.train.tokens.npy').exists())
  original = shard.read_bytes()
  shard.write_bytes(original[:len(original) // 2])  # a copy cut short
  with pytest.raises(DataError) as error:
    lm.lm_datasets(config, str(tmp_path / 'run'), SEED)
  assert one_line(error).startswith(f'Token-cache shard {shard} is truncated or corrupt (')
  assert one_line(error).endswith(f'delete {directory} and rerun (or run --mode=prepare) to rebuild it.')
  tokens = np.load(io.BytesIO(original))
  np.save(shard, tokens[:-1])  # a whole array, one token short of what its json says
  with pytest.raises(DataError) as error:
    lm.lm_datasets(config, str(tmp_path / 'run'), SEED)
  assert one_line(error) == (
      f'Token-cache shard {shard} holds {len(tokens) - 1} rows where its json says {len(tokens)}: it is corrupt; '
      f'delete {directory} and rerun (or run --mode=prepare) to rebuild it.')
  json_path = directory / shard.name.replace('.train.tokens.npy', '.json')
  json_path.write_text('{"lengths": ')  # a json cut short
  with pytest.raises(DataError) as error:
    lm.lm_datasets(config, str(tmp_path / 'run'), SEED)
  assert one_line(error).startswith(f'The token cache {directory} is incomplete or corrupt ({json_path.name}: ')
  assert one_line(error).endswith('delete that directory and rerun (or run --mode=prepare) to rebuild it.')


def test_a_corrupt_shard_ends_launch_with_one_error_line(corpus, tmp_path):
  overrides = {'data.source': corpus, 'data.cache_dir': str(tmp_path / 'cache'), 'data.cache_shard_mb': 0.002}
  config = support.tiny_gpt_config(corpus, **overrides)
  caches = lm.lm_datasets(config.data, str(tmp_path / 'run'), config.seed)[4]
  shard = tmp_path / 'cache' / caches['train'] / '00001.train.tokens.npy'
  shard.write_bytes(shard.read_bytes()[:100])
  result = support.launch(['--mode=prepare', '--config=configs/gpt.py:tiny', *support.override_args(overrides)])
  assert result.returncode == 1, result.stderr[-3000:]
  [line] = result.stderr.strip().splitlines()
  assert line.startswith(f'error: Token-cache shard {shard} is truncated or corrupt ('), line
  assert line.endswith('(or run --mode=prepare) to rebuild it.'), line


def test_a_cache_dir_that_cannot_be_written_or_is_empty_is_one_error(corpus, tmp_path):
  blocker = tmp_path / 'a-file'
  blocker.write_text('')
  for cache_dir in (blocker, blocker / 'cache'):  # tests run as root: a mode bit would not stop them
    with pytest.raises(DataError) as error:
      lm.lm_datasets(data_config(corpus, cache_dir), str(tmp_path / 'run'), SEED)
    message = one_line(error)
    assert re.fullmatch(rf'The token cache directory {re.escape(str(cache_dir))}/\S+ is not writable \([^)]+\); '
                        r'set --config.data.cache_dir to a directory this user can write\.', message), message
  with pytest.raises(DataError) as error:
    lm.lm_datasets(data_config(corpus, ''), str(tmp_path / 'run'), SEED)
  assert one_line(error) == ('data.cache_dir is empty: token caches need a directory; set --config.data.cache_dir '
                             f'(default {token_cache.DEFAULT_CACHE_DIR}).')


@pytest.mark.parametrize('full_at', ['00002.train.tokens.npy', '00002.json'])
def test_a_full_disk_is_one_error_and_the_finished_shards_survive(full_at, corpus, bpe, tmp_path, monkeypatch):
  whole = tmp_path / 'whole'
  build(corpus, bpe, whole)
  real_write = storage.write_atomically

  def disk_full_at_shard_2(location, data):
    if os.path.basename(str(location)) == full_at:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(location))
    return real_write(location, data)

  monkeypatch.setattr(storage, 'write_atomically', disk_full_at_shard_2)
  directory = tmp_path / 'cache'
  with pytest.raises(DataError) as error:
    build(corpus, bpe, directory)
  assert one_line(error) == (
      f'The disk of {directory / full_at} is full while building the token cache: the finished shards are kept; '
      'free space (or set --config.data.cache_dir elsewhere) and rerun to build the rest.')
  assert not glob.glob(str(directory / '*.tmp'))
  for index in (0, 1):
    for name in (f'0000{index}.json', f'0000{index}.train.tokens.npy'):
      assert (directory / name).read_bytes() == (whole / name).read_bytes()
  assert not (directory / '00002.json').exists()
  monkeypatch.setattr(storage, 'write_atomically', real_write)
  build(corpus, bpe, directory)  # space freed: the rest is built
  assert cache_files(directory) == cache_files(whole)


# ----------------------------------------------------------------------------- two processes, one cache
BUILD_AND_DRAW = textwrap.dedent('''
    import sys
    import grain
    import numpy as np
    from data import batching, lm, token_cache, tokenizers
    source, tokenizer_dir, directory, index, out = sys.argv[1:]
    corpus, carve, _ = lm.plan_corpus(source, True, {seed}, 'train', {shard_bytes})
    tokenizer = tokenizers.load_tokenizer(tokenizer_dir)
    token_cache.build(directory, corpus, lm.Tokens(tokenizer), carve, {{}}, process_index=int(index), process_count=2,
                      progress=False)
    stream = token_cache.Stream(token_cache.Cache(directory), 'train')
    examples = grain.MapDataset.source(token_cache.Windows(stream, 33, 33))
    batches = batching.Shuffled().global_batches(examples, 8, 5, int(index), 2)
    np.save(out, np.stack([batches[b]['tokens'] for b in range(6)]))
''')


def test_two_processes_build_half_of_the_shards_each_and_draw_the_global_batches(corpus, bpe, tmp_path, monkeypatch):
  one = tmp_path / 'one-process'
  plan = build(corpus, bpe, one)
  bpe.save(str(tmp_path / 'tokenizer'))
  two = tmp_path / 'two-processes'
  script = BUILD_AND_DRAW.format(seed=SEED, shard_bytes=SHARD_BYTES)
  args = lambda i: [corpus, str(tmp_path / 'tokenizer'), str(two), str(i), str(tmp_path / f'rows{i}.npy')]
  # Process 1 a new interpreter, process 0 this one (its imports done), the same script at once.
  process = subprocess.Popen([sys.executable, '-c', script, *args(1)], cwd=support.REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  monkeypatch.setattr(sys, 'argv', ['-c', *args(0)])
  monkeypatch.setattr(token_cache, 'WAIT_SECONDS', 120)  # for process 1's shards, should it fail
  try:
    exec(script, {'__name__': '__main__'})  # builds its shards, waits for process 1's, draws its rows
  finally:
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
  jsons = shard_jsons(two)
  assert [j['built_by_process'] for j in jsons] == [i % 2 for i in range(len(plan.shards))]
  assert [{**j, 'built_by_process': 0} for j in jsons] == shard_jsons(one)
  for name, data in cache_files(one).items():
    if name.endswith('.npy') or name == 'manifest.json':
      assert (two / name).read_bytes() == data, name
  # Each process drew its rows of the global batches: side by side, the batches one process draws.
  rows = [np.load(tmp_path / f'rows{i}.npy') for i in range(2)]
  assert rows[0].shape == (6, 4, 33)
  stream = token_cache.Stream(token_cache.Cache(str(one)), 'train')
  examples = grain.MapDataset.source(token_cache.Windows(stream, 33, 33))
  np.testing.assert_array_equal(np.concatenate(rows, axis=1), draw(examples, seed=5))


def test_build_workers_write_the_files_one_process_writes(corpus, bpe, tmp_path):
  """data.cache_workers=2: two spawned processes build the shards, each file as one process builds it."""
  build(corpus, bpe, tmp_path / 'one-process')
  build(corpus, bpe, tmp_path / 'workers', workers=2)
  assert cache_files(tmp_path / 'workers') == cache_files(tmp_path / 'one-process')
  assert token_cache.worker_count(0, 16, 1 << 20) == 1  # a small build stays in its process
  assert token_cache.worker_count(0, 1, 1 << 30) == 1 and token_cache.worker_count(3, 2, 0) == 2


# ----------------------------------------------------------------------------- reading rows of several shards
def test_rows_take_the_shards_in_turn(tmp_path):
  """Row i of a split is the i-th of the round-robin order over its shards (shards of 3, 0, 5, 1 rows
  here), and a limit keeps the first rows of that order."""
  counts = [3, 0, 5, 1]
  lengths = [{'lengths': {'train.x': n} if n else {}, 'info': {}} for n in counts]
  os.makedirs(tmp_path / 'cache')
  (tmp_path / 'cache' / 'manifest.json').write_text(json.dumps({'format': token_cache.FORMAT, 'shards': 4}))
  for shard, (n, entry) in enumerate(zip(counts, lengths)):
    (tmp_path / 'cache' / f'{shard:05d}.json').write_text(json.dumps(entry))
    if n:
      np.save(tmp_path / 'cache' / f'{shard:05d}.train.x.npy', np.arange(n) + 10 * shard)
  expected = [10 * shard + row for row in range(5) for shard, n in enumerate(counts) if row < n]
  assert expected == [0, 20, 30, 1, 21, 2, 22, 23, 24]
  cache = token_cache.Cache(str(tmp_path / 'cache'))
  for limit in (0, 2, 5, 9):
    rows = token_cache.Rows(cache, 'train', ['x'], limit)
    assert [int(rows[i]['x']) for i in range(len(rows))] == expected[:limit or None]
    taken = expected[:limit or None]
    assert rows.prefix_counts().tolist() == [sum(value // 10 == shard for value in taken) for shard in range(4)]


# ----------------------------------------------------------------------------- a resume onto another cache
def test_a_resume_onto_a_changed_corpus_is_refused_unless_data_changes_are_allowed(tmp_path):
  from train.trainer import train_and_evaluate
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=4, lines=30)
  # One block: what is checked is the data the run was trained on, not the model.
  overrides = {'data.cache_dir': str(tmp_path / 'cache'), 'model.num_layers': 1, 'train.eval_every': 2,
               'train.checkpoint_every': 2, 'train.async_checkpoints': False}
  workdir = str(tmp_path / 'run')
  train_and_evaluate(support.tiny_gpt_config(corpus, **overrides, **{'train.steps': 2}), workdir)
  saved = open(os.path.join(workdir, 'config.json')).read()
  trained_on = json.loads(saved)['data_history'][-1]['caches']
  os.utime(tmp_path / 'corpus' / 'doc1.txt', ns=(1, 1))  # the same source, one file changed since
  args = ['--config=configs/gpt.py:tiny', f'--workdir={workdir}',
          *support.override_args({'data.source': corpus, **overrides, 'train.steps': 4})]
  result = support.launch(args)
  assert result.returncode == 1, result.stderr[-3000:]
  [line] = result.stderr.strip().splitlines()
  assert line.startswith(f'error: {workdir} was trained on the token caches {trained_on} but its data now gives '), line
  assert line.endswith('or pass --config.train.allow_data_change=True (the best checkpoint is then tracked anew).')
  assert open(os.path.join(workdir, 'config.json')).read() == saved
  results = train_and_evaluate(support.tiny_gpt_config(corpus, **overrides, **{'train.steps': 4,
                                                                                'train.allow_data_change': True}),
                               workdir)
  assert results['step'] == 4
  history = json.load(open(os.path.join(workdir, 'config.json')))['data_history']
  assert [h['step'] for h in history] == [0, 2] and history[0]['caches'] == trained_on != history[1]['caches']


def test_shard_arrays_read_rows_from_the_file_and_map_nothing(tmp_path):
  """A shard's rows, slices and whole array equal numpy's own read of the .npy file, and no part of
  the file is memory-mapped (a map made a 1 GB translation run's RSS 5 GB); a file shorter than its
  header says is refused."""
  from data.token_cache import ShardArray
  rng = np.random.default_rng(0)
  for name, array in {'rows': rng.integers(0, 60000, (37, 5)).astype(np.uint16),
                      'stream': rng.integers(0, 2**31 - 1, 101).astype(np.int32), 'empty': np.zeros((0, 4), np.int32)}.items():
    path = str(tmp_path / f'{name}.npy')
    np.save(path, array)
    shard = ShardArray(path)
    assert shard.shape == array.shape and shard.dtype == array.dtype and len(shard) == len(array)
    np.testing.assert_array_equal(np.asarray(shard), array)
    if len(array):
      for i in (0, 5, len(array) - 1, -1):
        np.testing.assert_array_equal(shard[i], array[i])
      np.testing.assert_array_equal(shard[3:20], array[3:20])
      np.testing.assert_array_equal(shard[30:500], array[30:500])
    with open('/proc/self/maps') as maps:
      assert path not in maps.read()
  with open(tmp_path / 'rows.npy', 'r+b') as f:
    f.truncate(os.path.getsize(tmp_path / 'rows.npy') - 3)
  with pytest.raises(ValueError, match='header says'):
    ShardArray(str(tmp_path / 'rows.npy'))
