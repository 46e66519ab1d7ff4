"""What the training loop keeps besides the model: progress, step logs, preemption and saving, the
clock to `train.target` and wsd's cooldown under a wall-clock budget."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from errors import ConfigError, UserError
from train import checkpoint as ckpt
from train import compilation, evaluation, optim
from train.metrics import MetricWriter, reduce_metrics
from train.multihost import agreed
from train.state import TrainState


class TrainingDiverged(UserError):
  """The loss became NaN or inf."""


@dataclasses.dataclass
class Progress:
  """What the loop carries across a resume besides the model: saved in every checkpoint's data item."""
  best_value: float | None = None  # the best `train.best_metric` so far
  best_step: int = 0
  evals_since_best: int = 0  # evaluations without improvement, for `train.early_stopping_patience`
  seconds: float = 0.0  # wall time spent in train_and_evaluate so far, for `train.max_minutes`
  compile_seconds: float = 0.0  # the part of `seconds` spent tracing and compiling (train/compilation.py)
  tokens: int = 0  # token positions of the training batches so far (padding included, as train/tokens_per_s)
  # wsd's cooldown when the wall clock started it (`Cooldown`): its first step and planned length
  cooldown_start: int | None = None
  cooldown_steps: int | None = None
  target: dict[str, float] | None = None  # where `train.target` was first met: step, tokens, seconds, ...

  def record(self, step: int, metrics: dict[str, float], metric: str, mode: str) -> None:
    if metric not in metrics:
      raise UserError(f'train.best_metric={metric!r} is not among the eval metrics {sorted(metrics)}; '
                      f'set it to one of them.')
    value = metrics[metric]
    better = self.best_value is None or (value < self.best_value if mode == 'min' else value > self.best_value)
    if better:
      self.best_value, self.best_step, self.evals_since_best = value, step, 0
    else:
      self.evals_since_best += 1


class Saver:
  """Saves a step's checkpoint (state, input position, progress) at most once per step.

  `items(state)` gives the checkpoint's model and optimizer items (trainer `Setup.checkpoint_items`:
  schedule-free's averaged parameters as the model); `started` and `compile_started` are the
  time.time() and compilation.compile_seconds() when this process's run began."""

  def __init__(self, checkpointer: ckpt.Checkpointer, data_iter, progress: Progress, saved_step: int,
               started: float, compile_started: float = 0.0, items: Callable | None = None):
    self.checkpointer, self.data_iter, self.progress = checkpointer, data_iter, progress
    self.saved_step = saved_step  # the newest checkpoint's step, so that a stop never saves it twice
    self._seconds_before, self._started = progress.seconds, started
    self._compile_before, self._compile_started = progress.compile_seconds, compile_started
    self.items = items or (lambda state: ({'params': state.params, 'extra': state.extra}, state.opt_state))

  def seconds(self) -> float:
    """Wall time of the run so far, over every resume."""
    return self._seconds_before + time.time() - self._started

  def compile_seconds(self) -> float:
    """The part of `seconds()` spent tracing and compiling, over every resume."""
    return self._compile_before + compilation.compile_seconds() - self._compile_started

  def __call__(self, step: int, state: TrainState, metrics: dict[str, float] | None = None) -> None:
    if self.saved_step == step:
      return
    self.saved_step = step
    self.progress.seconds, self.progress.compile_seconds = self.seconds(), self.compile_seconds()
    model, optimizer = self.items(state)
    self.checkpointer.save(step, model, optimizer,
                           {'input': self.data_iter.get_state(), 'progress': dataclasses.asdict(self.progress)},
                           metrics)

  @contextlib.contextmanager
  def on_failure(self, step: int, state: TrainState):
    """Save `step` if the block fails, so its checkpoint outlives a failed evaluation."""
    try:
      yield
    except BaseException:
      self(step, state)
      self.checkpointer.wait()
      raise


class StepLogger:
  """Checks and logs completed steps one step late, so that reading the loss never stalls the device."""

  def __init__(self, train_config, schedule, writer: MetricWriter, checkpoint_dir):
    self.train, self.schedule, self.writer, self.checkpoint_dir = train_config, schedule, writer, checkpoint_dir
    self.pending = None  # (step, scalars, metrics, positions) of the step in flight
    self.last_time = time.time()
    self.positions, self.real_tokens = 0, 0.0  # summed over the steps since the last log line

  def add(self, step: int, scalars, metrics, positions: int) -> None:
    """`positions`: token positions of the step's global batch (padding included)."""
    self.flush()
    self.pending = (step, scalars, metrics, positions)

  def flush(self) -> None:
    """Check and log the pending step; raises on NaN before anything saves its parameters."""
    if self.pending is None:
      return
    step, scalars, metrics, positions = self.pending
    self.pending = None
    scalars = {k: float(v) for k, v in jax.device_get(scalars).items()}
    self.positions += positions
    self.real_tokens += scalars['real_tokens']
    if not np.isfinite(scalars['loss']):
      raise TrainingDiverged(
          f'The loss is {scalars["loss"]} at step {step}. Training stopped; the last good checkpoint in '
          f'{self.checkpoint_dir} is kept. Lower train.lr, raise train.warmup_steps or set train.grad_clip.')
    if step % self.train.log_every == 0 or step == self.train.steps:
      now = time.time()
      elapsed = max(now - self.last_time, 1e-9)
      out = {f'train/{k}': v for k, v in reduce_metrics(jax.device_get(metrics)).items()}
      out.update({'train/loss': scalars['loss'], 'train/grad_norm': scalars['grad_norm'],
                  'train/lr': float(self.schedule(step - 1)), 'train/tokens_per_s': self.positions / elapsed,
                  'train/real_tokens_per_s': self.real_tokens / elapsed})
      self.last_time, self.positions, self.real_tokens = now, 0, 0.0
      self.writer.write(step, out)
      self.writer.progress(step, out)


