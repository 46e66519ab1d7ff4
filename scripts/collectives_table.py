"""Compile a preset's train step on host CPU devices and print one JSON line: XLA's temporaries
per device and the collectives of the compiled step (train/hlo.py). The step is built as
`--mode=bench` builds it (`train.bench.compile_train_step`).

  python scripts/collectives_table.py configs/gpt.py:gpt2 --devices=8 --mesh=1,8,1 --batch=16 --seq_len=1024
  python scripts/collectives_table.py configs/bert.py:base --devices=8 --mesh=1,8,1 --batch=64 --seq_len=128
  python scripts/collectives_table.py configs/gpt.py:gpt2 --layers=2 --batch=16 --seq_len=1024 --optimizer=muon

Nothing runs and no data is read: the state and batch are abstract (shapes and shardings), dropout
is 0 and the vocabulary is the preset's (`data.vocab_size`, padded as the preset says). `--layers`
overrides the depth (compile time grows with it; the per-layer collectives and temporaries scale
with it). docs/accelerators.md's collectives tables come from this script.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import sys
import time


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('preset', help='configs/<family>.py:<preset>')
  parser.add_argument('--devices', type=int, default=8, help='host CPU devices to fake')
  parser.add_argument('--mesh', default='1,8,1', help='data,fsdp,tensor')
  parser.add_argument('--batch', type=int, required=True)
  parser.add_argument('--seq_len', type=int, required=True)
  parser.add_argument('--layers', type=int, default=0, help='override model.num_layers (0: the preset\'s)')
  parser.add_argument('--top', type=int, default=8, help='largest collectives to list, by bytes per step')
  parser.add_argument('--optimizer', default='', help="train.optimizer (default: the preset's), e.g. muon")
  return parser.parse_args()


def build_config(args):
  path, preset = args.preset.split(':')
  config = importlib.import_module(path[:-3].replace('/', '.')).get_config(preset)
  config.mesh.update(dict(zip(('data', 'fsdp', 'tensor'), (int(n) for n in args.mesh.split(',')))))
  config.train.batch_size, config.data.seq_len = args.batch, args.seq_len
  config.model.dropout = 0.0
  if 'attention_dropout' in config.model:
    config.model.attention_dropout = 0.0
  if args.layers:
    config.model.num_layers = args.layers
  if args.optimizer:
    config.train.optimizer = args.optimizer
  return config


def main():
  args = parse_args()
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.devices}'
  os.environ['JAX_PLATFORMS'] = 'cpu'
  sys.path.insert(0, os.getcwd())
  from train import hlo
  from train.bench import compile_train_step
  config = build_config(args)
  start = time.perf_counter()
  compiled = compile_train_step(config)
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  found = hlo.collectives(text)
  largest = collections.Counter()
  for c in found:
    largest[f'{c.kind} {"+".join(f"{d}{list(s)}" for d, s in c.arrays)}'] += c.bytes_per_step
  print(json.dumps({
      'preset': args.preset, 'optimizer': config.train.optimizer, 'mesh': args.mesh, 'batch': args.batch,
      'seq_len': args.seq_len,
      'layers': config.model.num_layers, 'compile_s': round(compile_s, 1),
      'temp_mb': round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
      'collective_mb': {k: round(v / 2**20, 1) for k, v in hlo.collective_bytes(text).items()},
      'activation_collectives': sum(c.kind in ('all-gather', 'all-reduce', 'reduce-scatter')
                                    and c.leads_with((args.batch, args.seq_len)) for c in found),
      'largest_mb': {k: round(v / 2**20, 1) for k, v in largest.most_common(args.top)},
  }))


if __name__ == '__main__':
  main()
