"""Translation data: sentence pairs -> joint subword vocabulary -> fixed-length id arrays.

Sources (`data.source`):
  numbers_en_fr            built-in and offline: English number words -> French number words
                           (num2words), generated deterministically from the seed
  tsv:<path>               one `source<TAB>target` pair per line (UTF-8, gzipped or not; a header
                           line is skipped with data.tsv_header=True; malformed lines are
                           skipped, up to data.max_malformed_fraction); held-out pairs are a
                           90/5/5 split by a hash of the line
  tfds:<name>[:<split>]    a TFDS translation set, e.g. tfds:wmt14_translate/de-en; the language
                           pair is read from the name ('de-en': German -> English) unless
                           data.source_lang / data.target_lang say otherwise; held-out pairs are
                           its validation and test splits
`data.eval_source` and `data.test_source` (same syntax) name the validation and test pairs, used
whole; the rule is in data/sources.py.

Every example is a dict of int32 arrays, padded with the tokenizer's pad id:
  source      [S]  source ids + EOS
  target_in   [T]  BOS + target ids (the decoder input, shifted right)
  target_out  [T]  target ids + EOS (what the decoder predicts)
One BPE or WordPiece vocabulary is trained on both sides of the training pairs (a joint
vocabulary, so embeddings can be shared) and saved in the run's workdir.

Shared by the Transformer (train/tasks/transformer.py) and the RNN seq2seq families.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import grain
import numpy as np

import storage
from data import sources, token_cache
from data.tokenizers import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_tokenizer

Pair = tuple[str, str]
TSV_FRACTIONS = (0.9, 0.05, 0.05)
# numbers_en_fr: pairs per split, and the share of each kind of number among the draws.
NUMBERS_SIZES = (50_000, 1_000, 1_000)
NUMBERS_HELD_OUT = 0.05  # share of all English number texts reserved for validation, and again for test
NUMBERS_KINDS = (('cardinal', 0.6), ('ordinal', 0.3), ('year', 0.1))
# Share of cardinals and ordinals with 1, 2, ..., 6 digits: mostly long compositions, while the
# few short numbers still recur often.
NUMBERS_DIGITS = (0.04, 0.08, 0.22, 0.22, 0.22, 0.22)
NUMBERS_YEARS = (1100, 2100)
# Numbers up to this one (both as cardinals and ordinals) are the lexicon and always in training.
NUMBERS_LEXICON = 100
# The joint vocabulary trains on at most this many characters of training pairs (as data/lm.py's).
TOKENIZER_TRAINING_CHARS = 20_000_000


@dataclasses.dataclass
class Splits:
  """Raw (source, target) text pairs of each split."""
  train: list[Pair]
  validation: list[Pair]
  test: list[Pair]


# ----------------------------------------------------------------------------- numbers_en_fr
def number_pair(kind: str, n: int) -> Pair:
  """('one hundred and twenty-first', 'cent vingt et unième') for ('ordinal', 121)."""
  return _number_words(kind, n, 'en'), _number_words(kind, n, 'fr')


def _number_words(kind: str, n: int, lang: str) -> str:
  from num2words import num2words
  return num2words(n, to=kind, lang=lang)


def _draw_numbers(rng: np.random.Generator, count: int = 4096):
  """Endless (kind, n) draws, generated `count` at a time."""
  kinds = [kind for kind, _ in NUMBERS_KINDS]
  while True:
    kind = rng.choice(len(kinds), size=count, p=[weight for _, weight in NUMBERS_KINDS])
    digits = rng.choice(len(NUMBERS_DIGITS), size=count, p=NUMBERS_DIGITS) + 1
    low = np.where(digits > 1, 10 ** (digits - 1), 0)
    value = low + np.floor(rng.random(count) * (10 ** digits - low)).astype(np.int64)
    year = rng.integers(*NUMBERS_YEARS, size=count)
    for k, v, y in zip(kind, value, year):
      yield (kinds[k], int(y)) if kinds[k] == 'year' else (kinds[k], int(v))


def numbers_en_fr(seed: int = 0, sizes: tuple[int, int, int] = NUMBERS_SIZES) -> Splits:
  """English -> French number words: cardinals, ordinals and years below a million.

  Numbers are drawn from `seed` (number of digits from NUMBERS_DIGITS, then a uniform value;
  small numbers recur, as in text). A hash of the English text reserves NUMBERS_HELD_OUT of all
  numbers for validation and as many for test, so held-out numbers never occur in training;
  validation and test hold distinct numbers, training keeps repeats. The lexicon (every cardinal
  and ordinal up to NUMBERS_LEXICON) is always training data, once up front and whenever drawn:
  held-out numbers are new compositions of known words. Splits have sizes[0] (+ the lexicon),
  sizes[1] and sizes[2] pairs.
  """
  french: dict[tuple[str, int], str] = {}  # num2words' French is slow and draws repeat

  def pair(kind, n):
    if (kind, n) not in french:
      french[kind, n] = _number_words(kind, n, 'fr')
    return _number_words(kind, n, 'en'), french[kind, n]

  lexicon = [pair(kind, n) for n in range(NUMBERS_LEXICON + 1) for kind in ('cardinal', 'ordinal')]
  lexicon_sources = {en for en, _ in lexicon}
  draws = _draw_numbers(np.random.default_rng(seed))
  fractions = [1 - 2 * NUMBERS_HELD_OUT, NUMBERS_HELD_OUT, NUMBERS_HELD_OUT]
  train: list[Pair] = []
  held_out: tuple[dict[str, str], ...] = ({}, {})
  while len(train) < sizes[0] or any(len(part) < size for part, size in zip(held_out, sizes[1:])):
    kind, n = next(draws)
    en = _number_words(kind, n, 'en')
    split = 0 if en in lexicon_sources else next(
        i for i, hit in enumerate(sources.deterministic_split([en], fractions, seed)) if hit)
    if split == 0 and len(train) < sizes[0]:
      train.append(pair(kind, n))
    elif split and len(held_out[split - 1]) < sizes[split] and en not in held_out[split - 1]:
      held_out[split - 1][en] = pair(kind, n)[1]
  return Splits(lexicon + train, *(list(part.items()) for part in held_out))


# ----------------------------------------------------------------------------- files and TFDS
def read_tsv(path: str, max_malformed_fraction: float = sources.MAX_MALFORMED_FRACTION,
             header: bool = False) -> list[Pair]:
  """`source<TAB>target` lines -> pairs, both sides stripped; blank lines are skipped, and the first
  line too with `header` (sources.read_lines).

  Malformed lines (not two fields, an empty side) are skipped and counted, or stop the run with a
  DataError when they are more than `max_malformed_fraction` of the non-blank lines.
  """
  lines, path = sources.read_lines(path, 'source<TAB>target', header)
  pairs, malformed = [], []
  for number, line in lines:
    fields = sources.tsv_fields(line)
    if len(fields) != 2:
      malformed.append((number, f'{len(fields)} tab-separated fields, not source<TAB>target'))
    elif not fields[0] or not fields[1]:
      malformed.append((number, f'empty {"source" if not fields[0] else "target"}'))
    else:
      pairs.append((fields[0], fields[1]))
  sources.check_malformed(f'tsv:{path}', malformed, len(lines), max_malformed_fraction)
  if not pairs:
    raise sources.DataError(f'tsv:{path} holds no pairs; give a file of source<TAB>target lines.')
  return pairs


def language_pair(name: str, data_config) -> tuple[str, str]:
  """(source, target) language keys: data.source_lang/target_lang, else from 'wmt14_translate/de-en'."""
  source_lang = data_config.get('source_lang', '')
  target_lang = data_config.get('target_lang', '')
  if source_lang and target_lang:
    return source_lang, target_lang
  languages = name.rpartition('/')[2].split('-')
  if len(languages) != 2:
    raise sources.DataError(f'Cannot read a language pair from tfds:{name}; set '
                            f'--config.data.source_lang and --config.data.target_lang.')
  return languages[0], languages[1]


def tfds_pairs(name: str, split: str, source_lang: str, target_lang: str) -> list[Pair]:
  records = sources.tfds_records(name, split)
  pairs = []
  for i in range(len(records)):
    record = records[i]
    if source_lang not in record or target_lang not in record:
      raise sources.DataError(f'tfds:{name}:{split} has features {sorted(record)}, not {source_lang!r} and '
                              f'{target_lang!r}; set data.source_lang and data.target_lang.')
    text = lambda value: (value.decode('utf-8') if isinstance(value, bytes) else str(value)).strip()
    pairs.append((text(record[source_lang]), text(record[target_lang])))
  if not pairs:
    raise sources.DataError(f'tfds:{name}:{split} is empty.')
  return pairs


def _numbers(data_config, seed: int, train: bool) -> Splits:
  """numbers_en_fr sized by data.max_examples (generating is the slow part: num2words); without
  `train`, only the held-out pairs (the same ones: draws that hash to training are skipped)."""
  size = data_config.max_examples or NUMBERS_SIZES[0]
  held_out = min(NUMBERS_SIZES[1], max(100, size // 10))
  return numbers_en_fr(seed, (size if train else 0, held_out, held_out))


def _unknown(source: str) -> sources.DataError:
  return sources.DataError(f'Unknown translation source {source!r}: use numbers_en_fr, tsv:<path> or '
                           f'tfds:<name>[:<split>] (e.g. tfds:wmt14_translate/de-en).')


def _carve(source: str, held_out: tuple[str, ...], data_config, seed: int) -> dict[str, sources.Part]:
  """data.source's training pairs and the held-out roles in `held_out` (see sources.split_roles)."""
  kind, argument = sources.parse_source(source)
  Part = sources.Part
  if kind == 'numbers_en_fr':
    numbers = _numbers(data_config, seed, train=True)
    origin = f'numbers_en_fr (generated from seed {seed})'
    own = {'valid': numbers.validation, 'test': numbers.test}
    return {'train': Part(numbers.train, origin), **{role: Part(own[role], origin) for role in held_out}}
  if kind == 'tsv':
    pairs = read_tsv(argument, **sources.tsv_options(data_config))
    if not held_out:
      return {'train': Part(pairs, f'{source}, whole (data.source)')}
    parts = dict(zip(sources.ROLES, sources.deterministic_split([f'{s}\t{t}' for s, t in pairs], TSV_FRACTIONS,
                                                                 seed)))
    if any(not parts[role] for role in held_out):
      raise sources.DataError(f'{source} has {len(pairs)} pairs, too few to hold out validation and test pairs; '
                              f'add more or name them with data.eval_source / data.test_source.')
    # A split named elsewhere gives its share back to training.
    train = sorted(i for role in sources.ROLES if role == 'train' or role not in held_out for i in parts[role])
    shares = dict(zip(sources.ROLES, TSV_FRACTIONS))
    result = {'train': Part([pairs[i] for i in train], f'{source}, the pairs not held out')}
    for role in held_out:
      result[role] = Part([pairs[i] for i in parts[role]], f'{source}, a {shares[role]:.0%} hash split')
    return result
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, 'train')
    languages = language_pair(name, data_config)
    result = {'train': Part(tfds_pairs(name, split, *languages), f'tfds:{name}:{split}')}
    for role in held_out:
      result[role] = Part(tfds_pairs(name, sources.TFDS_SPLITS[role], *languages),
                          f'tfds:{name}:{sources.TFDS_SPLITS[role]}')
    return result
  raise _unknown(source)


