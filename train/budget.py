"""The wall-clock budget (`train.max_minutes`): the run's clock, the reserve it keeps for the work that
closes the run, the stop, and wsd's cooldown planned against it.

The clock (`RunClock`) starts at train_and_evaluate's entry and counts every resume's seconds. The
loop stops once the budget less the reserve is spent (`clock_stop`); the reserve
(`RunClock.reserve`) is what runs after the last step, each part timed in this run:
  evaluations  the stop's evaluation during training and the final evaluation's losses
               (`final_eval_scale` evaluations' worth), at the last evaluation's time
  save         the stop's checkpoint, to the end of its writing (asynchronous or not)
  restore      the best checkpoint's model, when the final evaluation scores it (train.final_eval_from)
  decoding     the family's decoding after training (translation's greedy and beam search, samples)
  tasks        the last evaluation's scoring of train.eval_tasks (train/downstream.py), once one was timed
The loop times the save, the restore and a unit of the decoding at this process's first step, and
an evaluation's batches until an evaluation is timed (train/loop.py `time_closing_work`), so that a
run evaluating nothing before its end keeps its reserve from the start. The family's pictures and
programs its evaluation compiles afresh are not counted. When the reserve alone does not fit the
time left, the run ends at once and says what to change.
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from train import compilation, downstream, evaluation, optim
from train.multihost import agreed


def final_eval_scale(setup) -> float:
  """How many evaluations during training the final evaluation's losses are worth: its loss batches
  (train.final_eval_examples of each split it scores; `setup`: trainer.Setup) per batch of an
  evaluation during training."""
  batch_size = setup.task.eval_batch_size
  batches = sum(-(-scored // batch_size) for what, (scored, _) in evaluation.final_counts(setup).items()
                if what != 'decoded test')
  return batches / max(evaluation.batches_during_training(setup), 1)


class RunClock:
  """The run's clock: its seconds over every resume, their compilation, this process's seconds
  outside the steps, and the reserve `train.max_minutes` keeps for the work that closes the run.

  `progress` (loop.Progress) carries the seconds of earlier processes and the closing work's
  timings; `started` and `compile_started` are the time.time() and compilation.compile_seconds()
  when this process's run began; `budget` is train.max_minutes in seconds (0: none);
  `final_eval_scale` the final evaluation's losses in evaluations during training (`final_eval_scale`);
  `restores`: whether the run ends by restoring the best checkpoint (train.final_eval_from='best')."""

  def __init__(self, progress, started: float, compile_started: float = 0.0, budget: float = 0.0,
               final_eval_scale: float = 0.0, restores: bool = False):
    self.progress, self.budget = progress, budget
    self._seconds_before, self._started = progress.seconds, started
    self._compile_before, self._compile_started = progress.compile_seconds, compile_started
    self.final_eval_scale, self.restores = final_eval_scale, restores
    self.outside_steps = 0.0  # this process's seconds in evaluations, saves and timings, compilation excluded
    self.last_save_seconds = 0.0  # the last save's seconds in the loop (an asynchronous save: its start)

  def seconds(self) -> float:
    """Wall time of the run so far, over every resume."""
    return self._seconds_before + time.time() - self._started

  def compile_seconds(self) -> float:
    """The part of `seconds()` spent tracing and compiling, over every resume."""
    return self._compile_before + compilation.compile_seconds() - self._compile_started

  def seconds_left(self) -> float | None:
    """The budget's seconds not spent yet (None without a budget)."""
    return max(self.budget - self.seconds(), 0.0) if self.budget else None

  def measure(self, work: Callable[[], Any]) -> tuple[Any, float]:
    """(`work()`, its seconds without compilation), run outside the steps: counted in `outside_steps`."""
    seconds, compile_seconds = self.seconds(), self.compile_seconds()
    result = work()
    spent = max(self.seconds() - seconds - (self.compile_seconds() - compile_seconds), 0.0)
    self.outside_steps += spent
    return result, spent

  def reserve(self) -> float:
    """The seconds the budget keeps for the work that closes the run (module docstring), at the
    timings so far (a part not timed yet counts 0)."""
    return sum(self.closing_work().values())

  def closing_work(self) -> dict[str, float]:
    """{part of the closing work: its seconds}, as `reserve` sums them; 'tasks' (the last evaluation's
    scoring of train.eval_tasks) once one was timed."""
    p = self.progress
    work = {'evaluations': (p.eval_seconds or 0.0) * (1 + self.final_eval_scale), 'save': p.save_seconds or 0.0,
            'restore': (p.restore_seconds or 0.0) if self.restores else 0.0, 'decoding': p.decode_seconds or 0.0}
    return work if p.tasks_seconds is None else {**work, 'tasks': p.tasks_seconds}

  def describe_reserve(self, step: int) -> str:
    parts = ', '.join(f'{name} {seconds:.3g} s' for name, seconds in self.closing_work().items()
                      if seconds or name != 'restore')
    line = (f'train.max_minutes={self.budget / 60:g}: {self.reserve():.3g} s kept for the work that closes the run '
            f'({parts}; timed at step {step}).')
    left = self.seconds_left()
    if left is not None and self.reserve() > left:
      line += (f' It does not fit the {left:.3g} s left, so the run ends now: raise train.max_minutes, or lower '
               'train.final_eval_examples (or train.final_decode_examples).')
    return line


