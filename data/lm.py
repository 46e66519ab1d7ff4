"""Language-model data: documents -> tokenizer -> one token stream -> packed fixed-length windows.

Each example is {'tokens': int32 [seq_len + 1]}: inputs are tokens[:-1], targets tokens[1:].
Documents are joined with the tokenizer's EOS id so a window may span a document boundary, as in
GPT-2 training. Train and eval come from disjoint documents.
"""
from __future__ import annotations

import os

import grain
import numpy as np

from data import sources
from data.tokenizers import Tokenizer, load_tokenizer, train_tokenizer

EVAL_FRACTION = 0.05
# Tokenizer training reads at most this many characters: BPE merges stabilise long before.
TOKENIZER_TRAINING_CHARS = 20_000_000


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


def split_documents(data_config, seed: int):
  """(train documents, eval documents): `data.eval_source`, or a deterministic held-out split."""
  train_docs = read_documents(data_config.source)
  if data_config.eval_source:
    return train_docs, read_documents(data_config.eval_source, default_split='validation')
  if len(train_docs) == 1:  # one file: hold out its tail
    key, text = train_docs[0]
    cut = int(len(text) * (1 - EVAL_FRACTION))
    return [(key, text[:cut])], [(key + ':eval', text[cut:])]
  train_idx, eval_idx = sources.deterministic_split([k for k, _ in train_docs], [1 - EVAL_FRACTION, EVAL_FRACTION],
                                                    seed)
  if not eval_idx:
    eval_idx = train_idx[-1:]
    train_idx = train_idx[:-1]
  return [train_docs[i] for i in train_idx], [train_docs[i] for i in eval_idx]


def get_tokenizer(data_config, workdir: str, train_texts) -> Tokenizer:
  """The run's tokenizer: reloaded from `workdir` if saved there, else trained and saved."""
  if os.path.exists(os.path.join(workdir, 'tokenizer.json')):
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


def pack(documents: list[tuple[str, str]], tokenizer: Tokenizer, seq_len: int, max_examples: int = 0) -> np.ndarray:
  """Tokenize, join with EOS and cut into [N, seq_len + 1] windows (the ragged tail is dropped)."""
  separator = tokenizer.eos_id
  ids = tokenizer.encode_batch([text for _, text in documents])
  stream = []
  for doc in ids:
    stream.extend(doc)
    stream.append(separator)
  window = seq_len + 1
  count = len(stream) // window
  if max_examples:
    count = min(count, max_examples)
  if count == 0:
    raise sources.DataError(f'The data has {len(stream)} tokens, fewer than one sequence of data.seq_len + 1 = '
                            f'{window}; use more text or a smaller data.seq_len.')
  return np.asarray(stream[: count * window], dtype=np.int32).reshape(count, window)


def lm_datasets(data_config, workdir: str, seed: int):
  """(tokenizer, train MapDataset, eval MapDataset) of {'tokens': int32 [seq_len + 1]} examples."""
  train_docs, eval_docs = split_documents(data_config, seed)
  tokenizer = get_tokenizer(data_config, workdir, (text for _, text in train_docs))
  train = pack(train_docs, tokenizer, data_config.seq_len, data_config.max_examples)
  evaluation = pack(eval_docs, tokenizer, data_config.seq_len)
  as_dataset = lambda windows: grain.MapDataset.source(windows).map(lambda w: {'tokens': w})
  return tokenizer, as_dataset(train), as_dataset(evaluation)
