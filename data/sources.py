"""Where raw data comes from: a source string in the config names it.

  tfds:<name>[:<split>]   a TFDS dataset read with `tfds.data_source` (array_record, no TensorFlow)
  text:<glob>             local text files
  tsv:<path>              tab-separated file, local or gs:// (read by the families that take pairs or labels)
  pystdlib                the Python standard library's own sources, an offline LM corpus
  <other built-in name>   families register their own (numbers_en_fr, bbc_news)

The split rule, the same for every family (`split_roles`):
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
Carving is a deterministic hash split, stable across runs and machines, except for sources with
their own held-out data (numbers_en_fr, the validation/test splits of a TFDS translation set).
Families with a single held-out split (gpt, rnn_lm, BERT pretraining; none runs a test
evaluation) carve validation only: their test split is the validation split unless named.
Each family prints one line per split at the start of a run: its size and where it came from.

Every reader fails with one DataError naming the source and the fix (no files matched, empty or
undecodable data with its file and line, an unknown TFDS name). tsv rules: `read_lines`,
`tsv_fields`, `check_malformed`.
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import gzip
import hashlib
import os
import re
import sysconfig
import zlib
from typing import Callable, Sequence

import storage
from errors import UserError


class DataError(UserError):
  """Bad data input (missing path, empty or undecodable data); the message names the fix."""


ROLES = ('train', 'valid', 'test')
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


def parse_source(source: str) -> tuple[str, str]:
  """'text:/a/*.txt' -> ('text', '/a/*.txt'); 'pystdlib' -> ('pystdlib', '')."""
  if not source:
    raise DataError('data.source is empty: set --config.data.source (e.g. pystdlib, text:<glob>, '
                    'tfds:<name>[:<split>]).')
  kind, _, argument = source.partition(':')
  return kind, argument


def read_text_files(pattern: str) -> list[tuple[str, str]]:
  """[(key, text)] for the files matching `pattern` (recursive '**' allowed), sorted by path.

  The key is the path relative to the files' common folder: held-out splits hash it, and must not
  change when the corpus is moved or copied to another machine.
  """
  paths = sorted(p for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise DataError(f'text:{pattern} matched no files; check the path or quote the glob.')
  root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  documents = []
  for path in paths:
    with open(path, 'rb') as f:
      text = decode_utf8(f.read(), path)
    if text.strip():
      documents.append((os.path.relpath(os.path.abspath(path), root), text))
  if not documents:
    raise DataError(f'text:{pattern} matched only empty files; nothing to train on.')
  return documents


def decode_utf8(raw: bytes, path: str) -> str:
  """The text of a file's bytes (a leading byte-order mark dropped), or a DataError naming the line."""
  try:
    return raw.decode('utf-8').removeprefix('\ufeff')
  except UnicodeDecodeError as e:
    line = raw.count(b'\n', 0, e.start) + 1
    column = e.start - raw.rfind(b'\n', 0, e.start)
    raise DataError(f'{path}:{line}: byte {column} of the line (0x{raw[e.start]:02x}) is not UTF-8; data files '
                    f'must be UTF-8: convert it (e.g. iconv -f cp1252 -t utf-8) or fix that line.') from e


def read_lines(path: str, form: str, header: bool = False) -> tuple[list[tuple[int, str]], str]:
  """([(line number, line)] of the non-blank lines of a UTF-8 file (local or gs://, gzipped or not), its
  expanded path); `form` names the expected lines (e.g. 'source<TAB>target') for the messages.
  `header`: the first line names the columns and is skipped; when False, a first line that looks
  like a header is kept with a warning.

  Lines end at '\n' (or '\r\n') only: str.splitlines() also breaks at form feeds, U+2028 and
  other separators that occur inside real messages, which cuts a record in two and misnumbers
  every line after it.
  """
  path = path if storage.is_remote(path) else os.path.expanduser(path)
  file = storage.path(path)
  if file.is_dir():
    raise DataError(f'tsv:{path} is a directory; tsv: reads one file: name a file of {form} lines in it.')
  if not file.is_file():
    raise DataError(f'tsv:{path} does not exist; give the path of a file of {form} lines.')
  text = decode_utf8(_gunzipped(file.read_bytes(), path), path)
  lines = [(number, line.removesuffix('\r')) for number, line in enumerate(text.split('\n'), 1) if line.strip()]
  if header:
    return lines[1:], path
  if lines and looks_like_header(lines[0][1]):
    print(f'WARNING: tsv:{path}: the first line ({lines[0][1].strip()!r}) looks like a header of column names '
          f'and is read as data; pass --config.data.tsv_header=True to skip it.', flush=True)
  return lines, path


def _gunzipped(raw: bytes, path: str) -> bytes:
  """The bytes of a file, decompressed when they are gzip's (whatever the file's name)."""
  if not raw.startswith(GZIP_MAGIC):
    return raw
  try:
    return gzip.decompress(raw)
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(f'{path} is gzip-compressed but does not decompress ({e}); the file is cut short or '
                    f'corrupt: copy it again, or gunzip it to see where.') from e


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