def _read_whole(source: str, role: str, data_config, seed: int) -> list[Pair]:
  """The pairs of a source named for `role` ('valid' or 'test'); a built-in gives its own split."""
  kind, argument = sources.parse_source(source)
  if kind == 'numbers_en_fr':
    numbers = _numbers(data_config, seed, train=False)
    return numbers.validation if role == 'valid' else numbers.test
  if kind == 'tsv':
    return read_tsv(argument, **sources.tsv_options(data_config))
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, sources.TFDS_SPLITS[role])
    return tfds_pairs(name, split, *language_pair(name, data_config))
  raise _unknown(source)


def load_pairs(data_config, seed: int) -> Splits:
  """The raw pairs of each split by the rule of data/sources.py (data.source, data.eval_source,
  data.test_source); data.max_examples caps training. Prints one line per split."""
  parts = sources.split_roles(data_config, lambda source, held_out: _carve(source, held_out, data_config, seed),
                              lambda source, role: _read_whole(source, role, data_config, seed))
  sources.cap_train(parts, data_config.max_examples)
  sources.report_splits(parts, 'pairs')
  return keep_numbers_at_least(Splits(parts['train'].examples, parts['valid'].examples, parts['test'].examples),
                               data_config)


_SMALL = {w: i for i, w in enumerate('zero one two three four five six seven eight nine ten eleven twelve thirteen '
                                     'fourteen fifteen sixteen seventeen eighteen nineteen'.split())}
