"""Language-model data: documents -> tokenizer -> one token stream -> packed fixed-length windows.

Each example is {'tokens': int32 [seq_len + 1]}: inputs are tokens[:-1], targets tokens[1:].
Documents are joined with the tokenizer's EOS id so a window may span a document boundary, as in
GPT-2 training. Splits follow the rule of data/sources.py; validation is held out of data.source
by disjoint documents (a single file: its last EVAL_FRACTION, from a safe cut).

Training and evaluation read the stream from token caches (data/token_cache.py, `lm_datasets`,
`lm_streams`): every source is tokenized once, in shards, and read back by memory map, so a run
holds the windows it reads whatever the corpus's size, and a restart tokenizes nothing. The
in-memory path (`split_documents`, `token_stream`, `pack`) reads small document lists whole: the
held-out scoring of scripts/bits_per_byte.py, and the reference the cache is tested against.
"""
from __future__ import annotations

import os

import grain
import numpy as np

import storage
from data import batching, sources, token_cache
from data.tokenizers import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_tokenizer

EVAL_FRACTION = token_cache.EVAL_FRACTION
# Tokenizer training reads at most this many characters: BPE merges stabilise long before.
TOKENIZER_TRAINING_CHARS = 20_000_000
NAMED_BY = {'train': 'data.source', 'valid': 'data.eval_source', 'test': 'data.test_source'}
TOKENIZE_CHUNK = 256  # documents tokenized together when only the first max_tokens are needed


def read_documents(source: str, default_split: str = 'train') -> list[tuple[str, str]]:
  """[(key, text)] for an LM source: pystdlib, text:<glob> or tfds:<name>[:<split>]."""
  kind, argument = sources.parse_source(source)
  if kind == 'pystdlib':
    return sources.pystdlib_files()
  if kind == 'text':
    return sources.read_text_files(argument)
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, default_split)
    records = sources.tfds_records(name, split)
    documents = []
    for i in range(len(records)):
      text = records[i]['text']
      text = text.decode('utf-8') if isinstance(text, bytes) else str(text)
      documents.append((f'{name}:{split}:{i}', text))
    if not documents:
      raise sources.DataError(f'tfds:{name}:{split} is empty.')
    return documents
  raise sources.DataError(f'Unknown LM data source {source!r}: use pystdlib, text:<glob> or '
                          f'tfds:<name>[:<split>].')


def _carve(documents: list[tuple[str, str]], source: str, held_out: tuple[str, ...],
           seed: int) -> dict[str, sources.Part]:
  """The training documents and, when 'valid' is in `held_out`, EVAL_FRACTION of them by a hash
  of their keys (of a single document: its tail). LM families hold out one split (no 'test')."""
  Part = sources.Part
  if 'valid' not in held_out:
    return {'train': Part(documents, f'{source}, whole (data.source)')}
  if len(documents) == 1:  # one file: hold out its tail, from the token cache's cut (data/token_cache.py)
    key, text = documents[0]
    raw = text.encode()
    start = int(len(raw) * (1 - EVAL_FRACTION))
    cut = len(raw[:token_cache.safe_cut(raw[start:start + token_cache.SAFE_CUT_SEARCH + 1], start, len(raw))]
              .decode(errors='ignore'))
    return {'train': Part([(key, text[:cut])], f'{source}, the first {1 - EVAL_FRACTION:.0%} of the text'),
            'valid': Part([(key + ':eval', text[cut:])], f'{source}, the last {EVAL_FRACTION:.0%} of the text')}
  train_idx, eval_idx = sources.deterministic_split([k for k, _ in documents], [1 - EVAL_FRACTION, EVAL_FRACTION],
                                                    seed)
  if not eval_idx:
    eval_idx = train_idx[-1:]
    train_idx = train_idx[:-1]
  return {'train': Part([documents[i] for i in train_idx], f'{source}, the documents not held out'),
          'valid': Part([documents[i] for i in eval_idx], f'{source}, a {EVAL_FRACTION:.0%} hash split')}


