"""Time to quality: a recipe against a baseline recipe, in alternating runs on this machine (issue #33).

Two ways to compare, each arm a `launch.py` process with the compilation cache off (neither arm
finds the other's programs) on data prepared once beforehand (`--mode=prepare`: no arm builds a
token cache):

  steps to a target (--steps=N): the baseline trains N steps; its validation loss at step N (the
    evaluation logged during training, `train.eval_steps` batches every `--eval_every` steps) is the
    target. Then, alternating, each arm trains with `train.target='eval/loss<=<that loss>'` and
    `train.stop_at_target=True`; its result line says at which step, after how many seconds (and
    how many without compilation) it first met it. The baseline meets it at step N (or before).
  the same wall clock (--minutes=M): each arm trains for M minutes (`train.max_minutes`: from the
    trainer's start, set-up, compilation, evaluations and the final evaluation's losses included) and
    the metric `--metric` of its final result line is compared. Each arm gets the step count its
    schedule expects at that clock: a schedule that needs none (constant, rsqrt, wsd, whose cooldown
    follows the clock) trains with train.steps=1,000,000 until the clock stops it; one that decays
    over train.steps (cosine, linear) trains the steps it reached in a probe: the arm run first with
    train.max_minutes=M and train.steps=1,000,000 (--probe_minutes: those minutes instead, the steps
    at M fitted to them by least squares), whose result is in the table too. Either way
    train.max_minutes=M caps the run. The table states each arm's method.

  python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=2
  python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=1 \
      --size=model.num_layers=6,model.width=384,model.num_heads=6
  python scripts/time_to_target.py --config=configs/gpt.py:moe --baseline=gpt-dense --steps=400 --rounds=1 --run_through
  python scripts/time_to_target.py --config=configs/transformer.py:default --baseline=transformer-2019 \
      --data=gettext --minutes=10 --metric=test/bleu --rounds=1
  python scripts/time_to_target.py --config=configs/classifier.py:default --baseline=classifier-2019 \
      --minutes=3 --metric=test/accuracy --rounds=2

`--baseline` names one of BASELINES below: the recipe a family's `default` preset had before the
tuned recipes (as `--config.*` overrides of today's preset), or `gpt-dense`, the dense decoder under
a mixture-of-experts preset. With --run_through every arm trains all --steps steps (the target
recorded where first met, not stopping there). Every run's workdir, log and result
line are kept under --out; the table (Markdown) and results.json go there too, with the CPU model
and the load average before each run, and curves.csv: every evaluation during training of every run
(arm, round, step, eval/loss and the run's clock then), the learning curves against steps and seconds.
Both arms apply `--size` and `--set` overrides.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
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
    # The dense decoder a mixture-of-experts preset is built on (configs/gpt.py:moe is `default` with experts).
    'gpt-dense': {'model.moe_experts': 0, 'model.moe_hidden': 0, 'model.moe_router_bias': False},
}
GETTEXT_DIR = '/tmp/gettext'  # scripts/make_gettext_corpus.py's output
CLOCK_SCHEDULES = ('constant', 'rsqrt', 'wsd')  # schedules that need no step count: they run on the clock
UNBOUNDED_STEPS = 1_000_000  # train.steps of a run the clock ends


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


def arm_schedule(config_arg: str, overrides: dict) -> str:
  """The arm's train.schedule: its overrides', else that of the --config preset ('configs/x.py:preset')."""
  if 'train.schedule' in overrides:
    return str(overrides['train.schedule'])
  path, _, preset = config_arg.partition(':')
  if REPO not in sys.path:
    sys.path.insert(0, REPO)  # configs/<family>.py imports configs.base
  spec = importlib.util.spec_from_file_location('arm_config', os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset or 'default').train.schedule


def steps_at(minutes: float, probes: dict[float, int]) -> int:
  """The steps an arm reaches in `minutes` of train.max_minutes, from probes {minutes: steps reached}:
  the probe's at those minutes, else the least-squares line through the probes (its intercept is the
  set-up, compilation and closing evaluations; its slope the steps per minute) at `minutes`."""
  if minutes in probes:
    return probes[minutes]
  if len(probes) < 2:
    raise SystemExit(f'One probe ({next(iter(probes), 0):g} min) cannot tell the set-up time from the step rate: give '
                     f'--probe_minutes two or more (e.g. 1,2), or {minutes:g}, or leave it out.')
  slope, intercept = statistics.linear_regression(list(probes), list(probes.values()))
  if slope <= 0:
    raise SystemExit(f'The probes of {", ".join(f"{m:g}" for m in probes)} minutes reached '
                     f'{", ".join(str(n) for n in probes.values())} steps: no step rate; give longer --probe_minutes.')
  return max(int(intercept + slope * minutes), 1)


def same_clock_plans(args, arms: dict, config: list[str], runs: list[dict]) -> dict[str, dict]:
  """{arm: {'overrides': its train.steps and train.max_minutes, 'method': how they were chosen}} for
  --minutes; the probes' runs are appended to `runs`."""
  plans = {}
  for arm, overrides in arms.items():
    schedule = arm_schedule(args.config, overrides)
    if schedule in CLOCK_SCHEDULES:
      plans[arm] = {'overrides': {'train.max_minutes': args.minutes, 'train.steps': UNBOUNDED_STEPS},
                    'method': f'{schedule} needs no step count: train.steps={UNBOUNDED_STEPS:,}, ended by the clock'}
      continue
    probes = {}
    for minutes in args.probe_minutes or [args.minutes]:
      workdir = os.path.join(args.out, f'probe-{arm}-{minutes:g}min')
      probe = {'train.max_minutes': minutes, 'train.steps': UNBOUNDED_STEPS}
      runs.append(timed_run(args, config, {**overrides, **probe}, workdir, arm, 'probe'))
      probes[minutes] = runs[-1]['step']
    steps = steps_at(args.minutes, probes)
    how = (f'the steps it reached in {args.minutes:g} min' if args.minutes in probes else
           f'fitted at {args.minutes:g} min to the steps it reached in ' +
           ', '.join(f'{m:g} min ({n})' for m, n in probes.items()))
    plans[arm] = {'overrides': {'train.max_minutes': args.minutes, 'train.steps': steps},
                  'method': f'{schedule} decays over train.steps={steps}: {how} with train.steps={UNBOUNDED_STEPS:,} '
                            '(the probe rows)'}
  return plans