_TENS = {w: 10 * i for i, w in enumerate('twenty thirty forty fifty sixty seventy eighty ninety'.split(), 2)}
_IRREGULAR_ORDINALS = {'zeroth': 'zero', 'first': 'one', 'second': 'two', 'third': 'three', 'fifth': 'five',
                       'eighth': 'eight', 'ninth': 'nine', 'twelfth': 'twelve'}


def english_number(text: str) -> int | None:
  """The value of English number words (num2words style, cardinal or ordinal), None for other text.

  'one hundred and twenty-three thousand, four hundred and fifty-sixth' -> 123456. Years such as
  'nineteen ninety-nine' are not sums of their words and come out far below their value (118).
  """
  total = current = 0
  for word in re.split(r'[\s,-]+', text.lower().strip()):
    if word in ('', 'and'):
      continue
    word = _IRREGULAR_ORDINALS.get(word, word)
    if word.endswith('ieth'):  # twentieth -> twenty
      word = word[:-4] + 'y'
    elif word.endswith('th') and word not in _SMALL:
      word = word[:-2]
    if word in _SMALL:
      current += _SMALL[word]
    elif word in _TENS:
      current += _TENS[word]
    elif word == 'hundred':
      current *= 100
    elif word == 'thousand':
      total, current = total + current * 1000, 0
    else:
      return None
  return total + current