def split_documents(data_config, seed: int):
  """(train, valid, test) documents by the rule of data/sources.py (data.source, data.eval_source,
  data.test_source); test is the valid list itself unless data.test_source names one. Prints one
  line per split."""
  parts = sources.split_roles(
      data_config, lambda source, held_out: _carve(read_documents(source), source, held_out, seed),
      lambda source, role: read_documents(source, default_split=sources.TFDS_SPLITS[role]))
  sources.report_splits(parts, 'documents')
  return tuple(parts[role].examples for role in sources.ROLES)


def get_tokenizer(data_config, workdir: str, train_texts) -> Tokenizer:
  """The run's tokenizer: reloaded from `workdir` if saved there, else trained and saved."""
  if (storage.path(workdir) / TOKENIZER_FILE).exists():
    return load_tokenizer(workdir)
  budget, texts = TOKENIZER_TRAINING_CHARS, []
  for text in train_texts:
    texts.append(text[:budget])
    budget -= len(texts[-1])
    if budget <= 0:
      break
  tokenizer = train_tokenizer(data_config.tokenizer, texts, data_config.vocab_size, data_config.lowercase)
  tokenizer.save(workdir)
  return tokenizer


def token_stream(documents: list[tuple[str, str]], tokenizer: Tokenizer, max_tokens: int = 0) -> np.ndarray:
  """The documents' tokens, each document followed by EOS, int32 [N]: the first `max_tokens` of
  them (0: all), tokenizing only as many documents as that takes."""
  texts = [text for _, text in documents]
  chunk = TOKENIZE_CHUNK if max_tokens else max(len(texts), 1)
  pieces, total = [], 0
  for start in range(0, len(texts), chunk):
    for ids in tokenizer.encode_batch(texts[start:start + chunk]):
      pieces.append(np.asarray(ids + [tokenizer.eos_id], np.int32))
      total += len(pieces[-1])
    if max_tokens and total >= max_tokens:
      break
  stream = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
  return stream[:max_tokens] if max_tokens else stream


def pack(documents: list[tuple[str, str]], tokenizer: Tokenizer, seq_len: int, max_examples: int = 0,
         split: str = '') -> np.ndarray:
  """The documents' token stream (`token_stream`) cut into disjoint int32 [N, seq_len + 1] windows
  (`batching.stream_windows`), at most `max_examples` (0: all).

  The ragged tail (fewer tokens than a window) is dropped; with a `split` name, one line says how
  many tokens that is (a warning above sources.WARN_FRACTION of the split's tokens).
  """
  stream = token_stream(documents, tokenizer)
  window = seq_len + 1
  windows = batching.stream_windows(stream, seq_len, stride=window, max_windows=max_examples)
  if split:
    count = len(stream) // window
    dropped = len(stream) - count * window
    line = (f'{split} split: {count} windows of {window} tokens; the last {dropped} of {len(stream)} tokens are '
            f'dropped (less than a window).')
    print(f'WARNING: {line}' if dropped > sources.WARN_FRACTION * len(stream) else line, flush=True)
  return windows


def lm_datasets(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1):
  """(tokenizer, train, valid, test MapDatasets of {'tokens': int32 [seq_len + 1]} windows, the
  {split: token-cache name}), read from token caches (data/token_cache.py) built when missing; test
  is the valid dataset itself unless data.test_source names other documents."""
  tokenizer, streams, caches = lm_streams(data_config, workdir, seed, process_index, process_count)
  window = data_config.seq_len + 1
  train = token_cache.Windows(streams['train'], window, window, data_config.max_examples)
  as_dataset = lambda windows: grain.MapDataset.source(windows)
  datasets = {}
  for role in sources.ROLES:
    if role == 'test' and streams['test'] is streams['valid']:
      datasets[role] = datasets['valid']
      continue
    windows = train if role == 'train' else token_cache.Windows(streams[role], window, window)
    report_windows(role, windows, len(streams[role]))
    datasets[role] = as_dataset(windows)
  return tokenizer, datasets['train'], datasets['valid'], datasets['test'], caches


