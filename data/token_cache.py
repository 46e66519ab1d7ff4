"""Token caches: a corpus tokenized once into shards on disk, then read by memory map.

A language-model corpus of any size is planned (files listed, large files cut at safe places,
every document given its split), tokenized shard by shard into flat token arrays, and read back
by random access, so a run holds the windows it reads and nothing grows with the corpus:

  <data.cache_dir>/lm-<fingerprint>/
    manifest.json                  what the cache holds: source, tokenizer hash, settings, the shards
    00007.train.npy, 00007.valid.npy   shard 7's tokens of each split (uint16, or uint32 past 65,536 ids)
    00007.json                     written last: shard 7 is complete (its token and document counts)

The fingerprint hashes what decides the tokens: the source (its files' paths, sizes and
modification times; a TFDS split's name and size), the tokenizer's own file, the split seed and
rule, and the layout. Two runs on the same corpus and tokenizer share one cache; a changed file or
tokenizer makes a new one. Building is resumable and safe to run in several processes at once:
process p builds the shards i with i % P == p (every host of a pod its share, no text tokenized
twice), each shard is written to temporary names and renamed, its json written last, so a reader
never sees half a shard; an interrupted build resumes at the first shard without its json.

Shards are NumPy `.npy` files: `np.load(mmap_mode='r')` maps them, and a window is a slice of one
or two shards (nanoGPT's train.bin, cut in pieces that hosts write in parallel). A `gs://` cache is
written shard by shard and mirrored to local disk once before it is mapped.

Safe cuts: a large file is tokenized in pieces (for bounded memory and for `encode_batch`'s
threads). A piece ends after a newline between two printable ASCII characters ('x\\ny'), where
byte-level BPE's and WordPiece's pre-tokenizers split anyway, so the pieces' tokens are the whole
file's tokens (tested); a CRLF file is cut between '\\r' and '\\n' for the same reason. A stretch
of SAFE_CUT_SEARCH bytes without such a newline is cut at a UTF-8 character boundary instead.
"""
from __future__ import annotations

import codecs
import dataclasses
import glob as globlib
import hashlib
import io
import json
import os
import re
import sys
import sysconfig
import time
from typing import Iterator, Sequence

import numpy as np

import storage
from data import sources
from data.sources import DataError

FORMAT_VERSION = 1
DEFAULT_CACHE_DIR = '~/.cache/attention-lineage/data'  # data.cache_dir's default: runs on one corpus share it
SHARD_BYTES = 32 << 20  # text per shard: ~10 M tokens (a build holds ~10 bytes per byte of its shard); 5 GB: 150 shards
PIECE_BYTES = 256 << 10  # text per encode_batch item: enough items per batch for every core
BATCH_BYTES = 4 << 20  # text per encode_batch call: HF tokenizers holds ~100 bytes per token until it returns
SAFE_CUT_SEARCH = 4 << 20  # bytes searched for a safe cut before cutting at a character boundary
LOOKAHEAD = 64 << 10  # bytes read past a piece to find its safe cut, in the common case
WAIT_SECONDS = 3600  # how long a process waits for the shards other processes build
EVAL_FRACTION = 0.05
LOCAL_MIRROR = '~/.cache/attention-lineage/data-mirror'  # where a gs:// cache is copied to be mapped
# A carved source's shards hold 'train' and 'valid' tokens; a source used whole holds 'all'.
ROLES = ('train', 'valid', 'all')
_SAFE_NEWLINE = re.compile(rb'[!-~](\r?)\n[!-~]')


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class FileRange:
  """Bytes [start, end) of one text file, all of one split (ROLES); `last`: a document (the file, or
  the training part of a file whose tail is held out) ends here."""
  path: str
  key: str  # the document's key: its path relative to the corpus's common folder
  start: int
  end: int
  last: bool
  role: str
  strict: bool = True  # undecodable UTF-8 is an error (text:), else replaced (pystdlib)


@dataclasses.dataclass(frozen=True)
class RecordRange:
  """TFDS records [start, end) of `name:split`, each a document; 'valid' by a hash of its key
  when `carve`, else 'all'."""
  name: str
  split: str
  start: int
  end: int
  carve: bool


