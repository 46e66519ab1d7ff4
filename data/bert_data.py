"""BERT pretraining data: documents -> sentences -> sentence pairs -> masked-LM inputs.

Pairs follow BERT's `create_pretraining_data.py`: sentences of a document are gathered until
they fill a target length (`seq_len - 3`, or with probability `short_seq_prob` a random shorter
one), cut at a random sentence boundary into A and B, and half the time B is replaced by text
starting at a random sentence of another document (the next-sentence label is then 1). A long
single sentence is cut inside it, so the 50/50 next/random balance holds for every document.

Masking is a separate, per-draw step (`Masker`), applied when batches are drawn so that every
epoch sees fresh masks (dynamic masking, as in RoBERTa): 15% of the eligible tokens (never
[CLS], [SEP] or padding) are chosen; of those 80% become [MASK], 10% a random token and 10% stay.

Example fields, all fixed shape:
  tokens, segments int32 [seq_len]; valid bool [seq_len]; next_sentence int32 [] (1 = random B)
  after masking also: masked_positions, masked_labels int32 [P]; masked_weights float32 [P]
  (P = max_predictions; unused slots have weight 0 and point at position 0).

Training reads the pairs from an example cache (data/token_cache.py, `cached_pretraining_examples`),
built once per corpus, tokenizer and pair settings under data.cache_dir and read by memory map:
  - The documents, as `read_documents` defines them, are planned without holding the corpus: a
    `blank_line` file is scanned once, in pieces, for its document breaks (its documents keep
    their keys `<file>:<block>`), a `file` document is one file, TFDS records are ranges, bbc_news
    is carved as a corpus. Each document gets its split by the rule of `_carve` (a hash of its
    key, the few-documents rule included), and the training and the validation documents are
    grouped, in order, into their own shards of ~data.cache_shard_mb MB of text (at least 2
    documents each). The plan is kept under data.cache_dir/plans, so a restart reads no text.
  - Each shard is built alone (process p builds the shards i with i % P == p): its documents
    tokenized, their pairs cut dupe_factor times (validation: once) with an RNG seeded from
    (seed, shard index) (validation: seed + 1), and shuffled within the shard. A random next
    sentence B comes from another document of the SAME shard, as Google's create_pretraining_data.py
    draws it from the same input file: no shard reads another, so hosts build disjoint shards.
  - A corpus whose split fits one shard gives exactly the in-memory examples: numpy seeds
    (seed, 0) as it seeds `seed`, so shard 0 draws today's RNG sequence (tested).
  - Memory while building: one shard's text, tokens and pairs; a document is read whole, so a
    single document larger than a shard is held whole (as it must be to cut its pairs).
Masks are still drawn per example when batches are drawn.
"""
from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Iterator, Sequence

import numpy as np

import storage
from data import classification, lm, sources, token_cache
from data.classification import LabelledText, encode_pair, read_bbc_news
from data.tokenizers import Tokenizer

# A sentence ends at . ! or ? (perhaps closed by a quote or bracket) followed by space and an
# upper-case letter, digit or opening quote, unless the dot ends an initial or a title.
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]["\')\]]))'
                           r'(?<!\b[A-Z]\.)(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)'
                           r'\s+(?=["\'(\[]?[A-Z0-9])')
EVAL_FRACTION = 0.05
_DOCUMENT_BREAK = re.compile(r'\n\s*\n')  # data.documents=blank_line: documents end at a blank line
FIELDS = ('tokens', 'segments', 'valid', 'next_sentence')  # an example's fields (module docstring)
IN_MEMORY = {'tokens': np.int32, 'segments': np.int32, 'valid': np.bool_, 'next_sentence': np.int32}
ENCODE_CHARS = 1 << 20  # sentences per encode_batch call: ~10,000, enough for every core


def split_sentences(document: str) -> list[str]:
  """Lines of the document, each cut into sentences; blank lines dropped."""
  sentences = []
  for line in document.splitlines():
    sentences.extend(s.strip() for s in _SENTENCE_END.split(line) if s.strip())
  return sentences


def text_documents(pattern: str, mode: str) -> list[tuple[str, str]]:
  """[(key, document)] from files: one per file ('file'), or separated by blank lines
  ('blank_line'); 'auto' uses blank lines when the glob matches a single file."""
  files = sources.read_text_files(pattern)
  if mode == 'auto':
    mode = 'blank_line' if len(files) == 1 else 'file'
  if mode == 'file':
    return files
  if mode != 'blank_line':
    raise sources.DataError(f"data.documents={mode!r}: use 'file', 'blank_line' or 'auto'.")
  documents = []
  for path, text in files:
    for i, block in enumerate(_DOCUMENT_BREAK.split(text)):
      if block.strip():
        documents.append((f'{path}:{i}', block))
  return documents


