"""Data at scale: generated corpora of any size, and what preparing and training on them cost.

  python scripts/data_scale.py make --out_dir=/tmp/corpus-1g --megabytes=1000 [--kind=text]
  python scripts/data_scale.py measure --corpus=/tmp/corpus-1g --cache_dir=/tmp/scale-cache [--kind=text]

`make` writes ~MEGABYTES of this machine's own text: the standard library's Python sources and the
messages of the gettext catalogs (/usr/share/locale/*/LC_MESSAGES/*.mo, ~110 MB of English
messages and their translations into ~180 languages), cycled with a copy number so that no two
records are equal. By --kind:
  text       text files of 10 MB (GPT: data.source=text:<out_dir>/*.txt)
  pairs      <out_dir>/pairs.tsv: English<TAB>translation lines (translation)
  labels     <out_dir>/labels.tsv: text<TAB>language lines, the 12 languages with the most messages in
             turn, each text 8 messages of one language joined (classification: 12 labels)
  documents  <out_dir>/documents.txt: documents of 5-30 messages a line, between blank lines (BERT)
and beside it `<out_dir>.eval/`: small held-out files of the same kind (data.eval_source and
data.test_source), so that the final evaluation does not score a gigabyte.

`measure` runs, each under /usr/bin/time -v (wall time; peak RSS, of the process tree with its cache-building
workers, sampled every 0.2 s, where that is larger), launch.py on the corpus:
  text            configs/gpt.py:default (byte-level BPE, 2,048 ids)
  pairs           configs/transformer.py:default, data.seq_len=64
  labels          configs/classifier.py:default, data.seq_len=128
  documents       configs/bert.py:default (pretraining, WordPiece)
  first run  2 training steps into a fresh --cache_dir and workdir: tokenizer trained on its
             sample, every shard built, then trained, in one process
  restart    the same command again: resume + 2 more steps (the caches are there)
  small      the same first run and restart on a 1 MB corpus of the kind, the yardstick for `restart`
  raw        HF `tokenizers` encode_batch and encode_batch_fast on 64 MB of the corpus held in
             memory as the family's items, with the tokenizer the first run trained: the raw rates
             on these cores, and the first run's build rate against them
and for text also
  prepare    launch.py --mode=prepare into another fresh --cache_dir; its MB/s against `raw`
  train      2 training steps in a fresh workdir after that prepare (the cache is there)
It prints one JSON line per step, then a Markdown table.
"""
from __future__ import annotations

import argparse
import gettext
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_BYTES = 10 << 20


# ----------------------------------------------------------------------------- the corpus
def catalogs() -> Iterator[tuple[str, dict]]:
  """(language, catalog) of every gettext catalog of this machine, in path order."""
  for path in sorted(glob.glob('/usr/share/locale/*/LC_MESSAGES/*.mo')):
    try:
      with open(path, 'rb') as f:
        yield path.split('/')[-3], gettext.GNUTranslations(f)._catalog
    except (OSError, UnicodeDecodeError, IndexError, ValueError):  # a few catalogs have malformed headers
      continue


def english(key) -> str:
  return key if isinstance(key, str) else key[0]  # a plural message's key is (singular, n)


def source_texts() -> list[str]:
  """The machine's own text: standard-library sources and gettext messages (both sides)."""
  sys.path.insert(0, ROOT)
  from data.sources import pystdlib_paths
  root = sysconfig.get_paths()['stdlib']
  texts = []
  for key in pystdlib_paths(root):
    with open(os.path.join(root, key), 'rb') as f:
      texts.append(f.read().decode('utf-8', errors='replace'))
  for _, catalog in catalogs():
    texts.append(''.join(f'{english(key)}\n{value}\n' for key, value in catalog.items() if key))
  return texts