Piece = FileRange | RecordRange


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A planned LM source: its pieces in order, grouped into shards, and what identifies it."""
  source: str
  carve: bool  # 'valid' is held out of it, the rest is 'train'; else all of it is 'all'
  shards: tuple[tuple[Piece, ...], ...]
  identity: dict  # what the fingerprint hashes of the source itself
  description: dict[str, str]  # role -> where its documents come from (the split report)


def plan_corpus(source: str, carve: bool, seed: int, default_split: str = 'train',
                shard_bytes: int = SHARD_BYTES) -> Corpus:
  """The shards of an LM source (pystdlib, text:<glob>, tfds:<name>[:<split>]).

  `carve`: hold out EVAL_FRACTION of it as 'valid' by data/sources.py's rule (documents by a hash
  of their keys, a single file by its tail), the rest 'train'; otherwise all of it is 'all'.
  Reads no text, only file sizes and the few kilobytes around each cut.
  """
  kind, argument = sources.parse_source(source)
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, default_split)
    return _plan_records(source, name, split, carve, shard_bytes)
  if kind == 'pystdlib':
    files, strict = _pystdlib_files(), False
  elif kind == 'text':
    files, strict = _text_files(argument), True
  else:
    raise DataError(f'Unknown LM data source {source!r}: use pystdlib, text:<glob> or tfds:<name>[:<split>].')
  roles, description = _file_roles([key for key, _, _ in files], source, carve, seed)
  ranges = []
  for (key, path, size), file_role in zip(files, roles):
    if carve and len(files) == 1:  # one file: its last EVAL_FRACTION (from a safe cut) is validation
      cut = _safe_cut(path, int(size * (1 - EVAL_FRACTION)), size)
      # Each part ends with EOS, as the in-memory path (data/lm.py) holds them: two documents.
      ranges += _file_ranges(path, key, 0, cut, size, 'train', strict, shard_bytes, last=True)
      ranges += _file_ranges(path, key, cut, size, size, 'valid', strict, shard_bytes, last=True)
    else:
      ranges += _file_ranges(path, key, 0, size, size, file_role, strict, shard_bytes, last=True)
  identity = {'kind': kind, 'files': [[key, size, os.stat(path).st_mtime_ns] for key, path, size in files]}
  if kind == 'pystdlib':
    identity['stdlib'] = sysconfig.get_paths()['stdlib']
  return Corpus(source, carve, _group(ranges, lambda r: r.end - r.start, shard_bytes), identity, description)


def _text_files(pattern: str) -> list[tuple[str, str, int]]:
  """[(key, path, size)] of the files matching `pattern` that hold text (`_holds_text`), sorted by
  path; the key is the path relative to the files' common folder (as data/sources.read_text_files
  keys them)."""
  paths = sorted(p for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise DataError(f'text:{pattern} matched no files; check the path or quote the glob.')
  root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  files = [(os.path.relpath(os.path.abspath(p), root), p, os.path.getsize(p)) for p in paths]
  files = [f for f in files if f[2] and _holds_text(f[1])]
  if not files:
    raise DataError(f'text:{pattern} matched only empty files; nothing to train on.')
  return files


def _holds_text(path: str) -> bool:
  """Whether a file holds more than whitespace (after a byte-order mark): the documents
  data/sources.py reads (a whitespace-only file is none). Reads up to its first other character."""
  decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')
  with open(path, 'rb') as f:
    text = decoder.decode(f.read(4096)).removeprefix('\ufeff')
    while not text.strip():
      chunk = f.read(1 << 16)
      if not chunk:
        return bool(decoder.decode(b'', final=True).strip())
      text = decoder.decode(chunk)
  return True


def _pystdlib_files() -> list[tuple[str, str, int]]:
  root = sysconfig.get_paths()['stdlib']
  files = [(key, os.path.join(root, key), os.path.getsize(os.path.join(root, key)))
           for key in sources.pystdlib_paths(root)]
  return [f for f in files if f[2] and _holds_text(f[1])]


def _file_roles(keys: list[str], source: str, carve: bool, seed: int):
  """(the role of every file, {role: where its documents come from})."""
  if not carve:
    return ['all'] * len(keys), {'all': f'{source}, whole'}
  if len(keys) == 1:
    return ['train'], {'train': f'{source}, the first {1 - EVAL_FRACTION:.0%} of the text',
                       'valid': f'{source}, the last {EVAL_FRACTION:.0%} of the text'}
  train, held_out = sources.deterministic_split(keys, [1 - EVAL_FRACTION, EVAL_FRACTION], seed)
  if not held_out:
    held_out = train[-1:]
  roles = ['train'] * len(keys)
  for i in held_out:
    roles[i] = 'valid'
  return roles, {'train': f'{source}, the documents not held out',
                 'valid': f'{source}, a {EVAL_FRACTION:.0%} hash split'}


def _file_ranges(path, key, start, end, size, role, strict, shard_bytes, last) -> list[FileRange]:
  """[start, end) of a file cut at safe places into ranges of at most ~shard_bytes."""
  cuts = [start]
  while end - cuts[-1] > shard_bytes:
    cuts.append(_safe_cut(path, cuts[-1] + shard_bytes, end))
  cuts.append(end)
  return [FileRange(path, key, a, b, last and b == end, role, strict) for a, b in zip(cuts, cuts[1:]) if b > a]


def _safe_cut(path: str, offset: int, end: int) -> int:
  """The first safe cut (module docstring) at or after `offset` and before `end` of a file."""
  with open(path, 'rb') as f:
    f.seek(offset)
    return safe_cut(f.read(min(SAFE_CUT_SEARCH, end - offset) + 1), offset, end)


def safe_cut(window: bytes, offset: int, end: int) -> int:
  """The cut `_safe_cut` makes, given the bytes from `offset` (SAFE_CUT_SEARCH + 1 of them, or to `end`)."""
  return offset + safe_cut_in(window) if len(window) > 1 else end


def safe_cut_in(data: bytes) -> int:
  """The index in `data` of its first safe cut, else of its last UTF-8 character boundary (a byte
  that does not continue a character), else len(data)."""
  match = _SAFE_NEWLINE.search(data)
  if match:
    return match.start(1) if match.group(1) else match.end() - 1
  for i in range(len(data) - 1, max(len(data) - 4, 0), -1):
    if data[i] & 0xC0 != 0x80:
      return i
  return len(data)


def _plan_records(source, name, split, carve, shard_bytes) -> Corpus:
  records = sources.tfds_records(name, split)
  count = len(records)
  if not count:
    raise DataError(f'tfds:{name}:{split} is empty.')
  # Record sizes are unknown until read: shards of a fixed count, from the first record's size.
  first = len(_record_text(records, 0).encode())
  per_shard = max(1, shard_bytes // max(first, 256))
  shards = tuple((RecordRange(name, split, a, min(a + per_shard, count), carve),)
                 for a in range(0, count, per_shard))
  description = ({'train': f'{source}, the documents not held out', 'valid': f'{source}, a {EVAL_FRACTION:.0%} hash split'}
                 if carve else {'all': f'{source}, whole'})
  return Corpus(source, carve, shards, {'kind': 'tfds', 'name': name, 'split': split, 'records': count}, description)


def _record_text(records, index: int) -> str:
  text = records[index]['text']
  return text.decode('utf-8') if isinstance(text, bytes) else str(text)


def _group(items: list, size, limit: int) -> tuple[tuple, ...]:
  """Consecutive items in groups of at most `limit` total size (an item larger than it alone)."""
  groups, current, total = [], [], 0
  for item in items:
    if current and total + size(item) > limit:
      groups.append(tuple(current))
      current, total = [], 0
    current.append(item)
    total += size(item)
  if current:
    groups.append(tuple(current))
  return tuple(groups)


def corpus_bytes(shard: Sequence[Piece]) -> int:
  """The text bytes of a shard (TFDS ranges count their records: sizes are unknown until read)."""
  return sum(p.end - p.start for p in shard)


# ----------------------------------------------------------------------------- reading the text
def training_text(corpus: Corpus, seed: int) -> Iterator[str]:
  """The text of `corpus`'s training documents in order, a piece at a time (a large file in
  several): the tokenizer trains on a bounded sample of it."""
  for shard in corpus.shards:
    for piece in shard:
      for role, text, _ in _texts(piece, seed):
        if role in ('train', 'all'):
          yield text


def _texts(piece: Piece, seed: int) -> Iterator[tuple[str, str, bool]]:
  """(split, text, ends its document) of a piece, in parts of about PIECE_BYTES."""
  if isinstance(piece, RecordRange):
    records = sources.tfds_records(piece.name, piece.split)
    keys = [f'{piece.name}:{piece.split}:{i}' for i in range(piece.start, piece.end)]
    held_out = (set(sources.deterministic_split(keys, [1 - EVAL_FRACTION, EVAL_FRACTION], seed)[1])
                if piece.carve else set())
    for offset, index in enumerate(range(piece.start, piece.end)):
      role = ('valid' if offset in held_out else 'train') if piece.carve else 'all'
      yield role, _record_text(records, index), True
    return
  with open(piece.path, 'rb') as f:
    f.seek(piece.start)
    position = piece.start
    while position < piece.end:
      data = f.read(min(PIECE_BYTES + LOOKAHEAD, piece.end - position))
      if position + len(data) < piece.end and not _SAFE_NEWLINE.search(data, PIECE_BYTES):
        data += f.read(min(SAFE_CUT_SEARCH, piece.end - position - len(data)))  # a long stretch without one
      cut = len(data) if position + len(data) >= piece.end else PIECE_BYTES + safe_cut_in(data[PIECE_BYTES:])
      text = _decode(data[:cut], piece, position)
      f.seek(position + cut)
      position += cut
      if piece.start == 0 and position == cut:
        text = text.removeprefix('\ufeff')
      yield piece.role, text, piece.last and position >= piece.end


def _decode(data: bytes, piece: FileRange, offset: int) -> str:
  if not piece.strict:
    return data.decode('utf-8', errors='replace')
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{piece.path}: byte {offset + e.start} (0x{data[e.start]:02x}) is not UTF-8; data files must '
                    f'be UTF-8: convert it (e.g. iconv -f cp1252 -t utf-8) or fix it.') from e


# ----------------------------------------------------------------------------- building
def fingerprint(corpus: Corpus, tokenizer_json: str, seed: int, shard_bytes: int = SHARD_BYTES) -> str:
  """What decides the cache's tokens, hashed (module docstring)."""
  identity = {'format': FORMAT_VERSION, 'source': corpus.identity, 'carve': corpus.carve, 'seed': seed,
              'eval_fraction': EVAL_FRACTION, 'shard_bytes': shard_bytes,
              'tokenizer': hashlib.sha256(tokenizer_json.encode()).hexdigest()}
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def shard_bytes(data_config, fraction: float = 1.0) -> int:
  """Text per shard: data.cache_shard_mb (SHARD_BYTES for configs saved before it existed) x `fraction`."""
  return max(1, int(data_config.get('cache_shard_mb', SHARD_BYTES / 2**20) * 2**20 * fraction))