def keep_numbers_at_least(splits: Splits, data_config) -> Splits:
  """`data.min_number` > 0 (a numbers_en_fr setting): only the pairs whose English number is at
  least that large, in every split."""
  minimum = data_config.get('min_number', 0)
  if not minimum:
    return splits
  if sources.parse_source(data_config.source)[0] != 'numbers_en_fr':
    raise sources.DataError(f'data.min_number={minimum} filters numbers_en_fr pairs only; '
                            f'data.source is {data_config.source!r}. Set data.min_number=0.')
  keep = lambda pairs: [(s, t) for s, t in pairs if (english_number(s) or 0) >= minimum]
  return Splits(keep(splits.train), keep(splits.validation), keep(splits.test))


# ----------------------------------------------------------------------------- tokens
def get_tokenizer(data_config, workdir: str, train_pairs: list[Pair]) -> Tokenizer:
  """The joint vocabulary of both languages: reloaded from `workdir` if saved there, else trained
  on the training pairs (data.tokenizer, data.vocab_size) and saved."""
  if (storage.path(workdir) / TOKENIZER_FILE).exists():
    return load_tokenizer(workdir)
  texts = [text for pair in train_pairs for text in pair]
  tokenizer = train_tokenizer(data_config.tokenizer, texts, data_config.vocab_size, data_config.lowercase)
  for name in ('bos_id', 'eos_id', 'pad_id'):
    if getattr(tokenizer, name) is None:
      raise sources.DataError(f'Tokenizer {data_config.tokenizer!r} has no {name[:-3]} token; use bpe or wordpiece.')
  tokenizer.save(workdir)
  return tokenizer


