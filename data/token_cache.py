"""Token caches: every source tokenized once into shards on disk, then read back row by row.

One pipeline for every family (data/lm.py, translation.py, classification.py, bert_data.py), in
three steps, so that a run holds one shard's text while building and the rows it reads while
training, whatever the corpus's size:

  plan   A source is listed (files and their sizes, a TFDS split's record count, a built-in's
         parts) as `Range`s, cut where a shard may end, and grouped into shards of about
         data.cache_shard_mb MB of text (`plan`). Only the few kilobytes around each cut are read.
  build  Each shard is built alone (`build`): a family's processor reads the records of its ranges,
         the split rule (sources.Carve) gives each record its split, and the processor encodes each
         split's records into fixed fields. Process p of P builds the shards i with i % P == p
         (every host of a pod its share, no text tokenized twice), then waits for the others'.
         Within a host, data.cache_workers spawned processes build its shards (one per core by
         default): each holds one shard at a time, so a build's memory grows with the workers.
  read   `Rows` (the rows of a split, the shards taken in turn), `Stream` (a split's 1-D field,
         the shards joined) and `Texts` (text kept for scoring), each shard opened when first read.

A family supplies the processor, a `Processor` subclass with
  prefix                       the cache's name: '<prefix>-v<FORMAT>-<hash of what decides its rows>'
  VERSION                      what it writes for the same text, in that hash: bumped with any change
                               to its records or to what encode writes (tests/test_cache_versions.py)
  records(range, info)         (key, record) of a range, in order; the key is what the split hashes;
                               `info` (a dict kept in the shard's json) gathers what it reports
  encode(split, records, index, info)  {field: array [rows, ...]} of a split's records in shard `index`
and the cache module imports no family.

  <data.cache_dir>/<prefix>-v2-<hash>/
    manifest.json                  what the cache holds: source, identity, shard count
    00007.train.tokens.npy         shard 7's field `tokens` of split `train` (ids uint16, or uint32 past 65,536)
    00007.json                     written last: shard 7 is complete (each array's length, its info)

Every file is written to a temporary name and renamed, a shard's json last, so a reader never sees
half a shard and an interrupted build resumes at the first shard without its json. A gs:// cache is
written into the bucket shard by shard and read through a local mirror filled as reading reaches
each shard.

Cuts: a range ends where its records allow. 'bytes' (language-model text) after a newline between
two printable ASCII characters ('x\\ny'), where byte-level BPE's and WordPiece's pre-tokenizers
split anyway, so the pieces' tokens are the whole file's (tested; a CRLF file is cut between '\\r'
and '\\n'); 'lines' (tsv) after a newline; 'blocks' (documents between blank lines) after a blank
line, else after a newline (a sentence boundary: a document larger than a shard becomes several).
A stretch of SAFE_CUT_SEARCH bytes without such a place is cut at a UTF-8 character boundary.
"""
from __future__ import annotations

import codecs
import contextlib
import dataclasses
import glob as globlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
from typing import Callable, Iterator, Sequence

import numpy as np

import storage
from data import sources
from data.sources import DataError

FORMAT = 2  # in every cache's name: a cache of another format is never read
DEFAULT_CACHE_DIR = '~/.cache/attention-lineage/data'  # data.cache_dir's default: runs on one corpus share it
# When set, the folder DEFAULT_CACHE_DIR stands for (and LOCAL_MIRROR's parent): the tests' temporary one.
CACHE_DIR_VARIABLE = 'ATTENTION_LINEAGE_DATA_CACHE'
SHARD_BYTES = 32 << 20  # text per shard: ~10 M tokens (a build holds ~10 bytes per byte of its shard)
SAFE_CUT_SEARCH = 4 << 20  # bytes searched for a safe cut before cutting at a character boundary
MAX_WORKERS = 8  # data.cache_workers=0 starts one build process per core, at most this many
AUTO_WORKERS_BYTES = 16 << 20  # ... once there is this much text to build
WAIT_SECONDS = 3600  # how long a process waits for the shards other processes build
LOCAL_MIRROR = (os.path.join(os.environ[CACHE_DIR_VARIABLE], 'gs-mirror') if os.environ.get(CACHE_DIR_VARIABLE)
                else '~/.cache/attention-lineage/data-mirror')  # where a gs:// cache's shards are copied to be read
