"""CPU time per train step of config variants, alternated in one process (robust on a shared machine).

  python scripts/ab_variants.py --config=configs/gpt.py:bench --rounds=3 \
      --variant=model.attention=jax_nn --variant=model.scan_layers=True --variant=model.remat=dots

Each round benchmarks the base config, then each variant (one `key=value[,key=value]` override set
each), with `train.bench.run_benchmark` (no decoding). Prints per-variant medians of CPU ms per step
and wall ms per step, and their ratio to the base within each round.
"""
import argparse
import ast
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from train.bench import run_benchmark  # noqa: E402


def load_config(spec):
  path, _, preset = spec.partition(':')
  module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))
  return module.get_config(preset) if preset else module.get_config()


def apply(config, overrides):
  for item in filter(None, overrides.split(',')):
    key, value = item.split('=', 1)
    *parents, leaf = key.split('.')
    target = config
    for parent in parents:
      target = target[parent]
    try:
      target[leaf] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      target[leaf] = value
  return config


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', required=True)
  parser.add_argument('--variant', action='append', default=[])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=5)
  args = parser.parse_args()
  names = ['base', *args.variant]
  cpu = {n: [] for n in names}
  wall = {n: [] for n in names}
  for round_index in range(args.rounds):
    for name in names:
      result = run_benchmark(apply(load_config(args.config), '' if name == 'base' else name), steps=args.steps,
                             decode=False)
      cpu[name].append(result['step_cpu_ms'])
      wall[name].append(result['step_ms'])
      print(f'round {round_index + 1} {name}: cpu {result["step_cpu_ms"]:.0f} ms/step, wall {result["step_ms"]:.0f} '
            f'ms/step, compile {result["compile_s"]:.1f} s', flush=True)
  for name in names:
    ratios = [b / v for b, v in zip(cpu['base'], cpu[name])]
    print(f'{name:40s} cpu {statistics.median(cpu[name]):8.0f} ms/step  wall {statistics.median(wall[name]):8.0f} '
          f'ms/step  speed vs base (cpu) {statistics.median(ratios):.3f}')


if __name__ == '__main__':
  main()
