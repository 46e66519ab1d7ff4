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
    document larger than that becomes several documents, a shard holding several of them. The split
    hashes a document's key, which every piece of it carries: its file ('file'), or its file and the
    byte offset where it starts ('blank_line': a piece that begins inside a document takes the key of
    that document's start, `continued_documents`), so no document is in two splits. Validation is
    EVAL_FRACTION by the held-out rule of data/sources.py (at most sources.HELD_OUT_BYTES of text,
    at least sources.HELD_OUT_DOCUMENTS documents): files chosen whole by the hash of their keys
    and size when planned, planned last in shards of their own (a shard pairs its own documents);
    blank-line documents and TFDS records by the hash of each one's key as they are read. bbc_news
    keeps its own split (train / valid / test), so pretraining never sees the articles fine-tuning
    is tested on.
  - Each shard is paired alone (process p builds the shards i with i % P == p): its documents of a
    split tokenized, cut dupe_factor times (validation: once) with an RNG seeded from
    (seed + SEED_OFFSETS[split], shard index) (the documents' orders and the shuffle; the cuts and
    the trimming draw from two generators spawned from it, a block at a time: `Draws`), and
    shuffled within the shard. A random next
    sentence B comes from another document of the SAME shard, as Google's create_pretraining_data.py
    draws it from the same input file: no shard reads another. A shard with a single document of a
    split gives no pairs of it.
Masks are drawn per example when batches are drawn.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from typing import Iterator, Sequence

import numpy as np

from data import sources, token_cache
from data.tokenizers import Tokenizer, bert_layout

# A sentence ends at . ! or ? (perhaps closed by a quote or bracket) followed by space and an
# upper-case letter, digit or opening quote, unless the dot ends an initial or a title.
# The leading (?=\s) only makes it faster: most positions fail on it before the lookbehinds.
_SENTENCE_END = re.compile(r'(?=\s)(?:(?<=[.!?])|(?<=[.!?]["\')\]]))'
                           r'(?<!\b[A-Z]\.)(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)'
                           r'\s+(?=["\'(\[]?[A-Z0-9])')
EVAL_FRACTION = 0.05
FRACTIONS = (('train', 1 - EVAL_FRACTION), ('valid', EVAL_FRACTION))
FIELDS = ('tokens', 'segments', 'valid', 'next_sentence')  # an example's fields (module docstring)
IN_MEMORY = {'tokens': np.int32, 'segments': np.int32, 'valid': np.bool_, 'next_sentence': np.int32}
ENCODE_CHARS = 1 << 20  # characters per encode call: documents of ~10,000 sentences, enough for every core
ROWS_PER_LAYOUT = 8192  # pairs laid out into rows at once: the index arrays of ~1 M tokens
SEED_OFFSETS = {'train': 0, 'valid': 1}  # a split's RNG seed is seed + this
BUILT = ('train', 'valid')  # the splits pretraining reads (test is reported, never paired)
PAIRING = 2  # in every cache's identity: 2 = the draws of `Draws` (1, numpy scalar draws, paired otherwise)


def split_sentences(document: str) -> list[str]:
  """Lines of the document, each cut into sentences; blank lines dropped."""
  sentences = []
  for line in document.splitlines():
    for sentence in _SENTENCE_END.split(line):
      sentence = sentence.strip()
      if sentence:
        sentences.append(sentence)
  return sentences


@dataclasses.dataclass(frozen=True)
class TokenizedDocuments:
  """Documents as sentences of token ids, held flat (2 or 4 bytes an id; a list of Python ints would
  take 36): sentence j is tokens[bounds[j]:bounds[j + 1]], document d is its sentences
  spans[d] = (first, end). No sentence or document is empty, so every run of a document's
  sentences, and every part of one, is one slice of `tokens`: pairs are (start, end) ranges."""
  tokens: np.ndarray  # [T] ids
  bounds: list[int]  # [S + 1]: a Python list, as the pairing reads it an element at a time
  spans: list[tuple[int, int]]  # [D]

  def __len__(self) -> int:
    return len(self.spans)

  @classmethod
  def from_lengths(cls, tokens: np.ndarray, lengths: Sequence[int], counts: Sequence[int]) -> 'TokenizedDocuments':
    """`tokens` of sentences of `lengths`, documents of `counts` sentences; empty ones dropped."""
    bounds, spans, position = [0], [], 0
    for count in counts:
      first = len(bounds) - 1
      for length in lengths[position:position + count]:
        if length:
          bounds.append(bounds[-1] + length)
      position += count
      if len(bounds) - 1 > first:
        spans.append((first, len(bounds) - 1))
    return cls(tokens, bounds, spans)

  @classmethod
  def of(cls, documents: Sequence[Sequence[Sequence[int]]], dtype=np.int32) -> 'TokenizedDocuments':
    """From each document's sentences' ids."""
    sentences = [sentence for document in documents for sentence in document]
    lengths = [len(sentence) for sentence in sentences]
    tokens = np.fromiter(itertools.chain.from_iterable(sentences), dtype, sum(lengths))
    return cls.from_lengths(tokens, lengths, [len(document) for document in documents])


def tokenize_documents(texts: list[str], tokenizer) -> TokenizedDocuments:
  """Documents -> sentences -> WordPiece ids (empty sentences and documents dropped)."""
  sentences = [sentence for sentence in map(split_sentences, texts) if sentence]
  dtype = token_cache.token_dtype(tokenizer.vocab_size)
  parts, lengths = [], []
  # encode_batch holds ~50 bytes per character until it returns: a shard's text goes in batches.
  for batch in _batches(sentences, ENCODE_CHARS):
    ids, counts = tokenizer.encode_sentences(batch)
    parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype, int(counts.sum())))
    lengths += counts.tolist()
  tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
  return TokenizedDocuments.from_lengths(tokens, lengths, [len(doc) for doc in sentences])