def budget_spent(train_config, step: int, seconds: float) -> bool:
  """Whether `seconds` of the run exceed `train.max_minutes` (0: no budget). Several processes
  agree on process 0's clock, every `train.log_every` steps."""
  if not train_config.max_minutes or (jax.process_count() > 1 and step % train_config.log_every):
    return False
  return agreed(seconds > 60 * train_config.max_minutes)


def clock_stop(train_config, step: int, clock: RunClock, cooldown: Cooldown | None) -> str | None:
  """Why the wall clock ends the run after `step`, or None: wsd's wall-clock cooldown is over, or
  (outside one) the `train.max_minutes` budget less its reserve for the closing work is spent."""
  if cooldown is not None and cooldown.by_clock:
    return f'the wall-clock cooldown ended (train.max_minutes={train_config.max_minutes})' \
        if cooldown.finished(step) else None
  if budget_spent(train_config, step, clock.seconds() + clock.reserve()):
    return f'train.max_minutes={train_config.max_minutes} reached'
  return None


# ============================================================================ wsd's cooldown
class Cooldown:
  """Where wsd's cooldown starts and how long it lasts: the last `train.decay_fraction` of
  `train.steps`, unless a wall-clock budget (`train.max_minutes`) will end the run first.

  The budget runs on the run's clock (`RunClock.seconds`) and ends with the reserve for the work
  that closes the run (`RunClock.reserve`). Once `decay_fraction` of it is left and the steps that
  still fit end before `train.steps`, the cooldown starts, and from then on it is re-planned at
  every check from the recent step time (compilation, evaluations and saves left out: `_measure`)
  and the evaluations and saves to come (`_steps_that_fit`): the learning rate goes on from the rate
  the last update used (`replan`) to lr * end_lr_fraction, which the update of the last step that
  fits uses; the run stops there (`finished`). A step slower than planned can carry that last step
  past the budget, by at most itself. The same re-planning takes over a cooldown of `train.steps`
  the budget will not let end. A cooldown due during the warmup starts from the rate the warmup
  reached, not the peak; one due while that rate is still below the end rate waits, and the budget's
  own stop ends the run if it comes first. The plan is kept in the checkpointed `progress`, so a
  resume continues it (re-planned for the time its start-up took); the trainer writes it into the
  optimizer state (optim.with_cooldown), values the compiled step reads. Several processes take
  process 0's plan, checked every `train.log_every` steps."""

  def __init__(self, train_config, clock: RunClock, start_step: int, log=print):
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
    changed, start, length = (int(v) for v in decision)
    if not changed:
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
    t = self.train
    line = (f'Cooldown from step {step} to step {start + length + 1} (train.decay_shape={t.decay_shape}, re-planned '
            f'at every check): train.decay_fraction={t.decay_fraction} of the train.max_minutes={t.max_minutes} '
            f'budget is left, and train.steps={t.steps} will not be reached; {step_seconds:.3g} s per step, '
            f'{self.clock.reserve():.3g} s kept for the work that closes the run.')
    if step - 1 < t.warmup_steps:
      line += (f' It starts during the warmup (train.warmup_steps={t.warmup_steps}), from the rate it reached, '
               f'{self.learning_rate(step - 1):.3g}, not the peak.')
    return line

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
    """[changed (0 | 1), start, length]: the plan after `step` at `step_seconds` per step."""
    t, keep = self.train, np.asarray([0, 0, 0])
    budget = 60 * t.max_minutes
    left = budget - self.clock.seconds() - self.clock.reserve()
    waiting = not self.by_clock and (left <= 0 or left > t.decay_fraction * budget)  # or the budget's stop ends it
    if waiting or step >= t.steps or self.finished(step):
      return keep
    end = min(step + max(self._steps_that_fit(step, left, step_seconds), 1), t.steps)
    start, length = self.plan
    if end == start + length + 1 or (not self.by_clock and end >= t.steps):
      return keep  # the plan ends there already; or train.steps comes first
    plan = replan(t, self.plan, step, end)
    return keep if plan is None else np.asarray([1, *plan])

  def _steps_that_fit(self, step: int, left: float, step_seconds: float) -> int:
    """How many steps after `step` fit in `left` seconds, with the evaluations (and their saves) and the
    checkpoints due among them before the last, whose evaluation the reserve holds."""
    t = self.train
    eval_seconds, save_seconds = self.progress.eval_seconds or 0.0, self.clock.last_save_seconds
    tasks_seconds, tasks_every = self.progress.tasks_seconds or 0.0, downstream.every(t)
    eval_and_checkpoint_every = math.lcm(t.eval_every, t.checkpoint_every)

    def cost(n: int) -> float:
      # the multiples of `every` among steps step + 1 .. step + n - 1
      multiples = lambda every: (step + n - 1) // every - step // every
      saves = multiples(t.eval_every) + multiples(t.checkpoint_every) - multiples(eval_and_checkpoint_every)
      return (n * step_seconds + multiples(t.eval_every) * eval_seconds + multiples(tasks_every) * tasks_seconds
              + saves * save_seconds)  # evaluated: saved too

    per_step = (step_seconds + eval_seconds / t.eval_every + tasks_seconds / tasks_every
                + save_seconds / min(t.eval_every, t.checkpoint_every))
    steps = int(left / per_step) if per_step > 0 else t.steps
    steps = min(steps, t.steps)
    while steps > 0 and cost(steps) > left:
      steps -= 1
    while steps < t.steps and cost(steps + 1) <= left:
      steps += 1
    return steps


