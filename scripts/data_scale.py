"""Data at scale: a generated corpus of any size, and what preparing and training on it cost.

  python scripts/data_scale.py make --out_dir=/tmp/corpus-1g --megabytes=1000
  python scripts/data_scale.py measure --corpus=/tmp/corpus-1g --cache_dir=/tmp/scale-cache

`make` writes text files of ~MEGABYTES in total (10 MB each) from this machine's own text: the
standard library's Python sources and the English and Spanish messages of the gettext catalogs
(/usr/share/locale/*/LC_MESSAGES/*.mo), cycled with a file number so that no two files are equal.
It also writes `<out_dir>.eval/eval.txt`, a small held-out file for data.eval_source.

`measure` runs, each under /usr/bin/time -v (wall time and peak RSS), on the GPT `default`
preset (byte-level BPE, 8,192 ids) with the corpus as data.source and the small file as
data.eval_source:
  raw        HF `tokenizers` encode_batch and encode_batch_fast on 64 MB of the corpus held in
             memory, with the tokenizer that `prepare` trained: the raw rates on these cores
  prepare    launch.py --mode=prepare into a fresh --cache_dir: tokenizer trained on its sample,
             then every shard tokenized; its MB/s against `raw`
  train      launch.py, 2 training steps in a fresh workdir (the cache is there)
  restart    the same command again: resume + 2 more steps
  small      the same 2-step run on a 1 MB corpus, the yardstick for `restart`
and prints one JSON line per step, then a Markdown table.
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_BYTES = 10 << 20


# ----------------------------------------------------------------------------- the corpus
def source_texts() -> list[str]:
  """The machine's own text: standard-library sources and gettext messages (both sides)."""
  sys.path.insert(0, ROOT)
  from data.sources import pystdlib_paths
  root = sysconfig.get_paths()['stdlib']
  texts = []
  for key in pystdlib_paths(root):
    with open(os.path.join(root, key), 'rb') as f:
      texts.append(f.read().decode('utf-8', errors='replace'))
  for path in sorted(glob.glob('/usr/share/locale/*/LC_MESSAGES/*.mo')):
    try:
      with open(path, 'rb') as f:
        catalog = gettext.GNUTranslations(f)._catalog
    except (OSError, UnicodeDecodeError, IndexError, ValueError):  # a few catalogs have malformed headers
      continue
    lines = [f'{key if isinstance(key, str) else key[0]}\n{value}\n' for key, value in catalog.items() if key]
    texts.append(''.join(lines))
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