Run = tuple[int, int]  # tokens [start, end) of TokenizedDocuments.tokens


class Draws:
  """The pairing's random numbers: uniforms in [0, 1) and fair coins, each from a generator of its
  own, drawn a block at a time and handed out in order (a numpy scalar draw costs ~1 us, about what a
  whole pair costs otherwise). Each stream is the sequence that `uniforms.random()` (coins:
  `coins.random() < 0.5`) called once per number gives, whatever the block size."""

  BLOCK = 1 << 14

  def __init__(self, uniforms: np.random.Generator, coins: np.random.Generator):
    blocks = iter(lambda: uniforms.random(self.BLOCK).tolist(), None)
    self.uniform = itertools.chain.from_iterable(blocks).__next__  # () -> the next uniform, a C call
    self._coins, self._flips = coins, np.zeros(0, bool)

  def below(self, n: int) -> int:
    """An integer in [0, n) from the next uniform."""
    return int(self.uniform() * n)

  def flips(self, count: int) -> np.ndarray:
    """The next `count` coins: bool [count]."""
    while len(self._flips) < count:
      self._flips = np.concatenate([self._flips, self._coins.random(max(self.BLOCK, count)) < 0.5])
    taken, self._flips = self._flips[:count], self._flips[count:]
    return taken


def truncate_pairs(pairs: np.ndarray, max_tokens: int, draws: Draws) -> np.ndarray:
  """Pairs (A start, A end, B start, B end) int64 [N, 4], each trimmed until it fits `max_tokens`, a
  token at a time from the longer side (B on a tie), from its front when that token's coin says so
  (BERT's truncate_seq_pair), the pairs' coins drawn in turn. That loop in closed form: which side
  loses each token follows from the lengths alone (the longer until the two are equal, then B, A,
  B, ... in turn), and how many from the front is a count of coins: all of a run, or every other."""
  a_start, a_end, b_start, b_end = pairs.T
  length_a, length_b = a_end - a_start, b_end - b_start
  excess = np.maximum(length_a + length_b - max_tokens, 0)
  end = np.cumsum(excess)
  start = end - excess  # each pair's coins: [start, end) of the shard's coins drawn here
  coins = draws.flips(int(end[-1]) if len(end) else 0)
  fronts = np.concatenate([[0], np.cumsum(coins)])  # fronts[j]: coins [0, j) that say "front"
  odd = np.arange(len(coins)) % 2 == 1
  by_parity = np.stack([np.concatenate([[0], np.cumsum(coins & ~odd)]), np.concatenate([[0], np.cumsum(coins & odd)])])

  def every_other(first, stop):  # fronts among coins first, first + 2, ... before stop
    first = np.minimum(first, stop)
    return by_parity[first % 2, stop] - by_parity[first % 2, first]

  first = np.minimum(np.abs(length_a - length_b), excess)  # tokens the longer loses before the two are equal
  a_longer = length_a > length_b
  run = fronts[start + first] - fronts[start]  # fronts among the longer side's first coins
  taken_a = np.where(a_longer, first, 0) + (excess - first) // 2
  taken_b = np.where(a_longer, 0, first) + (excess - first + 1) // 2
  front_a = np.where(a_longer, run, 0) + every_other(start + first + 1, end)
  front_b = np.where(a_longer, 0, run) + every_other(start + first, end)
  return np.stack([a_start + front_a, a_end - taken_a + front_a, b_start + front_b, b_end - taken_b + front_b], 1)


