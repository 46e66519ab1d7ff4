"""What the training loop keeps besides the model: progress, step logs, preemption and saving, the
clock to `train.target` and wsd's cooldown under a wall-clock budget."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
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
  # wsd's cooldown when the wall clock started it (`Cooldown`): optim.wsd_schedule's (start, steps), re-planned
  # at every check, so that the update of its last step uses the end learning rate
  cooldown_start: int | None = None
  cooldown_steps: int | None = None
  eval_seconds: float | None = None  # the last evaluation during training's wall time, compilation excluded
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
  """Saves a step's checkpoint (state, input position, progress) at most once per step, and keeps the
  run's clock: its seconds, their compilation, this process's seconds outside the steps (evaluations
  and saves) and the reserve `train.max_minutes` keeps for the evaluations that end the run.

  `items(state)` gives the checkpoint's model and optimizer items (trainer `Setup.checkpoint_items`:
  schedule-free's averaged parameters as the model); `started` and `compile_started` are the
  time.time() and compilation.compile_seconds() when this process's run began; `final_eval_batches`
  the final evaluation's loss batches per batch of an evaluation during training (`final_eval_batches`)."""

  def __init__(self, checkpointer: ckpt.Checkpointer, data_iter, progress: Progress, saved_step: int,
               started: float, compile_started: float = 0.0, items: Callable | None = None,
               final_eval_batches: float = 0.0, before_save: Callable[[], None] = lambda: None):
    self.checkpointer, self.data_iter, self.progress = checkpointer, data_iter, progress
    self.before_save = before_save  # the metric writer's sync: a checkpoint never outruns its logged rows
    self.saved_step = saved_step  # the newest checkpoint's step, so that a stop never saves it twice
    self._seconds_before, self._started = progress.seconds, started
    self._compile_before, self._compile_started = progress.compile_seconds, compile_started
    self.items = items or (lambda state: ({'params': state.params, 'extra': state.extra}, state.opt_state))
    self.final_eval_batches = final_eval_batches
    self.outside_steps = 0.0  # this process's seconds in evaluations and saves, compilation excluded
    self.save_seconds = 0.0  # the last save's seconds in the loop (an asynchronous save: its start)

  def record_evaluation(self, seconds: float) -> None:
    """An evaluation during training took `seconds` (compilation excluded)."""
    self.progress.eval_seconds = max(seconds, 0.0)
    self.outside_steps += self.progress.eval_seconds

  def reserve(self) -> float:
    """The seconds `train.max_minutes` keeps for the evaluation and the save at the stop and the final
    evaluation's losses, at the last evaluation's rate (until one is timed, the save's alone; the
    family's decoding, samples and pictures are not counted)."""
    seconds = self.progress.eval_seconds or 0.0
    return seconds * (1 + self.final_eval_batches) + self.save_seconds

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
    self.before_save()
    self.checkpointer.save(step, model, optimizer,
                           {'input': self.data_iter.get_state(), 'progress': dataclasses.asdict(self.progress)},
                           metrics)
    saving = self.seconds() - self.progress.seconds - (self.compile_seconds() - self.progress.compile_seconds)
    self.save_seconds = max(saving, 0.0)
    self.outside_steps += self.save_seconds

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


def clock_stop(train_config, step: int, clock: Saver, cooldown: Cooldown | None) -> str | None:
  """Why the wall clock ends the run after `step`, or None: wsd's wall-clock cooldown is over, or
  (outside one) the `train.max_minutes` budget less its reserve for the closing evaluations is spent."""
  if cooldown is not None and cooldown.by_clock:
    return f'the wall-clock cooldown ended (train.max_minutes={train_config.max_minutes})' \
        if cooldown.finished(step) else None
  if budget_spent(train_config, step, clock.seconds() + clock.reserve()):
    return f'train.max_minutes={train_config.max_minutes} reached'
  return None


