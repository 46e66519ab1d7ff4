"""The Optuna side of a sweep (sweeps/runner.py): storages, samplers, pruners, the trial budget and heartbeats.

Optuna owns the search, the bookkeeping and the coordination; this module only chooses its parts,
through Optuna's public API:

* Storage: a journal file (Optuna's JournalFileBackend, safe for several processes and for hosts
  sharing a disk) or any database URL Optuna's RDBStorage takes (sqlite:///, postgresql://, ...).
* The study is created by one host (`create_study` refuses a second creator atomically in every
  storage): that host enqueues a grid's and `trials`' points (`enqueue_trial`, slot k's point k-th,
  so `study.ask` hands them out in the file's order) and then records the sweep; hosts that join
  wait for that record.
* Slots: a trial's place in the budget, 0..n_trials-1. An enqueued point carries its slot; a
  searched trial's slot is the number of trials that are not retries created before it. Storages
  number trials atomically, so every host computes the same slots and no two trials share one; a
  retry (`RetryHeartbeatStaleTrialCallback`) keeps the slot of the trial it retries.
* Samplers propose from (the sweep's seed, the slot), never from a process's random state, so
  hosts started with the same seed propose different trials and slot k gets the same proposal
  whichever worker asks: random search seeded per slot, quasi-random search as the slot-th point
  of one scrambled Sobol sequence, TPE and GP seeded per slot (they also read the finished trials).
* Heartbeats, one way for every storage (Optuna 5.0's RDBStorage has its own, its JournalStorage
  none): the worker running a trial writes the time into the trial's user attribute `heartbeat`; a
  running trial silent for twice the interval (its host died) is failed by whichever host sees it
  first (`study.tell`, which refuses a second teller) and queued again.
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
from optuna.trial import FrozenTrial, TrialState

import storage as storage_lib
from errors import UserError

SAMPLERS = ('grid', 'random', 'qmc', 'tpe', 'gp')
PRUNERS = {'none': optuna.pruners.NopPruner, 'median': optuna.pruners.MedianPruner,
           'successive_halving': optuna.pruners.SuccessiveHalvingPruner, 'hyperband': optuna.pruners.HyperbandPruner}
HEARTBEAT_ATTR = 'heartbeat'  # a running trial's last heartbeat (time.time() of its worker)
MAX_RETRIES = 3  # a trial whose worker dies this often stays failed
RECORD_WAIT_S = 60  # how long a joining host waits for the creating host to record the sweep


class SweepError(UserError):
  """A malformed sweep file, flag or storage; the message names the fix."""


# ---------------------------------------------------------------------------------------------- storage
def open_storage(location: str) -> optuna.storages.BaseStorage:
  """The storage at `location`: a database URL (anything with ://) or a journal file path."""
  shown = _without_password(location)
  if storage_lib.is_remote(location):
    raise SweepError(f'--sweep_storage={shown}: a journal file must be on a local or mounted shared disk; for a '
                     f'gs:// --workdir pass --sweep_storage=/shared/disk/study.journal or a database URL.')
  try:
    if '://' in location:
      return _database(location)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(location))
  except Exception as e:  # noqa: BLE001 - drivers, sockets and files fail in many ways; each is one line
    reason = ' '.join(str(e).split())[:300] or type(e).__name__
    raise SweepError(f'--sweep_storage={shown} cannot be opened ({reason}); pass a reachable database URL '
                     f'(sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB with requirements-dev.txt\'s psycopg) or a '
                     f'journal file in a directory that exists.') from None


def _database(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
  """RDBStorage at `url`. On a new database the first hosts to open it create Optuna's tables and
  version row at once, and all but one of them fail on the other's rows: they open it again."""
  import sqlalchemy
  timeout = {'timeout': 60} if url.startswith('sqlite') else {'connect_timeout': 20}
  for attempt in range(attempts):
    try:
      return optuna.storages.RDBStorage(url, engine_kwargs={'connect_args': timeout})
    except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
      if attempt == attempts - 1:
        raise
      time.sleep(0.5 * (attempt + 1))


def _without_password(location: str) -> str:
  if '://' not in location:
    return location
  try:
    import sqlalchemy
    return sqlalchemy.engine.make_url(location).render_as_string(hide_password=True)
  except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: the open will say so
    return location


def create_or_join(storage, name: str, sampler, pruner, direction: str, points: list[dict] | None,
                   record: dict[str, Any]) -> optuna.Study:
  """The study `name`: created here (its points enqueued, then `record` stored as the user attribute
  'sweep') or, when another host or an earlier run created it, joined once its record is there.
  SweepError when the study holds another sweep."""
  try:
    study = optuna.create_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner,
                                direction=direction)
  except optuna.exceptions.DuplicatedStudyError:
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    return _joined(study, record)
  for slot, point in enumerate(points or []):
    study.enqueue_trial(point, user_attrs={'slot': slot})
  study.set_user_attr('sweep', record)
  return study