def encode_pairs(tokenizer: Tokenizer, pairs: list[Pair], source_len: int, target_len: int, *,
                 drop_long: bool, split: str = '') -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Tokenize and pad pairs into the example arrays described in the module docstring.

  Args:
    source_len / target_len: S and T; EOS (and BOS) take one position each.
    drop_long: drop pairs that do not fit (training); otherwise truncate them, keeping EOS,
      so every pair keeps its row (evaluation against references).
    split: the split's name ('train', 'valid', 'test'): prints how many pairs did not fit
      (sources.report_fit); '' prints nothing (predictions).
  Returns:
    ({'source': [N, S], 'target_in': [N, T], 'target_out': [N, T]} int32, [N] indices of the kept
    pairs in `pairs`).
  """
  arrays, kept, cut = encoded_pairs(tokenizer, pairs, source_len, target_len, drop_long)
  if split:
    report_pair_fit(split, len(pairs), cut, drop_long, source_len, target_len)
  return arrays, kept


def report_pair_fit(split: str, total: int, cut: int, drop_long: bool, source_len: int, target_len: int) -> None:
  sources.report_fit(split, 'pairs', total, cut, 'dropped' if drop_long else 'truncated',
                     f'{source_len - 1} source / {target_len - 1} target tokens (data.seq_len)')


def encoded_pairs(tokenizer: Tokenizer, pairs: list[Pair], source_len: int, target_len: int, drop_long: bool
                  ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
  """`encode_pairs` without the report: (arrays, kept indices, how many pairs did not fit)."""
  pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
  source_ids = tokenizer.encode_batch([s for s, _ in pairs])
  target_ids = tokenizer.encode_batch([t for _, t in pairs])
  fits = [len(source_ids[i]) < source_len and len(target_ids[i]) < target_len for i in range(len(pairs))]
  kept = [i for i in range(len(pairs)) if fits[i] or not drop_long]
  arrays = {name: np.full((len(kept), length), pad, np.int32)
            for name, length in (('source', source_len), ('target_in', target_len), ('target_out', target_len))}
  for row, i in enumerate(kept):
    source = source_ids[i][: source_len - 1] + [eos]
    target = target_ids[i][: target_len - 1]
    arrays['source'][row, : len(source)] = source
    arrays['target_in'][row, : len(target) + 1] = [bos] + target
    arrays['target_out'][row, : len(target) + 1] = target + [eos]
  return arrays, np.asarray(kept, np.int64), fits.count(False)


def as_dataset(arrays: dict[str, np.ndarray]) -> grain.MapDataset:
  """Row i of every array -> one example dict."""
  count = len(next(iter(arrays.values())))
  return grain.MapDataset.source(np.arange(count)).map(lambda i: {k: v[i] for k, v in arrays.items()})


# ----------------------------------------------------------------------------- token caches
# tsv: and tfds: pairs of any size go through example caches (data/token_cache.py): read a shard at
# a time (a byte range of lines, or a range of records), carved by the same hash of each line,
# encoded as above, stored as uint16/uint32 rows, read back by memory map. numbers_en_fr is
# generated in memory. Each cache is one source: data.source's shards hold 'train' and the roles
# carved out of it; a source named for validation or test holds 'heldout' (truncated, not dropped).
PAIR_FIELDS = ('source', 'target_in', 'target_out')
BYTES_PER_RECORD = 256  # TFDS pairs per shard: shard bytes / this
# Pairs grow ~8x when padded to rows: a shard reads a quarter of data.cache_shard_mb of text.
PAIR_SHARD_FRACTION = 0.25
PAIRS_PER_BATCH = 16384


@dataclasses.dataclass(frozen=True)
class PairCorpus:
  """A planned pair source: its shards ('tsv', path, start, end) or ('tfds', name, split, start, end)."""
  source: str
  held_out: tuple[str, ...]  # roles carved out of it ('valid', 'test'); () = used whole
  whole_role: str  # the split a source used whole fills: 'train' (data.source) or 'heldout'
  shards: tuple[tuple, ...]
  identity: dict


cacheable = token_cache.table_sources_only


def plan_pairs(source: str, held_out: tuple[str, ...], whole_role: str, data_config, default_split: str,
               shard_bytes: int) -> PairCorpus:
  """The shards of a tsv: or tfds: source of pairs (token_cache.plan_table)."""
  if sources.parse_source(source)[0] not in ('tsv', 'tfds'):
    raise _unknown(source)
  _, shards, identity = token_cache.plan_table(source, data_config, default_split, shard_bytes, BYTES_PER_RECORD,
                                               'source<TAB>target')
  if identity['kind'] == 'tfds':
    identity['languages'] = language_pair(identity['name'], data_config)
  return PairCorpus(source, held_out, whole_role, shards, identity)


def _shard_pairs(corpus: PairCorpus, index: int, data_config, seed: int):
  """(the pairs of shard `index` by split, info: lines, malformed, header warning)."""
  shard = corpus.shards[index]
  info = {'lines': 0, 'line_count': 0, 'malformed': [], 'malformed_count': 0}
  if shard[0] == 'tfds':
    _, name, split, start, end = shard
    records = sources.tfds_records(name, split)
    languages = language_pair(name, data_config)
    pairs = []
    for i in range(start, end):
      record = records[i]
      if any(lang not in record for lang in languages):
        raise sources.DataError(f'tfds:{name}:{split} has features {sorted(record)}, not {languages[0]!r} and '
                                f'{languages[1]!r}; set data.source_lang and data.target_lang.')
      text = lambda value: (value.decode('utf-8') if isinstance(value, bytes) else str(value)).strip()
      pairs.append((text(record[languages[0]]), text(record[languages[1]])))
    return _carve_pairs(corpus, pairs, seed), info
  _, path, start, end = shard
  numbered, lines_info = token_cache.numbered_lines(path, start, end, path, start == 0,
                                                    data_config.get('tsv_header', False))
  info['line_count'] = lines_info['line_count']
  if 'header_warning' in lines_info:
    info['header_warning'] = lines_info['header_warning']
  pairs = []
  for number, line in numbered:
    fields = sources.tsv_fields(line)
    if len(fields) != 2:
      info['malformed'].append((number, f'{len(fields)} tab-separated fields, not source<TAB>target'))
    elif not fields[0] or not fields[1]:
      info['malformed'].append((number, f'empty {"source" if not fields[0] else "target"}'))
    else:
      pairs.append((fields[0], fields[1]))
  info['lines'] = len(numbered)
  info['malformed_count'] = len(info['malformed'])
  info['malformed'] = info['malformed'][:3]
  return _carve_pairs(corpus, pairs, seed), info


def _carve_pairs(corpus: PairCorpus, pairs: list[Pair], seed: int) -> dict[str, list[Pair]]:
  """The pairs of a shard by split: the tsv 90/5/5 hash split of each line for the roles carved
  out, the rest 'train' (as `_carve`); all of them `whole_role` when nothing is carved."""
  if not corpus.held_out or sources.parse_source(corpus.source)[0] == 'tfds':
    return {corpus.whole_role: pairs}
  parts = dict(zip(sources.ROLES, sources.deterministic_split([f'{s}\t{t}' for s, t in pairs], TSV_FRACTIONS, seed)))
  result = {'train': [pairs[i] for i in sorted(i for role in sources.ROLES
                                               if role == 'train' or role not in corpus.held_out for i in parts[role])]}
  for role in corpus.held_out:
    result[role] = [pairs[i] for i in parts[role]]
  return result


def _encode_shard(corpus: PairCorpus, index: int, tokenizer: Tokenizer, data_config, seed: int):
  """make_shard for token_cache.build_examples: the shard's pairs encoded per split (training drops
  pairs longer than data.seq_len, held-out splits truncate them), PAIRS_PER_BATCH at a time (HF
  tokenizers holds ~100 bytes per token until it returns); held-out pairs' text kept for BLEU."""
  by_split, info = _shard_pairs(corpus, index, data_config, seed)
  dtype, seq_len = token_cache.token_dtype(tokenizer.vocab_size), data_config.seq_len
  arrays, texts, info['pairs'], info['cut'] = {}, {}, {}, {}
  for split, pairs in by_split.items():
    parts, cut = [], 0
    for start in range(0, len(pairs), PAIRS_PER_BATCH):
      encoded, _, batch_cut = encoded_pairs(tokenizer, pairs[start:start + PAIRS_PER_BATCH], seq_len, seq_len,
                                            split == 'train')
      parts.append({name: encoded[name].astype(dtype) for name in PAIR_FIELDS})
      cut += batch_cut
    arrays[split] = {name: np.concatenate([part[name] for part in parts]) if parts else
                     np.zeros((0, seq_len), dtype) for name in PAIR_FIELDS}
    info['pairs'][split], info['cut'][split] = len(pairs), cut
    if split != 'train':
      texts[split] = pairs
  return arrays, info, texts