def cache_directory(cache_dir: str, name: str) -> str:
  """`name` under data.cache_dir (a local path with '~' expanded, or gs://)."""
  if not cache_dir:
    raise DataError("data.cache_dir is empty: token caches need a directory; set --config.data.cache_dir "
                    f"(default {DEFAULT_CACHE_DIR}).")
  return os.path.join(cache_dir if storage.is_remote(cache_dir) else os.path.expanduser(cache_dir), name)


def build(corpus: Corpus, tokenizer, directory: str, seed: int, process_index: int = 0, process_count: int = 1,
          progress: bool = True) -> None:
  """Tokenize this process's missing shards of `corpus` into `directory`, then wait until every
  process's shards are there. Resumable: a shard with its json is complete and skipped."""
  if len(_done_shards(directory)) == len(corpus.shards):  # complete: nothing to write (it may be read-only)
    return
  _check_writable(directory)
  _write(os.path.join(directory, 'manifest.json'), json.dumps(
      {'format': FORMAT_VERSION, 'source': corpus.source, 'carve': corpus.carve, 'identity': corpus.identity,
       'shards': len(corpus.shards), 'dtype': token_dtype(tokenizer.vocab_size).name}, indent=1))
  done = _done_shards(directory)
  mine = [i for i in range(len(corpus.shards)) if i % process_count == process_index and i not in done]
  if mine:
    _build_shards(corpus, tokenizer, directory, seed, mine, progress, process_index)
  _wait_for_shards(directory, len(corpus.shards))


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