def read_documents(source: str, data_config, default_split: str = 'train') -> list[tuple[str, str]]:
  kind, argument = sources.parse_source(source)
  if kind == 'bbc_news':
    return [(a.key, a.text) for a in read_bbc_news()]
  if kind == 'text':
    return text_documents(argument, data_config.documents)
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, default_split)
    records = sources.tfds_records(name, split)
    field = data_config.text_field
    documents = []
    for i in range(len(records)):
      text = records[i][field]
      documents.append((f'{name}:{split}:{i}', text.decode('utf-8') if isinstance(text, bytes) else str(text)))
    return documents
  raise sources.DataError(f'Unknown BERT pretraining source {source!r}: use bbc_news, text:<glob> or '
                          f'tfds:<name>[:<split>].')


def _carve(source: str, held_out: tuple[str, ...], data_config) -> dict[str, sources.Part]:
  """The training documents and, when 'valid' is in `held_out`, EVAL_FRACTION of them by a hash of
  their keys (at least one). bbc_news uses the classification split (train / valid / test), so
  pretraining never sees the articles fine-tuning is tested on."""
  Part = sources.Part
  if source == 'bbc_news':
    articles = [LabelledText(k, t, '') for k, t in read_documents(source, data_config)]
    return {role: Part([(a.key, a.text) for a in part.examples], part.origin)
            for role, part in classification.carve(articles, source, held_out).items()}
  documents = read_documents(source, data_config)
  if 'valid' not in held_out:
    return {'train': Part(documents, f'{source}, whole (data.source)')}
  train_idx, eval_idx = sources.deterministic_split([k for k, _ in documents], [1 - EVAL_FRACTION, EVAL_FRACTION],
                                                    seed=0)
  if not eval_idx and len(train_idx) > 2:  # few documents, none hashed to eval: hold out one
    eval_idx, train_idx = train_idx[-1:], train_idx[:-1]
  if not eval_idx or len(train_idx) < 2:
    raise sources.DataError(f'{source} has {len(documents)} documents: BERT pretraining needs several '
                            f'(random next sentences come from other documents, and some are held out). Use '
                            f'data.documents=blank_line or more files.')
  return {'train': Part([documents[i] for i in train_idx], f'{source}, the documents not held out'),
          'valid': Part([documents[i] for i in eval_idx], f'{source}, a {EVAL_FRACTION:.0%} hash split')}


def pretraining_documents(data_config) -> tuple[list[str], list[str], list[str]]:
  """(train, valid, test) document texts by the rule of data/sources.py (data.source,
  data.eval_source, data.test_source); test is the valid list itself unless data.test_source or
  bbc_news's own split gives one. Prints one line per split."""
  def read_whole(source, role):
    if source == 'bbc_news':  # a built-in named for a role gives its own split
      return _carve(source, ('valid', 'test'), data_config)[role].examples
    return read_documents(source, data_config, default_split=sources.TFDS_SPLITS[role])

  parts = sources.split_roles(data_config, lambda source, held_out: _carve(source, held_out, data_config), read_whole)
  sources.report_splits(parts, 'documents')
  texts = lambda role: [text for _, text in parts[role].examples]
  valid = texts('valid')
  return texts('train'), valid, valid if parts['test'].examples is parts['valid'].examples else texts('test')


def tokenize_documents(texts: list[str], tokenizer) -> list[list[Sequence[int]]]:
  """Documents -> sentences -> WordPiece ids (empty sentences dropped), each sentence an
  array.array of 2 (or 4) bytes per id: a list of Python ints would take 36."""
  sentences = [split_sentences(t) for t in texts]
  code = token_cache.token_dtype(tokenizer.vocab_size).char  # 'H' or 'I'
  flat = []
  # encode_batch holds ~50 bytes per character until it returns: a shard's text goes in batches.
  for batch in _batches([s for doc in sentences for s in doc], ENCODE_CHARS):
    flat.extend(array.array(code, ids) for ids in tokenizer.encode_batch(batch))
  documents, start = [], 0
  for doc in sentences:
    ids = [s for s in flat[start:start + len(doc)] if s]
    start += len(doc)
    if ids:
      documents.append(ids)
  return documents


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: np.random.Generator) -> None:
  """Trim the longer of a, b until they fit, from the front or the back at random (in place)."""
  while len(a) + len(b) > max_tokens:
    longer = a if len(a) > len(b) else b
    if rng.random() < 0.5:
      del longer[0]
    else:
      longer.pop()


def random_continuation(documents, exclude: int, length: int, rng: np.random.Generator) -> list[int]:
  """At least `length` tokens (or a whole document) from a random sentence of another document."""
  other = int(rng.integers(len(documents) - 1))
  other += other >= exclude
  sentences = documents[other]
  tokens = []
  for sentence in sentences[int(rng.integers(len(sentences))):]:
    tokens.extend(sentence)
    if len(tokens) >= length:
      break
  return tokens


