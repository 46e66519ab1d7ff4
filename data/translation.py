"""Translation data: sentence pairs -> joint subword vocabulary -> fixed-length id arrays.

Sources (`data.source`):
  numbers_en_fr            built-in and offline: English number words -> French number words
                           (num2words), generated deterministically from the seed, with its own
                           held-out numbers
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
vocabulary, so embeddings can be shared). Every source is read through an example cache
(data/token_cache.py, `pair_datasets`): training pairs longer than data.seq_len are dropped,
held-out ones truncated and their text kept beside them for BLEU (`Texts`, read as scored).

Shared by the Transformer (train/tasks/transformer.py) and the RNN seq2seq families.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from data import sources, token_cache
from data.tokenizers import Tokenizer

Pair = tuple[str, str]
TSV_FRACTIONS = (('train', 0.9), ('valid', 0.05), ('test', 0.05))
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
FIELDS = ('source', 'target_in', 'target_out')
BYTES_PER_RECORD = 256  # TFDS pairs per shard: shard bytes / this
# Pairs grow ~8x when padded to rows: a shard reads a quarter of data.cache_shard_mb of text.
PAIR_SHARD_FRACTION = 0.25
PAIRS_PER_BATCH = 16384  # pairs per encode_batch call: HF tokenizers holds ~100 bytes per token until it returns


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


def as_dataset(arrays: dict[str, np.ndarray]):
  """A grain MapDataset: row i of every array -> one example dict."""
  import grain  # here: a process that builds caches only does not load it
  count = len(next(iter(arrays.values())))
  return grain.MapDataset.source(np.arange(count)).map(lambda i: {k: v[i] for k, v in arrays.items()})


# ----------------------------------------------------------------------------- the cache
class Pairs(token_cache.Processor):
  """The processor of translation caches: a record is a (source, target) pair, keyed by its line
  (`source<TAB>target`) for the 90/5/5 split; a split's pairs become rows of FIELDS in the token
  dtype, and a held-out split's text is kept beside them ('source_text', 'target_text')."""
  prefix = 'pairs'
  VERSION = 1  # bump with any change to what records or encode write (token_cache.Processor)

  def __init__(self, data_config, seed: int, tokenizer: Tokenizer | None = None):
    self.data_config, self.seed, self.tokenizer, self.numbers = data_config, seed, tokenizer, {}

  def records(self, piece: token_cache.Range, info: dict):
    if piece.cut == 'items':  # numbers_en_fr: piece.key names its part, generated with data.source's sizes
      size = self.data_config.max_examples or NUMBERS_SIZES[0]
      held = min(NUMBERS_SIZES[1], max(100, size // 10))
      train = size if sources.parse_source(self.data_config.source)[0] == 'numbers_en_fr' else 0
      if (train, held) not in self.numbers:  # generated once per processor (num2words is the slow part)
        self.numbers[train, held] = numbers_en_fr(self.seed, (train, held, held))
      part = getattr(self.numbers[train, held], {'valid': 'validation'}.get(piece.key, piece.key))
      minimum = self.data_config.get('min_number', 0)
      yield from ((f'{s}\t{t}', (s, t)) for s, t in part[piece.start:piece.end]
                  if not minimum or (english_number(s) or 0) >= minimum)
    elif piece.cut == 'records':
      name, split = piece.key.rsplit(':', 1)
      records, languages = sources.tfds_records(name, split), language_pair(name, self.data_config)
      for i in range(piece.start, piece.end):
        fields = sources.tfds_fields(records[i], languages, piece.path, 'set data.source_lang and data.target_lang')
        yield f'{piece.key}:{i}', tuple(text.strip() for text in fields)
    else:
      yield from self._lines(piece, info)

  def _lines(self, piece, info):
    for number, fields in token_cache.tsv_lines(piece, self.data_config.get('tsv_header', False), info):
      if len(fields) != 2:
        token_cache.note_malformed(info, number, f'{len(fields)} tab-separated fields, not source<TAB>target')
      elif not fields[0] or not fields[1]:
        token_cache.note_malformed(info, number, f'empty {"source" if not fields[0] else "target"}')
      else:
        yield '\t'.join(fields), tuple(fields)

  def encode(self, split: str, pairs: list[Pair], index: int, info: dict) -> dict[str, np.ndarray]:
    """Training drops the pairs longer than data.seq_len, held-out splits truncate them."""
    dtype, seq_len = token_cache.token_dtype(self.tokenizer.vocab_size), self.data_config.seq_len
    parts, cut = [], 0
    for start in range(0, len(pairs), PAIRS_PER_BATCH):
      arrays, _, batch_cut = encoded_pairs(self.tokenizer, pairs[start:start + PAIRS_PER_BATCH], seq_len, seq_len,
                                           split == 'train')
      parts.append({field: arrays[field].astype(dtype) for field in FIELDS})
      cut += batch_cut
    info.setdefault('pairs', {})[split], info.setdefault('cut', {})[split] = len(pairs), cut
    rows = {field: np.concatenate([part[field] for part in parts]) for field in FIELDS}
    if split != 'train':
      for side, name in enumerate(('source_text', 'target_text')):
        rows.update({key.replace('text', name): value for key, value in
                     token_cache.text_arrays([pair[side] for pair in pairs]).items()})
    return rows


def plan_source(source: str, role: str, held_out: tuple[str, ...], data_config, seed: int, size: int,
                own: bool = False):
  """(the Corpus, its Carve, {split: origin}) of a source read for `role`: data.source with `held_out`
  carved out of it, or a source named for 'valid' / 'test' (its split 'heldout'); `own`: a TFDS
  set's own validation or test split."""
  kind, argument = sources.parse_source(source)
  carve = sources.Carve(whole='train' if role == 'train' else 'heldout')
  named = sources.origin(data_config, role) if not own else ''
  if kind == 'numbers_en_fr':
    train = data_config.max_examples or NUMBERS_SIZES[0]
    held = min(NUMBERS_SIZES[1], max(100, train // 10))
    counts = {'train': 2 * (NUMBERS_LEXICON + 1) + train, 'valid': held, 'test': held}
    splits = {'train': 'train', **{r: r for r in held_out}} if role == 'train' else {role: 'heldout'}
    identity = {'kind': 'numbers_en_fr', 'seed': seed, 'sizes': counts, 'parts': splits,
                'min_number': data_config.get('min_number', 0)}
    origin = f'numbers_en_fr (generated from seed {seed})' if role == 'train' else named
    return (token_cache.plan(source, token_cache.part_ranges(source, counts, splits), identity, size), carve,
            {split: origin for split in splits.values()})
  if kind == 'tsv':
    name, whole, identity = token_cache.tsv_range(argument, data_config, 'source<TAB>target')
    origins = {carve.whole: named}
    if role == 'train' and held_out:  # TSV_FRACTIONS, each held-out share at most sources.HELD_OUT_BYTES of the file
      carve = sources.carve_out(TSV_FRACTIONS, held_out, whole.end, seed)
      origins = sources.carved_origins(source, carve, 'pairs')
    return token_cache.plan(name, [whole], identity, size), carve, origins
  if kind == 'tfds':
    whole, identity = token_cache.tfds_range(argument, sources.TFDS_SPLITS[role])
    identity['languages'] = language_pair(whole.key.rsplit(':', 1)[0], data_config)
    origin = whole.path if role == 'train' or own else named
    return token_cache.plan(whole.path, [whole], identity, size, BYTES_PER_RECORD), carve, {carve.whole: origin}
  raise sources.unknown_source(source, 'translation', 'numbers_en_fr, tsv:<path> or tfds:<name>[:<split>] '
                               '(e.g. tfds:wmt14_translate/de-en)')


def pair_datasets(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1):
  """(tokenizer, {'train', 'valid', 'test'} -> token_cache.Rows of FIELDS, the test split's (source,
  reference) texts (token_cache.Texts), {split: cache name}), by the split rule of data/sources.py
  (data.max_examples caps training). The tokenizer is token_cache.shared_tokenizer's, trained when
  new on both sides of the training pairs. Prints what reading the sources found (header, malformed
  lines), one line per split, and the pairs data.seq_len cut."""
  minimum = data_config.get('min_number', 0)
  if minimum and sources.parse_source(data_config.source)[0] != 'numbers_en_fr':
    raise sources.DataError(f'data.min_number={minimum} filters numbers_en_fr pairs only; '
                            f'data.source is {data_config.source!r}. Set data.min_number=0.')
  size = token_cache.shard_bytes(data_config, PAIR_SHARD_FRACTION)
  kind = sources.parse_source(data_config.source)[0]
  held_out = sources.held_out_roles(data_config)
  corpora = plan_corpora(data_config, seed, size)
  train, carve, _ = corpora['train']
  processor = Pairs(data_config, seed)
  processor.tokenizer = token_cache.shared_tokenizer(
      data_config, workdir, {'family': Pairs.prefix, 'corpus': train.identity, 'carve': dataclasses.asdict(carve)},
      lambda: (text for pair in token_cache.records(train, processor, carve, 'train') for text in pair))
  tokenizer = processor.tokenizer
  splits, texts, caches, counts = {}, {}, {}, {}
  for role, (corpus, carve, origins) in corpora.items():
    identity = {'corpus': corpus.identity, 'carve': dataclasses.asdict(carve), 'seq_len': data_config.seq_len,
                'shard_bytes': size, 'tokenizer': token_cache.tokenizer_hash(tokenizer)}
    name = token_cache.cache_name(Pairs.prefix, identity)
    directory = token_cache.cache_directory(token_cache.cache_dir(data_config), name)
    cache = token_cache.build(directory, corpus, processor, carve, identity, process_index, process_count,
                              workers=token_cache.cache_workers(data_config))
    if corpus.shards[0][0].cut == 'lines':
      sources.report_lines(corpus.source, [shard['info'] for shard in cache.shards],
                           sources.max_malformed_fraction(data_config))
    for split in origins:
      target = role if split == 'heldout' else split
      limit = data_config.max_examples if target == 'train' else 0
      splits[target], caches[target] = token_cache.Rows(cache, split, FIELDS, limit), name
      counts[target] = (cache.info('pairs', split), cache.info('cut', split), origins[split])
      if target != 'train':
        texts[target] = token_cache.Texts(cache, split, ('source_text', 'target_text'))
  for role in held_out:
    if kind == 'tsv' and not counts[role][0]:
      raise sources.DataError(f'{data_config.source} has {sum(c[0] for c in counts.values())} pairs, too few to hold '
                              f'out validation and test pairs; add more or name them with data.eval_source / '
                              f'data.test_source.')
  if 'test' not in splits:  # the valid split, named by data.eval_source
    splits['test'], caches['test'], texts['test'] = splits['valid'], caches['valid'], texts['valid']
    counts['test'] = (*counts['valid'][:2], sources.origin(data_config, 'test'))
  report_splits(data_config, counts, len(splits['train']))
  return tokenizer, splits, texts['test'], caches


def plan_corpora(data_config, seed: int, size: int) -> dict:
  """role -> plan_source's (corpus, carve, origins): training from data.source (holding out the
  splits not named elsewhere), validation and test from a TFDS set's own splits or the sources
  named for them."""
  kind, argument = sources.parse_source(data_config.source)
  held_out = sources.held_out_roles(data_config)
  corpora = {'train': plan_source(data_config.source, 'train', () if kind == 'tfds' else held_out, data_config, seed,
                              size)}
  for role in ('valid', 'test'):
    named = data_config.get({'valid': 'eval_source', 'test': 'test_source'}[role], '')
    if kind == 'tfds' and role in held_out:  # a TFDS set's own validation / test split
      own = f'tfds:{sources.split_tfds_source(argument, "train")[0]}:{sources.TFDS_SPLITS[role]}'
      corpora[role] = plan_source(own, role, (), data_config, seed, size, own=True)
    elif named:
      corpora[role] = plan_source(named, role, (), data_config, seed, size)
  return corpora


def report_splits(data_config, counts: dict, train_rows: int) -> None:
  """One line per split (its pairs and origin), then the pairs data.seq_len cut; an error when no
  training pair fits. counts: role -> (pairs, pairs cut, origin)."""
  for role in sources.ROLES:
    total, _, origin = counts[role]
    if role == 'train' and data_config.max_examples and total > data_config.max_examples:
      total, origin = data_config.max_examples, f'{origin}, first {data_config.max_examples} (data.max_examples)'
    sources.report_split(role, total, 'pairs', origin)
  if not train_rows:
    raise sources.DataError(f'No training pair fits in data.seq_len={data_config.seq_len} tokens; raise '
                            f'data.seq_len.')
  for role in sources.ROLES:
    report_pair_fit(role, *counts[role][:2], role == 'train', data_config.seq_len, data_config.seq_len)