TOKENIZER_TRAINING_CHARS = 20_000_000  # a tokenizer trains on this much training text: BPE merges stabilise long before
_SAFE_NEWLINE = re.compile(rb'[!-~](\r?)\n[!-~]')
BLANK_LINE = re.compile(rb'\n\s*\n')  # documents of data.documents=blank_line end at one
_NEWLINE = re.compile(rb'\n')


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class Range:
  """Part of a source: bytes [start, end) of a local file `path`, or records [start, end) of a TFDS
  split (`path` 'tfds:<name>:<split>', `key` '<name>:<split>') or of a built-in's part (`path` its
  name, `key` the part).

  `cut`: where it may be cut ('bytes', 'lines', 'blocks'; 'records'; 'items': never). `key` of a
  file: its path relative to the corpus's common folder (a tsv file: its path as named). `split`:
  the split of all its records, or '' when each record's key decides. `last`: its end ends a
  document. `size`: bytes of text (records: estimated). `strict`: undecodable UTF-8 is an error
  (else replaced).
  """
  cut: str
  path: str
  key: str
  start: int
  end: int
  split: str = ''
  last: bool = True
  size: int = 0
  strict: bool = True


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A planned source: its shards of ranges, and what identifies its text (files with sizes and
  modification times, a TFDS split's size, a built-in's settings)."""
  source: str
  shards: tuple[tuple[Range, ...], ...]
  identity: dict


def plan(source: str, ranges: Sequence[Range], identity: dict, shard_bytes: int, bytes_per_record: int = 256,
         piece_bytes: int = 0, apart: bool = False) -> Corpus:
  """`ranges` (whole files, record ranges) cut into pieces where their kind allows, grouped in
  order into shards of at most `shard_bytes` (a larger piece alone). A file is cut at the first
  place its kind allows after every `piece_bytes` (default shard_bytes), records every
  shard_bytes // bytes_per_record. `apart`: a shard holds the pieces of one `split` only (ranges
  given grouped by split keep each split's documents together)."""
  piece_bytes = piece_bytes or shard_bytes
  pieces = []
  for whole in ranges:
    if whole.cut == 'items':  # a built-in's part: one piece, whatever its size
      pieces.append(whole)
      continue
    if whole.cut == 'records':
      step = max(1, shard_bytes // bytes_per_record)
      pieces += [dataclasses.replace(whole, start=a, end=min(a + step, whole.end),
                                     size=(min(a + step, whole.end) - a) * bytes_per_record)
                 for a in range(whole.start, whole.end, step)]
      continue
    cuts = [whole.start]
    while whole.end - cuts[-1] > piece_bytes:
      cuts.append(next_cut(whole.path, cuts[-1] + piece_bytes, whole.end, whole.cut))
    cuts.append(whole.end)
    pieces += [dataclasses.replace(whole, start=a, end=b, size=b - a, last=whole.last and b == whole.end)
               for a, b in zip(cuts, cuts[1:]) if b > a]
  shards, current, total = [], [], 0
  for piece in pieces:
    if current and (total + piece.size > shard_bytes or apart and piece.split != current[-1].split):
      shards.append(tuple(current))
      current, total = [], 0
    current.append(piece)
    total += piece.size
  if current:
    shards.append(tuple(current))
  if not shards:
    raise DataError(f'{source} holds no text.')
  return Corpus(source, tuple(shards), identity)


def next_cut(path: str, offset: int, end: int, cut: str) -> int:
  """The first place at or after `offset` (before `end`) of a file where a range of `cut` may end."""
  with open(path, 'rb') as f:
    f.seek(offset)
    if cut == 'lines':
      f.readline()
      return min(f.tell(), end)
    window = f.read(min(SAFE_CUT_SEARCH, end - offset))
  return offset + safe_cut_in(window, cut, final=end - offset <= SAFE_CUT_SEARCH)


def safe_cut_in(data: bytes, cut: str = 'bytes', start: int = 0, stop: int | None = None, final: bool = False) -> int:
  """The index in `data` of the first place in [start, stop) where a range of `cut` ('bytes',
  'blocks') may end (module docstring); without one, `stop` when it is the end of the text
  (`final`), else the last UTF-8 character boundary there."""
  stop = len(data) if stop is None else min(stop, len(data))
  if cut == 'blocks':
    match = BLANK_LINE.search(data, start, stop) or _NEWLINE.search(data, start, stop)
    if match:
      return match.end()
  else:
    match = _SAFE_NEWLINE.search(data, start, stop)
    if match:
      return match.start(1) if match.group(1) else match.end() - 1
  for i in range(stop - 1, max(stop - 4, start) if not final else stop, -1):
    if data[i] & 0xC0 != 0x80:
      return i
  return stop


def text_files(source: str) -> tuple[list[Range], dict]:
  """(a whole 'bytes' Range per file, the identity) of `pystdlib` or `text:<glob>`: the files that hold
  more than whitespace, sorted by path, keyed by their path relative to their common folder (the
  stdlib's root), so that a moved corpus keeps its keys and its split."""
  kind, pattern = sources.parse_source(source)
  if kind == 'pystdlib':
    root = sysconfig.get_paths()['stdlib']
    paths, strict = [os.path.join(root, key) for key in sources.pystdlib_paths(root)], False
  else:
    paths = sorted(p for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    strict = True
    if not paths:
      raise DataError(f'text:{pattern} matched no files; check the path or quote the glob.')
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  ranges = [Range('bytes', path, os.path.relpath(os.path.abspath(path), root), 0, os.path.getsize(path), strict=strict)
            for path in paths]
  ranges = [r for r in ranges if r.end and _holds_text(r.path)]
  if not ranges:
    raise DataError(f'{source} matched only empty files; nothing to train on.')
  identity = {'kind': kind, 'files': [[r.key, r.end, os.stat(r.path).st_mtime_ns] for r in ranges]}
  if kind == 'pystdlib':
    identity['stdlib'] = root
  return ranges, identity


def _holds_text(path: str) -> bool:
  """Whether a file holds more than whitespace (after a byte-order mark), reading up to its first other character."""
  decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')
  with open(path, 'rb') as f:
    text = decoder.decode(f.read(4096)).removeprefix('\ufeff')
    while not text.strip():
      chunk = f.read(1 << 16)
      if not chunk:
        return bool(decoder.decode(b'', final=True).strip())
      text = decoder.decode(chunk)
  return True


def tsv_range(argument: str, data_config, form: str) -> tuple[str, Range, dict]:
  """(the name messages give it, a whole 'lines' Range, the identity) of a tsv: file. A gzipped or
  gs:// file is first made a local plain file (`local_plain_file`)."""
  display = argument if storage.is_remote(argument) else os.path.expanduser(argument)
  if storage.path(display).is_dir():
    raise DataError(f'tsv:{display} is a directory; tsv: reads one file: name a file of {form} lines in it.')
  if not storage.path(display).is_file():
    raise DataError(f'tsv:{display} does not exist; give the path of a file of {form} lines.')
  path = local_plain_file(display, cache_dir(data_config))
  stat = os.stat(path)
  if not stat.st_size:
    raise DataError(f'tsv:{display} is empty; give a file of {form} lines.')
  identity = {'kind': 'tsv', 'path': os.path.abspath(path), 'size': stat.st_size, 'mtime': stat.st_mtime_ns,
              'header': data_config.get('tsv_header', False)}
  return f'tsv:{display}', Range('lines', path, display, 0, stat.st_size), identity


def tfds_range(argument: str, default_split: str) -> tuple[Range, dict]:
  """(a whole 'records' Range, the identity) of a TFDS split; an empty one is a DataError."""
  name, split = sources.split_tfds_source(argument, default_split)
  count = len(sources.tfds_records(name, split))
  if not count:
    raise DataError(f'tfds:{name}:{split} is empty.')
  return (Range('records', f'tfds:{name}:{split}', f'{name}:{split}', 0, count),
          {'kind': 'tfds', 'name': name, 'split': split, 'records': count})


def part_ranges(name: str, sizes: dict[str, int], splits: dict[str, str]) -> list[Range]:
  """'items' Ranges of a built-in source's own parts ({part: items}; `key` names the part), each part
  of `splits` going whole to its split there ({part: split})."""
  return [Range('items', name, part, 0, sizes[part], split=split) for part, split in splits.items()]


def local_plain_file(location: str, cache_directory_: str) -> str:
  """A local, uncompressed copy of a text file to cut into ranges: the file itself when it is local
  and not gzipped; else decompressed (or downloaded) once, streaming, under data.cache_dir/raw/."""
  with storage.path(location).open('rb') as f:
    gzipped = f.read(2) == sources.GZIP_MAGIC
  if not gzipped and not storage.is_remote(location):
    return location
  stat = storage.path(location).stat()
  key = _digest([location, getattr(stat, 'length', None) or getattr(stat, 'st_size', None),
                 getattr(stat, 'mtime', None) or getattr(stat, 'st_mtime', None)])
  target = os.path.join(os.path.expanduser(LOCAL_MIRROR if storage.is_remote(cache_directory_) else cache_directory_),
                        'raw', f'{key}.txt')
  if not os.path.exists(target):
    import gzip
    import zlib
    os.makedirs(os.path.dirname(target), exist_ok=True)
    try:
      with storage.path(location).open('rb') as raw:
        _copy(gzip.GzipFile(fileobj=raw) if gzipped else raw, target)
    except (OSError, EOFError, zlib.error) as e:
      raise DataError(f'{location} does not decompress ({e}); the file is cut short or corrupt: copy it again.') from e
  return target


def _copy(source, target: str) -> None:
  """A file object's bytes into `target`, streaming, complete under its name at once."""
  aside = f'{target}.{os.getpid()}.{threading.get_ident()}.tmp'
  try:
    with open(aside, 'wb') as out:
      shutil.copyfileobj(source, out, 16 << 20)
    os.replace(aside, target)
  finally:
    if os.path.exists(aside):
      os.remove(aside)


# ----------------------------------------------------------------------------- reading a range
def range_bytes(piece: Range) -> bytes:
  with open(piece.path, 'rb') as f:
    f.seek(piece.start)
    return f.read(piece.end - piece.start)


def decode(raw: bytes, piece: Range, offset: int = 0) -> str:
  """Bytes of `piece` from `offset` (relative to its start) as text: a byte-order mark at the file's
  start dropped; undecodable UTF-8 sources.decode_utf8's DataError naming the file's line (replaced
  when not `strict`)."""
  try:
    text = raw.decode('utf-8') if piece.strict else raw.decode('utf-8', errors='replace')
  except UnicodeDecodeError as e:
    where = piece.key if piece.cut == 'lines' else piece.path  # a tsv file as named (its copy may be gunzipped)
    sources.decode_utf8(b'\n' * _newlines_before(piece.path, piece.start + offset) + raw[:e.end], where)
    raise
  return text.removeprefix('\ufeff') if piece.start + offset == 0 else text


def tsv_lines(piece: Range, header: bool, info: dict) -> Iterator[tuple[int, list[str]]]:
  """(line number within the range, fields) of the non-blank lines of a 'lines' range, as
  sources.tsv_fields splits them. The file's first line is skipped with `header`, else kept and
  noted in info['header'] when it looks like column names; info also gets 'line_count' (lines the
  range spans, to number them across ranges) and 'lines' (non-blank lines read). Undecodable UTF-8
  is sources.decode_utf8's DataError naming the file's line."""
  text = decode(range_bytes(piece), piece)
  lines = text.split('\n')  # not splitlines(): form feeds and U+2028 occur inside real records
  numbered = [(number, line.removesuffix('\r')) for number, line in enumerate(lines, 1) if line.strip()]
  info['line_count'] = len(lines) - text.endswith('\n')
  if piece.start == 0 and numbered:
    if header:
      numbered = numbered[1:]
    elif sources.looks_like_header(numbered[0][1]):
      info['header'] = numbered[0][1].strip()
  info['lines'] = len(numbered)
  for number, line in numbered:
    yield number, sources.tsv_fields(line)


def note_malformed(info: dict, number: int, reason: str | Callable[[], str], suffix: str = '') -> None:
  """Count a malformed line in a shard's info ('malformed_count'; the first 3 kept in 'malformed',
  with `reason`, called only for those when it is a function)."""
  info[f'malformed_count{suffix}'] = info.get(f'malformed_count{suffix}', 0) + 1
  shown = info.setdefault(f'malformed{suffix}', [])
  if len(shown) < 3:
    shown.append((number, reason() if callable(reason) else reason))


def _newlines_before(path: str, offset: int, chunk: int = 16 << 20) -> int:
  count = 0
  with open(path, 'rb') as f:
    while f.tell() < offset:
      count += f.read(min(chunk, offset - f.tell())).count(b'\n')
  return count


# ----------------------------------------------------------------------------- names and settings
def cache_dir(data_config) -> str:
  """data.cache_dir (the default for configs saved before it existed); the default is the folder
  $ATTENTION_LINEAGE_DATA_CACHE names when it is set, in configs saved before too."""
  directory = data_config.get('cache_dir', DEFAULT_CACHE_DIR)
  if directory == DEFAULT_CACHE_DIR:
    return os.environ.get(CACHE_DIR_VARIABLE) or directory
  return directory


def cache_workers(data_config) -> int:
  """data.cache_workers (0, one per core, for configs saved before it existed)."""
  return int(data_config.get('cache_workers', 0))


def shard_bytes(data_config, fraction: float = 1.0) -> int:
  """Text per shard: data.cache_shard_mb (SHARD_BYTES for configs saved before it existed) x `fraction`."""
  return max(1, int(data_config.get('cache_shard_mb', SHARD_BYTES / 2**20) * 2**20 * fraction))


def cache_directory(directory: str, name: str) -> str:
  """`name` under data.cache_dir (a local path with '~' expanded, or gs://)."""
  if not directory:
    raise DataError("data.cache_dir is empty: token caches need a directory; set --config.data.cache_dir "
                    f"(default {DEFAULT_CACHE_DIR}).")
  return os.path.join(directory if storage.is_remote(directory) else os.path.expanduser(directory), name)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _versioned(prefix: str) -> dict:
  """{'version': the VERSION of the processor registered as `prefix`}, for a key; empty at version 1
  (what processors wrote when versions began), so that what was keyed before keeps its key."""
  if prefix not in PROCESSORS:
    raise KeyError(f'No token-cache processor has the prefix {prefix!r}; a processor subclasses token_cache.Processor.')
  version = PROCESSORS[prefix].VERSION
  return {'version': version} if version > 1 else {}


def cache_name(prefix: str, identity: dict) -> str:
  """The one naming of caches: the family's prefix, the format and a hash of what decides the rows,
  its processor's VERSION among it (version 1 adds nothing: the caches named before keep their
  names, and the runs that recorded them resume)."""
  return f'{prefix}-v{FORMAT}-{_digest({**identity, "format": FORMAT, **_versioned(prefix)})}'


def tokenizer_hash(tokenizer) -> str:
  return hashlib.sha256(tokenizer.to_json().encode()).hexdigest()


# ----------------------------------------------------------------------------- building
PROCESSORS: dict[str, type] = {}  # prefix -> its Processor subclass, registered when the class is defined


class Processor:
  """A family's processor (the interface in the module docstring). A subclass that sets its own
  `prefix` is registered in PROCESSORS under it, and `cache_name` puts its VERSION in its caches'
  names: bump VERSION with any change to what it writes for the same input (the records' keys or
  splits, the fields encode writes, their values or dtypes), so that no cache of the old code is read
  again. tests/test_cache_versions.py builds a fixed input through every registered processor and
  fails when what it writes changes without a bump."""
  prefix = ''
  VERSION = 0

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if 'prefix' not in cls.__dict__:  # a subclass of a processor (a test's wrapper) writes its caches
      return
    if not cls.prefix or not isinstance(cls.VERSION, int) or cls.VERSION < 1:
      raise TypeError(f'{cls.__qualname__} must set a prefix and an int VERSION >= 1 (token_cache.Processor).')
    known = PROCESSORS.get(cls.prefix)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
      raise TypeError(f'{cls.__module__}.{cls.__qualname__} and {known.__module__}.{known.__qualname__} both name '
                      f'their caches {cls.prefix!r}.')
    PROCESSORS[cls.prefix] = cls

  def records(self, piece: Range, info: dict) -> Iterator[tuple[str, object]]:
    raise NotImplementedError

  def encode(self, split: str, records: list, index: int, info: dict) -> dict[str, np.ndarray]:
    raise NotImplementedError


def records(corpus: Corpus, processor, carve: sources.Carve, split: str) -> Iterator:
  """The records of `split`, shard by shard in order, read as they are consumed (a tokenizer's sample)."""
  for shard in corpus.shards:
    for piece in shard:
      for key, record in processor.records(piece, {}):
        if (piece.split or carve.of(key)) == split:
          yield record


def build(directory: str, corpus: Corpus, processor, carve: sources.Carve, identity: dict, process_index: int = 0,
          process_count: int = 1, progress: bool = True, workers: int = 1) -> 'Cache':
  """Build this process's missing shards of `corpus` into `directory`, wait for the other processes',
  and open the cache. Resumable: a shard with its json is complete and skipped; a complete cache is
  read without writing. `workers` (data.cache_workers, `worker_count`): processes that build this
  process's shards at once."""
  count = len(corpus.shards)
  done = _done_shards(directory)
  mine = [i for i in range(count) if i % process_count == process_index and i not in done]
  if len(done) < count:
    _check_writable(directory)
    _write(os.path.join(directory, 'manifest.json'), json.dumps(
        {'format': FORMAT, 'source': corpus.source, 'identity': identity, 'shards': count}, indent=1))
  if mine:
    from tqdm import tqdm
    total = sum(piece.size for i in mine for piece in corpus.shards[i])
    workers = worker_count(workers, len(mine), total)
    what = (f'{len(mine)} of {count} shards ({total / 1e6:,.1f} MB of text) into {directory}'
            + (f' in {workers} processes' if workers > 1 else ''))
    terminal = progress and sys.stderr.isatty()
    if progress and not terminal:
      print(f'Tokenizing {what} ...', flush=True)
    started = time.monotonic()
    with tqdm(total=total, unit='B', unit_scale=True, unit_divisor=1024, disable=not terminal, desc='Tokenizing',
              mininterval=2) as bar:
      for index in _build_shards(directory, corpus, mine, processor, carve, process_index, workers):
        bar.update(sum(piece.size for piece in corpus.shards[index]))
    seconds = time.monotonic() - started
    if progress:
      print(f'Tokenized {what} in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.2f} MB/s).', flush=True)
    release_memory()
  _wait_for_shards(directory, count)
  return Cache(directory)


def release_memory() -> None:
  """Give the memory freed after building back to the system: glibc keeps freed heap (the shards'
  text and tokens, the tokenizer's buffers) for reuse, and the training that follows in the same
  process would otherwise count it in its peak."""
  import ctypes
  import ctypes.util
  try:
    ctypes.CDLL(ctypes.util.find_library('c')).malloc_trim(0)
  except (OSError, AttributeError, TypeError):  # not glibc: nothing to do
    pass


def worker_count(requested: int, shards: int, text_bytes: int) -> int:
  """Processes that build `shards` shards of `text_bytes` bytes: `requested`, or for 0 one per core
  (at most MAX_WORKERS) once there are AUTO_WORKERS_BYTES to build (below that, starting them costs
  more than they save); never more than the shards."""
  if requested <= 0:
    requested = min(os.cpu_count() or 1, MAX_WORKERS) if text_bytes >= AUTO_WORKERS_BYTES else 1
  return max(1, min(requested, shards))


def _build_shards(directory, corpus, indices, processor, carve, process_index, workers) -> Iterator[int]:
  """Build the shards `indices`, yielding each index once its shard is written: here, or in `workers`
  spawned processes that each build one shard at a time and tokenize with their share of the cores.
  One process per shard keeps the per-record Python (splitting, pairing, layout) on every core, where
  one process with a multi-threaded tokenizer runs it on one. A worker's error is raised here."""
  if workers <= 1:
    for index in indices:
      _build_shard(directory, corpus.shards[index], index, processor, carve, process_index)
      yield index
    return
  import multiprocessing  # spawn: a fork would copy this process's threads (JAX's, the tokenizer's)
  from concurrent import futures
  threads = max(1, (os.cpu_count() or 1) // workers)
  with futures.ProcessPoolExecutor(workers, multiprocessing.get_context('spawn'), initializer=_start_worker,
                                   initargs=(directory, processor, carve, process_index, threads)) as pool:
    pending = [pool.submit(_build_in_worker, index, corpus.shards[index]) for index in indices]
    try:
      for done in futures.as_completed(pending):
        yield done.result()
    except futures.process.BrokenProcessPool as e:
      raise DataError(f'A process building the token cache {directory} ended before its shard was written (out of '
                      f'memory, or a script that starts training when imported, without `if __name__ == '
                      f'"__main__":`, which spawned processes import again): the finished shards are kept; rerun '
                      f'with --config.data.cache_workers=1 to build in one process.') from e
    finally:
      for future in pending:
        future.cancel()


_WORKER = {}  # a build worker's directory, processor, carve and process index (`_start_worker`)


def _start_worker(directory, processor, carve, process_index, threads) -> None:
  os.environ['RAYON_NUM_THREADS'] = str(threads)  # read when the tokenizer first encodes in parallel
  _WORKER.update(directory=directory, processor=processor, carve=carve, process_index=process_index)


def _build_in_worker(index: int, shard) -> int:
  _build_shard(_WORKER['directory'], shard, index, _WORKER['processor'], _WORKER['carve'], _WORKER['process_index'])
  release_memory()
  return index


def _build_shard(directory, shard, index, processor, carve, process_index) -> None:
  """Read a shard's records, give each its split, encode each split's and write its arrays, then its json."""
  info, by_split = {}, {}
  for piece in shard:
    for key, record in processor.records(piece, info):
      by_split.setdefault(piece.split or carve.of(key), []).append(record)
  lengths = {}
  for split in sorted(by_split):
    arrays = processor.encode(split, by_split.pop(split), index, info)  # a split's records freed as encoded
    for field, array in arrays.items():
      _write_array(os.path.join(directory, f'{index:05d}.{split}.{field}.npy'), array)
      lengths[f'{split}.{field}'] = len(array)
  _write(os.path.join(directory, f'{index:05d}.json'),
         json.dumps({'lengths': lengths, 'info': info, 'built_by_process': process_index}))


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _check_writable(directory: str) -> None:
  try:
    storage.path(directory).mkdir(parents=True, exist_ok=True)
    probe = os.path.join(directory, f'.probe-{os.getpid()}')
    storage.write_atomically(probe, b'')
    storage.path(probe).unlink()
  except OSError as e:
    raise DataError(f'The token cache directory {directory} is not writable ({e.strerror or e}); set '
                    f'--config.data.cache_dir to a directory this user can write.') from e


def _done_shards(directory: str) -> set[int]:
  """The shards whose json is written (complete), from one listing of the directory."""
  folder = storage.path(directory)
  if not folder.exists():
    return set()
  return {int(p.name[:5]) for p in folder.iterdir() if re.fullmatch(r'\d{5}\.json', p.name)}


def _write_array(path: str, array: np.ndarray) -> None:
  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  _write(path, buffer.getvalue())


def _write(path: str, data: str | bytes) -> None:
  """`storage.write_atomically`, a full disk one DataError line (a shard's arrays, its json, the manifest)."""
  try:
    storage.write_atomically(path, data)
  except OSError as e:
    if e.errno == 28:  # ENOSPC
      raise DataError(f'The disk of {path} is full while building the token cache: the finished shards are kept; '
                      f'free space (or set --config.data.cache_dir elsewhere) and rerun to build the rest.') from e
    raise


def _wait_for_shards(directory: str, count: int) -> None:
  """Until every shard's json exists: the shards of the other processes (a shared cache_dir)."""
  deadline, announced = time.monotonic() + WAIT_SECONDS, False
  while True:
    missing = sorted(set(range(count)) - _done_shards(directory))
    if not missing:
      return
    if time.monotonic() > deadline:
      raise DataError(f'Waited {WAIT_SECONDS} s for {len(missing)} token-cache shards of {directory} (e.g. '
                      f'{missing[0]:05d}) that other processes build; every host must reach the same '
                      f'data.cache_dir (gs:// or a shared file system).')
    if not announced:
      print(f'Waiting for {len(missing)} token-cache shards that other processes build ...', flush=True)
      announced = True
    time.sleep(1)


# ----------------------------------------------------------------------------- reading
def _corrupt(directory: str, what: str) -> DataError:
  return DataError(f'The token cache {directory} is incomplete or corrupt ({what}); delete that directory and rerun '
                   f'(or run --mode=prepare) to rebuild it.')


def _read_json(directory: str, name: str):
  try:
    return json.loads(storage.path(os.path.join(directory, name)).read_text())
  except (OSError, ValueError) as e:
    raise _corrupt(directory, f'{name}: {e}') from e


class Cache:
  """A built cache: its manifest and shard jsons ({'lengths': {'<split>.<field>': rows}, 'info': what
  the processor noted}), read at once (a few kilobytes), and its arrays (ShardArray: rows read
  from the file when asked for); a gs:// cache's arrays are copied into a local mirror
  (LOCAL_MIRROR) when first opened, so that a run fetches the shards as it reaches them."""

  def __init__(self, directory: str):
    self.directory, self.remote = directory, storage.is_remote(directory)
    manifest = _read_json(directory, 'manifest.json')
    if manifest.get('format') != FORMAT:
      raise _corrupt(directory, f'format {manifest.get("format")}, not {FORMAT}')
    self.shards = [_read_json(directory, f'{i:05d}.json') for i in range(manifest['shards'])]
    self._arrays: dict[tuple[int, str], np.ndarray] = {}

  def length(self, shard: int, name: str) -> int:
    """Rows of the array `name` ('<split>.<field>') of a shard (0: the shard has none)."""
    return self.shards[shard]['lengths'].get(name, 0)

  def array(self, shard: int, name: str) -> 'ShardArray':
    """A shard's array (a gs:// one mirrored first), checked against its json."""
    if (shard, name) not in self._arrays:
      self._arrays[shard, name] = self._open(shard, name)
    return self._arrays[shard, name]

  def _open(self, shard: int, name: str) -> np.ndarray:
    file = f'{shard:05d}.{name}.npy'
    path = os.path.join(self.directory, file)
    if self.remote:
      path = os.path.join(os.path.expanduser(LOCAL_MIRROR), self.directory.replace('://', '/'), file)
      if not os.path.exists(path):  # shards never change once written
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with storage.path(os.path.join(self.directory, file)).open('rb') as remote:
          _copy(remote, path)
    try:
      array = ShardArray(path)
    except (OSError, ValueError, EOFError) as e:
      raise DataError(f'Token-cache shard {path} is truncated or corrupt ({e}); delete {self.directory} and rerun '
                      f'(or run --mode=prepare) to rebuild it.') from e
    if not array.shape or array.shape[0] != self.length(shard, name):
      raise DataError(f'Token-cache shard {path} holds {array.shape[0] if array.shape else 0} rows where its json says '
                      f'{self.length(shard, name)}: it is corrupt; delete {self.directory} and rerun (or run '
                      f'--mode=prepare) to rebuild it.')
    return array

  def check(self, names: Sequence[str]) -> None:
    """Open every shard's arrays `names` now (a local cache: a corrupt shard is found before training)."""
    for shard in range(len(self.shards)):
      for name in names:
        if not self.remote and self.length(shard, name):
          self.array(shard, name)

  def info(self, key: str, split: str) -> int:
    """The sum over shards of info[key][split] (counts a processor kept: documents, pairs, ...)."""
    return sum(entry['info'].get(key, {}).get(split, 0) for entry in self.shards)


class ShardArray:
  """A shard's .npy array, its rows read from the file when indexed (`a[i]`, `a[i:j]` -> np.ndarray),
  nothing mapped: runs read rows scattered over every shard, and a memory map would count each
  touched page's neighbours in the run's RSS (the kernel maps ~64 KB of cached file around every
  page a run touches: gigabytes of RSS for a few thousand rows of a large corpus;
  measurements/code_comments.csv)."""

  def __init__(self, path: str):
    self.path = path
    with open(path, 'rb') as f:
      major, _ = np.lib.format.read_magic(f)
      read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
      shape, fortran_order, self.dtype = read_header(f)
      self.offset = f.tell()
      size = os.fstat(f.fileno()).st_size
    if fortran_order or self.dtype.hasobject:
      raise ValueError('not a C-ordered array of numbers')
    self.shape = tuple(shape)
    self.row_bytes = self.dtype.itemsize * math.prod(self.shape[1:])
    if self.shape and size != self.offset + self.shape[0] * self.row_bytes:
      raise ValueError(f'{size} bytes where its header says {self.offset + self.shape[0] * self.row_bytes}')

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, index: int | slice) -> np.ndarray:
    if isinstance(index, slice):
      start, stop, step = index.indices(len(self))
      if step != 1:
        raise ValueError('A shard array is sliced with step 1 only.')
      return self._read(start, max(stop - start, 0))
    if not -len(self) <= index < len(self):
      raise IndexError(f'row {index} of {len(self)}')
    return self._read(index % len(self), 1)[0]

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    array = self[:]
    return array if dtype is None else array.astype(dtype)

  def _read(self, start: int, rows: int) -> np.ndarray:
    with open(self.path, 'rb', buffering=0) as f:
      data = os.pread(f.fileno(), rows * self.row_bytes, self.offset + start * self.row_bytes)
    return np.frombuffer(data, self.dtype).reshape((rows, *self.shape[1:]))


class Rows(Sequence):
  """The rows of one split of a cache: item i is {field: row}, ids as int32 (stored narrower).

  The order takes the shards in turn: row 0 of every shard, then row 1 of those with more, ... (a
  split whose shards are file order is thus not read one shard after another: the first rows and a
  `limit`'s sample every shard); `limit` keeps the first rows only (0: all)."""

  def __init__(self, cache: Cache, split: str, fields: Sequence[str], limit: int = 0):
    self.cache, self.split, self.fields = cache, split, tuple(fields)
    self.counts = np.asarray([cache.length(s, f'{split}.{self.fields[0]}') for s in range(len(cache.shards))], np.int64)
    cache.check([f'{split}.{field}' for field in self.fields])
    total = int(self.counts.sum())
    self.count = min(total, limit) if limit else total
    # The order's rounds change where a shard runs out: at each distinct count, the rows before it
    # and the shards still in.
    self.breaks = np.unique(np.concatenate([[0], self.counts]))
    self.before = np.asarray([np.minimum(self.counts, b).sum() for b in self.breaks], np.int64)
    self.active = [np.flatnonzero(self.counts > b) for b in self.breaks]

  def __len__(self) -> int:
    return self.count

  def locate(self, index: int) -> tuple[int, int]:
    """(shard, row in the shard) of row `index` of the split."""
    segment = int(np.searchsorted(self.before, index, side='right')) - 1
    offset, active = index - int(self.before[segment]), self.active[segment]
    return int(active[offset % len(active)]), int(self.breaks[segment]) + offset // len(active)

  def prefix_counts(self) -> np.ndarray:
    """How many of each shard's rows are among the split's first len(self)."""
    if self.count == int(self.counts.sum()):
      return self.counts
    segment = int(np.searchsorted(self.before, self.count, side='right')) - 1
    offset, active = self.count - int(self.before[segment]), self.active[segment]
    taken = np.minimum(self.counts, self.breaks[segment] + offset // len(active))
    taken[active[:offset % len(active)]] += 1
    return taken

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self.count:
      raise IndexError(index)
    shard, row = self.locate(index)
    return {field: _widened(self.cache.array(shard, f'{self.split}.{field}')[row]) for field in self.fields}


def _widened(value: np.ndarray) -> np.ndarray:
  """Unsigned ids as int32, as the models take them; other fields as stored."""
  return np.asarray(value, np.int32) if value.dtype.kind == 'u' else np.asarray(value)


class Stream:
  """The 1-D field `field` of a split, its shards joined in order (a language model's token stream):
  `len()` tokens, `read(start, length)` -> int32 [length]; `documents`: how many it holds."""

  def __init__(self, cache: Cache, split: str, field: str = 'tokens'):
    self.cache, self.split, self.name = cache, split, f'{split}.{field}'
    cache.check([self.name])
    self.shards = [s for s in range(len(cache.shards)) if cache.length(s, self.name)]
    self.starts = np.cumsum([0] + [cache.length(s, self.name) for s in self.shards])
    self.documents = cache.info('documents', split)

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: slice) -> 'StreamSlice':
    start, stop, step = index.indices(len(self))
    if step != 1:
      raise ValueError('A token stream is sliced with step 1 only.')
    return StreamSlice(self, start, max(stop - start, 0))

  def read(self, start: int, length: int) -> np.ndarray:
    """Tokens [start, start + length) as int32, from one shard or across the borders of several."""
    if start < 0 or start + length > len(self):
      raise IndexError(f'tokens [{start}, {start + length}) of a stream of {len(self)}')
    out = np.empty((length,), np.int32)
    index = int(np.searchsorted(self.starts, start, side='right')) - 1
    written = 0
    while written < length:
      offset = start + written - int(self.starts[index])
      array = self.cache.array(self.shards[index], self.name)
      take = min(length - written, len(array) - offset)
      out[written:written + take] = array[offset:offset + take]
      written += take
      index += 1
    return out


@dataclasses.dataclass(frozen=True)
class StreamSlice:
  """Tokens [start, start + length) of a Stream, read when sliced: `piece[a:b]` -> int32 [b - a]."""
  stream: Stream
  start: int
  length: int

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index: slice) -> np.ndarray:
    start, stop, step = index.indices(self.length)
    if step != 1:
      raise ValueError('A token stream is sliced with step 1 only.')
    return self.read(start, max(stop - start, 0))

  def read(self, start: int, length: int) -> np.ndarray:
    if start < 0 or start + length > self.length:
      raise IndexError(f'tokens [{start}, {start + length}) of a slice of {self.length}')
    return self.stream.read(self.start + start, length)


class Windows(Sequence):
  """Windows of `length` tokens of a stream (a Stream or a slice of one) starting every `stride`
  tokens, at most `limit` (0: all): {'tokens': int32 [length]} each; a grain source (random access,
  nothing in memory)."""

  def __init__(self, stream: Stream | StreamSlice, length: int, stride: int, limit: int = 0):
    self.stream, self.length, self.stride = stream, length, stride
    if len(stream) < length:
      raise DataError(f'The data has {len(stream)} tokens, fewer than one sequence of data.seq_len + 1 = {length}; '
                      f'use more text or a smaller data.seq_len.')
    count = (len(stream) - length) // stride + 1
    self.count = min(count, limit) if limit else count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self.count:
      raise IndexError(index)
    return {'tokens': self.stream.read(index * self.stride, self.length)}


def text_arrays(texts: Sequence[str]) -> dict[str, np.ndarray]:
  """Texts as the two arrays `Texts` reads: 'text' (their UTF-8 bytes joined, uint8) and 'text_end'
  (where each ends, int64 [rows])."""
  data = [text.encode() for text in texts]
  return {'text': np.frombuffer(b''.join(data), np.uint8),
          'text_end': np.cumsum([len(d) for d in data], dtype=np.int64)}


class Texts(Sequence):
  """Texts that `text_arrays` stored for a split under `names` ('<name>' and '<name>_end'), in the
  order `Rows` reads the split: item i is the tuple of its texts, read from its shard when asked
  for (nothing held)."""

  def __init__(self, cache: Cache, split: str, names: Sequence[str]):
    self.cache, self.split, self.names = cache, split, tuple(names)
    self.rows = Rows(cache, split, [f'{name}_end' for name in self.names])

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> tuple[str, ...]:
    if not 0 <= index < len(self):
      raise IndexError(index)
    shard, row = self.rows.locate(index)
    texts = []
    for name in self.names:
      ends = self.cache.array(shard, f'{self.split}.{name}_end')
      start = int(ends[row - 1]) if row else 0
      texts.append(bytes(self.cache.array(shard, f'{self.split}.{name}')[start:int(ends[row])]).decode())
    return tuple(texts)


# ----------------------------------------------------------------------------- the tokenizer
@contextlib.contextmanager
def _locked(path: str):
  """An exclusive lock on the local file `path` (processes of one host take turns)."""
  import fcntl
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield


def shared_tokenizer(data_config, workdir: str, identity: dict, sample, tokenizer=None):
  """The run's tokenizer, saved in `workdir`: `tokenizer` when given (init_from); the workdir's own;
  else the one trained before for the same data (`identity`: 'family', the prefix of the processor
  whose records `sample` reads, the corpus and its split), that processor's VERSION (its records,
  hence the text trained on, change with it; version 1 adds nothing, as in `cache_name`) and
  tokenizer settings, kept under data.cache_dir/tokenizers-v<FORMAT>/ so that runs on one corpus
  share it and therefore its caches; else one trained on the first TOKENIZER_TRAINING_CHARS
  characters of `sample()` (texts). Processes of a host that need the same new tokenizer take turns
  on a lock file: the first trains it, the others load it."""
  from data.tokenizers import TOKENIZER_FILE, load_tokenizer, train_tokenizer
  if tokenizer is None and (storage.path(workdir) / TOKENIZER_FILE).exists():
    return load_tokenizer(workdir)
  if tokenizer is None:
    settings = {'data': identity, 'kind': data_config.tokenizer, 'vocab_size': data_config.vocab_size,
                'lowercase': data_config.lowercase, 'chars': TOKENIZER_TRAINING_CHARS, 'format': FORMAT,
                **_versioned(identity['family'])}
    shared = cache_directory(cache_dir(data_config), f'tokenizers-v{FORMAT}/{_digest(settings)}')
    lock = (shared if not storage.is_remote(shared) else
            os.path.join(os.path.expanduser(LOCAL_MIRROR), shared.replace('://', '/'))) + '.lock'
    if not (storage.path(shared) / TOKENIZER_FILE).exists():
      _check_writable(shared)  # one line now, not an OSError after training
    with _locked(lock):
      if (storage.path(shared) / TOKENIZER_FILE).exists():
        tokenizer = load_tokenizer(shared)
      else:
        tokenizer = train_tokenizer(data_config.tokenizer, _bounded(sample()), data_config.vocab_size,
                                    data_config.lowercase)
        tokenizer.save(shared)
        release_memory()
  tokenizer.save(workdir)
  return tokenizer


def _bounded(texts) -> Iterator[str]:
  """The first TOKENIZER_TRAINING_CHARS characters of `texts`, read as they are consumed."""
  budget = TOKENIZER_TRAINING_CHARS
  for text in texts:
    yield text[:budget]
    budget -= len(text)
    if budget <= 0:
      return
