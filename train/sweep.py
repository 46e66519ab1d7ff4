"""Sweeps: run a grid or a list of config overrides as trials, one after another, and tabulate them.

  python launch.py --sweep=configs/sweeps/gpt_lr.py --workdir=runs/sweep
  python launch.py --sweep=configs/sweeps/gpt_lr.py --sweep_dry_run      # print the commands only
  python launch.py --sweep=configs/sweeps/gpt_lr.py --config.train.steps=100   # applies to every trial

A sweep file defines `get_sweep()` returning a dict:
  config     the --config argument of every trial, e.g. 'configs/gpt.py:tiny' (a --config flag given
             with --sweep replaces it)
  overrides  {key: value} for every trial (optional)
  grid       {key: [values, ...]}: one trial per combination (optional)
  trials     [{key: value, ...}, ...]: further trials, each its own overrides (optional)

Each trial is `python launch.py --config=... --workdir=<workdir>/<trial> --config.<key>=<value> ...`
in its own process (a crash, OOM or bad config ends that trial only; its log is in
<workdir>/logs/<trial>.log). Overrides apply in the order: the sweep's `overrides`, --config.*
flags of the sweep command, the trial's own values. Rerunning a sweep resumes every trial from
its checkpoints. Results, rewritten after every trial:
  sweep.csv     one row per trial: status, overrides, final metrics, error, seconds
  sweep.md      the same as a Markdown table
  eval_loss.png eval/loss against step for every trial (from each trial's metrics.jsonl)
"""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any

import storage
from errors import UserError

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch.py')


class SweepError(UserError):
  """A malformed sweep file; the message names the fix."""


@dataclasses.dataclass
class Trial:
  name: str
  own: dict[str, Any]  # this trial's values (the table's columns)
  common: dict[str, Any]  # the sweep's `overrides`, for every trial
  status: str = 'pending'  # 'ok' | 'failed'
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  error: str = ''
  seconds: float = 0.0


@dataclasses.dataclass
class Sweep:
  config: str
  trials: list[Trial]


def trial_name(index: int, overrides: dict[str, Any]) -> str:
  """'03-lr=0.001-width=64': the index keeps names unique, the last key component keeps them short."""
  parts = [f'{key.split(".")[-1]}={value}' for key, value in overrides.items()]
  return re.sub(r'[^A-Za-z0-9_.=+-]', '_', '-'.join([f'{index:02d}', *parts]))[:120]


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
  """The trials' own overrides: every combination of `grid`, then each entry of `trials`."""
  unknown = set(spec) - {'config', 'overrides', 'grid', 'trials'}
  if unknown:
    raise SweepError(f'Unknown sweep keys {sorted(unknown)}; use config, overrides, grid, trials.')
  grid = spec.get('grid') or {}
  for key, values in grid.items():
    if not isinstance(values, (list, tuple)) or not values:
      raise SweepError(f'grid[{key!r}] must be a non-empty list of values, got {values!r}.')
  combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else []
  extra = spec.get('trials') or []
  if not all(isinstance(t, dict) for t in extra):
    raise SweepError('`trials` must be a list of dicts of overrides, e.g. [{"train.lr": 1e-3}].')
  trials = combos + [dict(t) for t in extra]
  if not trials:
    raise SweepError('The sweep defines no trials: give a non-empty `grid` or `trials`.')
  return trials


def load_sweep(path: str, config: str | None = None) -> Sweep:
  """Read a sweep file; `config` (the --config flag) replaces the file's `config`."""
  if not os.path.exists(path):
    raise SweepError(f'--sweep={path} does not exist; sweep files live in configs/sweeps/.')
  spec_loader = importlib.util.spec_from_file_location('_sweep', path)
  module = importlib.util.module_from_spec(spec_loader)
  spec_loader.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise SweepError(f'{path} must define get_sweep() returning a dict (see train/sweep.py).')
  spec = module.get_sweep()
  config = config or spec.get('config')
  if not config:
    raise SweepError(f"{path}: get_sweep() has no 'config' (e.g. 'configs/gpt.py:tiny') and no --config was given.")
  common = dict(spec.get('overrides') or {})
  return Sweep(config=config, trials=[Trial(trial_name(i, own), own, common) for i, own in enumerate(expand(spec))])


def trial_command(sweep: Sweep, trial: Trial, workdir: str, extra_args: list[str] = ()) -> list[str]:
  common = [f'--config.{k}={v}' for k, v in trial.common.items()]
  own = [f'--config.{k}={v}' for k, v in trial.own.items()]
  return [sys.executable, LAUNCH, f'--config={sweep.config}', f'--workdir={os.path.join(workdir, trial.name)}',
          *common, *extra_args, *own]


def _error_line(stderr: str, returncode: int) -> str:
  lines = [line.strip() for line in stderr.splitlines() if line.strip()]
  for line in reversed(lines):
    if line.startswith('error:'):
      return line[len('error:'):].strip()
  return lines[-1] if lines else f'exit status {returncode}'


def _last_json(stdout: str) -> dict | None:
  lines = stdout.strip().splitlines()
  try:
    return json.loads(lines[-1]) if lines else None
  except ValueError:
    return None


def run_trial(sweep: Sweep, trial: Trial, workdir: str, extra_args: list[str] = (), env: dict | None = None) -> None:
  """Run one trial to completion in its own process; fills trial.status/metrics/error."""
  start = time.time()
  result = subprocess.run(trial_command(sweep, trial, workdir, extra_args), capture_output=True, text=True, env=env)
  trial.seconds = time.time() - start
  log = storage.path(os.path.join(workdir, 'logs', f'{trial.name}.log'))
  log.parent.mkdir(parents=True, exist_ok=True)
  log.write_text(result.stdout + '\n--- stderr ---\n' + result.stderr)
  final = _last_json(result.stdout) if result.returncode == 0 else None
  if final is None:
    trial.status = 'failed'
    trial.error = _error_line(result.stderr, result.returncode) if result.returncode else 'no final JSON line'
    return
  trial.status = 'ok'
  trial.metrics = {k: v for k, v in final.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != 'mode'}


def run_sweep(sweep: Sweep, workdir: str, *, dry_run: bool = False, extra_args: list[str] = (),
              env: dict | None = None) -> list[Trial]:
  """Run (or with `dry_run` print) every trial; writes sweep.csv, sweep.md and eval_loss.png."""
  if dry_run:
    for trial in sweep.trials:
      print(shlex.join(trial_command(sweep, trial, workdir, extra_args)), flush=True)
    return sweep.trials
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  for i, trial in enumerate(sweep.trials):
    print(f'[{i + 1}/{len(sweep.trials)}] {trial.name} ...', flush=True)
    run_trial(sweep, trial, workdir, extra_args, env)
    outcome = (f'eval/loss={trial.metrics["eval/loss"]:.4f}' if 'eval/loss' in trial.metrics else
               trial.status if trial.status == 'ok' else f'FAILED: {trial.error}')
    print(f'    {outcome} ({trial.seconds:.0f} s)', flush=True)
    write_results(sweep, workdir)
  print(f'Results: {os.path.join(workdir, "sweep.md")}, sweep.csv, eval_loss.png', flush=True)
  return sweep.trials


def _columns(sweep: Sweep) -> tuple[list[str], list[str]]:
  override_keys = list(dict.fromkeys(k for t in sweep.trials for k in t.own))
  metric_keys = sorted({k for t in sweep.trials for k in t.metrics}, key=lambda k: (k != 'step', k))
  return override_keys, metric_keys


def _format(value) -> str:
  if isinstance(value, float):
    return f'{value:.4g}' if math.isfinite(value) else str(value)
  return '' if value is None else str(value)


def write_results(sweep: Sweep, workdir: str) -> None:
  overrides, metrics = _columns(sweep)
  header = ['trial', 'status', *overrides, *metrics, 'seconds', 'error']
  rows = [[t.name, t.status, *(t.own.get(k, '') for k in overrides), *(t.metrics.get(k) for k in metrics),
           round(t.seconds, 1), t.error] for t in sweep.trials]
  table = io.StringIO(newline='')  # csv ends rows with \r\n itself; epath's gs:// files take no newline=
  writer = csv.writer(table)
  writer.writerow(header)
  writer.writerows([['' if v is None else v for v in row] for row in rows])
  storage.path(os.path.join(workdir, 'sweep.csv')).write_bytes(table.getvalue().encode())
  escape = lambda text: _format(text).replace('|', '\\|').replace('\n', ' ')
  lines = [f'Sweep of `{sweep.config}` ({sum(t.status == "ok" for t in sweep.trials)} of {len(sweep.trials)} '
           f'trials ok)', '', '| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(escape(v) for v in row) + ' |' for row in rows]
  storage.path(os.path.join(workdir, 'sweep.md')).write_text('\n'.join(lines) + '\n')
  plot_eval_loss(sweep, workdir)


def read_curve(trial_dir: str, metric: str = 'eval/loss') -> tuple[list[int], list[float]]:
  path = storage.path(os.path.join(trial_dir, 'metrics.jsonl'))
  if not path.exists():
    return [], []
  points = {m['step']: m[metric] for m in map(json.loads, path.read_text().splitlines()) if metric in m}
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def plot_eval_loss(sweep: Sweep, workdir: str) -> str:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  figure, axis = plt.subplots(figsize=(7, 4.5))
  for trial in sweep.trials:
    steps, losses = read_curve(os.path.join(workdir, trial.name))
    if steps:
      axis.plot(steps, losses, marker='o', markersize=3, label=trial.name)
  axis.set_xlabel('step')
  axis.set_ylabel('eval/loss')
  axis.set_title(f'Sweep of {sweep.config}')
  if axis.lines:
    axis.legend(fontsize=7)
  axis.grid(alpha=0.3)
  figure.tight_layout()
  path = os.path.join(workdir, 'eval_loss.png')
  storage.save_png(figure, path, dpi=110)
  plt.close(figure)
  return path


def run_sweep_from_flags(flags, argv: list[str]) -> list[Trial]:
  """launch.py --sweep: the sweep file, --workdir, --sweep_dry_run, and --config / --config.* flags."""
  config = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  extra = [a for a in argv if a.startswith('--config.')]
  sweep = load_sweep(flags.sweep, config)
  name = os.path.splitext(os.path.basename(flags.sweep))[0]
  workdir = flags.workdir or os.path.join('runs', f'sweep-{name}-{time.strftime("%Y%m%d-%H%M%S")}')
  return run_sweep(sweep, workdir, dry_run=flags.sweep_dry_run, extra_args=extra)