def _joined(study: optuna.Study, record: dict[str, Any]) -> optuna.Study:
  deadline = time.time() + RECORD_WAIT_S
  while (started := study.user_attrs.get('sweep')) is None:
    if time.time() > deadline:
      raise SweepError(f'Study {study.study_name!r} exists, but the host that created it has not recorded its sweep '
                       f'in {RECORD_WAIT_S} s (it may have died while starting); pass a new --workdir.')
    time.sleep(0.5)
  if started != record:
    differ = sorted(k for k in record if started.get(k) != record[k])
    raise SweepError(f'The storage holds the study of another sweep for {study.study_name} (it differs in '
                     f'{", ".join(differ)}); rerun that sweep as it was, or pass a new --workdir.')
  return study


# ---------------------------------------------------------------------------------------------- search space
def distribution(entry: dict[str, Any]) -> BaseDistribution:
  """Optuna's distribution of a checked `space` entry (sweeps/runner.py's parse_space)."""
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
  """The study's sampler; SweepError for options the sampler does not take or a missing PyTorch.
  A grid's and `trials`' points are enqueued (create_or_join), so its sampler proposes nothing."""
  if points is not None or name == 'qmc':
    if kwargs:
      raise SweepError(f"sampler {name!r} takes no options but 'seed', got {kwargs}.")
    if points is not None:
      return optuna.samplers.RandomSampler(seed=seed)
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
  return RetryHeartbeatStaleTrialCallback.retried_trial_number(trial) is not None


def take_slot(study: optuna.Study, trial: optuna.Trial, n_trials: int) -> int | None:
  """The trial's slot, recorded as its user attribute 'slot' (an enqueued point and a retry have
  theirs already); None, with the user attribute 'over_budget', when it comes after the budget."""
  if 'slot' in trial.user_attrs:
    return trial.user_attrs['slot']
  slot = sum(1 for t in study.get_trials(deepcopy=False) if t.number < trial.number and not is_retry(t))
  if slot >= n_trials:
    trial.set_user_attr('over_budget', True)
    return None
  trial.set_user_attr('slot', slot)
  return slot


def unclaimed(study: optuna.Study, n_trials: int) -> int:
  """Trials a worker may still take: slots no trial has taken, and queued points and retries."""
  trials = study.get_trials(deepcopy=False)
  fresh = sum(1 for t in trials if not is_retry(t))
  return max(0, n_trials - fresh) + sum(1 for t in trials if t.state == TrialState.WAITING)


def running(study: optuna.Study) -> list[int]:
  """The numbers of the study's running trials."""
  return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]


def retry(study: optuna.Study, trial: FrozenTrial, max_retry: int | None = MAX_RETRIES) -> None:
  """Queue `trial` again (same parameters, slot and workdir), with what it reported so far; not when
  it has been retried `max_retry` times already (None: no limit)."""
  RetryHeartbeatStaleTrialCallback(max_retry, inherit_intermediate_values=True)(study, trial)


def beat(trial: optuna.Trial) -> None:
  """Record that the worker running `trial` is alive."""
  try:
    trial.set_user_attr(HEARTBEAT_ATTR, time.time())
  except optuna.exceptions.UpdateFinishedTrialError:
    pass  # another host failed it as stale meanwhile; its retry runs elsewhere


def fail_stale_trials(study: optuna.Study, interval: float) -> None:
  """Fail the running trials whose worker has been silent for 2 x `interval` seconds, and queue
  again those that were running a proposal. Hosts' clocks are compared, so they should agree
  within the interval (NTP)."""
  now = time.time()
  for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
    # A retry copies its original's last beat: the start of this attempt counts as a beat too.
    last = max(trial.user_attrs.get(HEARTBEAT_ATTR, 0.0), trial.datetime_start.timestamp())
    if now - last <= 2 * interval:
      continue
    try:
      failed = study.tell(trial.number, state=TrialState.FAIL)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
      continue  # another host failed it (or its worker finished it) first
    if 'name' in failed.user_attrs:  # it ran a proposal (not a trial opened past the budget)
      retry(study, failed)
