"""Side-by-side speed table: this codebase's --mode=bench against the PyTorch reference scripts.

  python scripts/speed_table.py --reference_dir=/work/shared/reference-bench --rounds=3 [--only=gpt,bert]
  python scripts/speed_table.py --rounds=3 --only=llama,llama-decode   # Llama-style vs HF LlamaForCausalLM
  python scripts/speed_table.py --gpu --reference_dir=.gpu --rounds=2      # on one GPU: ../shared/gpu-bench

`--gpu` runs the GPU table (GPT-2 124M and BERT-base in bf16, the shapes of ../shared/gpu-bench)
instead of the CPU one; both sides run in this one process tree, one after the other, so a device
call of at most 10 minutes holds a round (`--only` splits the work across calls).

Runs, in each round, for each benchmark: ours, then the reference (alternating, so that a shared
machine's drift hits both alike), records the load average before each run, and prints a Markdown
table of medians over the rounds with the ratio ours / reference per round and overall. The
reference scripts need torch + transformers in the same Python (or pass --reference_python).
Raw JSON lines are appended to --raw (default measurements/speed_raw.jsonl, beside the rounds before).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (our launch arguments, reference command (script first), [(label, our value, reference value)]);
# a reference value is read from the list of JSON lines the reference script printed.
def _line(lines, **match):
  return next(line for line in lines if all(line.get(k) == v for k, v in match.items()))


_REF_LLAMA = os.path.join(REPO, 'scripts', 'ref_llama.py')  # in this repository, not the shared reference dir
CPU_BENCHMARKS = {
    'gpt': (['--config=configs/gpt.py:bench', '--bench_decode=false'], ['ref_gpt_train.py'],
            [('GPT train tokens/s', lambda o: o['tokens_per_s'], lambda r: r[-1]['tokens_per_s']),
             ('GPT train MFU vs same-run matmul probe', lambda o: o['mfu'],
              lambda r: r[-1]['mfu_vs_adjacent_probe_w_lmhead'])]),
    'decode': (['--config=configs/gpt.py:bench', '--bench_steps=1'], ['ref_gpt_generate.py'],
               [(f'GPT decode tokens/s, batch {b}', lambda o, b=b: o['decode_tokens_per_s'][str(b)],
                 lambda r, b=b: _line(r, batch=b)['new_tokens_per_s']) for b in (1, 8)]),
    # The Llama-style decoder against HF LlamaForCausalLM at the same shapes (scripts/ref_llama.py).
    'llama': (['--config=configs/gpt.py:llama-bench', '--bench_decode=false'], [_REF_LLAMA, 'train'],
              [('Llama train tokens/s', lambda o: o['tokens_per_s'], lambda r: r[-1]['tokens_per_s'])]),
    'llama-decode': (['--config=configs/gpt.py:llama-bench', '--bench_steps=1'], [_REF_LLAMA, 'generate'],
                     [(f'Llama decode tokens/s, batch {b}', lambda o, b=b: o['decode_tokens_per_s'][str(b)],
                       lambda r, b=b: _line(r, batch=b)['new_tokens_per_s']) for b in (1, 8)]),
    'bert': (['--config=configs/bert.py:bench', '--bench_decode=false'], ['ref_bert_train.py'],
             [('BERT train tokens/s', lambda o: o['tokens_per_s'], lambda r: r[-1]['tokens_per_s'])]),
    'transformer': (['--config=configs/transformer.py:bench', '--bench_decode=false'], ['ref_torch_seq2seq_train.py'],
                    [('Transformer train target tokens/s', lambda o: o['tokens_per_s'],
                      lambda r: r[-1]['tokens_per_s'])]),
}
# The GPU table of ../shared/gpu-bench/README.md: bf16 compute, float32 parameters, dropout 0.
_GPU = ['--config.model.dtype=bfloat16', '--config.model.dropout=0.0']
GPU_BENCHMARKS = {
    'gpt': (['--config=configs/gpt.py:gpt2', *_GPU, '--config.train.batch_size=16', '--bench_decode=false'],
            ['ref_torch_gpt.py', '--batch', '16', '--seq', '1024', '--which', 'nanogpt,hf'],
            [('GPT-2 124M train tokens/s, 16 x 1024 (vs nanoGPT-style + torch.compile)', lambda o: o['tokens_per_s'],
              lambda r: _line(r, bench='train_nanogpt_compile_bf16')['tokens_per_s']),
             ('GPT-2 124M train tokens/s, 16 x 1024 (vs HF GPT2LMHeadModel + torch.compile)',
              lambda o: o['tokens_per_s'], lambda r: _line(r, bench='train_hf_gpt2_compile_bf16')['tokens_per_s']),
             ('GPT-2 124M init compile s (vs first torch step s)', lambda o: o['init_s'],
              lambda r: _line(r, bench='train_nanogpt_compile_bf16')['first_step_s'])]),
    'decode': (['--config=configs/gpt.py:gpt2', *_GPU, '--config.decode.max_new_tokens=128', '--bench_steps=1'],
               ['ref_torch_gpt.py', '--which', 'generate', '--new', '128'],
               [(f'GPT-2 124M greedy decode new tokens/s, batch {b} (vs HF generate)',
                 lambda o, b=b: o['decode_tokens_per_s'][str(b)],
                 lambda r, b=b: _line(r, bench='generate_hf_bf16')['new_tokens_per_s'][str(b)]) for b in (1, 8)]),
    'bert': (['--config=configs/bert.py:base', *_GPU, '--config.model.attention_dropout=0.0',
              '--config.train.batch_size=64', '--config.data.seq_len=128', '--config.data.max_predictions=20',
              '--bench_decode=false'],
             ['ref_torch_bert.py'],
             [('BERT-base MLM+NSP train tokens/s, 64 x 128 (vs HF BertForPreTraining + torch.compile)',
               lambda o: o['tokens_per_s'], lambda r: r[-1]['tokens_per_s'])]),
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
  parser.add_argument('--gpu', action='store_true', help='the GPU table (GPT-2 124M, BERT-base, bf16)')
  parser.add_argument('--reference_dir', default=None,
                      help='default: /work/shared/reference-bench (CPU), /work/shared/gpu-bench (--gpu)')
  parser.add_argument('--reference_python', default=sys.executable)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--only', default='', help='comma-separated benchmark names (default: all)')
  parser.add_argument('--bench_steps', type=int, default=12)
  parser.add_argument('--reference_args', default='', help="e.g. '--bind' (pin torch's OpenMP threads)")
  parser.add_argument('--raw', default=os.path.join(REPO, 'measurements', 'speed_raw.jsonl'))
  args = parser.parse_args()
  benchmarks = GPU_BENCHMARKS if args.gpu else CPU_BENCHMARKS
  reference_dir = args.reference_dir or ('/work/shared/gpu-bench' if args.gpu else '/work/shared/reference-bench')
  names = args.only.split(',') if args.only else list(benchmarks)
  unknown = sorted(set(names) - set(benchmarks))
  if unknown:
    parser.error(f'--only: unknown {unknown}; choose from {sorted(benchmarks)}')
  rows = {}  # label -> {'ours': [...], 'ref': [...], 'ratio': [...], 'load': [...]}
  with open(args.raw, 'a') as raw:
    for round_index in range(args.rounds):
      for name in names:
        ours_args, reference, metrics = benchmarks[name]
        steps = [a for a in ours_args if a.startswith('--bench_steps')] or [f'--bench_steps={args.bench_steps}']
        load_ours = load()
        ours = json_lines([sys.executable, 'launch.py', '--mode=bench', *ours_args, *steps], REPO)[-1]
        load_ref = load()
        ref_lines = json_lines([args.reference_python, *reference, *args.reference_args.split()], reference_dir)
        raw.write(json.dumps({'round': round_index, 'name': name, 'ours': ours, 'reference': ref_lines,
                              'load_before': [load_ours, load_ref]}) + '\n')
        raw.flush()
        for label, our_value, ref_value in metrics:
          row = rows.setdefault(label, {'ours': [], 'ref': [], 'ratio': [], 'load': []})
          row['ours'].append(our_value(ours))
          row['ref'].append(ref_value(ref_lines))
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
