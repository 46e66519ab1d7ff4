"""The Optuna side of a sweep (train/sweep.py): storages, samplers, pruners and the trial budget.

Optuna owns the search, the bookkeeping and the coordination; this module only chooses its parts:

* Storage: a journal file (Optuna's JournalFileBackend, safe for several processes and for hosts
  sharing a disk) or any database URL Optuna's RDBStorage takes (sqlite:///, postgresql://, ...).
  Workers record heartbeats there; a running trial whose worker stopped beating (its host died) is
  failed and queued again with RetryHeartbeatStaleTrialCallback. RDBStorage has heartbeats; the
  journal gets the same interface here (`JournalWithHeartbeat`).
* Slots: a trial's place in the budget, 0..n_trials-1, is the number of trials that are not
  retries created before it. Storages number trials atomically, so every host computes the same
  slots and no two trials share one; a retry keeps the slot of the trial it retries.
* Samplers propose from (the sweep's seed, the slot), never from a process's random state, so
  hosts started with the same seed propose different trials and slot k gets the same proposal
  whichever worker asks: grid and `trials` points by slot, random search seeded per slot,
  quasi-random search as the slot-th point of one scrambled Sobol sequence, TPE and GP seeded per
  slot (they also read the finished trials).
"""
from __future__ import annotations

import importlib.util
import math
import threading
import time
from typing import Any, Callable

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat  # the interface RDBStorage implements for heartbeats
from optuna.trial import FrozenTrial, TrialState

import storage as storage_lib
from errors import UserError

SAMPLERS = ('grid', 'random', 'qmc', 'tpe', 'gp')
PRUNERS = {'none': optuna.pruners.NopPruner, 'median': optuna.pruners.MedianPruner,
           'successive_halving': optuna.pruners.SuccessiveHalvingPruner, 'hyperband': optuna.pruners.HyperbandPruner}
HEARTBEAT_ATTR = 'heartbeat'  # a journal trial's last heartbeat (time.time() of its worker)
MAX_RETRIES = 3  # a trial whose worker dies this often stays failed


class SweepError(UserError):
  """A malformed sweep file, flag or storage; the message names the fix."""


# ---------------------------------------------------------------------------------------------- storage
class JournalWithHeartbeat(optuna.storages.JournalStorage, BaseHeartbeat):
  """Optuna's journal file with the heartbeat RDBStorage has: each running trial carries the time
  of its worker's last beat (a system attribute), and one silent for twice the interval is stale.
  Hosts' clocks are compared, so they should agree within the interval (NTP)."""

  def __init__(self, path: str, interval: int, on_stale: Callable | None):
    super().__init__(optuna.storages.journal.JournalFileBackend(path))
    self._interval, self._on_stale = interval, on_stale

  def record_heartbeat(self, trial_id: int) -> None:
    try:
      self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())
    except optuna.exceptions.UpdateFinishedTrialError:
      pass  # another host failed it as stale meanwhile; its retry runs elsewhere

  def _get_stale_trial_ids(self, study_id: int) -> list[int]:
    now = time.time()
    # A retry copies its original's last beat: the start of this attempt counts as a beat too.
    last_beat = lambda t: max(t.system_attrs[HEARTBEAT_ATTR], t.datetime_start.timestamp())
    return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
            if HEARTBEAT_ATTR in t.system_attrs and now - last_beat(t) > 2 * self._interval]

  def get_heartbeat_interval(self) -> int:
    return self._interval

  def get_heartbeat_stale_trial_callback(self) -> Callable | None:
    return self._on_stale


def open_storage(location: str, heartbeat: int | None = None):
  """The storage at `location`: a database URL (anything with ://) or a journal file path.
  `heartbeat` (seconds): this process runs trials, so it records heartbeats and retries the trials
  of dead workers; a trial process, which only reports, passes None."""
  on_stale = RetryHeartbeatStaleTrialCallback(MAX_RETRIES, inherit_intermediate_values=True) if heartbeat else None
  shown = _without_password(location)
  if storage_lib.is_remote(location):
    raise SweepError(f'--sweep_storage={shown}: a journal file must be on a local or mounted shared disk; for a '
                     f'gs:// --workdir pass --sweep_storage=/shared/disk/study.journal or a database URL.')
  try:
    if '://' in location:
      timeout = {'timeout': 60} if location.startswith('sqlite') else {'connect_timeout': 20}
      return optuna.storages.RDBStorage(location, engine_kwargs={'connect_args': timeout}, heartbeat_interval=heartbeat,
                                        heartbeat_stale_trial_callback=on_stale)
    if heartbeat:
      return JournalWithHeartbeat(location, heartbeat, on_stale)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(location))
  except Exception as e:  # noqa: BLE001 - drivers, sockets and files fail in many ways; each is one line
    reason = ' '.join(str(e).split())[:300] or type(e).__name__
    raise SweepError(f'--sweep_storage={shown} cannot be opened ({reason}); pass a reachable database URL '
                     f'(sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB with its driver installed) or a journal '
                     f'file in a directory that exists.') from None


