"""Side-by-side speed table: this codebase's --mode=bench against the PyTorch reference scripts.

  python scripts/speed_table.py --reference_dir=/work/shared/reference-bench --rounds=3 [--only=gpt,bert]

Runs, in each round, for each benchmark: ours, then the reference (alternating, so that a shared
machine's drift hits both alike), records the load average before each run, and prints a Markdown
table of medians over the rounds with the ratio ours / reference per round and overall. The
reference scripts need torch + transformers in the same Python (or pass --reference_python).
Raw JSON lines go to --raw (default speed_raw.jsonl).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (our launch arguments, reference script, [(label, our value, reference value)])
BENCHMARKS = {
    'gpt': (['--config=configs/gpt.py:bench', '--bench_decode=false'], 'ref_gpt_train.py',
            [('GPT train tokens/s', lambda o: o['tokens_per_s'], lambda r: r['tokens_per_s']),
             ('GPT train MFU vs same-run matmul probe', lambda o: o['mfu'],
              lambda r: r['mfu_vs_adjacent_probe_w_lmhead'])]),
    'decode': (['--config=configs/gpt.py:bench', '--bench_steps=1'], 'ref_gpt_generate.py',
               [(f'GPT decode tokens/s, batch {b}', lambda o, b=b: o['decode_tokens_per_s'][str(b)],
                 lambda r, b=b: r[b]['new_tokens_per_s']) for b in (1, 8)]),
    'bert': (['--config=configs/bert.py:bench', '--bench_decode=false'], 'ref_bert_train.py',
             [('BERT train tokens/s', lambda o: o['tokens_per_s'], lambda r: r['tokens_per_s'])]),
    'transformer': (['--config=configs/transformer.py:bench', '--bench_decode=false'], 'ref_torch_seq2seq_train.py',
                    [('Transformer train target tokens/s', lambda o: o['tokens_per_s'],
                      lambda r: r['tokens_per_s'])]),
}


def load() -> float:
  with open('/proc/loadavg') as f:
    return float(f.read().split()[0])


def json_lines(command: list[str], cwd: str) -> list[dict]:
  result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  if result.returncode or not lines:
    raise RuntimeError(f'{" ".join(command)} failed:\n{result.stderr[-2000:]}')
  return lines


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--reference_dir', default='/work/shared/reference-bench')
  parser.add_argument('--reference_python', default=sys.executable)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--only', default=','.join(BENCHMARKS))
  parser.add_argument('--bench_steps', type=int, default=12)
  parser.add_argument('--reference_args', default='', help="e.g. '--bind' (pin torch's OpenMP threads)")
  parser.add_argument('--raw', default='speed_raw.jsonl')
  args = parser.parse_args()
  names = args.only.split(',')
  rows = {}  # label -> {'ours': [...], 'ref': [...], 'ratio': [...], 'load': [...]}
  with open(args.raw, 'a') as raw:
    for round_index in range(args.rounds):
      for name in names:
        ours_args, script, metrics = BENCHMARKS[name]
        steps = [a for a in ours_args if a.startswith('--bench_steps')] or [f'--bench_steps={args.bench_steps}']
        load_ours = load()
        ours = json_lines([sys.executable, 'launch.py', '--mode=bench', *ours_args, *steps], REPO)[-1]
        load_ref = load()
        ref_lines = json_lines([args.reference_python, script, *args.reference_args.split()], args.reference_dir)
        ref = {line['batch']: line for line in ref_lines} if name == 'decode' else ref_lines[-1]
        raw.write(json.dumps({'round': round_index, 'name': name, 'ours': ours, 'reference': ref_lines,
                              'load_before': [load_ours, load_ref]}) + '\n')
        raw.flush()
        for label, our_value, ref_value in metrics:
          row = rows.setdefault(label, {'ours': [], 'ref': [], 'ratio': [], 'load': []})
          row['ours'].append(our_value(ours))
          row['ref'].append(ref_value(ref))
          row['ratio'].append(row['ours'][-1] / row['ref'][-1])
          row['load'] += [load_ours, load_ref]
          print(f'round {round_index + 1} {label}: ours {row["ours"][-1]:.1f}, reference {row["ref"][-1]:.1f}, '
                f'ratio {row["ratio"][-1]:.2f} (load {load_ours:.1f} / {load_ref:.1f})', flush=True)
  print('\n| benchmark | ours (median) | reference (median) | ratio per round | median ratio | load avg |')
  print('|---|---|---|---|---|---|')
  for label, row in rows.items():
    print(f'| {label} | {statistics.median(row["ours"]):,.1f} | {statistics.median(row["ref"]):,.1f} | '
          f'{", ".join(f"{r:.2f}" for r in row["ratio"])} | {statistics.median(row["ratio"]):.2f} | '
          f'{min(row["load"]):.1f}-{max(row["load"]):.1f} |')


if __name__ == '__main__':
  main()