def document_pairs(documents: list[list[Sequence[int]]], index: int, max_tokens: int, short_seq_prob: float,
                   rng: np.random.Generator) -> list[tuple[list[int], list[int], int]]:
  """(A, B, is_random_next) pairs of at most `max_tokens` tokens from documents[index]."""
  document = documents[index]
  target = int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens
  pairs, chunk, length, i = [], [], 0, 0
  while i < len(document):
    chunk.append(document[i])
    length += len(document[i])
    if i == len(document) - 1 or length >= target:
      random_next = rng.random() < 0.5
      if len(chunk) == 1:
        # One sentence fills the chunk: A and B (when B is the real continuation) are its two halves.
        tokens = chunk[0]
        if len(tokens) < 2:
          chunk, length, i = [], 0, i + 1
          continue
        cut = int(rng.integers(1, len(tokens)))
        a, b = tokens[:cut], tokens[cut:]
      else:
        a_end = int(rng.integers(1, len(chunk)))
        a = [t for sentence in chunk[:a_end] for t in sentence]
        b = [t for sentence in chunk[a_end:] for t in sentence]
        if random_next:
          i -= len(chunk) - a_end  # the sentences not used as B start the next chunk
      if random_next:
        b = random_continuation(documents, index, max(target - len(a), 1), rng)
      a, b = list(a), list(b)
      truncate_pair(a, b, max_tokens, rng)
      if a and b:
        pairs.append((a, b, int(random_next)))
      chunk, length = [], 0
      target = int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens
    i += 1
  return pairs


def _batches(texts: list[str], chars: int) -> Iterator[list[str]]:
  """Consecutive runs of `texts` of about `chars` characters each."""
  batch, size = [], 0
  for text in texts:
    batch.append(text)
    size += len(text)
    if size >= chars:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def pretraining_examples(documents: list[list[Sequence[int]]], tokenizer, seq_len: int, *, dupe_factor: int = 1,
                         short_seq_prob: float = 0.1, seed: int = 0, max_examples: int = 0) -> dict[str, np.ndarray]:
  """Unmasked pair examples, stacked: {'tokens', 'segments' [N, seq_len], 'valid', 'next_sentence' [N]}."""
  _require_documents(documents)
  examples = sentence_pairs(documents, tokenizer, seq_len, np.random.default_rng(seed), dupe_factor=dupe_factor,
                            short_seq_prob=short_seq_prob)
  _require_pairs(examples)
  return {field: rows[:max_examples or None] for field, rows in examples.items()}


def _require_documents(documents: list, split: str = '') -> None:
  if len(documents) < 2:
    where = f' in the {split} split' if split else ''
    hint = '; use more documents or name data.eval_source.' if split == 'valid' else '.'
    raise sources.DataError(f'BERT pretraining needs at least 2 non-empty documents{where}, got {len(documents)}{hint}')


def _require_pairs(examples: dict[str, np.ndarray]) -> None:
  if not len(examples['tokens']):
    raise sources.DataError('The documents gave no sentence pairs; use longer documents.')