def final_eval_batches(setup) -> float:
  """The final evaluation's loss batches (train.final_eval_examples of each split it scores) per batch
  of an evaluation during training: its share of `Saver.reserve` (decoding is not counted)."""
  batch_size = setup.task.eval_batch_size
  batches = sum(-(-scored // batch_size) for what, (scored, _) in evaluation.final_counts(setup).items()
                if what != 'decoded test')
  return batches / max(evaluation.batches_during_training(setup), 1)


def evaluate_during_training(setup, state: TrainState, step: int, progress: Progress, writer: MetricWriter,
                             clock: dict[str, float]) -> tuple[dict[str, float], str | None]:
  """Score `train.eval_steps` validation batches at `step`, log them and track the best; returns
  (the metrics, why training should stop early or None). `clock`: written in the same metrics row
  (`time/seconds`, `time/seconds_excluding_compile`: the run's clock when the step had finished), so
  that a learning curve can be drawn against seconds as well as steps."""
  train = setup.config.train
  metrics = evaluation.evaluate_loss(setup, state, evaluation.batches_during_training(setup))
  progress.record(step, metrics, train.best_metric, train.best_mode)
  writer.write(step, {**metrics, **clock})
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

  The budget runs on the run's clock (`Saver.seconds`: from train_and_evaluate's entry, resumes
  included) and ends with the reserve for the evaluations that close the run (`Saver.reserve`).
  Once `decay_fraction` of it is left and the steps that still fit end before `train.steps`, the
  cooldown starts, and from then on it is re-planned at every check from the recent step time
  (compilation, evaluations and saves left out: `_measure`) and the evaluations and saves to come
  (`_steps_that_fit`): the learning rate goes on from where it is (`replan`) to lr * end_lr_fraction,
  which the update of the last step that fits uses; the run stops there (`finished`). A step slower
  than planned can carry that last step past the budget, by at most itself. The same re-planning
  takes over a cooldown of `train.steps` the budget will not let end. The plan is kept in the
  checkpointed `progress`, so a resume continues it (re-planned for the time its start-up took);
  the trainer writes it into the optimizer state (optim.with_cooldown), values the compiled step
  reads. A cooldown that would start before `train.warmup_steps` end is refused. Several processes
  take process 0's plan, checked every `train.log_every` steps."""

  def __init__(self, train_config, clock: Saver, start_step: int, log=print):
    self.train, self.clock, self.progress, self.log = train_config, clock, clock.progress, log
    self._loop_start = (start_step, self._steps_clock())  # this process's first step and the clock then
    self._last: tuple[int, float] | None = None  # the step and the clock at the last check
    self._recent = collections.deque(maxlen=RECENT_CHECKS)  # seconds per step between the last checks
    self._plans = [(start_step, self.plan)]  # (the first count a plan applied to, the plan): for `learning_rate`
    # The logged learning rate of any plan: one compiled program (the plan as values), not one per plan.
    self._schedule = jax.jit(
        lambda count, start, length: optim.learning_rate_schedule(train_config, (start, length))(count))

  @property
  def by_clock(self) -> bool:
    return self.progress.cooldown_start is not None

  @property
  def plan(self) -> tuple[int, int]:
    """(first cooldown count, cooldown steps), optim.wsd_schedule's."""
    if self.by_clock:
      return self.progress.cooldown_start, self.progress.cooldown_steps
    return optim.step_cooldown(self.train)

  def learning_rate(self, count: int) -> float:
    """The learning rate the update at optimizer count `count` used (that of step count + 1)."""
    plan = self._plans[0][1]
    for first, later in self._plans[1:]:
      plan = later if first <= count else plan
    return float(self._schedule(count, *plan))

  def check(self, step: int) -> bool:
    """After `step`: re-plan; whether the plan changed (the trainer then writes it into the optimizer state)."""
    t = self.train
    if not t.max_minutes or (jax.process_count() > 1 and step % t.log_every):
      return False
    step_seconds = self._measure(step)
    decision = self._decide(step, step_seconds)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # only multi-process runs need it
      decision = multihost_utils.broadcast_one_to_all(decision)
    kind, start, length = (int(v) for v in decision)
    if kind == _REFUSE:
      raise ConfigError(
          f'train.max_minutes={t.max_minutes}: {t.decay_fraction:.0%} of the budget (train.decay_fraction) is left at '
          f'step {step}, before train.warmup_steps={t.warmup_steps} end, and a cooldown from there would jump the '
          'learning rate to its peak; raise train.max_minutes or lower train.warmup_steps or train.decay_fraction.')
    if kind == _KEEP:
      return False
    started = not self.by_clock
    self.progress.cooldown_start, self.progress.cooldown_steps = start, length
    self._plans = self._plans[-3:] + [(step, (start, length))]  # the logger reads the last step's count late
    if started:
      self.log(self.describe(step, step_seconds))
    return True

  def finished(self, step: int) -> bool:
    """Whether the wall-clock cooldown is over: the update of `step` used the end learning rate."""
    start, length = self.plan
    return self.by_clock and step >= start + length + 1

  def describe(self, step: int, step_seconds: float) -> str:
    start, length = self.plan
    return (f'Cooldown from step {step} to step {start + length + 1} (train.decay_shape={self.train.decay_shape}, '
            f're-planned at every check): train.decay_fraction={self.train.decay_fraction} of the '
            f'train.max_minutes={self.train.max_minutes} budget is left, and train.steps={self.train.steps} will not '
            f'be reached; {step_seconds:.3g} s per step, {self.clock.reserve():.3g} s kept for the evaluations at '
            'the end.')

  def _steps_clock(self) -> float:
    """The run's clock less compilation and this process's evaluations and saves: what steps took."""
    return self.clock.seconds() - self.clock.compile_seconds() - self.clock.outside_steps

  def _measure(self, step: int) -> float:
    """The recent seconds per step after `step`: the last interval's, or the mean of the last
    `RECENT_CHECKS` if higher (a slower step counts at once, a faster one over a few: the plan errs
    towards ending in time)."""
    now = self._steps_clock()
    if self._last is not None and step > self._last[0]:
      self._recent.append(max(now - self._last[1], 0.0) / (step - self._last[0]))
    self._last = (step, now)
    if self._recent:
      return max(self._recent[-1], sum(self._recent) / len(self._recent))
    # The first check after a start: the first step's dispatch was not waited for, so this only stands in.
    first_step, first_clock = self._loop_start
    return max(now - first_clock, 0.0) / max(step - first_step, 1)

  def _decide(self, step: int, step_seconds: float) -> np.ndarray:
    """[_KEEP | _PLAN | _REFUSE, start, length] after `step` at `step_seconds` per step."""
    t, keep = self.train, np.asarray([_KEEP, 0, 0])
    budget = 60 * t.max_minutes
    left = budget - self.clock.seconds() - self.clock.reserve()
    waiting = not self.by_clock and (left <= 0 or left > t.decay_fraction * budget)  # or the budget's stop ends it
    if waiting or step >= t.steps or self.finished(step):
      return keep
    end = min(step + max(self._steps_that_fit(step, left, step_seconds), 1), t.steps)
    start, length = self.plan
    if end == start + length + 1 or (not self.by_clock and end >= t.steps):
      return keep  # the plan ends there already; or train.steps comes first
    if not self.by_clock and step < t.warmup_steps:
      return np.asarray([_REFUSE, 0, 0])
    return np.asarray([_PLAN, *replan(self.plan, step, end)])

  def _steps_that_fit(self, step: int, left: float, step_seconds: float) -> int:
    """How many steps after `step` fit in `left` seconds, with the evaluations (and their saves) and the
    checkpoints due among them before the last, whose evaluation the reserve holds."""
    t = self.train
    eval_seconds, save_seconds = self.progress.eval_seconds or 0.0, self.clock.save_seconds
    both = math.lcm(t.eval_every, t.checkpoint_every)

    def cost(n: int) -> float:
      due = lambda every: (step + n - 1) // every - step // every  # multiples of `every` in steps step+1 .. step+n-1
      saves = due(t.eval_every) + due(t.checkpoint_every) - due(both)  # every evaluated step is saved too
      return n * step_seconds + due(t.eval_every) * eval_seconds + saves * save_seconds

    per_step = step_seconds + eval_seconds / t.eval_every + save_seconds / min(t.eval_every, t.checkpoint_every)
    steps = int(left / per_step) if per_step > 0 else t.steps
    steps = min(steps, t.steps)
    while steps > 0 and cost(steps) > left:
      steps -= 1
    while steps < t.steps and cost(steps + 1) <= left:
      steps += 1
    return steps


_KEEP, _PLAN, _REFUSE = 0, 1, 2  # Cooldown._decide's verdicts
RECENT_CHECKS = 4  # the intervals between checks whose step time `Cooldown` plans with


def replan(plan: tuple[int, int], step: int, end: int) -> tuple[int, int]:
  """optim.wsd_schedule's cooldown (start, length) that goes on after `step` from the progress the
  last update (count step - 1) had under `plan` and reaches the end learning rate at the update of
  step `end` (count end - 1). Its progress never goes back."""
  start, length = plan
  done = min(max((step - 1 - start) / length, 0.0), 1.0)
  updates = end - step  # counts step .. end - 1
  length = min(max(round(updates / max(1.0 - done, 1e-9)), updates), 2 ** 30)
  return end - 1 - length, length
