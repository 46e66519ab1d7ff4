"""A training that is a sweep's trial reports its evaluations to the study, whose pruner may stop it.

train/sweep.py starts each trial as a `launch.py` process with the environment variable
`SWEEP_TRIAL` naming the study's storage, the study, the trial, the metric and the pruner. The
training loop (train/loop.py) hands every evaluation during training to `report`: the value of
the sweep's metric goes to the study (`Trial.report`, what Optuna's pruners and the dashboard's
curves read), and when the pruner says so `report` returns the reason to stop. Training then ends
as after early stopping: the step is saved with its metrics and the final evaluation runs, so a
pruned trial keeps a checkpoint that reloads. The trial's user attribute `pruned_at` tells the
sweep to mark it pruned. Without `SWEEP_TRIAL` (every other training) nothing happens.
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings

import jax

from train.multihost import agreed

ENV = 'SWEEP_TRIAL'


def environment(storage: str, study: str, trial_id: int, metric: str, pruner: tuple[str, dict]) -> dict[str, str]:
  """The variable that makes a training process report to trial `trial_id` of `study`."""
  return {ENV: json.dumps({'storage': storage, 'study': study, 'trial_id': trial_id, 'metric': metric,
                           'pruner': list(pruner)})}


def report(step: int, metrics: dict[str, float], last: bool = False) -> str | None:
  """Report `metrics` at `step` to the sweep's trial; why training should stop (pruned), or None.
  The `last` step is reported but never pruned: nothing is left to save. With several processes,
  process 0 reports and every process gets its answer."""
  if not os.environ.get(ENV):
    return None
  pruned = _reporter().report(step, metrics, last) if jax.process_index() == 0 else False
  if agreed(pruned):
    return f'pruned by the sweep ({_reporter().pruner_name} pruner, {_reporter().metric})'
  return None


class _Reporter:

  def __init__(self, spec: dict):
    import optuna
    from train import sweep_study
    warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    self.metric, self.pruner_name = spec['metric'], spec['pruner'][0]
    study = optuna.load_study(study_name=spec['study'], storage=sweep_study.open_storage(spec['storage']),
                              sampler=optuna.samplers.RandomSampler(),  # proposes nothing here
                              pruner=sweep_study.make_pruner(*spec['pruner']))
    # The trial that the sweep's worker asked for and runs this process in; Optuna's pruners read
    # it through a Trial object (its constructor is what study.ask uses).
    self.trial = optuna.trial.Trial(study, spec['trial_id'])

  def report(self, step: int, metrics: dict[str, float], last: bool) -> bool:
    value = metrics.get(self.metric)
    if value is None or not math.isfinite(value):
      return False
    self.trial.report(float(value), step)
    if last or not self.trial.should_prune():
      return False
    self.trial.set_user_attr('pruned_at', step)
    return True


@functools.cache
def _reporter() -> _Reporter:
  return _Reporter(json.loads(os.environ[ENV]))
