"""A sweep's trial as the worker that launched it sees it: its evaluations, read as training logs them.

Training knows nothing of sweeps. The worker (sweeps/runner.py) starts a trial's `launch.py` process
and, while it runs, reads the evaluations it appends to `<trial workdir>/metrics.jsonl`, reports
the sweep's metric at each to the trial's Optuna Trial (`Trial.report`, what pruners and the
dashboard's curves read) and asks the study's pruner (`Trial.should_prune`). When the pruner says
so the worker sends the process SIGTERM, which training takes as a preemption: it saves a
checkpoint at the next step boundary and ends with `"preempted": true`; the worker marks the trial
pruned, and its workdir reloads like any run's (`load_run`) from that checkpoint. The last step
(`train.steps` of the trial's config.json) is reported, never pruned: training ends there anyway,
and a SIGTERM after the training loop would cut its final evaluation short.

A gs:// workdir's metrics.jsonl is uploaded every 30 s (train/metrics.py), so its trials are
reported and pruned that much later.
"""
from __future__ import annotations

import json
import math
import os

import optuna

import storage

METRICS_FILE = 'metrics.jsonl'  # train/metrics.py's file, read here as a trial's output


class Reporter:
  """Reports a running trial's evaluations of `metric` to `trial`, each step once."""

  def __init__(self, study: optuna.Study, trial: optuna.Trial, trial_dir: str, metric: str):
    self.trial, self.trial_dir, self.metric = trial, trial_dir, metric
    # A retry starts with what its earlier attempts reported (and resumes after those steps).
    self.reported = set(next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number
                             ).intermediate_values)
    self._read_size = -1
    self._steps: int | None = None

  def report(self, may_prune: bool) -> dict[str, float] | None:
    """Report the evaluations logged since the last call, in step order; the evaluation (its
    metrics.jsonl line) at which the pruner stops the trial, or None. With `may_prune` False
    the pruner is not asked."""
    for line in self._new_evaluations():
      step, value = line['step'], line[self.metric]
      try:
        self.trial.report(value, step)
      except optuna.exceptions.UpdateFinishedTrialError:
        return None  # another host failed the trial as stale; its retry reports from now on
      self.reported.add(step)
      if may_prune and step < self._total_steps() and self.trial.should_prune():
        return line
    return None

  def _new_evaluations(self) -> list[dict[str, float]]:
    path = storage.path(os.path.join(self.trial_dir, METRICS_FILE))
    try:
      text = path.read_text()
    except FileNotFoundError:
      return []
    if len(text) == self._read_size:
      return []
    self._read_size = len(text)
    lines = []
    for raw in text.splitlines(keepends=True):
      if not raw.endswith('\n'):
        break  # the line being written
      try:
        line = json.loads(raw)
      except ValueError:
        continue
      value = line.get(self.metric)
      if isinstance(value, (int, float)) and math.isfinite(value) and line.get('step') not in self.reported:
        lines.append(line)
    return sorted(lines, key=lambda line: line['step'])

  def _total_steps(self) -> int:
    """train.steps of the trial's config.json (written before its first step); 0 when unreadable,
    so that nothing is pruned."""
    if self._steps is None:
      try:
        self._steps = int(json.loads(storage.path(os.path.join(self.trial_dir, 'config.json')).read_text())
                          ['train']['steps'])
      except (OSError, ValueError, KeyError, TypeError):
        return 0
    return self._steps