def _build_shards(corpus, tokenizer, directory, seed, indices: list[int], progress: bool, process_index: int) -> None:
  """Build the shards `indices`: a progress bar (MB/s, ETA) on a terminal, a line before and after elsewhere."""
  from tqdm import tqdm
  total = sum(corpus_bytes(corpus.shards[i]) for i in indices if not isinstance(corpus.shards[i][0], RecordRange))
  what = f'{len(indices)} of {len(corpus.shards)} token-cache shards ({total / 1e6:,.1f} MB of text) into {directory}'
  terminal = progress and sys.stderr.isatty()
  if progress and not terminal:
    print(f'Tokenizing {what} ...', flush=True)
  started = time.monotonic()
  bar = tqdm(total=total or None, unit='B', unit_scale=True, unit_divisor=1024, disable=not terminal,
             desc='Tokenizing', mininterval=2)
  try:
    for index in indices:
      _build_shard(corpus.shards[index], tokenizer, directory, index, seed, bar, process_index)
  finally:
    bar.close()
  seconds = time.monotonic() - started
  if progress:
    print(f'Tokenized {what} in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.2f} MB/s).', flush=True)


def _build_shard(shard, tokenizer, directory, index, seed, bar, process_index: int = 0) -> None:
  """Tokenize one shard and write its arrays, then its json (module docstring)."""
  dtype = token_dtype(tokenizer.vocab_size)
  tokens = {role: [] for role in ROLES}
  documents = dict.fromkeys(ROLES, 0)
  batch: list[tuple[str, str, bool]] = []

  def flush():
    for (role, _, ends), ids in zip(batch, tokenizer.encode_batch([text for _, text, _ in batch])):
      tokens[role].append(np.asarray(ids + [tokenizer.eos_id] if ends else ids, dtype))
      documents[role] += ends
    bar.update(sum(len(text.encode()) for _, text, _ in batch) if bar.total else 0)
    batch.clear()

  size = 0
  for piece in shard:
    for role, text, ends in _texts(piece, seed):
      batch.append((role, text, ends))
      size += len(text)
      if size >= BATCH_BYTES:
        flush()
        size = 0
  flush()
  counts = {}
  for role in ROLES:
    if tokens[role]:
      array = np.concatenate(tokens[role])
      _write_array(os.path.join(directory, f'{index:05d}.{role}.npy'), array)
      counts[role] = len(array)
  _write(os.path.join(directory, f'{index:05d}.json'),
         json.dumps({'tokens': counts, 'documents': {r: n for r, n in documents.items() if n},
                     'built_by_process': process_index}))


