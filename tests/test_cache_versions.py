"""Token caches outlive the code that wrote them: a processor's VERSION is in its caches' names
(data/token_cache.py, `Processor`), and this file records what every registered processor writes
for one fixed input, so that a change to it without a version bump fails here, naming the bump."""
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import string

import ml_collections
import numpy as np
import pytest

import data
from configs.base import base_config
from data import bert_data, classification, lm, token_cache, tokenizers, translation
from data.tokenizers import CharTokenizer

# {prefix: (the processor's VERSION, the digest of what it writes for its SAMPLES input)}: update an
# entry together with the VERSION bump the failure asks for.
RECORDED = {
    'lm': (2, '6670f66b2478509501de1569752a04eacffa0684150043173cbb41e8fe2d42d2'),  # 2: files held out by size
    'texts': (1, '4b0defcced72b5824c14fb3e2accabe4108e54fe44ec6291bdf9b9ccd3516190'),
    'pairs': (1, '1cab1a2eb1b9dfff1a79587c076314e7d59f10d3e29efe1b2f6ade75cb613312'),
    # 2: a piece of a file keyed by it; 3: files held out by size, in shards of their own
    'bert': (3, 'f1ffeb0d31993f2d225e5fc02e2f7fa170224a976a5e93eaf9d10af5914d2874'),
}
SEED = 3
SHARD_BYTES = 2048  # several shards, files cut into pieces
# Characters the fixed tokenizer knows: 'ï' of WORDS is not among them (an unknown id).
TOKENIZER = CharTokenizer(string.ascii_letters + string.digits + ' \t\n.,;:!?\'"-é')
WORDS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau '
         'upsilon phi chi psi omega café naïve').split()


def sentence(i: int) -> str:
  """A fixed pseudo-sentence (arithmetic, no random generator): 3 to 11 words, capitalised."""
  return ' '.join(WORDS[(i * 5 + k * k) % len(WORDS)] for k in range(3 + (i * 7) % 9)).capitalize() + '.'


def write(path, text: str) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return str(path)


def text_files(folder, count: int, lines) -> str:
  """`count` files doc00.txt... of `lines(i)` sentences each, one a line: a text: source."""
  for i in range(count):
    write(os.path.join(folder, f'doc{i:02d}.txt'), ''.join(sentence(i * 31 + j) + '\n' for j in range(lines(i))))
  return f'text:{folder}/*.txt'


def data_config(**values) -> ml_collections.ConfigDict:
  """The data keys the processors read, set here (not a preset's, which may change)."""
  return ml_collections.ConfigDict({'source': '', 'eval_source': '', 'test_source': '', 'tsv_header': False,
                                    'max_examples': 0, 'min_number': 0, 'text_field': 'text', 'label_field': 'label',
                                    'documents': 'file', 'dupe_factor': 2, 'short_seq_prob': 0.2, **values})


def lm_sample(folder):
  corpus, carve, _ = lm.plan_corpus(text_files(folder, 12, lambda i: 4 + 9 * (i % 4)), True, SEED, 'train',
                                    SHARD_BYTES)
  return [(lm.Tokens(TOKENIZER), corpus, carve)]


def classification_sample(folder):
  lines = [f'{sentence(i)}\t{("red", "green", "blue")[i % 3]}' for i in range(90)]
  lines += [f'{sentence(i)}\t{sentence(i + 1)}\t{("same", "other")[i % 2]}' for i in range(12)]  # pairs
  lines += ['a line without a label', f'{sentence(7)}\t']  # malformed
  config = data_config(seq_len=16)
  config.source = 'tsv:' + write(os.path.join(folder, 'labelled.tsv'), '\n'.join(lines) + '\n')
  corpus, carve, _ = classification.plan_source(config.source, 'train', ('valid', 'test'), config, SHARD_BYTES)
  return [(classification.Labelled(config, TOKENIZER), corpus, carve)]