class PreemptionWatcher:
  """Turns SIGTERM (preemption, `kill`) and Ctrl-C into a stop at a step boundary.

  With several processes, JAX's preemption sync point makes every host stop at the same step
  (the coordination service forwards the notice); on one process a handler sets a flag. A second
  Ctrl-C aborts at once (the last checkpoint is kept). Use it as a context manager: the previous
  handlers come back on exit.
  """

  def __init__(self, log=print):
    self.requested: str | bool = False  # the name of the signal that asked to stop
    self.log = log
    self._previous = {}

  def __enter__(self) -> 'PreemptionWatcher':
    # Several processes stop together only through the sync point, which SIGTERM reaches.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return self

  def __exit__(self, *exc) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)

  def _handler(self, signum, frame):
    if signum == signal.SIGINT and self.requested:
      raise KeyboardInterrupt
    self.requested = signal.Signals(signum).name
    if signum == signal.SIGINT:
      self.log('Ctrl-C: saving a checkpoint at the end of this step (Ctrl-C again aborts without saving).')

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # only multi-process runs need it
      return multihost_utils.reached_preemption_sync_point(step)
    return bool(self.requested)


def budget_spent(train_config, step: int, seconds: float) -> bool:
  """Whether `seconds` of the run exceed `train.max_minutes` (0: no budget). Several processes
  agree on process 0's clock, every `train.log_every` steps."""
  if not train_config.max_minutes or (jax.process_count() > 1 and step % train_config.log_every):
    return False
  return agreed(seconds > 60 * train_config.max_minutes)


def evaluate_during_training(setup, state: TrainState, step: int, progress: Progress, writer: MetricWriter
                             ) -> tuple[dict[str, float], str | None]:
  """Score `train.eval_steps` validation batches at `step`, log them and track the best; returns
  (the metrics, why training should stop early or None)."""
  train = setup.config.train
  metrics = evaluation.evaluate_loss(setup, state, evaluation.batches_during_training(setup))
  progress.record(step, metrics, train.best_metric, train.best_mode)
  writer.write(step, metrics)
  writer.log(f'step {step}: ' + ' '.join(f'{k}={v:.4f}' for k, v in metrics.items()))
  if train.early_stopping_patience and progress.evals_since_best >= train.early_stopping_patience:
    return metrics, (f'early stopping: {train.best_metric} has not improved on {progress.best_value:.4f} '
                     f'(step {progress.best_step}) in {progress.evals_since_best} evaluations')
  return metrics, None


# ============================================================================ a clock to a target
_TARGET = re.compile(r'^\s*([A-Za-z_][\w./-]*)\s*(<=|>=)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$')


@dataclasses.dataclass(frozen=True)
class Target:
  """`train.target`: an evaluation metric, '<=' or '>=', a value."""
  metric: str
  relation: str
  value: float

  def __str__(self) -> str:
    return f'{self.metric}{self.relation}{self.value:g}'

  def met_by(self, metrics: dict[str, float]) -> bool:
    value = metrics.get(self.metric)
    if value is None or not np.isfinite(value):
      return False
    return value <= self.value if self.relation == '<=' else value >= self.value


def parse_target(text: str) -> Target | None:
  """`train.target` ('eval/loss<=3.28'), None for ''; a ConfigError for anything else."""
  if not text:
    return None
  match = _TARGET.match(text)
  if not match:
    raise ConfigError(f"config.train.target={text!r} is not '<metric><=<value>' or '<metric>>=<value>'; "
                      "e.g. --config.train.target='eval/loss<=3.28'.")
  return Target(match[1], match[2], float(match[3]))


def check_target_metric(target: Target | None, text: str, eval_metrics) -> None:
  """A ConfigError unless `target` names one of `eval_metrics`, the names every evaluation logs."""
  if target is not None and target.metric not in eval_metrics:
    raise ConfigError(f'config.train.target={text!r} names {target.metric!r}, which no evaluation logs; this run\'s '
                      f'evaluations log {", ".join(sorted(eval_metrics))}.')


