"""The training loop (stage 4 of train/trainer.py: `train_loop`) and what it keeps besides the model:
progress, step logs, saving, preemption, evaluations during training and the clock to `train.target`.
The wall-clock budget and wsd's cooldown planned against it are train/budget.py's."""
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
from train import budget, compilation, downstream, evaluation, optim, sharding, steps
from train import checkpoint as ckpt
from train import state as state_lib
from train.budget import RunClock
from train.metrics import MetricWriter, reduce_metrics
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
  # wsd's cooldown when the wall clock started it (budget.Cooldown): optim.wsd_schedule's (start, steps),
  # re-planned at every check, so that the update of its last step uses the end learning rate
  cooldown_start: int | None = None
  cooldown_steps: int | None = None
  eval_seconds: float | None = None  # the last evaluation during training's wall time, compilation excluded
  tasks_seconds: float | None = None  # the last scoring of train.eval_tasks' wall time, compilation excluded
  # The rest of the closing work budget.RunClock.reserve keeps, timed (None: not yet): a save to the end of
  # its writing, the best checkpoint's restore, the family's decoding after training
  save_seconds: float | None = None
  restore_seconds: float | None = None
  decode_seconds: float | None = None
  target: dict[str, float] | None = None  # where `train.target` was first met: step, tokens, seconds, ...

  def record(self, step: int, metrics: dict[str, float], metric: str, mode: str) -> None:
    """Track the best `metric` at the evaluation of `step`; an evaluation that scored no tasks
    (train.eval_tasks_every) leaves a task metric's best as it was."""
    if metric.startswith(downstream.PREFIX) and metric not in metrics:
      return
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
  """Saves a step's checkpoint (state, input position, the clock's progress) at most once per step,
  its seconds counted on the run's clock (`clock`) as outside the steps.

  `items(state)` gives the checkpoint's model and optimizer items (trainer `Setup.checkpoint_items`:
  schedule-free's averaged parameters as the model); `before_save` runs first (the metric writer's
  sync: a checkpoint never outruns its logged rows). With `time_completion` (a budget), the next save
  is waited for: its time to the end of its writing is the reserve's save (`Progress.save_seconds`)."""

  def __init__(self, checkpointer: ckpt.Checkpointer, data_iter, clock: RunClock, saved_step: int,
               items: Callable | None = None, before_save: Callable[[], None] = lambda: None,
               time_completion: bool = False):
    self.checkpointer, self.data_iter, self.clock, self.before_save = checkpointer, data_iter, clock, before_save
    self.saved_step = saved_step  # the newest checkpoint's step, so that a stop never saves it twice
    self.items = items or (lambda state: ({'params': state.params, 'extra': state.extra}, state.opt_state))
    self.time_completion = time_completion

  def __call__(self, step: int, state: TrainState, metrics: dict[str, float] | None = None) -> None:
    if self.saved_step == step:
      return
    self.saved_step = step
    _, self.clock.last_save_seconds = self.clock.measure(lambda: self._save(step, state, metrics))
    if self.time_completion:
      self.clock.progress.save_seconds, self.time_completion = self.clock.last_save_seconds, False

  def _save(self, step: int, state: TrainState, metrics: dict[str, float] | None) -> None:
    progress = self.clock.progress
    progress.seconds, progress.compile_seconds = self.clock.seconds(), self.clock.compile_seconds()
    model, optimizer = self.items(state)
    self.before_save()
    self.checkpointer.save(step, model, optimizer,
                           {'input': self.data_iter.get_state(), 'progress': dataclasses.asdict(progress)}, metrics)
    if self.time_completion:
      self.checkpointer.wait()

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

  def __init__(self, train_config, schedule, writer: MetricWriter, checkpoint_dir,
               seconds_left: Callable[[], float | None] = lambda: None):
    """`seconds_left`: the budget's seconds left (None: no budget), for the progress line's eta."""
    self.train, self.schedule, self.writer, self.checkpoint_dir = train_config, schedule, writer, checkpoint_dir
    self.seconds_left = seconds_left
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
      self.writer.progress(step, out, self.seconds_left())


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