def _without_password(location: str) -> str:
  if '://' not in location:
    return location
  try:
    import sqlalchemy
    return sqlalchemy.engine.make_url(location).render_as_string(hide_password=True)
  except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: the open will say so
    return location


# ---------------------------------------------------------------------------------------------- search space
def distribution(entry: dict[str, Any]) -> BaseDistribution:
  """Optuna's distribution of a checked `space` entry (train/sweep.py's parse_space)."""
  if 'choices' in entry:
    return CategoricalDistribution(entry['choices'])
  if entry['int']:
    return IntDistribution(entry['low'], entry['high'], log=entry['log'], step=entry['step'] or 1)
  return FloatDistribution(entry['low'], entry['high'], log=entry['log'], step=entry['step'])


def suggest(trial: optuna.Trial, key: str, entry: dict[str, Any]) -> Any:
  """The trial's value of `key`, from the study's sampler (or, for a retry, the value it had)."""
  if 'choices' in entry:
    return trial.suggest_categorical(key, entry['choices'])
  if entry['int']:
    return trial.suggest_int(key, entry['low'], entry['high'], log=entry['log'], step=entry['step'] or 1)
  return trial.suggest_float(key, entry['low'], entry['high'], log=entry['log'], step=entry['step'])


# ---------------------------------------------------------------------------------------------- samplers
def slot_seed(seed: int, slot: int) -> int:
  return int(np.random.SeedSequence([seed, slot]).generate_state(1)[0])


class PointsSampler(optuna.samplers.BaseSampler):
  """A sweep file's grid and `trials`: the trial in slot k takes point k (in the file's order), as
  Optuna's GridSampler takes grid point k for trial k, but for any list of points, not only a
  product. The study's budget is the number of points."""

  def __init__(self, points: list[dict[str, Any]]):
    self.points = points

  def infer_relative_search_space(self, study, trial) -> dict:
    return {}

  def sample_relative(self, study, trial, search_space) -> dict:
    return {}

  def sample_independent(self, study, trial: FrozenTrial, name: str, param_distribution) -> Any:
    return self.points[trial.user_attrs['slot']][name]


class PerSlotSeed(optuna.samplers.BaseSampler):
  """`make(seed)`'s sampler, built for each trial with a seed of (the sweep's seed, the trial's
  slot): Optuna's samplers draw from one random state per process, so two hosts started with one
  seed would propose the same trials."""

  def __init__(self, make: Callable[[int], optuna.samplers.BaseSampler], seed: int):
    self._make, self._seed = make, seed
    self._samplers: dict[int, optuna.samplers.BaseSampler] = {}
    self._lock = threading.Lock()  # --sweep_workers threads share the sampler

  def _for(self, trial: FrozenTrial) -> optuna.samplers.BaseSampler:
    slot = trial.user_attrs['slot']
    with self._lock:
      if slot not in self._samplers:
        self._samplers[slot] = self._make(slot_seed(self._seed, slot))
      return self._samplers[slot]

  def infer_relative_search_space(self, study, trial):
    return self._for(trial).infer_relative_search_space(study, trial)

  def sample_relative(self, study, trial, search_space):
    return self._for(trial).sample_relative(study, trial, search_space)

  def sample_independent(self, study, trial, name, param_distribution):
    return self._for(trial).sample_independent(study, trial, name, param_distribution)

  def after_trial(self, study, trial, state, values) -> None:
    if 'slot' in trial.user_attrs:  # a trial past the budget suggested nothing
      self._for(trial).after_trial(study, trial, state, values)
      with self._lock:
        self._samplers.pop(trial.user_attrs['slot'], None)


class SobolSampler(optuna.samplers.BaseSampler):
  """Quasi-random search: slot k takes point k of the scrambled Sobol sequence of the sweep's seed.
  (Optuna's QMCSampler counts its points in a study attribute that two hosts can read at once, and
  samples its first trial at random.)"""

  def __init__(self, space: dict[str, BaseDistribution], seed: int):
    self.space, self.seed = space, seed

  def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
    return dict(self.space)

  def sample_relative(self, study, trial: FrozenTrial, search_space) -> dict[str, Any]:
    if not search_space:
      return {}
    from scipy.stats import qmc
    engine = qmc.Sobol(len(self.space), scramble=True, seed=self.seed)
    if trial.user_attrs['slot']:
      engine.fast_forward(trial.user_attrs['slot'])
    point = engine.random(1)[0]
    return {name: from_unit(dist, u) for (name, dist), u in zip(self.space.items(), point)}

  def sample_independent(self, study, trial, name, param_distribution):
    raise SweepError(f'{name!r} is not in the sweep\'s space; a qmc sweep suggests only its space.')


