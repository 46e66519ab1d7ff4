"""What the training loop keeps besides the model: progress, step logs, preemption and saving."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time

import jax
import numpy as np

from errors import UserError
from train import checkpoint as ckpt
from train import evaluation
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
  """Saves a step's checkpoint (state, input position, progress) at most once per step."""

  def __init__(self, checkpointer: ckpt.Checkpointer, data_iter, progress: Progress, saved_step: int,
               started: float):
    self.checkpointer, self.data_iter, self.progress = checkpointer, data_iter, progress
    self.saved_step = saved_step  # the newest checkpoint's step, so that a stop never saves it twice
    self._seconds_before, self._started = progress.seconds, started

  def seconds(self) -> float:
    """Wall time of the run so far, over every resume."""
    return self._seconds_before + time.time() - self._started

  def __call__(self, step: int, state: TrainState, metrics: dict[str, float] | None = None) -> None:
    if self.saved_step == step:
      return
    self.saved_step = step
    self.progress.seconds = self.seconds()
    self.checkpointer.save(step, {'params': state.params, 'extra': state.extra}, state.opt_state,
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
