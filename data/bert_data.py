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
"""
from __future__ import annotations

import re

import numpy as np

from data import classification, sources
from data.classification import LabelledText, encode_pair, read_bbc_news

# A sentence ends at . ! or ? (perhaps closed by a quote or bracket) followed by space and an
# upper-case letter, digit or opening quote, unless the dot ends an initial or a title.
_SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]["\')\]]))'
                           r'(?<!\b[A-Z]\.)(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)'
                           r'\s+(?=["\'(\[]?[A-Z0-9])')
EVAL_FRACTION = 0.05


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
    for i, block in enumerate(re.split(r'\n\s*\n', text)):
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


def tokenize_documents(texts: list[str], tokenizer) -> list[list[list[int]]]:
  """Documents -> sentences -> WordPiece ids (empty sentences dropped)."""
  sentences = [split_sentences(t) for t in texts]
  flat = tokenizer.encode_batch([s for doc in sentences for s in doc])
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


def document_pairs(documents: list[list[list[int]]], index: int, max_tokens: int, short_seq_prob: float,
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


def pretraining_examples(documents: list[list[list[int]]], tokenizer, seq_len: int, *, dupe_factor: int = 1,
                         short_seq_prob: float = 0.1, seed: int = 0, max_examples: int = 0) -> dict[str, np.ndarray]:
  """Unmasked pair examples, stacked: {'tokens', 'segments' [N, seq_len], 'valid', 'next_sentence' [N]}."""
  if len(documents) < 2:
    raise sources.DataError(f'BERT pretraining needs at least 2 non-empty documents, got {len(documents)}.')
  rng = np.random.default_rng(seed)
  tokens, segments, valid, labels = [], [], [], []
  for _ in range(dupe_factor):
    for index in rng.permutation(len(documents)):
      for a, b, random_next in document_pairs(documents, int(index), seq_len - 3, short_seq_prob, rng):
        t, s, v = encode_pair(a, b, seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        tokens.append(t)
        segments.append(s)
        valid.append(v)
        labels.append(random_next)
  if not tokens:
    raise sources.DataError('The documents gave no sentence pairs; use longer documents.')
  order = rng.permutation(len(tokens))[:max_examples or None]
  return {'tokens': np.stack(tokens)[order], 'segments': np.stack(segments)[order], 'valid': np.stack(valid)[order],
          'next_sentence': np.asarray(labels, np.int32)[order]}


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
