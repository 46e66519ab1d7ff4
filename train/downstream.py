"""Tasks beyond the validation loss, scored during training on the current weights (`train.eval_tasks`):
the hook the loop calls, and when it calls it.

Training knows no task harness: evals/ stands above train/ (tests/test_layering.py), so the launcher
builds the scorer (evals/during_training.py: lm-eval tasks) and hands it to
`trainer.train_and_evaluate(config, workdir, downstream=...)`. Its metrics are named
`tasks/<task>/<metric>` and join the evaluation's row (metrics.jsonl, TensorBoard), where
`train.best_metric` and `train.target` may name them.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from flax import nnx

from errors import ConfigError

PREFIX = 'tasks/'  # of every metric a scorer logs


class Downstream(Protocol):
  """A scorer of tasks: `metric_names` (what every scoring logs, known before training starts),
  `describe()` (one line announcing what each scoring scores) and `__call__(model, task, step)`:
  {tasks/<task>/<metric>: value} of `model` (the live nnx model, in eval mode) of the family
  Task `task` at `step`."""
  metric_names: Sequence[str]

  def describe(self) -> str: ...

  def __call__(self, model: nnx.Module, task, step: int) -> dict[str, float]: ...


def enabled(train_config) -> bool:
  """train.eval_tasks names a task (a config saved before the key: no)."""
  return bool(train_config.get('eval_tasks', ''))


def every(train_config) -> int:
  """Steps between scorings: train.eval_tasks_every, 0 = every evaluation (train.eval_every)."""
  return train_config.get('eval_tasks_every', 0) or train_config.eval_every


def due(train_config, step: int, last: bool) -> bool:
  """Whether the evaluation of `step` scores the tasks: every `every` steps and at the run's last
  evaluation (`last`: train.steps, or the wall clock's stop)."""
  return enabled(train_config) and (step % every(train_config) == 0 or last)


def check(config, downstream: Downstream | None) -> None:
  """A ConfigError unless a scorer comes with train.eval_tasks (and only then), and train.best_metric,
  when it names a task metric, is one the scorer logs."""
  train = config.train
  if enabled(train) and downstream is None:
    raise ConfigError(f'config.train.eval_tasks={train.eval_tasks!r} needs the task scorer evals/ builds: train with '
                      'launch.py, or pass train_and_evaluate(..., downstream=evals.during_training.'
                      'TrainingTasks(config, workdir)).')
  names = list(downstream.metric_names) if downstream is not None and enabled(train) else []
  if train.best_metric.startswith(PREFIX) and train.best_metric not in names:
    raise ConfigError(f'config.train.best_metric={train.best_metric!r} is no metric of train.eval_tasks; they log '
                      f'{", ".join(names) or "nothing (train.eval_tasks is empty)"}.')
