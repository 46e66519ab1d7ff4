"""LoRA against full fine-tuning of one trained GPT run on another text: each arm a `launch.py` run
from `--base` (`config.init_from`) with the same data, steps, optimizer, schedule and evaluations.

  python scripts/lora_vs_full.py --base=RUN --text='/tmp/gettext_en/*.txt' [--steps=120] [--lr=2e-3] [--lora_lr=2e-2]
      [--set=a.b=1,...]

Arms, in this order: full (every weight trained), lora-qv (rank --rank on q and v, the LoRA paper's
default), lora-all (rank --rank on every projection: q, k, v, o, up, down). All use AdamW (Muon, the `default` preset's
optimizer, orthogonalises whole weight matrices and is refused for adapters) at --lr for the full arm
and --lora_lr for the adapters (by default 10x --lr: the ratio of the best LoRA to the best full
fine-tuning learning rate that Schulman et al., "LoRA Without Regret", Thinking Machines 2025, found
across ranks with the adapters scaled by alpha / rank), the preset's wsd schedule over --steps, `train.eval_every=--eval_every` with `train.eval_steps=--eval_steps`.
Reported per arm: the validation loss at each evaluation (curves.csv: step, seconds, loss), the
loss at the last step, the loss at the same seconds (each arm's curve at the smallest of the arms'
last-evaluation seconds, linearly interpolated), trained parameters and optimizer-state bytes (the
run's "Training state" line, train/state.py `describe_sizes`), the last checkpoint's bytes on disk,
and the median train tokens/s of the logged steps. Results go to --out: results.json, curves.csv and
each run's workdir and log.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {'full': {}, 'lora-qv': {'train.lora_targets': 'q,v'},
        'lora-all': {'train.lora_targets': 'q,k,v,o,up,down'}}
STATE_LINE = re.compile(r'Training state: ([\d,]+) trained parameters \(([\d,.]+) MiB\), ([\d,]+) frozen '
                        r'\(([\d,.]+) MiB\), optimizer state ([\d,]+) values \(([\d,.]+) MiB\)')


def run_arm(args, arm: str) -> dict:
  workdir = os.path.join(args.out, arm)
  overrides = {'init_from': os.path.abspath(args.base), 'data.source': f'text:{args.text}', 'compile_cache': '',
               'train.optimizer': 'adamw', 'train.lr': args.lr if arm == 'full' else args.lora_lr,
               'train.steps': args.steps,
               'train.eval_every': args.eval_every, 'train.eval_steps': args.eval_steps,
               'train.checkpoint_every': 100000, 'decode.num_samples': 0,
               **dict(item.split('=', 1) for item in args.set.split(',') if item), **ARMS[arm]}
  if arm != 'full':
    overrides['train.lora_rank'] = args.rank
  command = [sys.executable, os.path.join(REPO, 'launch.py'), f'--config={args.config}', f'--workdir={workdir}',
             *(f'--config.{k}={v}' for k, v in overrides.items())]
  log = workdir + '.log'
  with open(log, 'w') as out:
    out.write(' '.join(command) + '\n')
    out.flush()
    if subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode:
      raise SystemExit(f'{arm} failed; see {log}')
  text = open(log).read()
  sizes = STATE_LINE.search(text)
  number = lambda i: float(sizes[i].replace(',', ''))
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  curve = [(r['step'], r['time/seconds'], r['eval/loss']) for r in rows if 'eval/loss' in r and 'time/seconds' in r]
  rates = [r['train/tokens_per_s'] for r in rows if 'train/tokens_per_s' in r]
  checkpoints = os.path.join(workdir, 'checkpoints')
  last = max((d for d in os.listdir(checkpoints) if d.isdigit()), key=int)
  checkpoint_bytes = sum(os.path.getsize(os.path.join(root, name))
                         for root, _, names in os.walk(os.path.join(checkpoints, last)) for name in names)
  return {'arm': arm, 'lr': overrides['train.lr'], 'trained_parameters': int(number(1)), 'optimizer_state_mib': number(6),
          'checkpoint_bytes': checkpoint_bytes, 'median_tokens_per_s': round(statistics.median(rates), 1),
          'last_step': curve[-1][0], 'last_loss': curve[-1][2], 'last_seconds': curve[-1][1], 'curve': curve,
          'result': json.loads(text.strip().splitlines()[-1])}


def loss_at(curve: list[tuple], seconds: float) -> float | None:
  """The curve's validation loss at `seconds` of the run's clock, linearly interpolated; None before
  its first evaluation."""
  if seconds < curve[0][1]:
    return None
  for (_, s0, l0), (_, s1, l1) in zip(curve, curve[1:]):
    if s0 <= seconds <= s1:
      return l0 + (l1 - l0) * (seconds - s0) / (s1 - s0)
  return curve[-1][2]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--base', required=True, help='the trained GPT run to fine-tune')
  parser.add_argument('--text', required=True, help="the fine-tuning text, a glob: '/tmp/gettext_en/*.txt'")
  parser.add_argument('--config', default='configs/gpt.py:default')
  parser.add_argument('--steps', type=int, default=120)
  parser.add_argument('--lr', type=float, default=2e-3)
  parser.add_argument('--lora_lr', type=float, default=None, help='the LoRA arms\' learning rate (default 10 x --lr)')
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--eval_every', type=int, default=20)
  parser.add_argument('--eval_steps', type=int, default=8)
  parser.add_argument('--set', default='', help='further overrides of every arm: a.b=1,c.d=x')
  parser.add_argument('--out', default='runs/lora-vs-full')
  args = parser.parse_args(argv)
  args.lora_lr = 10 * args.lr if args.lora_lr is None else args.lora_lr
  os.makedirs(args.out, exist_ok=True)
  results = [run_arm(args, arm) for arm in ARMS]
  same_seconds = min(r['last_seconds'] for r in results)
  for r in results:
    loss = loss_at(r['curve'], same_seconds)
    r['loss_at_same_seconds'] = None if loss is None else round(loss, 4)
    r['same_seconds'] = same_seconds
    print(json.dumps({k: v for k, v in r.items() if k not in ('curve', 'result')}), flush=True)
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(args.out, 'curves.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['arm', 'step', 'seconds', 'eval_loss'])
    writer.writerows([r['arm'], *point] for r in results for point in r['curve'])


if __name__ == '__main__':
  main()