def make_corpus(out_dir: str, megabytes: int) -> None:
  texts = source_texts()
  os.makedirs(out_dir, exist_ok=True)
  total, number, index = megabytes * 1_000_000, 0, 0
  written = 0
  while written < total:
    parts, size = [f'# corpus file {number}\n'], 0
    while size < min(FILE_BYTES, total - written):
      text = texts[index % len(texts)]
      index += 1
      parts.append(text)
      size += len(text.encode())
    data = ''.join(parts).encode()[:min(FILE_BYTES, total - written)]
    data = data[:len(data.decode(errors='ignore').encode())]  # whole characters only
    with open(os.path.join(out_dir, f'part-{number:05d}.txt'), 'wb') as f:
      f.write(data)
    written += len(data)
    number += 1
  eval_dir = out_dir.rstrip('/') + '.eval'
  os.makedirs(eval_dir, exist_ok=True)
  with open(os.path.join(eval_dir, 'eval.txt'), 'w') as f:
    f.write(''.join(texts[-40:])[:400_000])
  print(json.dumps({'corpus': out_dir, 'files': number, 'bytes': written, 'eval_source': eval_dir}), flush=True)


def messages() -> list[tuple[str, str, str]]:
  """(language, English message, its translation) of every gettext catalog of this machine, one line each."""
  clean = lambda text: ' '.join(text.replace('\t', ' ').split())
  return [(language, clean(english(key)), clean(value)) for language, catalog in catalogs()
          for key, value in catalog.items() if key and clean(value)]


def make_records(kind: str, out_dir: str, megabytes: int) -> None:
  """`make --kind=pairs|labels|documents` (module docstring): records cycled with a copy number until
  the file holds `megabytes`, and the small held-out files of the same kind."""
  import collections
  import random
  rows = messages()
  languages = [lang for lang, _ in collections.Counter(language for language, _, _ in rows).most_common(12)]
  by_language = collections.defaultdict(list)
  for language, _, text in rows:
    by_language[language].append(text)
  rng = random.Random(0)

  def records(copy: int):
    if kind == 'pairs':
      yield from (f'{english} {copy}\t{text} {copy}\n' for _, english, text in rows)
    elif kind == 'labels':  # the languages in turn, so that every stretch of the file has them all
      for start in range(0, max(len(by_language[lang]) for lang in languages), 8):
        yield from (f'{" ".join(by_language[lang][start:start + 8])} {copy}\t{lang}\n' for lang in languages
                    if start < len(by_language[lang]))
    else:
      for start in range(0, len(rows), 20):
        lines = [f'{text} {copy}.' for _, _, text in rows[start:start + rng.randint(5, 30)]]
        yield '\n'.join(lines) + '\n\n'

  name = {'pairs': 'pairs.tsv', 'labels': 'labels.tsv', 'documents': 'documents.txt'}[kind]
  eval_dir = out_dir.rstrip('/') + '.eval'
  for directory in (out_dir, eval_dir):
    os.makedirs(directory, exist_ok=True)
  with open(os.path.join(eval_dir, name), 'w') as f:  # a copy number the corpus never reaches
    f.writelines(record for _, record in zip(range(300), (r for r in records(10**9) if rng.random() < 0.01)))
  written, copy = 0, 0
  with open(os.path.join(out_dir, name), 'w') as f:
    while written < megabytes * 1_000_000:
      for record in records(copy):
        f.write(record)
        written += len(record.encode())
        if written >= megabytes * 1_000_000:
          break
      copy += 1
  print(json.dumps({'corpus': os.path.join(out_dir, name), 'bytes': written, 'copies': copy,
                    'eval_source': os.path.join(eval_dir, name)}), flush=True)


# ----------------------------------------------------------------------------- measuring
def tree_rss(root: int) -> int:
  """Resident bytes of process `root` and all its descendants now (the cache's build workers too)."""
  parents = {}
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat') as f:
          parents[int(entry)] = int(f.read().rsplit(')', 1)[1].split()[1])
      except (OSError, IndexError, ValueError):  # exited meanwhile
        pass
  tree, frontier = {root}, [root]
  while frontier:
    children = [pid for pid, parent in parents.items() if parent in frontier]
    tree.update(children)
    frontier = children
  total = 0
  for pid in tree:
    try:
      with open(f'/proc/{pid}/statm') as f:
        total += int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, IndexError, ValueError):
      pass
  return total