def _write_array(path: str, array: np.ndarray) -> None:
  """An .npy file, complete under its name at once (a temporary name, then a rename)."""
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
    done = _done_shards(directory)
    missing = [i for i in range(count) if i not in done]
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
class TokenStream:
  """The concatenated tokens of one role of a built cache, read by memory map: `len()` tokens,
  `read(start, length)` -> int32 [length]. Holds only the open maps."""

  def __init__(self, directory: str, role: str):
    local = _local_copy(directory)
    manifest = _read_json(os.path.join(local, 'manifest.json'), directory)
    dtype = np.dtype(manifest['dtype'])
    self.arrays, self.documents = [], 0
    for index in range(manifest['shards']):
      counts = _read_json(os.path.join(local, f'{index:05d}.json'), directory)
      count = counts['tokens'].get(role, 0)
      self.documents += counts['documents'].get(role, 0)
      if count:
        self.arrays.append(_open_shard(os.path.join(local, f'{index:05d}.{role}.npy'), count, dtype, directory))
    self.starts = np.cumsum([0] + [len(a) for a in self.arrays])

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
    shard = int(np.searchsorted(self.starts, start, side='right')) - 1
    written = 0
    while written < length:
      offset = start + written - self.starts[shard]
      take = min(length - written, len(self.arrays[shard]) - offset)
      out[written:written + take] = self.arrays[shard][offset:offset + take]
      written += take
      shard += 1
    return out


@dataclasses.dataclass(frozen=True)
class StreamSlice:
  """Tokens [start, start + length) of a TokenStream, read when sliced: `piece[a:b]` -> int32 [b - a]."""
  stream: TokenStream
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