def sentence_pairs(documents: list[list[Sequence[int]]], tokenizer, seq_len: int, rng: np.random.Generator, *,
                   dupe_factor: int, short_seq_prob: float, dtypes: dict = IN_MEMORY) -> dict[str, np.ndarray]:
  """Every pair of `documents` (each cut `dupe_factor` times, in a random order of documents),
  shuffled: {'tokens', 'segments', 'valid' [N, seq_len], 'next_sentence' [N]} in `dtypes` (N may be 0)."""
  code = token_cache.token_dtype(tokenizer.vocab_size).char
  pairs = []  # (A, B, is_random_next), A and B as 2-byte arrays: a shard's pairs take ~1/4 of its rows
  for _ in range(dupe_factor):
    for index in rng.permutation(len(documents)):
      for a, b, random_next in document_pairs(documents, int(index), seq_len - 3, short_seq_prob, rng):
        pairs.append((array.array(code, a), array.array(code, b), random_next))
  order = rng.permutation(len(pairs))
  shapes = {'tokens': (len(pairs), seq_len), 'segments': (len(pairs), seq_len), 'valid': (len(pairs), seq_len),
            'next_sentence': (len(pairs),)}
  examples = {field: np.zeros(shape, dtypes[field]) for field, shape in shapes.items()}
  for row, index in enumerate(order):
    a, b, random_next = pairs[index]
    pairs[index] = None  # freed as its row is written
    encoded = encode_pair(a, b, seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    for field, value in zip(FIELDS, (*encoded, random_next)):
      examples[field][row] = value
  return examples


class Masker:
  """Chooses and corrupts MLM positions of one example: `masker(example, rng)` (a grain random_map).

  Exactly round(mask_prob * eligible) positions are chosen (at least 1, at most
  `max_predictions`), uniformly among the real tokens that are not special.
  """

  def __init__(self, tokenizer, mask_prob: float = 0.15, max_predictions: int = 20):
    special = [tokenizer.token_id(t) for t in ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')]
    if any(s is None for s in special):
      raise sources.DataError('The tokenizer lacks BERT special tokens ([PAD] [UNK] [CLS] [SEP] [MASK]); use '
                       'data.tokenizer=wordpiece.')
    self.mask_id = tokenizer.token_id('[MASK]')
    self.never_chosen = np.asarray([tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id])
    self.random_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), special)
    self.mask_prob = mask_prob
    self.max_predictions = max_predictions

  def __call__(self, example: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens = example['tokens']
    eligible = np.flatnonzero(example['valid'] & ~np.isin(tokens, self.never_chosen))
    count = min(self.max_predictions, max(1, int(round(len(eligible) * self.mask_prob))), len(eligible))
    positions = np.sort(rng.choice(eligible, count, replace=False))
    corrupted = tokens.copy()
    action = rng.random(count)
    corrupted[positions[action < 0.8]] = self.mask_id
    random_slots = positions[(action >= 0.8) & (action < 0.9)]
    corrupted[random_slots] = rng.choice(self.random_ids, len(random_slots))
    pad = self.max_predictions - count
    return {**example, 'tokens': corrupted,
            'masked_positions': np.pad(positions, (0, pad)).astype(np.int32),
            'masked_labels': np.pad(tokens[positions], (0, pad)).astype(np.int32),
            'masked_weights': np.pad(np.ones(count, np.float32), (0, pad))}


# ----------------------------------------------------------------------------- example caches
PLAN_FORMAT = 1  # the layout of a remembered plan (data.cache_dir/plans)
PAIRS_FORMAT = 1  # how a shard's pairs are made: a change here makes new caches
SCAN_BYTES = 16 << 20  # a blank_line file is scanned for document breaks this many bytes at a time
SEED_OFFSETS = {'train': 0, 'valid': 1}  # a split's RNG seed is seed + this (as the in-memory path)
BUILT = ('train', 'valid')  # the splits pretraining reads (test is reported, never paired)


@dataclasses.dataclass(frozen=True)
class Piece:
  """Some documents of one split, consecutive in the source.

  kind 'file': the text file `where` is one document. 'blank_line': the documents of bytes
  [start, end) of the file `where`, numbered from `first_block` and keyed `<key>:<number>`, those of
  `split`. 'tfds': records [start, end) of `where` (name:split), keyed `<key>:<index>`, those of
  `split`. 'bbc_news': articles [start, end) of part `where` of bbc_news carved with the held-out
  roles `key` (comma-separated). `documents` and `size` (bytes of text; TFDS estimated) are its.
  """
  kind: str
  where: str
  key: str
  start: int
  end: int
  first_block: int
  split: str
  documents: int
  size: int


@dataclasses.dataclass(frozen=True)
class DocumentPlan:
  """A BERT source planned: its shards per split and what identifies it."""
  source: str
  whole: str  # the split every document goes to; '' when 'valid' is carved out by a hash of the keys
  forced: str  # the key of the document the few-documents rule holds out ('' none)
  shards: dict  # split -> [[Piece, ...], ...]
  documents: dict  # split -> documents
  origins: dict  # split -> where its documents come from (the split report)
  identity: dict  # what the cache's name hashes of the source itself


@dataclasses.dataclass
class _Stretch:
  """A Piece before its documents are assigned to shards: its documents and bytes per split."""
  kind: str
  where: str
  key: str
  start: int
  end: int
  first_block: int = 0
  counts: dict = dataclasses.field(default_factory=dict)  # split -> [documents, bytes]

  def add(self, split: str, documents: int, size: int) -> None:
    counts = self.counts.setdefault(split, [0, 0])
    counts[0] += documents
    counts[1] += size


def cached_pretraining_examples(data_config, workdir: str, seed: int, tokenizer: Tokenizer | None = None,
                                process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid'} -> token_cache.CachedExamples of unmasked pairs (FIELDS), {split:
  cache name}), by the split rule of data/sources.py; data.max_examples caps both splits.

  The tokenizer is `tokenizer` (init_from) or the workdir's, else the one trained before for this
  corpus and settings (under data.cache_dir), else trained on the first TOKENIZER_TRAINING_CHARS of
  the training documents; it is saved in `workdir`. Prints one line per split.
  """
  plans = _plans(data_config)
  _report_documents(data_config, plans)
  if tokenizer is None:
    tokenizer = _cached_tokenizer(data_config, workdir, plans['train'])
  else:
    tokenizer.save(workdir)
  examples, caches = {}, {}
  for role, plan in plans.items():
    wanted = [split for split in BUILT if split in plan.shards and split not in examples]
    if role == 'test' or not wanted:
      continue
    name = _build_cache(data_config, plan, wanted, tokenizer, seed, process_index, process_count)
    directory = token_cache.cache_directory(lm.cache_dir(data_config), name)
    for split in wanted:
      examples[split] = token_cache.CachedExamples(directory, split, FIELDS, data_config.max_examples)
      caches[split] = name
  return tokenizer, examples, caches


def _plans(data_config) -> dict[str, DocumentPlan]:
  """{'train': data.source's plan (with 'valid' carved out unless data.eval_source is named), and
  'valid' / 'test' for the sources named for them}."""
  eval_source, test_source = data_config.get('eval_source', ''), data_config.get('test_source', '')
  named = {'valid': eval_source, 'test': test_source or eval_source}
  held_out = tuple(role for role in ('valid', 'test') if not named[role])
  plans = {'train': plan_documents(data_config.source, 'train', held_out, data_config)}
  if eval_source:
    plans['valid'] = plan_documents(eval_source, 'valid', (), data_config)
  if test_source:
    plans['test'] = plan_documents(test_source, 'test', (), data_config)
  return plans


def _report_documents(data_config, plans: dict[str, DocumentPlan]) -> None:
  """The split lines of the in-memory path (sources.report_splits)."""
  parts = {}
  for plan in plans.values():
    for split, count in plan.documents.items():
      parts.setdefault(split, sources.Part(range(count), plan.origins[split]))
  if 'test' not in parts:
    why = 'data.test_source is empty' if data_config.get('eval_source', '') else 'this family holds out one split'
    parts['test'] = sources.Part(parts['valid'].examples, f'the valid split ({why})')
  sources.report_splits(parts, 'documents')


# ----------------------------------------------------------------------------- planning
def plan_documents(source: str, role: str, held_out: tuple[str, ...], data_config) -> DocumentPlan:
  """The plan of `source` named for `role` ('train': data.source, carving `held_out` out of it;
  'valid', 'test': used whole), remembered under data.cache_dir/plans: read once per corpus."""
  kind, argument = sources.parse_source(source)
  shard_bytes = token_cache.shard_bytes(data_config)
  if kind == 'bbc_news':
    identity, where = {'kind': 'bbc_news'}, {'root': classification.bbc_news_dir()}
  elif kind == 'text':
    files = token_cache._text_files(argument)
    identity = {'kind': 'text', 'documents': data_config.documents,
                'files': [[key, size, os.stat(path).st_mtime_ns] for key, path, size in files]}
    where = {'paths': [os.path.abspath(path) for _, path, _ in files]}
  elif kind == 'tfds':
    name, split = sources.split_tfds_source(argument, sources.TFDS_SPLITS[role])
    identity = {'kind': 'tfds', 'name': name, 'split': split, 'records': len(sources.tfds_records(name, split)),
                'field': data_config.text_field}
    where = {}
  else:
    raise sources.DataError(f'Unknown BERT pretraining source {source!r}: use bbc_news, text:<glob> or '
                            f'tfds:<name>[:<split>].')
  settings = {'format': PLAN_FORMAT, 'identity': identity, 'where': where, 'role': role, 'held_out': held_out,
              'shard_bytes': shard_bytes, 'eval_fraction': EVAL_FRACTION}
  key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
  plans = token_cache.cache_directory(lm.cache_dir(data_config), 'plans')
  path = os.path.join(plans, f'bert-{key}.json')
  if storage.path(path).exists():
    return _plan_from_json(storage.path(path).read_text(), path)
  if kind == 'bbc_news':
    plan = _plan_bbc_news(source, role, held_out, shard_bytes)
  elif kind == 'text':
    plan = _plan_text(source, files, role, 'valid' in held_out, data_config.documents, shard_bytes)
  else:
    plan = _plan_records(source, identity, role, 'valid' in held_out, shard_bytes)
  plan = dataclasses.replace(plan, identity={**identity, 'role': role, 'held_out': list(held_out)})
  token_cache._check_writable(plans)
  storage.write_atomically(path, json.dumps(dataclasses.asdict(plan)))
  return plan


def _plan_from_json(text: str, path: str) -> DocumentPlan:
  try:
    plan = DocumentPlan(**json.loads(text))
    shards = {split: [[Piece(**piece) for piece in shard] for shard in groups] for split, groups in plan.shards.items()}
  except (ValueError, TypeError) as e:
    raise sources.DataError(f'The remembered plan {path} is corrupt ({e}); delete it and rerun.') from e
  return dataclasses.replace(plan, shards=shards)


def _plan(source: str, role: str, carve: bool, stretches: list[_Stretch], last, shard_bytes: int) -> DocumentPlan:
  """A text or TFDS source's plan from its stretches (in document order) and its last document
  (stretch index, key, bytes): `_carve`'s rule and errors, the shards of every split."""
  documents = {}
  for stretch in stretches:
    for split, (count, _) in stretch.counts.items():
      documents[split] = documents.get(split, 0) + count
  forced = ''
  if carve:
    total, train, held = sum(documents.values()), documents.get('train', 0), documents.get('valid', 0)
    if not held and train > 2:  # few documents, none hashed to eval: hold out the last one
      index, forced, size = last
      stretches[index].add('train', -1, -size)
      stretches[index].add('valid', 1, size)
      train, held = train - 1, 1
    if not held or train < 2:
      raise sources.DataError(f'{source} has {total} documents: BERT pretraining needs several (random next '
                              f'sentences come from other documents, and some are held out). Use '
                              f'data.documents=blank_line or more files.')
    documents = {'train': train, 'valid': held}
    origins = {'train': f'{source}, the documents not held out', 'valid': f'{source}, a {EVAL_FRACTION:.0%} hash split'}
  else:
    documents = {role: documents.get(role, 0)}
    origins = {role: f'{source}, whole ({lm.NAMED_BY[role]})'}
  return DocumentPlan(source, '' if carve else role, forced, _shards(stretches, documents, shard_bytes), documents,
                      origins, {})