def report_windows(split: str, windows: token_cache.Windows, tokens: int) -> None:
  """One line: the split's windows, and the tokens of the ragged tail they leave out (a warning above
  sources.WARN_FRACTION of the split)."""
  whole = (tokens - windows.length) // windows.stride + 1
  dropped = tokens - whole * windows.length
  line = (f'{split} split: {whole} windows of {windows.length} tokens; the last {dropped} of {tokens} tokens are '
          f'dropped (less than a window).')
  print(f'WARNING: {line}' if dropped > sources.WARN_FRACTION * tokens else line, flush=True)


def lm_streams(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid', 'test'} -> token_cache.TokenStream, {split: token-cache name}).

  The split rule of data/sources.py over planned corpora: data.source carved into train and valid
  unless data.eval_source is named; test is the valid stream itself unless data.test_source names
  one. Each corpus is tokenized once into its cache (`data.cache_dir`), this process building its
  share of the shards; the tokenizer is the workdir's, else the one trained for this corpus and
  these settings before (kept in the cache directory), else trained now on a bounded sample.
  """
  eval_source, test_source = data_config.get('eval_source', ''), data_config.get('test_source', '')
  plan = lambda source, carve, split='train': token_cache.plan_corpus(source, carve, seed, split,
                                                                     token_cache.shard_bytes(data_config))
  corpora = {'train': plan(data_config.source, carve=not eval_source)}
  if eval_source:
    corpora['valid'] = plan(eval_source, False, sources.TFDS_SPLITS['valid'])
  if test_source:
    corpora['test'] = plan(test_source, False, sources.TFDS_SPLITS['test'])
  tokenizer = cached_tokenizer(data_config, workdir, corpora['train'], seed)
  streams, origins, caches = {}, {}, {}
  for role, corpus in corpora.items():
    directory = build_cache(data_config, corpus, tokenizer, seed, process_index, process_count)
    for cached_role, origin in corpus.description.items():
      name = {'all': role}.get(cached_role, cached_role)
      if cached_role == 'all':
        origin = f'{origin} ({NAMED_BY[role]})'
      if name not in streams:
        streams[name], origins[name] = token_cache.TokenStream(directory, cached_role), origin
        caches[name] = os.path.basename(directory)
  if 'test' not in streams:
    streams['test'], caches['test'] = streams['valid'], caches['valid']
    origins['test'] = f'the valid split ({"data.test_source is empty" if eval_source else "this family holds out one split"})'
  for role in sources.ROLES:
    count = streams[role].documents
    print(f'{role} split: {count} document{"s" if count != 1 else ""} from {origins[role]}', flush=True)
  return tokenizer, streams, caches


def cache_dir(data_config) -> str:
  """data.cache_dir (the default for configs saved before it existed)."""
  return data_config.get('cache_dir', token_cache.DEFAULT_CACHE_DIR)


def build_cache(data_config, corpus: token_cache.Corpus, tokenizer: Tokenizer, seed: int, process_index: int = 0,
                process_count: int = 1) -> str:
  """The cache directory of `corpus` tokenized by `tokenizer`, built (this process's shards) when missing."""
  fingerprint = token_cache.fingerprint(corpus, tokenizer.to_json(), seed, token_cache.shard_bytes(data_config))
  directory = token_cache.cache_directory(cache_dir(data_config), f'lm-{fingerprint}')
  token_cache.build(corpus, tokenizer, directory, seed, process_index, process_count)
  return directory


def cached_tokenizer(data_config, workdir: str, corpus: token_cache.Corpus, seed: int) -> Tokenizer:
  """The run's tokenizer (token_cache.shared_tokenizer), trained when new on the first
  TOKENIZER_TRAINING_CHARS of the corpus's training text."""
  identity = {'corpus': corpus.identity, 'carve': corpus.carve, 'seed': seed, 'chars': TOKENIZER_TRAINING_CHARS}
  return token_cache.shared_tokenizer(data_config, workdir, identity, lambda directory: get_tokenizer(
      data_config, directory, token_cache.training_text(corpus, seed)))