# ============================================================================ the loop
def train_loop(setup, state: TrainState, saver: Saver, data_iter, writer: MetricWriter, start_step: int
               ) -> tuple[TrainState, dict[str, Any]]:
  """Steps from `start_step` to `train.steps` (or an earlier stop) of `setup` (trainer.Setup), on the
  run's clock `saver.clock`; returns (the last state, {'step', 'train/compiles', 'stopped'?,
  'preempted'?, 'target/...'?})."""
  train, clock = setup.config.train, saver.clock
  train_step = steps.jit_train_step(setup.task, setup.spec, setup.tx, train.grad_accum)
  state, cooldown, logger = schedule_and_logger(setup, state, clock, writer, saver.checkpointer.directory, start_step)
  compiled_before = compilation.compiled('train_step')
  compiles = lambda: compilation.compiled('train_step') - compiled_before
  step, stopped, timed = start_step, None, False
  try:
    with sharding.use_mesh(setup.mesh), PreemptionWatcher(writer.log) as watcher:
      while step < train.steps and stopped is None:
        if watcher.should_stop(step):
          logger.flush()
          return state, save_and_leave(setup, state, step, saver, writer, watcher.requested, compiles())
        local_batch = next(data_iter)
        state, (scalars, metrics) = train_step(state, sharding.global_batch(local_batch, setup.mesh))
        step += 1
        # From this host's numpy slice: on the global arrays, count_tokens' real-token count would be
        # eager device ops every step.
        positions = setup.task.count_tokens(local_batch)[0] * jax.process_count()
        clock.progress.tokens += positions
        logger.add(step, scalars, metrics, positions)
        if cooldown is not None and cooldown.check(step):
          state = with_plan(setup, state, cooldown.plan)
        stopped = budget.clock_stop(train, step, clock, cooldown)
        evaluated = step % train.eval_every == 0 or step == train.steps or stopped is not None
        if evaluated:
          logger.flush()  # the step has finished: the clock below is its own
          last_eval, early_stop = evaluate_step(setup, state, step, saver, writer, time_final=not timed,
                                                last=stopped is not None or step == train.steps)
          stopped, timed = stopped or early_stop, True
        # Every evaluated step is saved with its metrics, so the best checkpoint is always on disk.
        if evaluated or stopped or step % train.checkpoint_every == 0:
          logger.flush()
          saver(step, state, last_eval if evaluated else None)
        if train.max_minutes and step == start_step + 1 and not stopped:
          logger.flush()
          time_closing_work(setup, state, step, saver, writer)
      logger.flush()
    saver.checkpointer.wait()
  finally:
    # Every distinct batch shape builds the train step once: few shapes are the data pipeline's job.
    writer.log(f'The train step was compiled {compiles()} time(s). ' + (compilation.cache_summary() or ''))
  if stopped:
    writer.log(f'Stopped at step {step} of {train.steps}: {stopped}.')
  if setup.target is not None and clock.progress.target is None:
    writer.log(f'Target {setup.target} not met by step {step}.')
  return state, {'step': step, 'train/compiles': compiles(), **({'stopped': stopped} if stopped else {}),
                 **target_results(setup.target, clock.progress)}


def with_plan(setup, state: TrainState, plan: tuple[int, int]) -> TrainState:
  """`state` whose optimizer state holds wsd's cooldown `plan` (optim.with_cooldown)."""
  opt_state = optim.with_cooldown(state.opt_state, plan, setup.spec.shardings.opt_state)
  return dataclasses.replace(state, opt_state=opt_state)


def schedule_and_logger(setup, state: TrainState, clock: RunClock, writer: MetricWriter, checkpoint_dir,
                        start_step: int) -> tuple[TrainState, budget.Cooldown | None, StepLogger]:
  """(the state with wsd's cooldown plan in its optimizer state, that plan's Cooldown or None without
  wsd, the step logger). The plan is a resume's, or the one train.steps gives now."""
  train = setup.config.train
  cooldown = budget.Cooldown(train, clock, start_step, writer.log) if train.schedule == 'wsd' else None
  if cooldown is not None:
    state = with_plan(setup, state, cooldown.plan)
    if cooldown.by_clock:
      writer.log(f'Resumed in the wall-clock cooldown (planned to end at step {sum(cooldown.plan) + 1}); it is '
                 're-planned for the time left.')
  # The logged learning rate: one compiled program, not an eager dispatch (and compilation) per op of the schedule.
  learning_rate = jax.jit(setup.schedule) if cooldown is None else cooldown.learning_rate
  return state, cooldown, StepLogger(train, learning_rate, writer, checkpoint_dir, clock.seconds_left)


def save_and_leave(setup, state: TrainState, step: int, saver: Saver, writer: MetricWriter, requested: str | bool,
                   compiles: int) -> dict[str, Any]:
  """A preemption (SIGTERM, Ctrl-C) at `step`: save, wait for the save, say how to resume; the results."""
  saver(step, state)
  saver.checkpointer.wait()
  writer.log(f'{requested or "Preemption"}: saved step {step} to {saver.checkpointer.directory}; rerun the '
             f'same command to resume.')
  return {'step': step, 'preempted': True, 'train/compiles': compiles,
          **target_results(setup.target, saver.clock.progress)}