def _shards(stretches: list[_Stretch], splits, shard_bytes: int) -> dict[str, list[list[Piece]]]:
  """For each split, its pieces in order, grouped into shards of at most ~shard_bytes of text and
  at least 2 documents (a random next sentence needs another document of the shard)."""
  shards = {}
  for split in splits:
    groups, current, size, count = [], [], 0, 0
    for s in stretches:
      documents, nbytes = s.counts.get(split, (0, 0))
      if not documents:
        continue
      if current and size + nbytes > shard_bytes and count >= 2:
        groups.append(current)
        current, size, count = [], 0, 0
      current.append(Piece(s.kind, s.where, s.key, s.start, s.end, s.first_block, split, documents, nbytes))
      size, count = size + nbytes, count + documents
    if current and groups and count < 2:
      groups[-1] += current
    elif current:
      groups.append(current)
    shards[split] = groups
  return shards


def _split_of(plan: DocumentPlan, key: str) -> str:
  """The split of the document `key`: `_carve`'s rule (a hash of the key, seed 0)."""
  if plan.whole:
    return plan.whole
  if key == plan.forced:
    return 'valid'
  return 'valid' if sources.deterministic_split([key], [1 - EVAL_FRACTION, EVAL_FRACTION], seed=0)[1] else 'train'


def _plan_bbc_news(source: str, role: str, held_out: tuple[str, ...], shard_bytes: int) -> DocumentPlan:
  """bbc_news carved as the in-memory path carves it (its classification split for data.source;
  its own valid or test part when named for that role)."""
  carve = held_out if role == 'train' else ('valid', 'test')
  parts = _bbc_news_parts(carve)
  splits = tuple(parts) if role == 'train' else (role,)
  stretches = []
  for split in splits:
    texts, start, size = parts[split].examples, 0, 0
    for index, text in enumerate(texts):
      size += len(text.encode())
      if size >= shard_bytes or index == len(texts) - 1:
        stretches.append(_Stretch('bbc_news', split, ','.join(carve), start, index + 1, 0,
                                  {split: [index + 1 - start, size]}))
        start, size = index + 1, 0
  origins = ({split: part.origin for split, part in parts.items()} if role == 'train'
             else {role: f'{source}, whole ({lm.NAMED_BY[role]})'})
  documents = {split: len(parts[split].examples) for split in splits}
  return DocumentPlan(source, '', '', _shards(stretches, splits, shard_bytes), documents, origins, {})


@functools.lru_cache(maxsize=2)
def _bbc_news_parts(held_out: tuple[str, ...]) -> dict[str, sources.Part]:
  """`_carve(held_out)` of bbc_news, the article texts of each part (5 MB: kept while a process builds)."""
  return {split: sources.Part([text for _, text in part.examples], part.origin)
          for split, part in _carve('bbc_news', held_out, None).items()}


def _plan_text(source: str, files, role: str, carve: bool, mode: str, shard_bytes: int) -> DocumentPlan:
  """text:<glob> by data.documents: a file a document, or a file's blank-line blocks."""
  if mode == 'auto':
    mode = 'blank_line' if len(files) == 1 else 'file'
  if mode not in ('file', 'blank_line'):
    raise sources.DataError(f"data.documents={mode!r}: use 'file', 'blank_line' or 'auto'.")
  plan = DocumentPlan(source, '' if carve else role, '', {}, {}, {}, {})
  stretches, last = [], None
  for key, path, size in files:
    if mode == 'file':
      stretches.append(_Stretch('file', path, key, 0, size, 0, {_split_of(plan, key): [1, size]}))
      last = (len(stretches) - 1, key, size)
    else:
      found, found_last = _block_stretches(path, key, shard_bytes, lambda k: _split_of(plan, k))
      if found_last:
        last = (len(stretches) + found_last[0], *found_last[1:])
      stretches += found
  return _plan(source, role, carve, stretches, last, shard_bytes)


def _block_stretches(path: str, key: str, shard_bytes: int, split_of):
  """A blank_line file scanned once, SCAN_BYTES at a time: ([stretches that end after a document
  break every ~shard_bytes, with their documents per split], (stretch index, key, bytes) of its
  last document or None). Its documents are text_documents' (`_DOCUMENT_BREAK.split` of the text)."""
  import codecs
  decoder = codecs.getincrementaldecoder('utf-8')()
  stretches, current = [], _Stretch('blank_line', path, key, 0, 0)
  block, block_bytes, block_text, position, pending, read, last, begun = 0, 0, False, 0, '', 0, None, False

  def extend(text: str) -> None:  # more text of the current block
    nonlocal block_bytes, block_text, position
    size = len(text.encode())
    block_bytes, block_text, position = block_bytes + size, block_text or bool(text.strip()), position + size

  def close() -> None:  # the current block ends: a document unless it is blank
    nonlocal block, block_bytes, block_text, last
    if block_text:
      current.add(split_of(f'{key}:{block}'), 1, block_bytes)
      last = (len(stretches), f'{key}:{block}', block_bytes)
    block, block_bytes, block_text = block + 1, 0, False

  with open(path, 'rb') as f:
    while True:
      raw = f.read(SCAN_BYTES)
      final = not raw
      try:
        text = pending + decoder.decode(raw, final)
      except UnicodeDecodeError as e:
        offset = read - (len(e.object) - len(raw)) + e.start
        raise sources.DataError(f'{path}: byte {offset} (0x{e.object[e.start]:02x}) is not UTF-8; data files must '
                                f'be UTF-8: convert it (e.g. iconv -f cp1252 -t utf-8) or fix it.') from e
      if text and not begun:  # read_text_files drops a byte-order mark
        begun = True
        if text.startswith('\ufeff'):
          text, position = text[1:], 3
      read += len(raw)
      # A break touching the end may grow with the next bytes: only text before the trailing
      # whitespace is split now.
      boundary = len(text) if final else len(text.rstrip())
      cursor = 0
      for match in _DOCUMENT_BREAK.finditer(text, 0, boundary):
        extend(text[cursor:match.start()])
        close()
        position += len(match.group().encode())
        cursor = match.end()
        if position - current.start >= shard_bytes:
          current.end = position
          stretches.append(current)
          current = _Stretch('blank_line', path, key, position, position, block)
      extend(text[cursor:boundary])
      pending = text[boundary:]
      if final:
        break
  close()
  current.end = position
  if current.end > current.start:
    stretches.append(current)
  return stretches, last


