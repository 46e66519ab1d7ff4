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

The pairs are an example cache (data/token_cache.py, `pretraining_datasets`):
  - Documents: a text file ('file'), the blocks between blank lines of a file ('blank_line';
    data.documents='auto': blank lines when the glob matches a single file), a TFDS record
    (`data.text_field`), a bbc_news article. A file is read in pieces of about a quarter of a
    shard, cut at a blank line or, where none is near, at a sentence boundary (a newline): a
    document larger than that becomes several documents, a shard holding several of them. Each is keyed
    by its file and byte offset (its file alone when whole) for the split: EVAL_FRACTION of the
    documents by a hash of their keys is validation; bbc_news keeps its own split (train / valid /
    test), so pretraining never sees the articles fine-tuning is tested on.
  - Each shard is paired alone (process p builds the shards i with i % P == p): its documents of a
    split tokenized, cut dupe_factor times (validation: once) with an RNG seeded from
    (seed + SEED_OFFSETS[split], shard index), and shuffled within the shard. A random next
    sentence B comes from another document of the SAME shard, as Google's create_pretraining_data.py
    draws it from the same input file: no shard reads another. A shard with a single document of a
    split gives no pairs of it.
Masks are drawn per example when batches are drawn.
"""
from __future__ import annotations

import array
import dataclasses
import itertools
import re
from typing import Iterator, Sequence

import numpy as np

from data import sources, token_cache
from data.tokenizers import Tokenizer

# A sentence ends at . ! or ? (perhaps closed by a quote or bracket) followed by space and an
# upper-case letter, digit or opening quote, unless the dot ends an initial or a title.
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]["\')\]]))'
                           r'(?<!\b[A-Z]\.)(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)'
                           r'\s+(?=["\'(\[]?[A-Z0-9])')
EVAL_FRACTION = 0.05
FIELDS = ('tokens', 'segments', 'valid', 'next_sentence')  # an example's fields (module docstring)
IN_MEMORY = {'tokens': np.int32, 'segments': np.int32, 'valid': np.bool_, 'next_sentence': np.int32}
ENCODE_CHARS = 1 << 20  # sentences per encode_batch call: ~10,000, enough for every core
SEED_OFFSETS = {'train': 0, 'valid': 1}  # a split's RNG seed is seed + this
BUILT = ('train', 'valid')  # the splits pretraining reads (test is reported, never paired)


def split_sentences(document: str) -> list[str]:
  """Lines of the document, each cut into sentences; blank lines dropped."""
  sentences = []
  for line in document.splitlines():
    sentences.extend(s.strip() for s in _SENTENCE_END.split(line) if s.strip())
  return sentences


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


def truncate_pair(a: Sequence[int], b: Sequence[int], max_tokens: int, rng: np.random.Generator):
  """(a, b) trimmed until they fit, a token at a time from the longer (b on a tie), from its front or
  its back at random (one draw per token, as BERT's truncate_seq_pair)."""
  excess = len(a) + len(b) - max_tokens
  if excess <= 0:
    return a, b
  lengths, trims = [len(a), len(b)], [[0, 0], [0, 0]]  # tokens taken from the front and the back of a, of b
  for front in (rng.random(excess) < 0.5).tolist():
    side = 0 if lengths[0] > lengths[1] else 1
    lengths[side] -= 1
    trims[side][0 if front else 1] += 1
  return a[trims[0][0]:len(a) - trims[0][1]], b[trims[1][0]:len(b) - trims[1][1]]


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
        a, b = list(itertools.chain.from_iterable(chunk[:a_end])), list(itertools.chain.from_iterable(chunk[a_end:]))
        if random_next:
          i -= len(chunk) - a_end  # the sentences not used as B start the next chunk
      if random_next:
        b = random_continuation(documents, index, max(target - len(a), 1), rng)
      a, b = truncate_pair(a, b, max_tokens, rng)
      if len(a) and len(b):
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
  examples = {field: np.zeros((len(pairs), seq_len) if field != 'next_sentence' else (len(pairs),), dtypes[field])
              for field in FIELDS}
  tokens, segments, valid = examples['tokens'], examples['segments'], examples['valid']
  tokens[:], cls, sep = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
  for row, index in enumerate(order):  # [CLS] A [SEP] B [SEP], padded
    a, b, random_next = pairs[index]
    pairs[index] = None  # freed as its row is written
    middle, end = len(a) + 1, len(a) + len(b) + 3
    tokens[row, 0], tokens[row, middle], tokens[row, end - 1] = cls, sep, sep
    tokens[row, 1:middle], tokens[row, middle + 1:end - 1] = a, b
    segments[row, middle + 1:end] = 1
    valid[row, :end] = True
    examples['next_sentence'][row] = random_next
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


# ----------------------------------------------------------------------------- the cache
class Documents:
  """The processor of BERT pretraining caches: a record is a document's text; a split's documents in
  a shard become its sentence pairs (FIELDS; 'test' documents are only counted)."""
  prefix = 'bert'

  def __init__(self, data_config, seed: int, blank_lines: bool = False, tokenizer: Tokenizer | None = None):
    self.data_config, self.seed, self.blank_lines, self.tokenizer = data_config, seed, blank_lines, tokenizer

  def records(self, piece: token_cache.Range, info: dict):
    if piece.cut == 'items':  # bbc_news: piece.key names its part
      for key, text, _ in sources.bbc_news()[piece.key][piece.start:piece.end]:
        yield key, text
    elif piece.cut == 'records':
      name, split = piece.key.rsplit(':', 1)
      records = sources.tfds_records(name, split)
      for index in range(piece.start, piece.end):
        [text] = sources.tfds_fields(records[index], [self.data_config.text_field], piece.path,
                                     'set data.text_field')
        yield f'{piece.key}:{index}', text
    else:
      raw, start = token_cache.range_bytes(piece), 0
      for match in [*(token_cache.BLANK_LINE.finditer(raw) if self.blank_lines else ()), None]:
        end = match.start() if match else len(raw)
        text = token_cache.decode(raw[start:end], piece, start)
        if text.strip():  # keyed by its file (a whole file) or its file and byte offset
          whole = piece.start + start == 0 and not self.blank_lines
          yield piece.key if whole else f'{piece.key}:{piece.start + start}', text
        start = match.end() if match else end

  def encode(self, split: str, documents: list[str], index: int, info: dict) -> dict[str, np.ndarray]:
    info.setdefault('documents', {})[split] = len(documents)
    if split not in BUILT:
      return {}
    tokenizer, config = self.tokenizer, self.data_config
    tokenized = tokenize_documents(documents, tokenizer)
    dtypes = {'tokens': token_cache.token_dtype(tokenizer.vocab_size), 'segments': np.uint8, 'valid': np.bool_,
              'next_sentence': np.uint8}
    rows = sentence_pairs(tokenized if len(tokenized) >= 2 else [], tokenizer, config.seq_len,
                          np.random.default_rng([self.seed + SEED_OFFSETS[split], index]),
                          dupe_factor=config.dupe_factor if split == 'train' else 1,
                          short_seq_prob=config.short_seq_prob, dtypes=dtypes)
    info.setdefault('pairs', {})[split] = len(rows['tokens'])
    return rows


def plan_source(source: str, role: str, data_config, size: int):
  """(the Corpus, its Carve, {split: origin}, whether documents are blank-line blocks) of a source
  read for `role`: data.source (validation carved out unless data.eval_source is named), or a
  source named for 'valid' / 'test' (whole)."""
  kind, argument = sources.parse_source(source)
  carve = sources.Carve(whole=role)
  origins = {role: sources.origin(data_config, role)}
  held_out = sources.held_out_roles(data_config) if role == 'train' else ()
  if kind == 'bbc_news':  # its own split; a role not held out gives its part to training
    parts = sources.bbc_news()
    splits = {part: part if part in held_out else 'train' for part in parts} if role == 'train' else {role: role}
    if held_out:
      origins = {'train': f'{source}, the documents not held out',
                 **{r: f'{source}, a {share:.0%} hash split' for r, share in sources.BBC_NEWS_FRACTIONS
                    if r in held_out}}
    identity = {'kind': 'bbc_news', 'root': sources.bbc_news_dir(), 'parts': splits}
    ranges = token_cache.part_ranges(source, {part: len(parts[part]) for part in parts}, splits)
    return token_cache.plan(source, ranges, identity, size), carve, origins, False
  if held_out:
    carve = sources.Carve(fractions=(('train', 1 - EVAL_FRACTION), ('valid', EVAL_FRACTION)), held_out=('valid',))
    origins = {'train': f'{source}, the documents not held out', 'valid': f'{source}, a {EVAL_FRACTION:.0%} hash split'}
  if kind == 'tfds':
    whole, identity = token_cache.tfds_range(argument, sources.TFDS_SPLITS[role])
    identity['field'] = data_config.text_field
    return token_cache.plan(source, [whole], identity, size), carve, origins, False
  if kind != 'text':
    raise sources.unknown_source(source, 'BERT pretraining', 'bbc_news, text:<glob> or tfds:<name>[:<split>]')
  files, identity = token_cache.text_files(source)
  mode = data_config.documents
  if mode not in ('file', 'blank_line', 'auto'):
    raise sources.DataError(f"data.documents={mode!r}: use 'file', 'blank_line' or 'auto'.")
  blank_lines = mode == 'blank_line' or (mode == 'auto' and len(files) == 1)
  identity['blank_lines'] = blank_lines
  files = [dataclasses.replace(f, cut='blocks') for f in files]
  # Pieces of about a quarter of a shard: a shard holds several documents even of one huge file.
  return token_cache.plan(source, files, identity, size, piece_bytes=size // 4), carve, origins, blank_lines


def pretraining_datasets(data_config, workdir: str, seed: int, tokenizer: Tokenizer | None = None,
                         process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid'} -> token_cache.Rows of unmasked pairs (FIELDS), {split: cache name})
  by the split rule of data/sources.py; data.max_examples caps both splits. The tokenizer is the
  given one (init_from), else token_cache.shared_tokenizer's, trained when new on the training
  documents. Prints one line per split."""
  size = token_cache.shard_bytes(data_config)
  corpora = {'train': plan_source(data_config.source, 'train', data_config, size)}
  for role in ('valid', 'test'):
    named = data_config.get({'valid': 'eval_source', 'test': 'test_source'}[role], '')
    if named:
      corpora[role] = plan_source(named, role, data_config, size)
  train, carve, _, blank_lines = corpora['train']
  tokenizer = token_cache.shared_tokenizer(
      data_config, workdir, {'family': 'bert', 'corpus': train.identity, 'carve': dataclasses.asdict(carve)},
      lambda: token_cache.records(train, Documents(data_config, seed, blank_lines), carve, 'train'), tokenizer)
  examples, caches, documents = {}, {}, {}
  for role, (corpus, carve, origins, blank_lines) in corpora.items():
    identity = {'corpus': corpus.identity, 'carve': dataclasses.asdict(carve), 'shard_bytes': size, 'seed': seed,
                'seq_len': data_config.seq_len, 'dupe_factor': data_config.dupe_factor,
                'short_seq_prob': data_config.short_seq_prob, 'tokenizer': token_cache.tokenizer_hash(tokenizer)}
    name = token_cache.cache_name(Documents.prefix, identity)
    directory = token_cache.cache_directory(token_cache.cache_dir(data_config), name)
    cache = token_cache.build(directory, corpus, Documents(data_config, seed, blank_lines, tokenizer), carve,
                              identity, process_index, process_count)
    for split, origin in origins.items():
      documents[split] = (cache.info('documents', split), origin, len(origins) > 1)
      if split in BUILT:
        examples[split], caches[split] = token_cache.Rows(cache, split, FIELDS, data_config.max_examples), name
        if not len(examples[split]) and documents[split][0] >= 2:
          raise sources.DataError(f'The {documents[split][0]} documents of the {split} split gave no sentence pairs (a '
                                  f'shard pairs its own documents, two or more of a split); use longer documents, '
                                  f'more of them, or a larger data.cache_shard_mb.')
  documents.setdefault('test', (documents['valid'][0], sources.origin(data_config, 'test'), False))
  for role in sources.ROLES:
    sources.report_split(role, documents[role][0], 'documents', documents[role][1])
  for split in BUILT:
    count, _, carved = documents[split]
    if count < 2 and carved:
      raise sources.DataError(f'{data_config.source} has {documents["train"][0] + documents["valid"][0]} documents '
                              f'with {count} in the {split} split: BERT pretraining needs several (random next '
                              f'sentences come from other documents, and some are held out). Use '
                              f'data.documents=blank_line or more files.')
    if count < 2:
      raise sources.DataError(f'BERT pretraining needs at least 2 non-empty documents in the {split} split, got '
                              f'{count}{"; use more documents or name data.eval_source." if split == "valid" else "."}')
  return tokenizer, examples, caches