def timed_run(args, config: list[str], overrides: dict, workdir: str, arm: str, round_) -> dict:
  """Run one arm in `workdir`: its table row (the load before it, its wall seconds, its result line's
  step, stop and metrics)."""
  load = load_average()
  started = time.time()
  result = launch(config, overrides, workdir, workdir + '.log')
  run = {'arm': arm, 'round': round_, 'workdir': os.path.basename(workdir), 'load': load,
         'wall_s': round(time.time() - started, 1),
         'train.steps': overrides.get('train.steps'), 'stopped': result.get('stopped', ''),
         **{k: v for k, v in result.items() if k.startswith('target/') or k in (args.metric, 'step')}}
  print(json.dumps(run), flush=True)
  return run


CURVE_KEYS = ('eval/loss', 'time/seconds', 'time/seconds_excluding_compile')


def write_curves(out: str, runs: list[dict]) -> str:
  """Write <out>/curves.csv: a row per evaluation during training of each run (its workdir
  <out>/<arm>-<round>, or probe-<arm>-<minutes>min), from its metrics.jsonl; returns the path."""
  path = os.path.join(out, 'curves.csv')
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['arm', 'round', 'step', *CURVE_KEYS])
    for run in runs:
      name = run.get('workdir') or f'{run["arm"]}-{run["round"]}'
      with open(os.path.join(out, name, 'metrics.jsonl')) as rows:
        for row in map(json.loads, rows):
          if all(key in row for key in CURVE_KEYS):
            writer.writerow([run['arm'], run['round'], row['step'], *(row[key] for key in CURVE_KEYS)])
  return path


def logged_at(workdir: str, key: str, step: int) -> float:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return next(m[key] for m in map(json.loads, f) if m['step'] == step and key in m)


def parse_args(argv: list[str] | None):
  """The command line, checked: exactly one of --steps and --minutes, --probe_minutes as a list."""
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
  parser.add_argument('--probe_minutes', default='',
                      help='with --minutes: the minutes of the probes of a schedule that decays over train.steps '
                           '(comma-separated; default: --minutes itself)')
  parser.add_argument('--run_through', action='store_true',
                      help='with --steps: each arm trains all N steps (the target still recorded where first met), '
                           'so the result lines and metrics hold every arm at step N too')
  parser.add_argument('--out', default='runs/time-to-target')
  args = parser.parse_args(argv)
  if bool(args.steps) == bool(args.minutes):
    raise SystemExit('Give exactly one of --steps and --minutes.')
  if args.run_through and not args.steps:
    raise SystemExit('--run_through goes with --steps (a --minutes run always trains to its clock).')
  try:
    args.probe_minutes = [float(m) for m in args.probe_minutes.split(',') if m]
  except ValueError:
    raise SystemExit(f'--probe_minutes={args.probe_minutes!r}: give minutes separated by commas, e.g. 1,2.') from None
  if any(m <= 0 for m in args.probe_minutes):
    raise SystemExit(f'--probe_minutes={args.probe_minutes}: each must be positive.')
  if len(args.probe_minutes) == 1 and args.probe_minutes != [args.minutes]:
    raise SystemExit(f'--probe_minutes={args.probe_minutes[0]:g}: one probe at other minutes than --minutes cannot '
                     'tell the set-up time from the step rate; give two or more (e.g. 1,2), or leave it out.')
  return args


def arm_overrides(args) -> dict[str, dict]:
  """{'baseline' | 'recipe': its overrides}: both on the same data, size and evaluations, without the
  compilation cache, checkpoints or samples; the baseline's recipe on top."""
  common = {**data_overrides(args.data), **parse_overrides(args.size), **parse_overrides(args.set),
            'compile_cache': '', 'train.eval_every': args.eval_every, 'train.eval_steps': args.eval_steps,
            'train.checkpoint_every': 100000, 'decode.num_samples': 0}
  return {'baseline': {**common, **BASELINES[args.baseline]}, 'recipe': dict(common)}


def steps_target(args, config: list[str], arms: dict[str, dict]) -> str | None:
  """With --steps, the target both arms race to: the baseline's validation loss at step N (--target,
  or a run of the baseline now); None with --minutes."""
  if args.steps and args.target:  # the baseline's rerun in the rounds still shows whether it meets it at step N
    return f'eval/loss<={args.target!r}'
  if not args.steps:
    return None
  first = os.path.join(args.out, 'baseline-full')
  launch(config, {**arms['baseline'], 'train.steps': args.steps}, first, first + '.log')
  target = f'eval/loss<={logged_at(first, "eval/loss", args.steps)!r}'
  print(f'target: the baseline\'s {args.steps}-step validation loss, {target}', flush=True)
  return target


def main(argv: list[str] | None = None):
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  arms, config = arm_overrides(args), [f'--config={args.config}']
  print(f'CPU: {cpu_model()}', flush=True)
  launch(config + ['--mode=prepare'], arms['recipe'], None, os.path.join(args.out, 'prepare.log'))
  target = steps_target(args, config, arms)
  runs = []
  plans = same_clock_plans(args, arms, config, runs) if args.minutes else {}
  for round_ in range(args.rounds):
    for arm in ('recipe', 'baseline') if round_ % 2 == 0 else ('baseline', 'recipe'):
      overrides = dict(arms[arm])
      if target:
        # N steps, as the baseline's first run: a schedule's length (cosine's decay, wsd's cooldown) is part
        # of the recipe, so the rerun baseline meets the target at step N, and a recipe that has not met
        # it by then ends with target/met false.
        overrides.update({'train.target': target, 'train.stop_at_target': not args.run_through,
                          'train.steps': args.steps})
      else:
        overrides.update(plans[arm]['overrides'])
      runs.append(timed_run(args, config, overrides, os.path.join(args.out, f'{arm}-{round_}'), arm, round_))
  report(args, target, runs, plans)


def report(args, target, runs, plans=None):
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
    lines += [f'Each arm {args.minutes:g} minutes (train.max_minutes); {args.metric} of the final result line. '
              'Each arm\'s step count:']
    lines += [f'- {arm}: {plan["method"]}' for arm, plan in plans.items()]
    lines += ['', f'| arm | round | load | train.steps | steps | stopped | wall s | {args.metric} |',
              '| --- | --- | --- | ---: | ---: | --- | ---: | ---: |']
    for r in runs:
      lines.append(f'| {r["arm"]} | {r["round"]} | {r["load"]} | {r.get("train.steps")} | {r.get("step")} '
                   f'| {r.get("stopped") or "-"} | {r.get("wall_s")} | {r.get(args.metric)} |')
  text = '\n'.join(lines)
  print(text)
  with open(os.path.join(args.out, 'table.md'), 'w') as f:
    f.write(text + '\n')
  with open(os.path.join(args.out, 'results.json'), 'w') as f:
    json.dump({'target': target, 'runs': runs, 'cpu': cpu_model(),
               'methods': {arm: plan['method'] for arm, plan in (plans or {}).items()}}, f, indent=1)
  write_curves(args.out, runs)


if __name__ == '__main__':
  main()