def cached_pairs(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid', 'test'} -> token_cache.CachedExamples, the test split's text
  pairs, {split: cache name}) for tsv:/tfds: sources, by the split rule of data/sources.py. The
  tokenizer is the workdir's, else the one trained before for this data (under data.cache_dir),
  else trained on the first TOKENIZER_TRAINING_CHARS of the training pairs."""
  shard_bytes = token_cache.shard_bytes(data_config, PAIR_SHARD_FRACTION)
  eval_source, test_source = data_config.get('eval_source', ''), data_config.get('test_source', '')
  named = {'valid': eval_source, 'test': test_source or eval_source}
  held_out = tuple(role for role in ('valid', 'test') if not named[role])
  kind = sources.parse_source(data_config.source)[0]
  corpora = {'train': plan_pairs(data_config.source, () if kind == 'tfds' else held_out, 'train', data_config,
                                 'train', shard_bytes)}
  for role in ('valid', 'test'):
    source = named[role] or (data_config.source if kind == 'tfds' else '')
    if source and not (role == 'test' and not test_source and eval_source):
      default = sources.TFDS_SPLITS[role]
      if not named[role]:  # tfds data.source: its own validation / test split
        source = f'tfds:{sources.split_tfds_source(sources.parse_source(source)[1], "train")[0]}:{default}'
      corpora[role] = plan_pairs(source, (), 'heldout', data_config, default, shard_bytes)
  tokenizer = _cached_pair_tokenizer(data_config, workdir, corpora['train'], seed)
  splits, texts, caches, infos = {}, {}, {}, {}
  for role, corpus in corpora.items():
    identity = {'corpus': corpus.identity, 'held_out': corpus.held_out, 'whole': corpus.whole_role, 'seed': seed,
                'seq_len': data_config.seq_len, 'shard_bytes': shard_bytes, 'format': token_cache.FORMAT_VERSION,
                'tokenizer': hashlib.sha256(tokenizer.to_json().encode()).hexdigest()}
    name = 'pairs-' + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    directory = token_cache.cache_directory(data_config.cache_dir, name)
    infos[role] = token_cache.build_examples(
        directory, {'source': corpus.source, 'identity': identity}, [_shard_size(s) for s in corpus.shards],
        lambda index, corpus=corpus: _encode_shard(corpus, index, tokenizer, data_config, seed),
        process_index, process_count)
    for split in ((corpus.whole_role,) if not corpus.held_out else ('train', *corpus.held_out)):
      target = role if split == 'heldout' else split
      splits[target] = token_cache.CachedExamples(directory, split, PAIR_FIELDS,
                                                  data_config.max_examples if target == 'train' else 0)
      if target == 'test':
        texts[target] = [tuple(pair) for pair in token_cache.read_texts(directory, split)]
      caches[target] = name
  if 'test' not in splits:  # the valid split, named by data.eval_source
    splits['test'], caches['test'] = splits['valid'], caches['valid']
    texts['test'] = [tuple(pair) for pair in token_cache.read_texts(
        token_cache.cache_directory(data_config.cache_dir, caches['valid']), 'heldout')]
  _report_pairs(data_config, corpora, infos)
  return tokenizer, splits, texts['test'], caches


def _shard_size(shard: tuple) -> int:
  return token_cache.table_shard_bytes(shard, BYTES_PER_RECORD)


def _report_pairs(data_config, corpora: dict[str, PairCorpus], infos: dict[str, list[dict]]) -> None:
  """The lines the in-memory path prints: header warnings, malformed lines (an error above
  data.max_malformed_fraction), each split's size and origin, and the pairs data.seq_len cut."""
  max_fraction = sources.max_malformed_fraction(data_config)
  for role, corpus in corpora.items():
    shards = [entry['info'] for entry in infos[role]]
    name = f'tsv:{sources.parse_source(corpus.source)[1]}'
    if shards and shards[0].get('header_warning'):
      print(f'WARNING: {name}: the first line ({shards[0]["header_warning"]!r}) looks like a header of column names '
            f'and is read as data; pass --config.data.tsv_header=True to skip it.', flush=True)
    offset, malformed, lines = 0, [], 0
    for info in shards:
      malformed += [(offset + number, reason) for number, reason in info['malformed']]
      offset, lines = offset + info['line_count'], lines + info['lines']
    count = sum(info['malformed_count'] for info in shards)
    if count:
      malformed += [(0, '')] * (count - len(malformed))  # counted, not kept: check_malformed shows the first 3
      sources.check_malformed(name, malformed, lines, max_fraction)
  seq_len = data_config.seq_len
  for split, (total, cut) in _split_totals(corpora, infos).items():
    if split == 'train' and not total - cut:
      raise sources.DataError(f'No training pair fits in data.seq_len={seq_len} tokens; raise data.seq_len.')
    report_pair_fit(split, total, cut, split == 'train', seq_len, seq_len)


def _split_totals(corpora, infos) -> dict[str, tuple[int, int]]:
  """{split: (pairs, pairs cut by data.seq_len)}, and one line per split: its size and origin."""
  totals = {}
  for role, corpus in corpora.items():
    for entry in infos[role]:
      for split, count in entry['info']['pairs'].items():
        target = role if split == 'heldout' else split
        previous = totals.get(target, (0, 0))
        totals[target] = (previous[0] + count, previous[1] + entry['info']['cut'][split])
  for role in sources.ROLES:
    origin = _origin(role, corpora)
    count = totals.get(role, totals.get('valid'))[0]
    print(f'{role} split: {count} pair{"s" if count != 1 else ""} from {origin}', flush=True)
  return totals


def _origin(role: str, corpora: dict[str, PairCorpus]) -> str:
  if role in corpora:
    corpus = corpora[role]
    if role == 'train':
      return f'{corpus.source}, the pairs not held out' if corpus.held_out else f'{corpus.source}, whole (data.source)'
    if sources.parse_source(corpus.source)[0] == 'tfds' and corpus.source != corpora['train'].source:
      return corpus.source.replace('tfds:', 'tfds:', 1)
    return f'{corpus.source}, whole (data.{"eval_source" if role == "valid" else "test_source"})'
  if role in corpora['train'].held_out:
    return f'{corpora["train"].source}, a {dict(zip(sources.ROLES, TSV_FRACTIONS))[role]:.0%} hash split'
  return 'the valid split (data.test_source is empty)'


def _cached_pair_tokenizer(data_config, workdir: str, corpus: PairCorpus, seed: int) -> Tokenizer:
  """The run's joint vocabulary (token_cache.shared_tokenizer), trained when new on the first
  TOKENIZER_TRAINING_CHARS of the training pairs."""
  identity = {'corpus': corpus.identity, 'held_out': corpus.held_out, 'seed': seed, 'chars': TOKENIZER_TRAINING_CHARS}
  return token_cache.shared_tokenizer(data_config, workdir, identity, lambda directory: get_tokenizer(
      data_config, directory, _training_sample(corpus, data_config, seed)))


def _training_sample(corpus: PairCorpus, data_config, seed: int) -> list[Pair]:
  """The first training pairs, up to TOKENIZER_TRAINING_CHARS characters of text."""
  sample, chars = [], 0
  for index in range(len(corpus.shards)):
    for pair in _shard_pairs(corpus, index, data_config, seed)[0].get('train', []):
      sample.append(pair)
      chars += len(pair[0]) + len(pair[1])
      if chars >= TOKENIZER_TRAINING_CHARS:
        return sample
  return sample
