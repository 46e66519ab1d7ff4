"""Language-model data: documents -> tokenizer -> one token stream -> packed fixed-length windows.

Each example is {'tokens': int32 [seq_len + 1]}: inputs are tokens[:-1], targets tokens[1:].
Documents are joined with the tokenizer's EOS id so a window may span a document boundary, as in
GPT-2 training. Splits follow the rule of data/sources.py; validation is held out of data.source
by disjoint documents.
"""
from __future__ import annotations

import grain
import numpy as np

import storage
from data import batching, sources
from data.tokenizers import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_tokenizer

EVAL_FRACTION = 0.05
# Tokenizer training reads at most this many characters: BPE merges stabilise long before.
TOKENIZER_TRAINING_CHARS = 20_000_000
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
  if len(documents) == 1:  # one file: hold out its tail
    key, text = documents[0]
    cut = int(len(text) * (1 - EVAL_FRACTION))
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


def lm_datasets(data_config, workdir: str, seed: int):
  """(tokenizer, train, valid, test MapDatasets) of {'tokens': int32 [seq_len + 1]} examples; test
  is the valid dataset itself unless data.test_source names other documents."""
  train_docs, eval_docs, test_docs = split_documents(data_config, seed)
  tokenizer = get_tokenizer(data_config, workdir, (text for _, text in train_docs))
  train = pack(train_docs, tokenizer, data_config.seq_len, data_config.max_examples, split='train')
  as_dataset = lambda windows: grain.MapDataset.source(windows).map(lambda w: {'tokens': w})
  evaluation = as_dataset(pack(eval_docs, tokenizer, data_config.seq_len, split='valid'))
  test = evaluation if test_docs is eval_docs else as_dataset(pack(test_docs, tokenizer, data_config.seq_len,
                                                                   split='test'))
  return tokenizer, as_dataset(train), evaluation, test