def record_target(target: Target | None, step: int, metrics: dict[str, float], progress: Progress, seconds: float,
                  compile_seconds: float, writer: MetricWriter | None = None) -> bool:
  """At the evaluation of `step` (`metrics`): the first time `target` is met, record where in
  `progress` (step, tokens seen, the run's seconds when the step had finished, those without
  compilation) and log it; returns whether it was met now. `seconds` and `compile_seconds`: the
  run's clock (Saver.seconds) and its compilation time, over every resume."""
  if target is None or progress.target is not None or not target.met_by(metrics):
    return False
  progress.target = {'step': step, 'tokens': progress.tokens, 'seconds': round(seconds, 3),
                     'seconds_excluding_compile': round(seconds - compile_seconds, 3), 'value': metrics[target.metric]}
  if writer is not None:
    writer.write(step, {f'target/{k}': v for k, v in progress.target.items() if k != 'value'})
    writer.log(f'Target {target} met at step {step} ({target.metric}={metrics[target.metric]:.4f}): '
               f'{progress.tokens:,} tokens, {seconds:.1f} s ({seconds - compile_seconds:.1f} s without compilation).')
  return True


def target_results(target: Target | None, progress: Progress) -> dict[str, Any]:
  """The result line's target/...: met or not, and where."""
  if target is None:
    return {}
  if progress.target is None:
    return {'target': str(target), 'target/met': False}
  return {'target': str(target), 'target/met': True,
          **{f'target/{k}': v for k, v in progress.target.items() if k != 'value'}}


# ============================================================================ wsd's cooldown
class Cooldown:
  """Where wsd's cooldown starts and how long it lasts: the last `train.decay_fraction` of
  `train.steps`, unless a wall-clock budget (`train.max_minutes`) will end the run first.

  Then, once `decay_fraction` of the budget is left and the steps that fit in it (at the seconds
  per step measured since this process's first step, evaluations and saves included) end before
  `train.steps`, the cooldown starts at the next step and lasts those steps; the run stops when it
  is over (`finished`), cooled down. The plan is kept in the checkpointed `progress`, so a resume
  continues the same schedule; the trainer writes it into the optimizer state (optim.with_cooldown).
  Several processes take process 0's plan, checked every `train.log_every` steps."""

  def __init__(self, train_config, progress: Progress, start_step: int, seconds: float):
    self.train, self.progress = train_config, progress
    self._first = (start_step, seconds)  # this process's first step and the run's clock then
    self._timed_from: tuple[int, float] | None = None  # after the first step, which compiles
    self._compiled_schedule = None  # (plan, its jitted schedule)

  @property
  def by_clock(self) -> bool:
    return self.progress.cooldown_start is not None

  @property
  def plan(self) -> tuple[int, int]:
    """(first cooldown step, cooldown steps)."""
    if self.by_clock:
      return self.progress.cooldown_start, self.progress.cooldown_steps
    return optim.step_cooldown(self.train)

  def learning_rate(self, count: int) -> float:
    plan = self.plan
    if self._compiled_schedule is None or self._compiled_schedule[0] != plan:  # compiled once per plan
      self._compiled_schedule = plan, jax.jit(optim.learning_rate_schedule(self.train, plan))
    return float(self._compiled_schedule[1](count))

  def check(self, step: int, seconds: float) -> bool:
    """After `step`, at the run's clock `seconds`: whether the cooldown starts now (the plan changed)."""
    t = self.train
    if not t.max_minutes or self.by_clock or (jax.process_count() > 1 and step % t.log_every):
      return False
    if self._timed_from is None:
      self._timed_from = (step, seconds)
    budget = 60 * t.max_minutes
    left = budget - seconds
    plan = np.asarray([-1, -1])
    if left <= t.decay_fraction * budget and step < optim.step_cooldown(t)[0]:
      timed_step, timed_seconds = self._timed_from if step > self._timed_from[0] else self._first
      per_step = (seconds - timed_seconds) / max(step - timed_step, 1)
      fit = max(int(left / max(per_step, 1e-9)), 1)
      if step + fit < t.steps:
        plan = np.asarray([step, fit])
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # only multi-process runs need it
      plan = multihost_utils.broadcast_one_to_all(plan)
    if plan[0] < 0:
      return False
    self.progress.cooldown_start, self.progress.cooldown_steps = int(plan[0]), int(plan[1])
    return True

  def finished(self, step: int) -> bool:
    start, length = self.plan
    return self.by_clock and step >= start + length

  def describe(self) -> str:
    start, length = self.plan
    return (f'Cooldown from step {start} for {length} steps (to step {start + length}, train.decay_shape='
            f'{self.train.decay_shape}): train.decay_fraction={self.train.decay_fraction} of the '
            f'train.max_minutes={self.train.max_minutes} budget is left, and train.steps={self.train.steps} will '
            f'not be reached.')