def translation_sample(folder):
  lines = [f'{sentence(i)}\t{sentence(i * 3 + 1)}' for i in range(120)] + ['one field only']
  config = data_config(seq_len=60)  # the longer sentences do not fit: training drops them, held-out truncates
  config.source = 'tsv:' + write(os.path.join(folder, 'pairs.tsv'), '\n'.join(lines) + '\n')
  corpus, carve, _ = translation.plan_source(config.source, 'train', ('valid', 'test'), config, SEED, SHARD_BYTES)
  return [(translation.Pairs(config, SEED, TOKENIZER), corpus, carve)]


def paragraphs(path, count: int, lines) -> str:
  """A file of `count` paragraphs of `lines(i)` sentences, one a line, between blank lines."""
  return write(path, '\n'.join(''.join(sentence(i * 17 + j) + '\n' for j in range(lines(i))) for i in range(count)))


def bert_sample(folder):
  """Both kinds of documents: files (data.documents='file'), and the blocks between blank lines
  (data.documents='blank_line'), keyed by where they start, also when a piece begins inside one."""
  # 80 files (documents), a few larger than a quarter shard (read in pieces), in shards large enough
  # that some hold two validation documents (a split pairs its documents within a shard).
  files = data_config(seq_len=32, source=text_files(os.path.join(folder, 'files'), 80,
                                                    lambda i: 3 + (i % 5) * (7 if i % 9 else 30)))
  # 2 files of 60 paragraphs, the last of 300 lines (~15 KiB): a piece (a quarter shard, 4 KiB) ends
  # at the first blank line after its size, and in the last paragraph, which has none, at a newline:
  # the pieces after begin inside it and continue the document begun in the piece before.
  for k in range(2):
    paragraphs(os.path.join(folder, 'blocks', f'part{k}.txt'), 60, lambda i: 300 if i == 59 else 2 + (i * 7 + k) % 9)
  blocks = data_config(seq_len=32, documents='blank_line', source=f'text:{folder}/blocks/*.txt')
  built = []
  for config in (files, blocks):
    corpus, carve, _, blank_lines = bert_data.plan_source(config.source, 'train', config, 8 * SHARD_BYTES)
    continued = bert_data.continued_documents(corpus) if blank_lines else {}
    built.append((bert_data.Documents(config, SEED, blank_lines, TOKENIZER, continued), corpus, carve))
  return built


# {prefix: a function of a folder -> [(the processor, a planned Corpus, its Carve), ...]}: one per processor.
SAMPLES = {'lm': lm_sample, 'texts': classification_sample, 'pairs': translation_sample, 'bert': bert_sample}


def registered() -> dict[str, type]:
  """token_cache.PROCESSORS once every module of data/ is imported (each registers its own)."""
  for module in pkgutil.iter_modules(data.__path__):
    importlib.import_module(f'data.{module.name}')
  return dict(token_cache.PROCESSORS)


def written_digest(processor, corpus, carve, directory) -> str:
  """SHA-256 of what the processor gives: each record's key and split, in order (a key is what the
  split hashes: a new key is another split under any carve), and what its build wrote: each
  shard's json (lengths, info) and each array's dtype, shape and values, by file name (the
  manifest, which names the input's paths, left out)."""
  digest = hashlib.sha256()
  for piece in (piece for shard in corpus.shards for piece in shard):
    for key, _ in processor.records(piece, {}):
      digest.update(f'{key}\t{piece.split or carve.of(key)}\n'.encode())
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if name.endswith('.npy'):
      array = np.load(path, allow_pickle=False)
      digest.update(f'{name} {array.dtype.str} {array.shape}'.encode())
      digest.update(np.ascontiguousarray(array).tobytes())
    elif name != 'manifest.json':
      with open(path) as f:
        shard = json.load(f)
      digest.update(f'{name} {json.dumps([shard["lengths"], shard["info"]], sort_keys=True)}'.encode())
  return digest.hexdigest()


