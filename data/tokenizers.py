"""Tokenizers: character-level, byte-level BPE and WordPiece, all saved with the run and reloaded by it.

BPE and WordPiece are trained and run by Hugging Face `tokenizers`; this module only picks their
settings and gives every tokenizer the same small interface:

  encode(text) -> list[int]     decode(ids) -> str     vocab_size     special ids (pad_id, ...)
  save(directory)               load_tokenizer(directory)

`encode` gives the text's own ids; `encode(text, special_tokens=True)` adds what the tokenizer's
post-processor adds around them (BERT's [CLS]/[SEP], the BOS of an imported Llama tokenizer), as
Hugging Face's tokenizers do by default (the lm-eval harness's models read text that way).

The file written is `<directory>/tokenizer.json` (plus `tokenizer_meta.json` naming the kind).
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Iterable, Iterator, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

import storage
from data.sources import DataError

META_FILE = 'tokenizer_meta.json'
TOKENIZER_FILE = 'tokenizer.json'
# Special tokens every tokenizer reserves, in this order: ids 0..3.
PAD, BOS, EOS, UNK = '<pad>', '<bos>', '<eos>', '<unk>'
BERT_SPECIALS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
GPT2_END = '<|endoftext|>'  # GPT-2's one special token: document end, also used as BOS and padding


class Tokenizer:
  """Common interface; subclasses define `encode`, `decode`, `vocab_size` and `to_json`."""
  kind: str = ''

  def token_id(self, token: str) -> int | None:
    raise NotImplementedError

  def id_to_token(self, index: int) -> str:
    raise NotImplementedError

  @property
  def pad_id(self) -> int:
    return self._special(PAD, '[PAD]', GPT2_END)

  @property
  def bos_id(self) -> int | None:
    return self._special(BOS, '[CLS]', GPT2_END)

  @property
  def eos_id(self) -> int | None:
    return self._special(EOS, '[SEP]', GPT2_END)

  @property
  def unk_id(self) -> int | None:
    return self._special(UNK, '[UNK]')

  def _special(self, *names):
    for name in names:
      index = self.token_id(name)
      if index is not None:
        return index
    return None

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def encode_sentences(self, documents: list[list[str]]) -> tuple[list[list[int]], np.ndarray]:
    """The ids of every sentence of the documents, each encoded alone, in order: (id lists whose
    concatenation is them all, int64 [S]: each sentence's id count)."""
    ids = self.encode_batch([sentence for document in documents for sentence in document])
    return ids, np.fromiter(map(len, ids), np.int64, len(ids))

  def to_json(self) -> str:
    """The contents of tokenizer.json."""
    raise NotImplementedError

  def save(self, directory: str) -> None:
    """Write the meta file, then tokenizer.json, each complete under its name at once
    (`storage.write_atomically`): the processes of a multi-host run prepare the same workdir
    together, and one that finds tokenizer.json must find both files whole."""
    storage.path(directory).mkdir(parents=True, exist_ok=True)
    storage.write_atomically(os.path.join(directory, META_FILE), json.dumps({'kind': self.kind}))
    storage.write_atomically(os.path.join(directory, TOKENIZER_FILE), self.to_json())


class CharTokenizer(Tokenizer):
  """One id per character seen in training; unseen characters map to <unk>."""
  kind = 'char'

  def __init__(self, chars: Iterable[str]):
    self.vocab = [PAD, BOS, EOS, UNK] + sorted(set(chars) - {PAD, BOS, EOS, UNK})
    self._ids = {c: i for i, c in enumerate(self.vocab)}

  @classmethod
  def train(cls, texts: Iterable[str]) -> 'CharTokenizer':
    chars = set()
    for text in texts:
      chars.update(text)
    return cls(chars)

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def token_id(self, token):
    return self._ids.get(token)

  def id_to_token(self, index):
    return self.vocab[index]

  def encode(self, text: str, special_tokens: bool = False) -> list[int]:
    del special_tokens  # no post-processor: characters only (so is its Hugging Face form, interop.common)
    unk = self._ids[UNK]
    return [self._ids.get(c, unk) for c in text]

  def decode(self, ids) -> str:
    return ''.join(self.vocab[i] for i in ids if i > 3 and i < len(self.vocab))

  def to_json(self):
    return json.dumps({'vocab': self.vocab})

  @classmethod
  def from_json(cls, text: str):
    tok = cls([])
    tok.vocab = json.loads(text)['vocab']
    tok._ids = {c: i for i, c in enumerate(tok.vocab)}
    return tok


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizers.Tokenizer` (BPE or WordPiece) behind the common interface."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, kind: str):
    self.tokenizer = tokenizer
    self.kind = kind

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size()

  def token_id(self, token):
    return self.tokenizer.token_to_id(token)

  def id_to_token(self, index):
    return self.tokenizer.id_to_token(index)

  def encode(self, text: str, special_tokens: bool = False) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

  def encode_batch(self, texts):
    # The fast variant skips the character offsets (unused here): the same ids, twice the rate.
    return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

  def encode_sentences(self, documents):
    # A document's sentences as one pre-tokenized input: each is still normalized, pre-tokenized and
    # encoded alone (the same ids), but one Encoding per document, not per sentence, crosses into
    # Python, and its word ids say which sentence each id came from.
    encodings = self.tokenizer.encode_batch(documents, is_pretokenized=True, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    counts = np.fromiter(map(len, documents), np.int64, len(documents))
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    sentence = (np.fromiter(itertools.chain.from_iterable(e.word_ids for e in encodings), np.int64, int(lengths.sum()))
                + np.repeat(np.cumsum(counts) - counts, lengths))
    return ids, np.bincount(sentence, minlength=int(counts.sum()))

  def encode_pair(self, text_a: str, text_b: str | None = None):
    """BERT input: ([CLS] a [SEP] (b [SEP])) ids and segment ids (WordPiece only)."""
    encoding = self.tokenizer.encode(text_a, text_b, add_special_tokens=True)
    return encoding.ids, encoding.type_ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)

  def to_json(self):
    return self.tokenizer.to_str(pretty=True)  # as `tokenizers.Tokenizer.save` writes it


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> HFTokenizer:
  """Byte-level BPE (GPT-2 style): no unknown tokens, whitespace kept in the tokens."""
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[PAD, BOS, EOS, UNK],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tokenizer.train_from_iterator(_batched(texts), trainer=trainer)
  return HFTokenizer(tokenizer, 'bpe')


def bert_normalizer(lowercase: bool):
  return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                    lowercase=lowercase)


def configure_wordpiece(tokenizer: tokenizers.Tokenizer, lowercase: bool) -> tokenizers.Tokenizer:
  """BERT's pipeline around a WordPiece model: normalizer, pre-tokenizer, [CLS]/[SEP] template."""
  tokenizer.normalizer = bert_normalizer(lowercase)
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = decoders.WordPiece(prefix='##')
  cls_id, sep_id = tokenizer.token_to_id('[CLS]'), tokenizer.token_to_id('[SEP]')
  tokenizer.post_processor = processors.TemplateProcessing(
      single='[CLS] $A [SEP]', pair='[CLS] $A [SEP] $B:1 [SEP]:1',
      special_tokens=[('[CLS]', cls_id), ('[SEP]', sep_id)])
  return tokenizer


def train_wordpiece(texts: Iterable[str], vocab_size: int, lowercase: bool = True,
                    min_frequency: int = 2) -> HFTokenizer:
  """BERT-style WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0..4."""
  tokenizer = tokenizers.Tokenizer(models.WordPiece(unk_token='[UNK]'))
  tokenizer.normalizer = bert_normalizer(lowercase)
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(BERT_SPECIALS), show_progress=False)
  tokenizer.train_from_iterator(_batched(texts), trainer=trainer)
  return HFTokenizer(configure_wordpiece(tokenizer, lowercase), 'wordpiece')


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int, lowercase: bool = True) -> Tokenizer:
  """Train the tokenizer named by `data.tokenizer`: 'char', 'bpe' or 'wordpiece'."""
  if kind == 'char':
    return CharTokenizer.train(texts)
  if kind == 'bpe':
    return train_bpe(texts, vocab_size)
  if kind == 'wordpiece':
    return train_wordpiece(texts, vocab_size, lowercase=lowercase)
  raise DataError(f"Unknown tokenizer kind {kind!r}: use 'char', 'bpe' or 'wordpiece'.")


def load_tokenizer(directory: str) -> Tokenizer:
  meta_path = storage.path(directory) / META_FILE
  path = storage.path(directory) / TOKENIZER_FILE
  if not meta_path.exists() or not path.exists():
    raise DataError(f'No tokenizer in {directory} ({TOKENIZER_FILE} and {META_FILE} expected).')
  kind = json.loads(meta_path.read_text())['kind']
  if kind == 'char':
    return CharTokenizer.from_json(path.read_text())
  return HFTokenizer(tokenizers.Tokenizer.from_str(path.read_text()), kind)


def bert_inputs(ids_a: Sequence[Sequence[int]], ids_b: Sequence[Sequence[int] | None] | None, seq_len: int,
                cls_id: int, sep_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """BERT's inputs of N id lists (`ids_b` None) or pairs (an entry of `ids_b` None: that row has no b):
  [CLS] a [SEP] (b [SEP]) padded to seq_len -> (tokens, segments: int32 [N, seq_len], valid: bool
  [N, seq_len], cut: bool [N], whether tokens were dropped).

  The text that is longer loses tokens from its end first, one at a time (a on a tie), as in BERT's
  fine-tuning, until both fit the budget B = seq_len - 3 (one text: seq_len - 2). That loop in
  closed form: a keeps min(len a, max(B // 2, B - len b)) tokens and b keeps what is left of B, up
  to its length (one text longer than half: only it is cut; both longer: B // 2 and B - B // 2)."""
  count = len(ids_a)
  ids_b = ids_b if ids_b is not None else [None] * count
  has_b = np.fromiter((b is not None for b in ids_b), bool, count)
  (flat_a, start_a, length_a) = _flat(ids_a, seq_len)
  (flat_b, start_b, length_b) = _flat([b or () for b in ids_b], seq_len)
  budget = seq_len - 2 - has_b
  keep_a = np.minimum(length_a, np.maximum(budget // 2, budget - length_b))
  keep_b = np.minimum(length_b, budget - keep_a)
  tokens, segments, valid = bert_layout((flat_a, start_a, keep_a), (flat_b, start_b, keep_b), has_b, seq_len,
                                        cls_id, sep_id, pad_id)
  return tokens, segments, valid, (keep_a < length_a) | (keep_b < length_b)


def bert_layout(a: tuple[np.ndarray, np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray, np.ndarray],
                has_b: np.ndarray, seq_len: int, cls_id: int, sep_id: int, pad_id: int):
  """Rows [CLS] a [SEP] (b [SEP]) padded to seq_len, where a and b are runs (flat ids [T], start [N],
  length [N]) that fit: tokens, segments int32 [N, seq_len], valid bool [N, seq_len]. Row i has b
  where has_b[i] (bool [N]); segment 1 is b and its [SEP]."""
  (_, _, length_a), (_, _, length_b) = a, b
  rows = np.arange(len(has_b))
  tokens = np.full((len(rows), seq_len), pad_id, np.int32)
  tokens[:, 0] = cls_id
  _place_runs(tokens, *a, 1)
  tokens[rows, length_a + 1] = sep_id
  _place_runs(tokens, *b, length_a + 2)
  tokens[rows[has_b], (length_a + length_b + 2)[has_b]] = sep_id
  positions = np.arange(seq_len)
  valid = positions < (length_a + 2 + (length_b + 1) * has_b)[:, None]
  segments = ((positions > (length_a + 1)[:, None]) & valid).astype(np.int32)
  return tokens, segments, valid


def _flat(lists: Sequence[Sequence[int]], limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The first `limit` ids of each list as one run of a flat array, each id read once: (ids [T],
  start [N], length [N] of the whole lists). A long text costs no more than `limit` ids."""
  lengths = np.fromiter(map(len, lists), np.int64, len(lists))
  kept = np.minimum(lengths, limit)
  flat = np.fromiter(itertools.chain.from_iterable(ids[:limit] for ids in lists), np.int64, int(kept.sum()))
  return flat, np.cumsum(kept) - kept, lengths


def _place_runs(out: np.ndarray, flat: np.ndarray, start: np.ndarray, length: np.ndarray, column) -> None:
  """out[i, column_i + j] = flat[start[i] + j] for j < length[i] (`column` an int or one per row)."""
  row = np.repeat(np.arange(len(length)), length)
  within = np.arange(len(row)) - np.repeat(np.cumsum(length) - length, length)
  out[row, np.broadcast_to(column, length.shape)[row] + within] = flat[start[row] + within]


def encode_pair(ids_a: Sequence[int], ids_b: Sequence[int] | None, seq_len: int, cls_id: int, sep_id: int,
                pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`bert_inputs` of one example: (tokens, segments: int32 [seq_len], valid: bool [seq_len])."""
  tokens, segments, valid, _ = bert_inputs([ids_a], [ids_b], seq_len, cls_id, sep_id, pad_id)
  return tokens[0], segments[0], valid[0]


def _batched(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
  batch = []
  for text in texts:
    batch.append(text)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch
