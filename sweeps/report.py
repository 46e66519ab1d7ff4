"""A sweep's results, read from its study (sweeps/runner.py): the tables, the plots, the best trial.

  sweep.csv       one row per trial of the budget: status, its overrides, final metrics, seconds, error
  sweep.md        the same as a Markdown table, then the best trial and its command line
  eval_loss.png   eval/loss against step for every trial (from each trial's metrics.jsonl)
  history.png     the metric of every finished trial and the best so far (Optuna's plot)
  importance.png  how much each parameter explains of the metric (Optuna's fANOVA), with 2+ trials ok

Every host of a sweep may write them; they describe the whole study, whichever host ran a trial.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shlex
import warnings

import optuna
from optuna.trial import FrozenTrial, TrialState

import storage

STATUS = {TrialState.COMPLETE: 'ok', TrialState.PRUNED: 'pruned', TrialState.FAIL: 'failed',
          TrialState.RUNNING: 'running', TrialState.WAITING: 'waiting'}


def budget_trials(study: optuna.Study) -> list[FrozenTrial]:
  """The latest attempt at each slot, in slot order: a retry replaces the attempt it retries, and
  a trial opened past the budget (never run) is left out."""
  latest = {}
  for trial in study.get_trials(deepcopy=False):  # in number order: a retry comes after its original
    if 'name' in trial.user_attrs:  # named once its values are proposed; never past the budget
      latest[trial.user_attrs['slot']] = trial
  return [latest[slot] for slot in sorted(latest)]


def _columns(keys: list[str], trials: list[FrozenTrial]) -> tuple[list[str], list[str]]:
  overrides = [k for k in keys if any(k in t.params for t in trials)]
  metrics = sorted({k for t in trials for k in t.user_attrs.get('metrics', {})}, key=lambda k: (k != 'step', k))
  return overrides, metrics


def _format(value) -> str:
  if isinstance(value, float):
    return f'{value:.4g}' if math.isfinite(value) else str(value)
  return '' if value is None else str(value)


def write_results(sweep, study: optuna.Study, workdir: str, command, final: bool = False) -> None:
  """sweep.csv, sweep.md and eval_loss.png; with `final` also Optuna's history and importance plots.
  `command(trial)` is a finished trial's launch.py command line."""
  trials = budget_trials(study)
  overrides, metrics = _columns(sweep.keys, trials)
  header = ['trial', 'status', *overrides, *metrics, 'seconds', 'error']
  rows = [[t.user_attrs['name'], STATUS[t.state], *(t.params.get(k, '') for k in overrides),
           *(t.user_attrs.get('metrics', {}).get(k) for k in metrics), round(t.user_attrs.get('seconds', 0.0), 1),
           t.user_attrs.get('error', '')] for t in trials]
  table = io.StringIO(newline='')  # csv ends rows with \r\n itself; epath's gs:// files take no newline=
  csv.writer(table).writerows([header, *[['' if v is None else v for v in row] for row in rows]])
  storage.path(os.path.join(workdir, 'sweep.csv')).write_bytes(table.getvalue().encode())
  escape = lambda text: _format(text).replace('|', '\\|').replace('\n', ' ')
  counts = [f'{sum(t.state == state for t in trials)} {STATUS[state]}' for state in (TrialState.PRUNED,
            TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING) if any(t.state == state for t in trials)]
  lines = [f'Sweep of `{sweep.config}` ({sum(t.state == TrialState.COMPLETE for t in trials)} of {sweep.n_trials} '
           f'trials ok{"".join(", " + c for c in counts)})', '', '| ' + ' | '.join(header) + ' |',
           '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(escape(v) for v in row) + ' |' for row in rows]
  lines += _best_lines(sweep, study, command)
  storage.path(os.path.join(workdir, 'sweep.md')).write_text('\n'.join(lines) + '\n')
  plot_eval_loss(sweep, trials, workdir)
  if final:
    plot_study(study, sweep.metric, workdir)


def best_trial(study: optuna.Study) -> FrozenTrial | None:
  completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
  return study.best_trial if completed else None


def _best_lines(sweep, study: optuna.Study, command) -> list[str]:
  best = best_trial(study)
  if best is None:
    return []
  return ['', f'Best ({sweep.direction} {sweep.metric}): `{best.user_attrs["name"]}`, {sweep.metric} = '
          f'{_format(best.value)}', '', '    ' + shlex.join(command(best))]


def read_curve(trial_dir: str, metric: str = 'eval/loss') -> tuple[list[int], list[float]]:
  path = storage.path(os.path.join(trial_dir, 'metrics.jsonl'))
  if not path.exists():
    return [], []
  points = {m['step']: m[metric] for m in map(json.loads, path.read_text().splitlines()) if metric in m}
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def _pyplot():
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  return plt


def plot_eval_loss(sweep, trials: list[FrozenTrial], workdir: str) -> str:
  plt = _pyplot()
  figure, axis = plt.subplots(figsize=(7, 4.5))
  for trial in trials:
    steps, losses = read_curve(os.path.join(workdir, trial.user_attrs['name']))
    if steps:
      axis.plot(steps, losses, marker='o', markersize=3, label=trial.user_attrs['name'])
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


def plot_study(study: optuna.Study, metric: str, workdir: str) -> list[str]:
  """history.png and importance.png (Optuna's matplotlib plots); a plot the study cannot make yet
  (importance needs two finished trials that differ) is left out with a note."""
  from optuna.visualization import matplotlib as optuna_plots
  plt = _pyplot()
  written = []
  for name, plot in (('history', optuna_plots.plot_optimization_history),
                     ('importance', optuna_plots.plot_param_importances)):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # "experimental" notices
      try:
        axis = plot(study, target_name=metric)
      except (ValueError, RuntimeError, ZeroDivisionError, ImportError) as e:  # fANOVA needs scikit-learn
        print(f'note: no {name}.png ({" ".join(str(e).split())[:200]})', flush=True)
        continue
    path = os.path.join(workdir, f'{name}.png')
    axis.figure.set_size_inches(7, 4.5)
    axis.figure.tight_layout()
    storage.save_png(axis.figure, path, dpi=110)
    plt.close(axis.figure)
    written.append(path)
  return written