def build_sample(prefix: str, folder) -> str:
  """The digests of what each of the prefix's samples writes, joined."""
  digests = []
  for index, (processor, corpus, carve) in enumerate(SAMPLES[prefix](os.path.join(folder, 'input'))):
    directory = os.path.join(folder, f'cache{index}')
    token_cache.build(directory, corpus, processor, carve, {}, progress=False)
    digests.append(written_digest(processor, corpus, carve, directory))
  return digests[0] if len(digests) == 1 else hashlib.sha256(' '.join(digests).encode()).hexdigest()


def version_problem(prefix: str, folder) -> str | None:
  """Why the processor `prefix` disagrees with RECORDED (the fix included), or None."""
  cls = registered()[prefix]
  digest, (version, recorded) = build_sample(prefix, folder), RECORDED[prefix]
  where = f'{cls.__module__}.{cls.__qualname__}'
  if digest != recorded and cls.VERSION == version:
    return (f'{where} (prefix {prefix!r}) writes other shards for the same input than its VERSION {version} did '
            f'(digest {digest}, recorded {recorded}): every cache built before would be read as if new. Bump '
            f'{cls.__qualname__}.VERSION to {version + 1} in {inspect.getsourcefile(cls)} and set '
            f'RECORDED[{prefix!r}] = ({version + 1}, {digest!r}) in tests/test_cache_versions.py. (A dependency '
            f'that computes other values, e.g. numpy\'s random streams, needs the bump too: old caches hold '
            f'other rows.)')
  if (cls.VERSION, digest) != (version, recorded):
    return (f'{where}.VERSION is {cls.VERSION}: set RECORDED[{prefix!r}] = ({cls.VERSION}, {digest!r}) in '
            f'tests/test_cache_versions.py.')
  return None


def test_every_processor_has_a_version_and_a_recorded_sample():
  processors = registered()
  assert set(processors) == set(SAMPLES) == set(RECORDED), (
      f'Processors registered: {sorted(processors)}; a new one needs an input in SAMPLES and its (VERSION, digest) '
      f'in RECORDED (tests/test_cache_versions.py).')
  # A processor that does not subclass token_cache.Processor would name caches without a version.
  for module in pkgutil.iter_modules(data.__path__):
    for name, value in vars(importlib.import_module(f'data.{module.name}')).items():
      if inspect.isclass(value) and callable(getattr(value, 'records', None)) and callable(
          getattr(value, 'encode', None)):
        assert value in processors.values() or value is token_cache.Processor, (
            f'data.{module.name}.{name} has records and encode but is no registered token_cache.Processor.')
  assert all(isinstance(cls.VERSION, int) and cls.VERSION >= 1 for cls in processors.values())


@pytest.mark.parametrize('prefix', sorted(SAMPLES))
def test_what_a_processor_writes_changes_only_with_its_version(prefix, tmp_path):
  problem = version_problem(prefix, tmp_path)
  assert problem is None, problem


def test_a_changed_encode_without_a_version_bump_fails_naming_the_bump(tmp_path, monkeypatch):
  encode = lm.Tokens.encode
  monkeypatch.setattr(lm.Tokens, 'encode', lambda self, *args: {
      field: array[::-1].copy() for field, array in encode(self, *args).items()})  # the tokens reversed
  version = lm.Tokens.VERSION
  problem = version_problem('lm', tmp_path / 'changed')
  assert problem.startswith(f"data.lm.Tokens (prefix 'lm') writes other shards for the same input than its VERSION "
                            f"{version} did")
  assert f"Bump Tokens.VERSION to {version + 1} in" in problem
  assert f"set RECORDED['lm'] = ({version + 1}, '" in problem
  monkeypatch.setattr(lm.Tokens, 'VERSION', version + 1)  # bumped, the table not yet updated
  problem = version_problem('lm', tmp_path / 'bumped')
  assert problem.startswith(f"data.lm.Tokens.VERSION is {version + 1}: set RECORDED['lm'] = ({version + 1}, '")


