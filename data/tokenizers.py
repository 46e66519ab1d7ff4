"""Tokenizers: character-level, byte-level BPE and WordPiece, all saved with the run and reloaded by it.

BPE and WordPiece are trained and run by Hugging Face `tokenizers`; this module only picks their
settings and gives every tokenizer the same small interface:

  encode(text) -> list[int]     decode(ids) -> str     vocab_size     special ids (pad_id, ...)
  save(directory)               load_tokenizer(directory)

The file written is `<directory>/tokenizer.json` (plus `tokenizer_meta.json` naming the kind).
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

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

  def encode(self, text: str) -> list[int]:
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

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts):
    # The fast variant skips the character offsets (unused here): the same ids, twice the rate.
    return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

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


def encode_pair(ids_a: list[int], ids_b: list[int] | None, seq_len: int, cls_id: int, sep_id: int, pad_id: int):
  """BERT's input of one or two id lists: [CLS] a [SEP] (b [SEP]) padded to seq_len -> (tokens,
  segments: int32 [seq_len], valid: bool [seq_len]); the longer text loses tokens from its end
  first, as in BERT's fine-tuning."""
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


def _batched(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
  batch = []
  for text in texts:
    batch.append(text)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch
