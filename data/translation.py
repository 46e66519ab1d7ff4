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
import re

import grain
import numpy as np

import storage
from data import sources
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
  pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
  source_ids = tokenizer.encode_batch([s for s, _ in pairs])
  target_ids = tokenizer.encode_batch([t for _, t in pairs])
  fits = [len(source_ids[i]) < source_len and len(target_ids[i]) < target_len for i in range(len(pairs))]
  kept = [i for i in range(len(pairs)) if fits[i] or not drop_long]
  if split:
    sources.report_fit(split, 'pairs', len(pairs), fits.count(False), 'dropped' if drop_long else 'truncated',
                       f'{source_len - 1} source / {target_len - 1} target tokens (data.seq_len)')
  arrays = {name: np.full((len(kept), length), pad, np.int32)
            for name, length in (('source', source_len), ('target_in', target_len), ('target_out', target_len))}
  for row, i in enumerate(kept):
    source = source_ids[i][: source_len - 1] + [eos]
    target = target_ids[i][: target_len - 1]
    arrays['source'][row, : len(source)] = source
    arrays['target_in'][row, : len(target) + 1] = [bos] + target
    arrays['target_out'][row, : len(target) + 1] = target + [eos]
  return arrays, np.asarray(kept, np.int64)


def as_dataset(arrays: dict[str, np.ndarray]) -> grain.MapDataset:
  """Row i of every array -> one example dict."""
  count = len(next(iter(arrays.values())))
  return grain.MapDataset.source(np.arange(count)).map(lambda i: {k: v[i] for k, v in arrays.items()})