def timed(command: list[str], env: dict | None = None) -> dict:
  """Wall seconds, peak RSS (GB) and the last JSON line of a command run under /usr/bin/time -v. The peak
  is the larger of time's (the largest single process) and the process tree's sum sampled every 0.2 s
  (the parent and its build workers together)."""
  started = time.time()
  process = subprocess.Popen(['/usr/bin/time', '-v', *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, **(env or {})})
  tree_peak, finished = [0], threading.Event()

  def sample():
    while not finished.wait(0.2):
      tree_peak[0] = max(tree_peak[0], tree_rss(process.pid))

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  stdout, stderr = process.communicate()
  finished.set()
  sampler.join()
  result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
  seconds = time.time() - started
  if result.returncode:
    raise SystemExit(f'{" ".join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}')
  rss = re.search(r'Maximum resident set size \(kbytes\): (\d+)', result.stderr)
  lines = [line for line in result.stdout.splitlines() if line.startswith('{')]
  builds = re.findall(r'Tokenized .*\(([\d,.]+) MB of text\).* in [\d.]+ s \(([\d.]+) MB/s\)', result.stdout)
  rate = max(builds, key=lambda build: float(build[0].replace(',', '')))[1] if builds else None  # the corpus's
  return {'seconds': round(seconds, 1), 'peak_rss_gb': round(max(int(rss.group(1)) * 1e3, tree_peak[0]) / 1e9, 2),
          'tokenize_mb_per_s': float(rate) if rate else None,
          'result': json.loads(lines[-1]) if lines else None}


def corpus_items(kind: str, path: str, megabytes: int) -> tuple[list[str], int]:
  """The first `megabytes` of a corpus as the items its family encodes, and their bytes: 256 KB pieces of
  the text files (GPT), both sides of each pair (translation), each text (classification), each
  line of the documents (BERT's sentences)."""
  items, size = [], 0
  for name in sorted(glob.glob(path)):
    with open(name, encoding='utf-8') as f:
      while size < megabytes << 20:
        chunk = f.read(256 << 10) if kind == 'text' else f.readline()
        if not chunk:
          break
        parts = {'text': [chunk], 'pairs': chunk.rstrip('\n').split('\t'),
                 'labels': chunk.split('\t')[:1], 'documents': [chunk.strip()]}[kind]
        items += [part for part in parts if part]
        size += sum(len(part.encode()) for part in parts)
  return items, size


def raw_rates(cache_dir: str, kind: str, path: str, megabytes: int = 64) -> dict[str, float]:
  """MB/s of HF tokenizers over `megabytes` of the corpus already in memory, with the tokenizer the first
  run trained, 4 MB of text per call as the caches' batches: `encode_batch` (the issue's yardstick)
  and `encode_batch_fast` (the same ids without character offsets, what the caches call)."""
  sys.path.insert(0, ROOT)
  from data.tokenizers import load_tokenizer
  tokenizers_dir = os.path.join(cache_dir, 'tokenizers-v2')
  trained = [name for name in os.listdir(tokenizers_dir) if os.path.isdir(os.path.join(tokenizers_dir, name))]
  tokenizer = load_tokenizer(os.path.join(tokenizers_dir, trained[0])).tokenizer  # beside it: its .lock
  items, size = corpus_items(kind, path, megabytes)
  batches, batch, batch_bytes = [], [], 0
  for item in items:
    batch.append(item)
    batch_bytes += len(item)
    if batch_bytes >= 4 << 20:
      batches.append(batch)
      batch, batch_bytes = [], 0
  batches += [batch] if batch else []
  rates = {}
  for name in ('encode_batch', 'encode_batch_fast'):
    started = time.time()
    for batch in batches:
      getattr(tokenizer, name)(batch, add_special_tokens=False)
    rates[name] = round(size / 1e6 / (time.time() - started), 2)
  return rates


KINDS = {  # --kind -> (the file make writes, the command's config and settings)
    'text': ('*.txt', ['--config=configs/gpt.py:{preset}', '--config.decode.num_samples=0']),
    'pairs': ('pairs.tsv', ['--config=configs/transformer.py:{preset}', '--config.data.seq_len=64']),
    'labels': ('labels.tsv', ['--config=configs/classifier.py:{preset}', '--config.data.seq_len=128']),
    'documents': ('documents.txt', ['--config=configs/bert.py:{preset}']),
}