# ----------------------------------------------------------------------------- measuring
def timed(command: list[str], env: dict | None = None) -> dict:
  """Wall seconds, peak RSS (GB) and the last JSON line of a command run under /usr/bin/time -v."""
  started = time.time()
  result = subprocess.run(['/usr/bin/time', '-v', *command], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
  seconds = time.time() - started
  if result.returncode:
    raise SystemExit(f'{" ".join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}')
  rss = re.search(r'Maximum resident set size \(kbytes\): (\d+)', result.stderr)
  lines = [line for line in result.stdout.splitlines() if line.startswith('{')]
  rate = re.search(r'Tokenized .* in ([\d.]+) s \(([\d.]+) MB/s\)', result.stdout)
  return {'seconds': round(seconds, 1), 'peak_rss_gb': round(int(rss.group(1)) / 1e6, 2),
          'tokenize_mb_per_s': float(rate.group(2)) if rate else None,
          'result': json.loads(lines[-1]) if lines else None}


def raw_rates(tokenizer_dir: str, corpus: str, megabytes: int = 64) -> dict[str, float]:
  """MB/s of HF tokenizers over `megabytes` of the corpus already in memory, in items of 256 KB (as
  the cache's pieces): `encode_batch` (the issue's yardstick) and `encode_batch_fast` (what the
  cache calls: the same ids without character offsets)."""
  sys.path.insert(0, ROOT)
  from data.tokenizers import load_tokenizer
  tokenizer = load_tokenizer(tokenizer_dir).tokenizer
  texts, size = [], 0
  for path in sorted(glob.glob(os.path.join(corpus, '*.txt'))):
    with open(path, encoding='utf-8') as f:
      text = f.read()
    texts += [text[i:i + (256 << 10)] for i in range(0, len(text), 256 << 10)]
    size += len(text.encode())
    if size >= megabytes << 20:
      break
  rates = {}
  for name in ('encode_batch', 'encode_batch_fast'):
    started = time.time()
    for start in range(0, len(texts), 16):  # 4 MB per call, as the cache's batches
      getattr(tokenizer, name)(texts[start:start + 16], add_special_tokens=False)
    rates[name] = round(size / 1e6 / (time.time() - started), 2)
  return rates


def measure(corpus: str, cache_dir: str, preset: str) -> list[dict]:
  eval_source = f"text:{corpus.rstrip('/')}.eval/eval.txt"
  common = [sys.executable, 'launch.py', f'--config=configs/gpt.py:{preset}', f'--config.data.cache_dir={cache_dir}',
            f'--config.data.eval_source={eval_source}', '--config.train.eval_every=2', '--config.train.eval_steps=1',
            '--config.decode.num_samples=0']
  rows = []
  shutil.rmtree(cache_dir, ignore_errors=True)
  prepare = timed(common + [f"--config.data.source=text:{corpus}/*.txt", '--mode=prepare'])
  tokenizers_dir = os.path.join(cache_dir, 'tokenizers')
  tokenizer_dir = os.path.join(tokenizers_dir, os.listdir(tokenizers_dir)[0])
  raw = raw_rates(tokenizer_dir, corpus)
  for name, rate in raw.items():
    rows.append({'step': f'raw tokenizers {name}', 'mb_per_s': rate})
  rows.append({'step': 'prepare', **prepare, 'vs_raw': {name: round(prepare['tokenize_mb_per_s'] / rate, 2)
                                                        for name, rate in raw.items()}})
  with tempfile.TemporaryDirectory() as scratch:
    workdir = os.path.join(scratch, 'run')
    train = common + [f"--config.data.source=text:{corpus}/*.txt", f'--workdir={workdir}']
    rows.append({'step': 'train 2 steps', **timed(train + ['--config.train.steps=2'])})
    rows.append({'step': 'restart +2 steps', **timed(train + ['--config.train.steps=4'])})
    small = os.path.join(scratch, 'small')
    os.makedirs(small)
    with open(os.path.join(small, 'small.txt'), 'w') as f:
      f.write(open(sorted(glob.glob(os.path.join(corpus, '*.txt')))[0], encoding='utf-8').read()[:1_000_000])
    small_run = common + [f"--config.data.source=text:{small}/*.txt", f'--workdir={scratch}/small-run',
                          '--config.train.steps=2']
    timed(small_run)  # its cache and tokenizer, once
    rows.append({'step': 'restart +2 steps, 1 MB corpus', **timed(small_run[:-1] + ['--config.train.steps=4'])})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('what', choices=('make', 'measure'))
  parser.add_argument('--out_dir')
  parser.add_argument('--megabytes', type=int, default=1000)
  parser.add_argument('--corpus')
  parser.add_argument('--cache_dir', default='/tmp/data-scale-cache')
  parser.add_argument('--preset', default='default')
  args = parser.parse_args()
  if args.what == 'make':
    make_corpus(args.out_dir, args.megabytes)
    return
  rows = measure(args.corpus, args.cache_dir, args.preset)
  for row in rows:
    print(json.dumps(row), flush=True)
  print('\n| step | wall s | peak RSS GB | MB/s |\n| --- | --- | --- | --- |')
  for row in rows:
    print(f"| {row['step']} | {row.get('seconds', '')} | {row.get('peak_rss_gb', '')} | "
          f"{row.get('tokenize_mb_per_s') or row.get('mb_per_s') or ''} |")


if __name__ == '__main__':
  main()
