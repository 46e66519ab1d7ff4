"""Time to quality: a recipe against a baseline recipe, in alternating runs on this machine (issue #33).

Two ways to compare, each arm a `launch.py` process with the compilation cache off (neither arm
finds the other's programs) on data prepared once beforehand (`--mode=prepare`: no arm builds a
token cache):

  steps to a target (--steps=N): the baseline trains N steps; its validation loss at step N (the
    evaluation logged during training, `train.eval_steps` batches every `--eval_every` steps) is the
    target. Then, alternating, each arm trains with `train.target='eval/loss<=<that loss>'` and
    `train.stop_at_target=True`; its result line says at which step, after how many seconds (and
    how many without compilation) it first met it. The baseline meets it at step N (or before).
  the same wall clock (--minutes=M): each arm trains for M minutes (`train.max_minutes`, set-up and
    evaluations included) and the metric `--metric` of its final result line is compared.

  python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=2
  python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=1 \
      --size=model.num_layers=6,model.width=384,model.num_heads=6
  python scripts/time_to_target.py --config=configs/transformer.py:default --baseline=transformer-2019 \
      --data=gettext --minutes=10 --metric=test/bleu --rounds=1

`--baseline` names one of BASELINES below: the recipe a family's `default` preset had before the
tuned recipes (as `--config.*` overrides of today's preset). Every run's workdir, log and result
line are kept under --out; the table (Markdown) and results.json go there too, with the CPU model
and the load average before each run. Both arms apply `--size` and `--set` overrides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The recipes the `default` presets had before issue #33's tuned ones, as overrides of today's
# presets. Everything a tuned preset changes is named, so the baseline is what it was.
BASELINES = {
    'gpt-2019': {  # GPT-2 block, AdamW, warmup + cosine (configs/gpt.py:default before issue #33)
        'train.optimizer': 'adamw', 'train.schedule': 'cosine', 'train.lr': 2e-3, 'train.warmup_steps': 50,
        'train.b1': 0.9, 'train.b2': 0.95, 'train.weight_decay': 0.1, 'train.grad_clip': 1.0,
        'train.end_lr_fraction': 0.1, 'train.z_loss': 0.0, 'train.label_smoothing': 0.0,
        'model.positions': 'learned', 'model.norm': 'layernorm', 'model.mlp': 'gelu', 'model.mlp_hidden': 0,
        'model.num_kv_heads': 0, 'model.use_bias': True, 'model.tie_embeddings': True, 'model.dropout': 0.0,
        'model.qk_norm': False, 'model.logit_softcap': 0.0, 'model.zero_init_out': False,
    },
    'transformer-2019': {  # configs/transformer.py:default before issue #33: the paper's Adam and rsqrt
        'train.optimizer': 'adam', 'train.schedule': 'rsqrt', 'train.lr': 2e-3, 'train.warmup_steps': 200,
        'train.b1': 0.9, 'train.b2': 0.98, 'train.eps': 1e-9, 'train.weight_decay': 0.0, 'train.grad_clip': 0.0,
        'train.z_loss': 0.0, 'train.label_smoothing': 0.1, 'model.dropout': 0.1, 'model.attention_dropout': 0.0,
        'model.pre_norm': False, 'model.qk_norm': False, 'model.zero_init_out': False,
    },
    'classifier-2019': {  # configs/classifier.py:default before issue #33
        'train.optimizer': 'adamw', 'train.schedule': 'linear', 'train.lr': 1e-3, 'train.warmup_steps': 40,
        'train.b1': 0.9, 'train.b2': 0.98, 'train.weight_decay': 0.01, 'train.grad_clip': 1.0,
        'train.end_lr_fraction': 0.0, 'train.z_loss': 0.0, 'train.label_smoothing': 0.0, 'model.dropout': 0.1,
        'model.attention_dropout': 0.0, 'model.pre_norm': True, 'model.qk_norm': False, 'model.zero_init_out': False,
        'model.token_dropout': 0.0,
    },
}
GETTEXT_DIR = '/tmp/gettext'  # scripts/make_gettext_corpus.py's output


def load_average() -> str:
  return open('/proc/loadavg').read().split()[0]


def cpu_model() -> str:
  with open('/proc/cpuinfo') as f:
    model = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  return f'{os.cpu_count()} x {model}'


def parse_overrides(text: str) -> dict[str, str]:
  """'a.b=1,c.d=x' -> {'a.b': '1', 'c.d': 'x'}."""
  return dict(item.split('=', 1) for item in text.split(',') if item)


def data_overrides(name: str) -> dict[str, str]:
  if name == 'builtin':
    return {}
  if name == 'gettext':
    if not os.path.exists(f'{GETTEXT_DIR}/train.tsv'):
      subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'make_gettext_corpus.py'),
                      f'--out_dir={GETTEXT_DIR}'], check=True)
    return {'data.source': f'tsv:{GETTEXT_DIR}/train.tsv', 'data.eval_source': f'tsv:{GETTEXT_DIR}/valid.tsv',
            'data.test_source': f'tsv:{GETTEXT_DIR}/test.tsv'}
  raise SystemExit(f'--data={name!r}: choose builtin or gettext.')


def launch(args, overrides: dict, workdir: str | None, log: str) -> dict:
  """Run launch.py; its final JSON line (a SystemExit naming the log when it fails)."""
  command = [sys.executable, os.path.join(REPO, 'launch.py'), *args,
             *(f'--config.{k}={v}' for k, v in overrides.items())]
  if workdir:
    command.append(f'--workdir={workdir}')
  with open(log, 'w') as out:
    out.write(' '.join(command) + '\n')
    out.flush()
    status = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
  lines = open(log).read().strip().splitlines()
  if status:
    raise SystemExit(f'{" ".join(command)} failed ({status}); see {log}:\n' + '\n'.join(lines[-5:]))
  return json.loads(lines[-1])


def logged_at(workdir: str, key: str, step: int) -> float:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return next(m[key] for m in map(json.loads, f) if m['step'] == step and key in m)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', required=True)
  parser.add_argument('--baseline', required=True, choices=sorted(BASELINES))
  parser.add_argument('--steps', type=int, default=0, help='steps to the baseline\'s N-step validation loss')
  parser.add_argument('--minutes', type=float, default=0.0, help='or: the same wall clock, compare --metric')
  parser.add_argument('--metric', default='test/bleu')
  parser.add_argument('--eval_every', type=int, default=20)
  parser.add_argument('--eval_steps', type=int, default=8)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--size', default='', help='overrides of both arms, e.g. model.num_layers=6,model.width=384')
  parser.add_argument('--set', default='', help='further overrides of both arms')
  parser.add_argument('--data', default='builtin', help='builtin | gettext (scripts/make_gettext_corpus.py)')
  parser.add_argument('--target', type=float, default=0.0,
                      help="with --steps: the baseline's N-step loss from an earlier run's table (skips that run)")
  parser.add_argument('--out', default='runs/time-to-target')
  args = parser.parse_args()
  if bool(args.steps) == bool(args.minutes):
    raise SystemExit('Give exactly one of --steps and --minutes.')
  os.makedirs(args.out, exist_ok=True)
  common = {**data_overrides(args.data), **parse_overrides(args.size), **parse_overrides(args.set),
            'compile_cache': '', 'train.eval_every': args.eval_every, 'train.eval_steps': args.eval_steps,
            'train.checkpoint_every': 100000, 'decode.num_samples': 0, 'decode.prompts': ''}
  arms = {'baseline': {**common, **BASELINES[args.baseline]}, 'recipe': dict(common)}
  config = [f'--config={args.config}']
  print(f'CPU: {cpu_model()}', flush=True)
  launch(config + ['--mode=prepare'], arms['recipe'], None, os.path.join(args.out, 'prepare.log'))

  target = None
  if args.steps and args.target:  # the baseline's rerun below still shows whether it meets it at step N
    target = f'eval/loss<={args.target!r}'
  elif args.steps:
    first = os.path.join(args.out, 'baseline-full')
    launch(config, {**arms['baseline'], 'train.steps': args.steps}, first, first + '.log')
    loss = logged_at(first, 'eval/loss', args.steps)
    target = f'eval/loss<={loss!r}'
    print(f'target: the baseline\'s {args.steps}-step validation loss, {target}', flush=True)
  runs = []
  for round_ in range(args.rounds):
    for arm in ('recipe', 'baseline') if round_ % 2 == 0 else ('baseline', 'recipe'):
      workdir = os.path.join(args.out, f'{arm}-{round_}')
      overrides = dict(arms[arm])
      if target:
        # N steps, as the baseline's first run: a schedule's length (cosine's decay, wsd's cooldown) is part
        # of the recipe, so the rerun baseline meets the target at step N, and a recipe that has not met
        # it by then ends with target/met false.
        overrides.update({'train.target': target, 'train.stop_at_target': True, 'train.steps': args.steps})
      else:
        overrides.update({'train.max_minutes': args.minutes, 'train.steps': 1_000_000})
      load = load_average()
      started = time.time()
      result = launch(config, overrides, workdir, workdir + '.log')
      run = {'arm': arm, 'round': round_, 'load': load, 'wall_s': round(time.time() - started, 1),
             **{k: v for k, v in result.items() if k.startswith('target/') or k in (args.metric, 'step')}}
      runs.append(run)
      print(json.dumps(run), flush=True)
  report(args, target, runs)


def report(args, target, runs):
  by_arm = {arm: [r for r in runs if r['arm'] == arm] for arm in ('recipe', 'baseline')}
  lines = [f'CPU: {cpu_model()}; {args.config} {args.size or ""} {args.set or ""}; baseline {args.baseline}', '']
  if target:
    lines += [f'Target: {target} (the baseline\'s {args.steps}-step validation loss)', '',
              '| arm | round | load | met | step | tokens | seconds | seconds w/o compile |',
              '| --- | --- | --- | --- | ---: | ---: | ---: | ---: |']
    for r in runs:
      lines.append(f'| {r["arm"]} | {r["round"]} | {r["load"]} | {r.get("target/met")} | {r.get("target/step", "-")} '
                   f'| {r.get("target/tokens", "-")} | {r.get("target/seconds", "-")} '
                   f'| {r.get("target/seconds_excluding_compile", "-")} |')
    met = lambda arm, key: [r[key] for r in by_arm[arm] if r.get('target/met')]
    if all(met(arm, 'target/step') for arm in by_arm):
      for key in ('target/step', 'target/seconds', 'target/seconds_excluding_compile'):
        ratio = statistics.median(met('recipe', key)) / statistics.median(met('baseline', key))
        lines.append(f'\nrecipe / baseline, median {key}: {ratio:.3f}')
  else:
    lines += [f'Each arm {args.minutes} minutes; {args.metric} of the final result line', '',
              f'| arm | round | load | steps | {args.metric} |', '| --- | --- | --- | ---: | ---: |']
    for r in runs:
      lines.append(f'| {r["arm"]} | {r["round"]} | {r["load"]} | {r.get("step")} | {r.get(args.metric)} |')
  text = '\n'.join(lines)
  print(text)
  with open(os.path.join(args.out, 'table.md'), 'w') as f:
    f.write(text + '\n')
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump({'target': target, 'runs': runs, 'cpu': cpu_model()}, f, indent=1)


if __name__ == '__main__':
  main()