RECENT_CHECKS = 4  # the intervals between checks whose step time `Cooldown` plans with


def cooldown_progress(train_config, plan: tuple[int, int], count: int) -> float | None:
  """The progress (0 to 1) at which wsd's cooldown has the rate that `plan`'s schedule gives the
  update at `count`: the cooldown's own progress once it has started; before, that of the warmup's
  rate (the peak's: 0); None while the warmup's rate is below the cooldown's end rate."""
  start, length = plan
  if count >= start:
    return min(max((count - start) / length, 0.0), 1.0)
  t = train_config
  reached = min(count / t.warmup_steps, 1.0) if t.warmup_steps else 1.0  # of the peak: optax's linear warmup
  if reached >= 1.0:
    return 0.0
  fall = (1.0 - reached) / (1.0 - t.end_lr_fraction) if t.end_lr_fraction < 1 else math.inf  # of the cooldown's
  if fall > 1.0:
    return None
  return fall**2 if t.decay_shape == '1-sqrt' else fall  # optim.wsd_schedule's shapes, inverted


def replan(train_config, plan: tuple[int, int], step: int, end: int) -> tuple[int, int] | None:
  """optim.wsd_schedule's cooldown (start, length) that goes on after `step` from the rate the last
  update (count step - 1) used under `plan` (`cooldown_progress`) and reaches the end learning rate
  at the update of step `end` (count end - 1); None while that rate is below the end rate. Its rate
  never rises."""
  done = cooldown_progress(train_config, plan, step - 1)
  if done is None:
    return None
  updates = end - step  # counts step .. end - 1
  length = min(max(round(updates / max(1.0 - done, 1e-9)), updates), 2 ** 30)
  return end - 1 - length, length