def random_continuation(documents: TokenizedDocuments, exclude: int, length: int, draws: Draws) -> Run:
  """At least `length` tokens (or the rest of a document): whole sentences from a random sentence of
  another document."""
  other = draws.below(len(documents) - 1)
  other += other >= exclude
  first, end = documents.spans[other]
  start = first + draws.below(end - first)
  bounds = documents.bounds
  stop = min(bisect.bisect_left(bounds, bounds[start] + length, start + 1, end + 1), end)
  return bounds[start], bounds[stop]


def document_pairs(documents: TokenizedDocuments, index: int, max_tokens: int, short_seq_prob: float,
                   draws: Draws) -> list[tuple[int, int, int, int, int]]:
  """(A start, A end, B start, B end, is_random_next) of the pairs of document `index`, A and B ranges
  of documents.tokens, before they are trimmed to `max_tokens` (`truncate_pairs`)."""
  first, end = documents.spans[index]
  bounds, uniform = documents.bounds, draws.uniform
  new_target = lambda: 2 + int(uniform() * (max_tokens - 1)) if uniform() < short_seq_prob else max_tokens
  target, pairs, chunk = new_target(), [], first
  while chunk < end:
    # The chunk: sentences chunk..i, up to the first that reaches the target (or the document's last).
    i = bisect.bisect_left(bounds, bounds[chunk] + target, chunk + 1, end) - 1
    random_next = uniform() < 0.5
    if i == chunk:
      # One sentence fills the chunk: A and B (when B is the real continuation) are its two halves.
      if bounds[i + 1] - bounds[i] < 2:
        chunk += 1
        continue
      cut = bounds[i] + 1 + int(uniform() * (bounds[i + 1] - bounds[i] - 1))
      a, b = (bounds[i], cut), (cut, bounds[i + 1])
    else:
      a_end = chunk + 1 + int(uniform() * (i - chunk))
      a, b = (bounds[chunk], bounds[a_end]), (bounds[a_end], bounds[i + 1])
      if random_next:
        i = a_end - 1  # the sentences not used as B start the next chunk
    if random_next:
      b = random_continuation(documents, index, max(target - (a[1] - a[0]), 1), draws)
    pairs.append((*a, *b, int(random_next)))
    chunk, target = i + 1, new_target()
  return pairs