def test_blank_line_documents_keyed_as_before_version_2_change_the_bert_sample(tmp_path, monkeypatch):
  # Before version 2 a piece that begins inside a blank-line document was keyed by its own start,
  # not by the document's (`continued_documents`): the sample must see that keying.
  monkeypatch.setattr(bert_data, 'continued_documents', lambda corpus: {})
  problem = version_problem('bert', tmp_path)
  assert problem is not None and 'Bump Documents.VERSION to 4 in' in problem, problem


def test_the_shared_tokenizer_is_retrained_when_its_processor_version_changes(tmp_path, monkeypatch):
  """The text a tokenizer trains on is its processor's records: another VERSION may read other
  records (another split), so it gets a tokenizer of its own; version 1 keeps the key it had."""
  trained, train = [], tokenizers.train_tokenizer
  monkeypatch.setattr(tokenizers, 'train_tokenizer', lambda *args: trained.append(args[0]) or train(*args))
  config = base_config('test').data
  config.update({'cache_dir': str(tmp_path / 'cache'), 'tokenizer': 'bpe', 'vocab_size': 300})
  shared = tmp_path / 'cache' / f'tokenizers-v{token_cache.FORMAT}'

  def tokenizer(version: int, run: str):
    monkeypatch.setattr(lm.Tokens, 'VERSION', version)
    return token_cache.shared_tokenizer(config, str(tmp_path / run), {'family': 'lm', 'corpus': 'one'},
                                        lambda: iter(['alpha beta gamma delta ' * 200]))

  tokenizer(1, 'first')
  assert trained == ['bpe'] and sorted(os.listdir(shared)) == ['dbbd826a5e6fd7789df8', 'dbbd826a5e6fd7789df8.lock']
  tokenizer(2, 'second')
  assert trained == ['bpe', 'bpe'] and len(os.listdir(shared)) == 4  # a second tokenizer, its own lock
  tokenizer(2, 'third')
  tokenizer(1, 'fourth')
  assert trained == ['bpe', 'bpe']  # each version's tokenizer loaded


def test_a_version_bump_renames_only_its_own_caches_and_version_1_keeps_the_old_names(monkeypatch):
  identity = {'corpus': {'kind': 'text', 'files': [['a.txt', 10, 1]]}, 'tokenizer': 'abc'}
  # The names the code gave these caches before processors had versions: at version 1 their caches
  # (and the runs whose data history recorded them) stay valid.
  before = {'lm': 'lm-v2-576408782bc07aef167d', 'texts': 'texts-v2-576408782bc07aef167d'}
  for cls in (lm.Tokens, classification.Labelled):
    monkeypatch.setattr(cls, 'VERSION', 1)
  assert {prefix: token_cache.cache_name(prefix, identity) for prefix in before} == before
  monkeypatch.setattr(lm.Tokens, 'VERSION', 2)
  assert token_cache.cache_name('lm', identity) not in (before['lm'], token_cache.cache_name('lm', {}))
  assert token_cache.cache_name('lm', identity).startswith('lm-v2-')
  assert token_cache.cache_name('texts', identity) == before['texts']
  with pytest.raises(KeyError, match="No token-cache processor has the prefix 'nope'"):
    token_cache.cache_name('nope', identity)


def test_a_processor_needs_a_version_and_its_own_prefix(monkeypatch):
  monkeypatch.setattr(token_cache, 'PROCESSORS', dict(token_cache.PROCESSORS))
  with pytest.raises(TypeError, match='Unversioned must set a prefix and an int VERSION >= 1'):
    type('Unversioned', (token_cache.Processor,), {'prefix': 'unversioned'})
  with pytest.raises(TypeError, match="both name their caches 'lm'"):
    type('Impostor', (token_cache.Processor,), {'prefix': 'lm', 'VERSION': 1})
  wrapper = type('Counting', (lm.Tokens,), {})  # a subclass keeping its parent's prefix writes its caches
  assert token_cache.PROCESSORS['lm'] is lm.Tokens and wrapper.VERSION == lm.Tokens.VERSION