def _plan_records(source: str, identity: dict, role: str, carve: bool, shard_bytes: int) -> DocumentPlan:
  """tfds:<name>[:<split>]: ranges of records, every record a document keyed name:split:index."""
  name, split, count = identity['name'], identity['split'], identity['records']
  records = sources.tfds_records(name, split)
  plan = DocumentPlan(source, '' if carve else role, '', {}, {}, {}, {})
  # Record sizes are unknown until read: ranges of a fixed count, from the first record's size.
  first = len(_record_text(records, 0, identity['field']).encode()) if count else 1
  step = max(1, shard_bytes // max(first, 256))
  stretches = []
  for start in range(0, count, step):
    stretch = _Stretch('tfds', f'{name}:{split}', f'{name}:{split}', start, min(start + step, count))
    for index in range(stretch.start, stretch.end):
      stretch.add(_split_of(plan, f'{name}:{split}:{index}'), 1, first)
    stretches.append(stretch)
  last = (len(stretches) - 1, f'{name}:{split}:{count - 1}', first) if count else None
  return _plan(source, role, carve, stretches, last, shard_bytes)


def _record_text(records, index: int, field: str) -> str:
  text = records[index][field]
  return text.decode('utf-8') if isinstance(text, bytes) else str(text)


# ----------------------------------------------------------------------------- reading and building
def _documents(plan: DocumentPlan, pieces, data_config) -> Iterator[str]:
  """The texts of the documents of `pieces` (Piece), in order."""
  for piece in pieces:
    if piece.kind == 'bbc_news':
      yield from _bbc_news_parts(tuple(filter(None, piece.key.split(','))))[piece.where].examples[piece.start:piece.end]
    elif piece.kind == 'file':
      with open(piece.where, 'rb') as f:
        text = sources.decode_utf8(f.read(), piece.where)
      if text.strip():
        yield text
    elif piece.kind == 'blank_line':
      with open(piece.where, 'rb') as f:
        f.seek(piece.start)
        raw = f.read(piece.end - piece.start)
      text = raw.decode('utf-8', errors='replace')  # the plan's scan decoded it strictly
      text = text.removeprefix('\ufeff') if piece.start == 0 else text
      for number, block in enumerate(_DOCUMENT_BREAK.split(text), piece.first_block):
        if block.strip() and _split_of(plan, f'{piece.key}:{number}') == piece.split:
          yield block
    else:
      name, split = piece.where.rsplit(':', 1)
      records = sources.tfds_records(name, split)
      for index in range(piece.start, piece.end):
        if _split_of(plan, f'{piece.key}:{index}') == piece.split:
          yield _record_text(records, index, data_config.text_field)


def _training_documents(plan: DocumentPlan, data_config) -> Iterator[str]:
  for shard in plan.shards['train']:
    yield from _documents(plan, shard, data_config)


def _cached_tokenizer(data_config, workdir: str, plan: DocumentPlan) -> Tokenizer:
  """The run's tokenizer (token_cache.shared_tokenizer), trained when new on the first
  TOKENIZER_TRAINING_CHARS of the training documents, as the in-memory path trains it."""
  identity = {'family': 'bert', 'corpus': plan.identity, 'whole': plan.whole, 'chars': lm.TOKENIZER_TRAINING_CHARS}
  return token_cache.shared_tokenizer(data_config, workdir, identity, lambda directory: lm.get_tokenizer(
      data_config, directory, _training_documents(plan, data_config)))


def _build_cache(data_config, plan: DocumentPlan, splits: list[str], tokenizer: Tokenizer, seed: int,
                 process_index: int, process_count: int) -> str:
  """The name of the example cache of `plan`'s `splits`, built (this process's shards) when missing:
  shard i is the layout's i-th (split, index within the split)."""
  layout = [(split, index) for split in splits for index in range(len(plan.shards[split]))]
  for split in splits:
    if not plan.shards[split]:
      _require_documents([], split)
  identity = {'format': token_cache.FORMAT_VERSION, 'pairs': PAIRS_FORMAT, 'corpus': plan.identity,
              'whole': plan.whole, 'forced': plan.forced, 'shard_bytes': token_cache.shard_bytes(data_config),
              'splits': splits, 'seed': seed, 'seq_len': data_config.seq_len, 'dupe_factor': data_config.dupe_factor,
              'short_seq_prob': data_config.short_seq_prob,
              'tokenizer': hashlib.sha256(tokenizer.to_json().encode()).hexdigest()}
  name = 'bert-' + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
  directory = token_cache.cache_directory(lm.cache_dir(data_config), name)
  infos = token_cache.build_examples(
      directory, {'source': plan.source, 'identity': identity},
      [sum(piece.size for piece in plan.shards[split][index]) for split, index in layout],
      lambda i: _shard_examples(plan, *layout[i], tokenizer, data_config, seed), process_index, process_count)
  for split in splits:
    if not sum(entry['rows'].get(split, 0) for entry in infos):
      _require_pairs({'tokens': ()})
  return name


def _shard_examples(plan: DocumentPlan, split: str, index: int, tokenizer: Tokenizer, data_config, seed: int):
  """make_shard for token_cache.build_examples: the pairs of shard `index` of `split`, from its own
  documents only, with the RNG seeded from (seed + SEED_OFFSETS[split], index)."""
  documents = tokenize_documents(list(_documents(plan, plan.shards[split][index], data_config)), tokenizer)
  alone = len(plan.shards[split]) == 1  # the whole split: the in-memory path's checks
  if alone:
    _require_documents(documents, split)
  dtypes = {'tokens': token_cache.token_dtype(tokenizer.vocab_size), 'segments': np.uint8, 'valid': np.bool_,
            'next_sentence': np.uint8}
  # A shard left with one document after tokenizing (its split has others) gives no pair.
  rows = sentence_pairs(documents if len(documents) >= 2 else [], tokenizer, data_config.seq_len,
                        np.random.default_rng([seed + SEED_OFFSETS[split], index]),
                        dupe_factor=data_config.dupe_factor if split == 'train' else 1,
                        short_seq_prob=data_config.short_seq_prob, dtypes=dtypes)
  if alone:
    _require_pairs(rows)
  return {split: rows}, {'split': split, 'documents': len(documents), 'pairs': len(rows['tokens'])}, {}