def measure(corpus: str, cache_dir: str, preset: str, kind: str = 'text') -> list[dict]:
  name, settings = KINDS[kind]
  scheme = 'text' if kind in ('text', 'documents') else 'tsv'
  held_out = os.path.join(corpus.rstrip('/') + '.eval', 'eval.txt' if kind == 'text' else name)
  sources = [f'--config.data.source={scheme}:{os.path.join(corpus, name)}',
             f'--config.data.eval_source={scheme}:{held_out}'] + (
                 [f'--config.data.test_source={scheme}:{held_out}'] if kind in ('pairs', 'labels') else [])
  common = [sys.executable, 'launch.py', *(s.format(preset=preset) for s in settings),
            '--config.train.eval_every=2', '--config.train.eval_steps=1']
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    workdir = os.path.join(scratch, 'run')
    run = common + [f'--config.data.cache_dir={cache_dir}', f'--workdir={workdir}'] + sources
    shutil.rmtree(cache_dir, ignore_errors=True)
    rows.append({'step': 'first run: build + 2 steps, one command', **timed(run + ['--config.train.steps=2'])})
    rows.append({'step': 'restart +2 steps', **timed(run + ['--config.train.steps=4'])})
    small = os.path.join(scratch, 'small')
    with open(os.path.join(corpus, name) if kind != 'text' else sorted(glob.glob(os.path.join(corpus, name)))[0],
              encoding='utf-8') as f:
      head = f.read(1_000_000)
    os.makedirs(small)
    with open(os.path.join(small, name.replace('*', 'small')), 'w', encoding='utf-8') as f:
      f.write(head[:head.rfind('\n') + 1])
    small_source = f'--config.data.source={scheme}:{os.path.join(small, name.replace("*", "small"))}'
    small_run = common + [f'--config.data.cache_dir={cache_dir}-small', f'--workdir={scratch}/small-run',
                          small_source] + sources[1:]
    shutil.rmtree(f'{cache_dir}-small', ignore_errors=True)
    rows.append({'step': 'first run, 1 MB corpus', **timed(small_run + ['--config.train.steps=2'])})
    rows.append({'step': 'restart +2 steps, 1 MB corpus', **timed(small_run + ['--config.train.steps=4'])})
    raw = raw_rates(cache_dir, kind, os.path.join(corpus, name))
    for rate_name, rate in raw.items():
      rows.append({'step': f'raw tokenizers {rate_name}', 'mb_per_s': rate})
    built = rows[0]['tokenize_mb_per_s']
    rows.append({'step': 'first run\'s build against raw', 'vs_raw': {k: round(built / v, 2) for k, v in raw.items()}})
    if kind == 'text':
      prepared = f'{cache_dir}-prepared'
      shutil.rmtree(prepared, ignore_errors=True)
      prepare = timed(common + [f'--config.data.cache_dir={prepared}', '--mode=prepare'] + sources)
      rows.append({'step': 'prepare', **prepare, 'vs_raw': {rate_name: round(prepare['tokenize_mb_per_s'] / rate, 2)
                                                            for rate_name, rate in raw.items()}})
      rows.append({'step': 'train 2 steps after prepare', **timed(
          common + [f'--config.data.cache_dir={prepared}', f'--workdir={scratch}/after-prepare',
                    '--config.train.steps=2'] + sources)})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('what', choices=('make', 'measure'))
  parser.add_argument('--kind', choices=tuple(KINDS), default='text')
  parser.add_argument('--out_dir')
  parser.add_argument('--megabytes', type=int, default=1000)
  parser.add_argument('--corpus')
  parser.add_argument('--cache_dir', default='/tmp/data-scale-cache')
  parser.add_argument('--preset', default='default')
  args = parser.parse_args()
  if args.what == 'make':
    make_corpus(args.out_dir, args.megabytes) if args.kind == 'text' else make_records(args.kind, args.out_dir,
                                                                                     args.megabytes)
    return
  rows = measure(args.corpus, args.cache_dir, args.preset, args.kind)
  for row in rows:
    print(json.dumps(row), flush=True)
  print('\n| step | wall s | peak RSS GB | MB/s | against raw |\n| --- | --- | --- | --- | --- |')
  for row in rows:
    print(f"| {row['step']} | {row.get('seconds', '')} | {row.get('peak_rss_gb', '')} | "
          f"{row.get('tokenize_mb_per_s') or row.get('mb_per_s') or ''} | {row.get('vs_raw', '')} |")


if __name__ == '__main__':
  main()