def tsv_options(data_config) -> dict:
  """The read_tsv options a data config sets (one without data.tsv_header skips no line)."""
  return {'max_malformed_fraction': max_malformed_fraction(data_config),
          'header': data_config.get('tsv_header', False)}


def max_malformed_fraction(data_config) -> float:
  """data.max_malformed_fraction, checked (a config without the key gets the default)."""
  fraction = data_config.get('max_malformed_fraction', MAX_MALFORMED_FRACTION)
  if not 0 <= fraction <= 1:
    raise DataError(f'data.max_malformed_fraction={fraction} must be in [0, 1] (0 = stop at the first '
                    f'malformed line).')
  return fraction


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


def pystdlib_files() -> list[tuple[str, str]]:
  """[(path, text)] of `pystdlib_paths`, the empty ones left out."""
  root = sysconfig.get_paths()['stdlib']
  documents = []
  for key in pystdlib_paths(root):
    with open(os.path.join(root, key), 'rb') as f:
      text = f.read().decode('utf-8', errors='replace')
    if text.strip():
      documents.append((key, text))
  if not documents:
    raise DataError(f'No Python sources found under {root}; use --config.data.source=text:<glob>.')
  return documents


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


def split_tfds_source(argument: str, default_split: str) -> tuple[str, str]:
  """'wmt14_translate/de-en:train' -> ('wmt14_translate/de-en', 'train')."""
  name, _, split = argument.partition(':')
  if not name:
    raise DataError('tfds: needs a dataset name, e.g. tfds:wmt14_translate/de-en:train.')
  return name, split or default_split


def deterministic_split(keys: Sequence[str], fractions: Sequence[float], seed: int = 0) -> list[list[int]]:
  """Partition item indices by a hash of each key: stable across runs, machines and orderings.

  Returns one index list per fraction (fractions sum to 1), each in the original order.
  """
  bounds, total = [], 0.0
  for fraction in fractions:
    total += fraction
    bounds.append(total)
  parts = [[] for _ in fractions]
  for index, key in enumerate(keys):
    digest = hashlib.sha256(f'{seed}:{key}'.encode()).digest()
    u = int.from_bytes(digest[:8], 'big') / 2.0**64
    part = next((i for i, b in enumerate(bounds) if u < b), len(bounds) - 1)
    parts[part].append(index)
  return parts


# ----------------------------------------------------------------------------- the split rule
@dataclasses.dataclass
class Part:
  """The examples of one split and where they came from (for the split report)."""
  examples: list
  origin: str


def split_roles(data_config, carve: Callable[[str, tuple[str, ...]], dict[str, Part]],
                read_whole: Callable[[str, str], list]) -> dict[str, Part]:
  """The split rule of the module docstring, for one family's readers.

  Args:
    carve(source, held_out): data.source's parts: 'train' and each role of `held_out` (a tuple
      of 'valid', 'test'; empty when both are named) carved out of it. A family that holds out a
      single split returns no 'test': the test split is then the validation split.
    read_whole(source, role): the examples of a source named for `role`, used whole.
  Returns:
    {'train', 'valid', 'test'} -> Part.
  """
  eval_source = data_config.get('eval_source', '')
  test_source = data_config.get('test_source', '')
  named = {'valid': eval_source, 'test': test_source or eval_source}
  parts = carve(data_config.source, tuple(role for role in ROLES[1:] if not named[role]))
  if eval_source:
    parts['valid'] = Part(read_whole(eval_source, 'valid'), f'{eval_source}, whole (data.eval_source)')
  if test_source:
    parts['test'] = Part(read_whole(test_source, 'test'), f'{test_source}, whole (data.test_source)')
  elif 'test' not in parts:
    why = 'data.test_source is empty' if eval_source else 'this family holds out one split'
    parts['test'] = Part(parts['valid'].examples, f'the valid split ({why})')
  return parts


def cap_train(parts: dict[str, Part], max_examples: int) -> None:
  """Keep the first `max_examples` (data.max_examples; 0 = all) training examples, in place."""
  train = parts['train']
  if max_examples and len(train.examples) > max_examples:
    parts['train'] = Part(train.examples[:max_examples], f'{train.origin}, first {max_examples} (data.max_examples)')


def report_splits(parts: dict[str, Part], unit: str) -> None:
  """One line per split: its size in `unit` (a plural: 'pairs') and where it came from."""
  for role in ROLES:
    count = len(parts[role].examples)
    print(f'{role} split: {count} {unit if count != 1 else unit[:-1]} from {parts[role].origin}', flush=True)


def report_fit(split: str, unit: str, total: int, cut: int, action: str, limit: str) -> None:
  """One line on the `cut` of `total` examples of a split that exceed `limit` and were `action`
  ('dropped', 'truncated'); a warning when they are more than WARN_FRACTION of the split."""
  line = f'{split} split: {cut} of {total} {unit} ({cut / max(total, 1):.1%}) are longer than {limit}: {action}.'
  if cut > WARN_FRACTION * total:
    line = f'WARNING: {line} Raise data.seq_len to keep them whole.'
  print(line, flush=True)