def _batches(documents: list[list[str]], chars: int) -> Iterator[list[list[str]]]:
  """Consecutive runs of `documents` (each its sentences) of about `chars` characters each."""
  batch, size = [], 0
  for document in documents:
    batch.append(document)
    size += sum(map(len, document))
    if size >= chars:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def sentence_pairs(documents: TokenizedDocuments, tokenizer, seq_len: int, rng: np.random.Generator, *,
                   dupe_factor: int, short_seq_prob: float, dtypes: dict = IN_MEMORY) -> dict[str, np.ndarray]:
  """Every pair of `documents` (each cut `dupe_factor` times, in a random order of documents),
  shuffled: {'tokens', 'segments', 'valid' [N, seq_len], 'next_sentence' [N]} in `dtypes` (N may be 0;
  it is when there are fewer than 2 documents: a random B comes from another one)."""
  pairs, draws = [], Draws(*rng.spawn(2))
  for _ in range(dupe_factor if len(documents) >= 2 else 0):
    for index in rng.permutation(len(documents)).tolist():
      pairs += document_pairs(documents, index, seq_len - 3, short_seq_prob, draws)
  table = np.asarray(pairs, np.int64).reshape(-1, 5)
  del pairs
  for start in range(0, len(table), ROWS_PER_LAYOUT):  # in the order drawn: the coins are taken in turn
    table[start:start + ROWS_PER_LAYOUT, :4] = truncate_pairs(table[start:start + ROWS_PER_LAYOUT, :4], seq_len - 3,
                                                              draws)
  table = table[(table[:, 1] > table[:, 0]) & (table[:, 3] > table[:, 2])]  # a side trimmed away: no pair
  table = table[rng.permutation(len(table))]
  examples = {field: np.zeros((len(table), seq_len) if field != 'next_sentence' else (len(table),), dtypes[field])
              for field in FIELDS}
  for start in range(0, len(table), ROWS_PER_LAYOUT):  # [CLS] A [SEP] B [SEP], padded
    part = table[start:start + ROWS_PER_LAYOUT]
    rows = slice(start, start + len(part))
    examples['tokens'][rows], examples['segments'][rows], examples['valid'][rows] = bert_layout(
        (documents.tokens, part[:, 0], part[:, 1] - part[:, 0]), (documents.tokens, part[:, 2], part[:, 3] - part[:, 2]),
        np.ones(len(part), bool), seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
  examples['next_sentence'][:] = table[:, 4]
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
class Documents(token_cache.Processor):
  """The processor of BERT pretraining caches: a record is a document's text; a split's documents in
  a shard become its sentence pairs (FIELDS; 'test' documents are only counted)."""
  prefix = 'bert'
  # bump with any change to what records or encode write (token_cache.Processor; PAIRING stays); 3: the
  # held-out rule (data/sources.py) deals files by size, in shards of their own; TFDS pieces follow a sample
  VERSION = 3

  def __init__(self, data_config, seed: int, blank_lines: bool = False, tokenizer: Tokenizer | None = None,
               continued: dict[tuple[str, int], str] | None = None):
    """`continued`: `continued_documents` of the corpus read (blank-line documents only)."""
    self.data_config, self.seed, self.blank_lines, self.tokenizer = data_config, seed, blank_lines, tokenizer
    self.continued = continued or {}

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
        if text.strip():  # keyed by its file, or by its file and the offset where its document starts
          if not self.blank_lines:
            yield piece.key, text
          else:
            yield (self.continued.get((piece.key, piece.start)) if start == 0 else None) or \
                f'{piece.key}:{piece.start + start}', text
        start = match.end() if match else end

  def encode(self, split: str, documents: list[str], index: int, info: dict) -> dict[str, np.ndarray]:
    info.setdefault('documents', {})[split] = len(documents)
    if split not in BUILT:
      return {}
    tokenizer, config = self.tokenizer, self.data_config
    tokenized = tokenize_documents(documents, tokenizer)
    dtypes = {'tokens': token_cache.token_dtype(tokenizer.vocab_size), 'segments': np.uint8, 'valid': np.bool_,
              'next_sentence': np.uint8}
    rows = sentence_pairs(tokenized, tokenizer, config.seq_len,
                          np.random.default_rng([self.seed + SEED_OFFSETS[split], index]),
                          dupe_factor=config.dupe_factor if split == 'train' else 1,
                          short_seq_prob=config.short_seq_prob, dtypes=dtypes)
    info.setdefault('pairs', {})[split] = len(rows['tokens'])
    return rows


def continued_documents(corpus: token_cache.Corpus, window: int = 1 << 16) -> dict[tuple[str, int], str]:
  """{(file key, piece start): the key of the document it continues} of the pieces of blank-line
  documents that begin inside a document (cut at a newline, where no blank line was near): the
  document started at the last blank line of the piece before, or where that piece's own first
  document started. Reads each piece before such a cut back from its end, `window` bytes and then
  twice as many at a time, to its last blank line (usually a few KB; the whole piece when it has none)."""
  pieces = [piece for shard in corpus.shards for piece in shard if piece.cut == 'blocks']
  continued = {}
  for before, piece in zip(pieces, pieces[1:]):
    if piece.key != before.key or piece.start != before.end:
      continue
    size = window
    while True:
      start = max(before.start, before.end - size)
      raw = token_cache.range_bytes(dataclasses.replace(before, start=start))
      last = None
      for last in token_cache.BLANK_LINE.finditer(raw):
        pass
      if last is not None or start == before.start:
        break
      size *= 2
    if not raw[last.end() if last else 0:].strip():  # the piece before ends with its document
      continue
    continued[piece.key, piece.start] = (f'{before.key}:{start + last.end()}' if last else
                                         continued.get((before.key, before.start), f'{before.key}:{before.start}'))
  return continued


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
  if kind == 'tfds':
    whole, identity = token_cache.tfds_range(argument, sources.TFDS_SPLITS[role])
    identity['field'] = data_config.text_field
    name, split = whole.key.rsplit(':', 1)
    per_record = sources.bytes_per_record(sources.tfds_records(name, split), [data_config.text_field], whole.path,
                                          'set data.text_field')
    corpus = token_cache.plan(source, [whole], identity, size, max(round(per_record), 256))
    if held_out:  # records dealt as they are read
      carve = sources.carve_out(FRACTIONS, ('valid',), whole.end * per_record)
      origins = sources.carved_origins(source, carve, 'documents')
    return corpus, carve, origins, False
  if kind != 'text':
    raise sources.unknown_source(source, 'BERT pretraining', 'bbc_news, text:<glob> or tfds:<name>[:<split>]')
  files, identity = token_cache.text_files(source)
  mode = data_config.documents
  if mode not in ('file', 'blank_line', 'auto'):
    raise sources.DataError(f"data.documents={mode!r}: use 'file', 'blank_line' or 'auto'.")
  blank_lines = mode == 'blank_line' or (mode == 'auto' and len(files) == 1)
  identity['blank_lines'] = blank_lines
  files = [dataclasses.replace(f, cut='blocks') for f in files]
  if held_out and blank_lines:  # documents met as they are read, dealt by the hash of each one's key
    carve = sources.carve_out(FRACTIONS, ('valid',), sum(f.end for f in files))
    origins = sources.carved_origins(source, carve, 'documents')
  elif held_out:  # files dealt whole, the held-out ones last, in shards of their own (a shard pairs its own)
    documents = [(f.key, f.end) for f in files]
    dealt = sources.hold_out_documents(documents, FRACTIONS, ('valid',))
    files = sorted((dataclasses.replace(f, split=dealt.get(f.key, ('train',))[0]) for f in files),
                   key=lambda f: f.split != 'train')
    carve = sources.Carve(fractions=FRACTIONS, held_out=('valid',))
    origins = sources.held_out_origins(source, documents, dealt, ('valid',))
  # Pieces of about a quarter of a shard: a shard holds several documents even of one huge file.
  return token_cache.plan(source, files, identity, size, piece_bytes=size // 4, apart=True), carve, origins, blank_lines


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
  continued = {role: continued_documents(corpus) if blank_lines else {}
               for role, (corpus, _, _, blank_lines) in corpora.items()}
  train, carve, _, blank_lines = corpora['train']
  tokenizer = token_cache.shared_tokenizer(
      data_config, workdir, {'family': 'bert', 'corpus': train.identity, 'carve': dataclasses.asdict(carve)},
      lambda: token_cache.records(train, Documents(data_config, seed, blank_lines, continued=continued['train']), carve,
                                  'train'), tokenizer)
  examples, caches, documents = {}, {}, {}
  for role, (corpus, carve, origins, blank_lines) in corpora.items():
    identity = {'corpus': corpus.identity, 'carve': dataclasses.asdict(carve), 'shard_bytes': size, 'seed': seed,
                'seq_len': data_config.seq_len, 'dupe_factor': data_config.dupe_factor,
                'short_seq_prob': data_config.short_seq_prob, 'pairing': PAIRING,
                'tokenizer': token_cache.tokenizer_hash(tokenizer)}
    name = token_cache.cache_name(Documents.prefix, identity)
    directory = token_cache.cache_directory(token_cache.cache_dir(data_config), name)
    processor = Documents(data_config, seed, blank_lines, tokenizer, continued[role])
    cache = token_cache.build(directory, corpus, processor, carve, identity, process_index, process_count,
                              workers=token_cache.cache_workers(data_config))
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
