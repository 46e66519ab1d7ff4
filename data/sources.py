"""Where raw data comes from: a source string in the config names it.

  tfds:<name>[:<split>]   a TFDS dataset read with `tfds.data_source` (array_record, no TensorFlow)
  text:<glob>             local text files
  tsv:<path>              local tab-separated file (read by the families that take pairs or labels)
  pystdlib                the Python standard library's own sources, an offline LM corpus
  <other built-in name>   families register their own (numbers_en_fr, bbc_news)

Every reader fails with one message naming the source and the fix: no files matched, empty or
undecodable data, an unknown TFDS name.
"""
from __future__ import annotations

import glob as globlib
import hashlib
import os
import sysconfig
from typing import Sequence

from errors import UserError


class DataError(UserError):
  """Bad data input (missing path, empty or undecodable data); the message names the fix."""


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
      raw = f.read()
    try:
      text = raw.decode('utf-8')
    except UnicodeDecodeError as e:
      raise DataError(f'{path} is not UTF-8 text ({e}); convert it or remove it from the glob.') from e
    if text.strip():
      documents.append((os.path.relpath(os.path.abspath(path), root), text))
  if not documents:
    raise DataError(f'text:{pattern} matched only empty files; nothing to train on.')
  return documents


def pystdlib_files() -> list[tuple[str, str]]:
  """The standard library's .py files (no test/tests/idlelib/site-packages folders), sorted."""
  root = sysconfig.get_paths()['stdlib']
  skip = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}
  documents = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in skip)
    for name in sorted(files):
      if name.endswith('.py'):
        path = os.path.join(directory, name)
        with open(path, 'rb') as f:
          text = f.read().decode('utf-8', errors='replace')
        if text.strip():
          documents.append((os.path.relpath(path, root), text))
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