def _read(path: str, directory: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except (OSError, ValueError) as e:
    raise DataError(f'The token cache {directory} is incomplete or corrupt ({os.path.basename(path)}: {e}); '
                    f'delete that directory and rerun (or run --mode=prepare) to rebuild it.') from e


def _read_json(path: str, directory: str):
  """A cache's json file, parsed; one cut short or damaged is `_read`'s DataError."""
  text = _read(path, directory)
  try:
    return json.loads(text)
  except ValueError as e:
    raise DataError(f'The token cache {directory} is incomplete or corrupt ({os.path.basename(path)}: {e}); '
                    f'delete that directory and rerun (or run --mode=prepare) to rebuild it.') from e


def _open_shard(path: str, count: int, dtype: np.dtype, directory: str) -> np.ndarray:
  """A shard's tokens, memory-mapped, checked against the count its json recorded."""
  try:
    array = np.load(path, mmap_mode='r', allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    raise DataError(f'Token-cache shard {path} is truncated or corrupt ({e}); delete {directory} and rerun '
                    f'(or run --mode=prepare) to rebuild it.') from e
  if array.shape != (count,) or array.dtype != dtype:
    raise DataError(f'Token-cache shard {path} holds {array.shape[0] if array.ndim == 1 else array.shape} '
                    f'{array.dtype} tokens where its json says {count} {dtype}: it is corrupt; delete {directory} '
                    f'and rerun (or run --mode=prepare) to rebuild it.')
  return array


def _local_copy(directory: str) -> str:
  """`directory` itself when local; a gs:// cache is copied once into a local mirror to be mapped."""
  if not storage.is_remote(directory):
    return directory
  mirror = os.path.join(os.path.expanduser(LOCAL_MIRROR), directory.replace('://', '/'))
  remote = storage.path(directory)
  os.makedirs(mirror, exist_ok=True)
  for item in sorted(remote.iterdir(), key=lambda p: p.name):
    target = os.path.join(mirror, item.name)
    if item.name.endswith('.tmp') or item.name.startswith('.probe'):
      continue
    if not os.path.exists(target):  # shards never change once written
      storage.write_atomically(target, item.read_bytes())
  return mirror


class Windows(Sequence):
  """Windows of `length` tokens of a stream (a TokenStream or a slice of one) starting every `stride`
  tokens, at most `limit` (0: all): {'tokens': int32 [length]} each; a grain source (random access,
  nothing in memory)."""

  def __init__(self, stream: TokenStream | StreamSlice, length: int, stride: int, limit: int = 0):
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


# ----------------------------------------------------------------------------- the tokenizer
def shared_tokenizer(data_config, workdir: str, identity: dict, train):
  """The run's tokenizer, saved in `workdir`: the workdir's own; else the one trained before for
  the same data (`identity`: what identifies the corpus and the split) and tokenizer settings, kept
  under data.cache_dir/tokenizers/ so that runs on one corpus share it and therefore its caches;
  else `train(directory)`, which trains one on a bounded sample and saves it in `directory`."""
  from data.tokenizers import TOKENIZER_FILE, load_tokenizer
  if (storage.path(workdir) / TOKENIZER_FILE).exists():
    return load_tokenizer(workdir)
  settings = {'data': identity, 'kind': data_config.tokenizer, 'vocab_size': data_config.vocab_size,
              'lowercase': data_config.lowercase, 'format': FORMAT_VERSION}
  key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:20]
  shared = cache_directory(data_config.get('cache_dir', DEFAULT_CACHE_DIR), f'tokenizers/{key}')
  if (storage.path(shared) / TOKENIZER_FILE).exists():
    tokenizer = load_tokenizer(shared)
  else:
    _check_writable(shared)  # one line now, not an OSError after training
    tokenizer = train(shared)
  tokenizer.save(workdir)
  return tokenizer


# ----------------------------------------------------------------------------- caches of examples
# Families whose examples are fixed-shape rows (translation pairs, labelled texts, BERT's sentence
# pairs) cache them the same way: shard i holds, per split, one .npy per field ([rows, ...], ids
# in the token dtype), `{i:05d}.{split}.{field}.npy`, and its json (rows per split and what the
# family reports: dropped, truncated, malformed lines) is written last.
def build_examples(directory: str, manifest: dict, sizes: Sequence[int], make_shard, process_index: int = 0,
                   process_count: int = 1, progress: bool = True) -> list[dict]:
  """Build this process's missing shards of an example cache, wait for the others', and return
  every shard's json. `make_shard(i)` -> ({split: {field: array [rows, ...]}}, info dict, {split:
  JSON-able texts}) tokenizes shard i, whose text is `sizes[i]` bytes (for the progress line); the
  texts (e.g. references to score against) are kept beside its arrays, read by `read_texts`."""
  done = _done_shards(directory)
  mine = [i for i in range(len(sizes)) if i % process_count == process_index and i not in done]
  if len(done) < len(sizes):  # else complete: nothing to write (it may be read-only)
    _check_writable(directory)
    _write(os.path.join(directory, 'manifest.json'),
           json.dumps({'format': FORMAT_VERSION, 'shards': len(sizes), **manifest}, indent=1))
  if mine:
    total = sum(sizes[i] for i in mine)
    what = f'{len(mine)} of {len(sizes)} example-cache shards ({total / 1e6:,.1f} MB of text) into {directory}'
    started = time.monotonic()
    if progress:
      print(f'Tokenizing {what} ...', flush=True)
    for index in mine:
      arrays, info, texts = make_shard(index)
      for split, fields in arrays.items():
        for field, array in fields.items():
          _write_array(os.path.join(directory, f'{index:05d}.{split}.{field}.npy'), array)
      for split, text in texts.items():
        _write(os.path.join(directory, f'{index:05d}.{split}.text.json'), json.dumps(text, ensure_ascii=False))
      rows = {split: len(next(iter(fields.values()))) for split, fields in arrays.items() if fields}
      _write(os.path.join(directory, f'{index:05d}.json'),
             json.dumps({'rows': rows, 'info': info, 'built_by_process': process_index}))
    seconds = time.monotonic() - started
    if progress:
      print(f'Tokenized {what} in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.2f} MB/s).', flush=True)
  _wait_for_shards(directory, len(sizes))
  local = _local_copy(directory)
  return [json.loads(_read(os.path.join(local, f'{i:05d}.json'), directory)) for i in range(len(sizes))]


def read_texts(directory: str, split: str) -> list:
  """The texts `build_examples` kept for `split`, every shard's in order."""
  local = _local_copy(directory)
  texts = []
  for index in range(_read_json(os.path.join(local, 'manifest.json'), directory)['shards']):
    path = os.path.join(local, f'{index:05d}.{split}.text.json')
    if os.path.exists(path):
      texts += _read_json(path, directory)
  return texts


class CachedExamples(Sequence):
  """The rows of one split of an example cache, read by memory map: item i is {field: row i}, ids
  as int32 (the cache may store them narrower); `limit` keeps the first rows only (0: all)."""

  def __init__(self, directory: str, split: str, fields: Sequence[str], limit: int = 0):
    local = _local_copy(directory)
    manifest = json.loads(_read(os.path.join(local, 'manifest.json'), directory))
    self.fields, self.shards, counts = tuple(fields), [], [0]
    for index in range(manifest['shards']):
      rows = json.loads(_read(os.path.join(local, f'{index:05d}.json'), directory))['rows'].get(split, 0)
      if rows:
        self.shards.append({field: _open_rows(os.path.join(local, f'{index:05d}.{split}.{field}.npy'), rows,
                                              directory) for field in self.fields})
        counts.append(rows)
    self.starts = np.cumsum(counts)
    self.count = min(int(self.starts[-1]), limit) if limit else int(self.starts[-1])

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self.count:
      raise IndexError(index)
    shard = int(np.searchsorted(self.starts, index, side='right')) - 1
    row = index - self.starts[shard]
    return {field: _widened(self.shards[shard][field][row]) for field in self.fields}


def _widened(value: np.ndarray) -> np.ndarray:
  """Unsigned ids as int32, as the models take them; other fields as stored."""
  return np.asarray(value, np.int32) if value.dtype.kind == 'u' else np.asarray(value)


def _open_rows(path: str, rows: int, directory: str) -> np.ndarray:
  """A shard's field, memory-mapped, checked against the rows its json recorded."""
  try:
    array = np.load(path, mmap_mode='r', allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    raise DataError(f'Cache shard {path} is truncated or corrupt ({e}); delete {directory} and rerun '
                    f'(or run --mode=prepare) to rebuild it.') from e
  if array.ndim == 0 or array.shape[0] != rows:
    raise DataError(f'Cache shard {path} holds {array.shape} where its json says {rows} rows: it is corrupt; '
                    f'delete {directory} and rerun (or run --mode=prepare) to rebuild it.')
  return array


def line_ranges(path: str, shard_bytes: int) -> list[tuple[int, int]]:
  """[start, end) byte ranges of a local text file, each ending after a newline, of ~shard_bytes."""
  size = os.path.getsize(path)
  cuts = [0]
  with open(path, 'rb') as f:
    while size - cuts[-1] > shard_bytes:
      f.seek(cuts[-1] + shard_bytes)
      f.readline()
      cuts.append(min(f.tell(), size))
  cuts.append(size)
  return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def table_sources_only(data_config) -> bool:
  """Whether every named source is a tsv: file or a TFDS set: what the example caches read (a
  family's built-in dataset is read in memory)."""
  named = [data_config.source, data_config.get('eval_source', ''), data_config.get('test_source', '')]
  return all(sources.parse_source(s)[0] in ('tsv', 'tfds') for s in named if s)


def plan_table(source: str, data_config, default_split: str, shard_bytes: int, bytes_per_record: int, form: str
               ) -> tuple[str, tuple[tuple, ...], dict]:
  """(the source as messages name it, its shards, its identity) for a tsv: file of `form` lines
  (shards ('tsv', local path, start, end) of `line_ranges`; a gzipped or gs:// file is first made a
  local plain file) or a TFDS split (shards ('tfds', name, split, start, end) of
  shard_bytes // bytes_per_record records). Reads no text."""
  kind, argument = sources.parse_source(source)
  if kind == 'tsv':
    display = argument if storage.is_remote(argument) else os.path.expanduser(argument)
    if storage.path(display).is_dir():
      raise DataError(f'tsv:{display} is a directory; tsv: reads one file: name a file of {form} lines in it.')
    if not storage.path(display).is_file():
      raise DataError(f'tsv:{display} does not exist; give the path of a file of {form} lines.')
    path = local_plain_file(argument, data_config.get('cache_dir', DEFAULT_CACHE_DIR))
    stat = os.stat(path)
    identity = {'kind': 'tsv', 'path': os.path.abspath(path), 'size': stat.st_size, 'mtime': stat.st_mtime_ns,
                'header': data_config.get('tsv_header', False)}
    shards = tuple(('tsv', path, a, b) for a, b in line_ranges(path, shard_bytes))
    if not shards:
      raise DataError(f'tsv:{display} is empty; give a file of {form} lines.')
    return f'tsv:{display}', shards, identity
  if kind == 'tfds':
    name, split = sources.split_tfds_source(argument, default_split)
    count = len(sources.tfds_records(name, split))
    if not count:
      raise DataError(f'tfds:{name}:{split} is empty.')
    step = max(1, shard_bytes // bytes_per_record)
    shards = tuple(('tfds', name, split, a, min(a + step, count)) for a in range(0, count, step))
    return f'tfds:{name}:{split}', shards, {'kind': 'tfds', 'name': name, 'split': split, 'records': count}
  raise DataError(f'{source!r} is not a tsv: or tfds: source.')


def table_shard_bytes(shard: tuple, bytes_per_record: int) -> int:
  """The text of a `plan_table` shard, in bytes (a TFDS shard's estimated)."""
  return shard[3] - shard[2] if shard[0] == 'tsv' else (shard[4] - shard[3]) * bytes_per_record


def numbered_lines(path: str, start: int, end: int, display: str, first: bool, header: bool
                   ) -> tuple[list[tuple[int, str]], dict]:
  """The non-blank lines of bytes [start, end) of a local text file (a `line_ranges` range), as
  data/sources.read_lines reads a whole file: [(line number within the range, line)], and {'line_count':
  the lines the range spans, 'nonblank': whether it has a non-blank line (a header counts),
  'header_warning': a first line that looks like column names}. `first`:
  the range holds the file's first line, skipped with `header`, else warned about when it looks
  like a header. Undecodable UTF-8 is sources.decode_utf8's DataError naming the line of the file
  (`display`)."""
  with open(path, 'rb') as f:
    f.seek(start)
    raw = f.read(end - start)
  try:
    text = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    sources.decode_utf8(b'\n' * _newlines_before(path, start) + raw[:e.start + 1], display)  # numbers the line
    raise
  if start == 0:
    text = text.removeprefix('\ufeff')
  lines = text.split('\n')
  numbered = [(number, line.removesuffix('\r')) for number, line in enumerate(lines, 1) if line.strip()]
  info = {'line_count': len(lines) - text.endswith('\n'), 'nonblank': bool(numbered)}
  if first and numbered:
    if header:
      numbered = numbered[1:]
    elif sources.looks_like_header(numbered[0][1]):
      info['header_warning'] = numbered[0][1].strip()
  return numbered, info


def _newlines_before(path: str, offset: int, chunk: int = 16 << 20) -> int:
  count = 0
  with open(path, 'rb') as f:
    while f.tell() < offset:
      count += f.read(min(chunk, offset - f.tell())).count(b'\n')
  return count


def local_plain_file(path: str, cache_dir: str) -> str:
  """A local, uncompressed copy of a text file to cut into shards: the file itself when it is local
  and not gzipped; else decompressed (or downloaded) once, streaming, under data.cache_dir/raw/."""
  location = path if storage.is_remote(path) else os.path.expanduser(path)
  with storage.path(location).open('rb') as f:
    gzipped = f.read(2) == sources.GZIP_MAGIC
  if not gzipped and not storage.is_remote(location):
    return location
  stat = storage.path(location).stat()
  key = hashlib.sha256(json.dumps([location, getattr(stat, 'length', None) or getattr(stat, 'st_size', None),
                                   getattr(stat, 'mtime', None) or getattr(stat, 'st_mtime', None)],
                                  default=str).encode()).hexdigest()[:20]
  target = os.path.join(os.path.expanduser(cache_dir) if not storage.is_remote(cache_dir) else
                        os.path.expanduser(LOCAL_MIRROR), 'raw', f'{key}.txt')
  if not os.path.exists(target):
    import gzip
    import shutil
    import zlib
    os.makedirs(os.path.dirname(target), exist_ok=True)
    aside = f'{target}.{os.getpid()}.tmp'
    try:
      with storage.path(location).open('rb') as raw, open(aside, 'wb') as out:
        shutil.copyfileobj(gzip.GzipFile(fileobj=raw) if gzipped else raw, out, 16 << 20)
      os.replace(aside, target)
    except (OSError, EOFError, zlib.error) as e:
      if os.path.exists(aside):
        os.remove(aside)
      raise DataError(f'{path} does not decompress ({e}); the file is cut short or corrupt: copy it again.') from e
  return target