def from_unit(dist: BaseDistribution, u: float) -> Any:
  """The value at u in [0, 1) of `dist`, uniform over its range (over log values for log=True)."""
  if isinstance(dist, CategoricalDistribution):
    return dist.choices[min(int(u * len(dist.choices)), len(dist.choices) - 1)]
  is_int = isinstance(dist, IntDistribution)
  low, high = dist.low, dist.high + (1 if is_int else 0)  # an integer range owns [k, k + 1)
  if dist.log:
    value = math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
  else:
    value = low + u * (high - low)
  if is_int:
    return min(dist.low + (int(value) - dist.low) // dist.step * dist.step, dist.high)
  if dist.step:
    value = dist.low + round((value - dist.low) / dist.step) * dist.step
  return min(max(value, dist.low), dist.high)


def make_sampler(name: str, kwargs: dict, seed: int, points: list[dict] | None,
                 space: dict[str, dict] | None) -> optuna.samplers.BaseSampler:
  """The study's sampler; SweepError for options the sampler does not take or a missing PyTorch."""
  if points is not None:
    return PointsSampler(points)
  if name == 'qmc':
    return SobolSampler({key: distribution(entry) for key, entry in space.items()}, seed)
  if name == 'gp' and importlib.util.find_spec('torch') is None:
    raise SweepError("sampler 'gp' needs PyTorch (pip install torch; the CPU build is enough); 'tpe' needs nothing more.")
  cls = {'random': optuna.samplers.RandomSampler, 'tpe': optuna.samplers.TPESampler, 'gp': optuna.samplers.GPSampler}[name]
  make = lambda slot_seed_: cls(seed=slot_seed_, **kwargs)
  _check_options(f'sampler {name!r}', lambda: make(0), kwargs)
  return PerSlotSeed(make, seed)


def make_pruner(name: str, kwargs: dict) -> optuna.pruners.BasePruner:
  if name not in PRUNERS:
    raise SweepError(f"Unknown pruner {name!r}; use one of {sorted(PRUNERS)}, e.g. 'pruner': 'median'.")
  return _check_options(f'pruner {name!r}', lambda: PRUNERS[name](**kwargs), kwargs)


def _check_options(what: str, build: Callable, kwargs: dict):
  try:
    return build()
  except (TypeError, ValueError) as e:
    raise SweepError(f'{what} does not take the options {kwargs} ({e}); see its Optuna documentation.') from None


# ---------------------------------------------------------------------------------------------- the budget
def is_retry(trial: FrozenTrial) -> bool:
  return 'failed_trial' in trial.system_attrs  # set by RetryHeartbeatStaleTrialCallback


class OverBudget(Exception):
  """A trial opened after the budget was taken (two workers asked for the last slot at once)."""


def take_slot(study: optuna.Study, trial: optuna.Trial, n_trials: int) -> int:
  """The trial's slot, recorded as its user attribute 'slot' (a retry has its original's).
  OverBudget, and the study stops, when the trial comes after the budget."""
  if 'slot' in trial.user_attrs:
    return trial.user_attrs['slot']
  slot = sum(1 for t in study.get_trials(deepcopy=False) if t.number < trial.number and not is_retry(t))
  if slot >= n_trials:
    trial.set_user_attr('over_budget', True)
    study.stop()
    raise OverBudget(f'slot {slot} of {n_trials}')
  trial.set_user_attr('slot', slot)
  return slot


def unclaimed(study: optuna.Study, n_trials: int) -> int:
  """Trials a worker may still take: slots no trial has taken, and queued retries."""
  trials = study.get_trials(deepcopy=False)
  fresh = sum(1 for t in trials if not is_retry(t))
  return max(0, n_trials - fresh) + sum(1 for t in trials if t.state == TrialState.WAITING)


def running(study: optuna.Study) -> int:
  return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def retry(study: optuna.Study, trial: FrozenTrial) -> None:
  """Queue `trial` again (same parameters, slot and workdir), as Optuna does for a stale one."""
  RetryHeartbeatStaleTrialCallback(None, inherit_intermediate_values=True)(study, trial)


def fail_stale_trials(study: optuna.Study) -> None:
  optuna.storages.fail_stale_trials(study)