def evaluate_step(setup, state: TrainState, step: int, saver: Saver, writer: MetricWriter, time_final: bool = False,
                  last: bool = False) -> tuple[dict[str, float], str | None]:
  """The evaluation during training at `step`: (its metrics, why training should stop now or None:
  early stopping, or train.target met with train.stop_at_target). Records the target's clock (the
  run's seconds when the step had finished, read before evaluating, also written in the evaluation's
  metrics row as `time/seconds`) and its own time, which the budget reserves for the closing
  evaluations (budget.RunClock.reserve); the scoring of train.eval_tasks when due (`last`: the run's
  last evaluation), timed apart. `time_final`: log how long the final evaluation should take at this
  evaluation's rate (the run's first evaluation)."""
  clock = saver.clock
  seconds, compile_seconds = clock.seconds(), clock.compile_seconds()
  times = {'time/seconds': round(seconds, 3), 'time/seconds_excluding_compile': round(seconds - compile_seconds, 3)}
  with saver.on_failure(step, state):
    evaluated, task_metrics = setup.evaluated(state), {}
    if downstream.due(setup.config.train, step, last):
      task_metrics, clock.progress.tasks_seconds = clock.measure(lambda: score_tasks(setup, evaluated, step))
    (metrics, early_stop), clock.progress.eval_seconds = clock.measure(
        lambda: evaluate_during_training(setup, evaluated, step, clock.progress, writer, times, task_metrics))
  if time_final:
    writer.log(evaluation.describe_cost(setup, clock.progress.eval_seconds))
  if record_target(setup.target, step, metrics, clock.progress, seconds, compile_seconds, writer) \
      and setup.config.train.stop_at_target:
    early_stop = f'train.target {setup.target} met'
  return metrics, early_stop


def score_tasks(setup, state: TrainState, step: int) -> dict[str, float]:
  """train.eval_tasks' metrics (tasks/...) of `state`'s model at `step`: the scorer's (train/downstream.py)."""
  model = state_lib.model_of(setup.spec, state)
  model.eval()
  return setup.task_scorer(model, setup.task, step)


def evaluate_during_training(setup, state: TrainState, step: int, progress: Progress, writer: MetricWriter,
                             times: dict[str, float], task_metrics: dict[str, float] | None = None
                             ) -> tuple[dict[str, float], str | None]:
  """Score `train.eval_steps` validation batches at `step`, log them with `task_metrics` (the tasks
  scored at this step, tasks/...: the evaluation's own metrics too) and track the best; returns (the
  metrics, why training should stop early or None). `times`: written in the same metrics row
  (`time/seconds`, `time/seconds_excluding_compile`: the run's clock when the step had finished), so
  that a learning curve can be drawn against seconds as well as steps."""
  train = setup.config.train
  metrics = evaluation.evaluate_loss(setup, state, evaluation.batches_during_training(setup))
  metrics.update(task_metrics or {})
  progress.record(step, metrics, train.best_metric, train.best_mode)
  writer.write(step, {**metrics, **times})
  writer.log(f'step {step}: ' + ' '.join(f'{k}={v:.4f}' for k, v in metrics.items()))
  if train.early_stopping_patience and progress.evals_since_best >= train.early_stopping_patience:
    return metrics, (f'early stopping: {train.best_metric} has not improved on {progress.best_value:.4f} '
                     f'(step {progress.best_step}) in {progress.evals_since_best} evaluations')
  return metrics, None


def time_closing_work(setup, state: TrainState, step: int, saver: Saver, writer: MetricWriter) -> None:
  """Under a budget, at this process's first `step`: time the work that closes the run, so that the
  budget keeps it from the start (budget.RunClock.reserve): this step's save to the end of its
  writing (the process's first, `Saver.time_completion`), the restore of its model when the final
  evaluation scores the best checkpoint, a unit of the family's decoding (`Task.decode_unit`), and,
  until an evaluation is timed, an evaluation during training's batches (not logged)."""
  clock, progress = saver.clock, saver.clock.progress
  saver(step, state)  # nothing when the loop saved this step: that save was the timed one
  if clock.restores:
    _, progress.restore_seconds = clock.measure(lambda: jax.block_until_ready(
        saver.checkpointer.restore(step, ckpt.restore_target(setup.spec))['model']))
  evaluated = setup.evaluated(state)
  units = setup.task.final_decoding()
  if units:
    model = state_lib.model_of(setup.spec, evaluated)
    model.eval()
    progress.decode_seconds = warm_seconds(clock, lambda: setup.task.decode_unit(model)) * units
  if progress.eval_seconds is None:
    batches = evaluation.batches_during_training(setup)
    progress.eval_seconds = warm_seconds(clock, lambda: evaluation.evaluate_loss(setup, evaluated, batches))
  writer.log(clock.describe_reserve(step))


def warm_seconds(clock: RunClock, work: Callable[[], Any]) -> float:
  """The seconds of `work`'s second run: the first compiles and warms its programs up, which the end
  of the run, running them again, does not repeat (both count outside the steps)."""
  clock.measure(work)
  return clock.measure(work)[1]


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

