"""Sweeps: an Optuna study whose trials are `launch.py` processes, each in its own workdir.

  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --workdir=runs/sweep
  python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --workdir=runs/rs --sweep_workers=2
  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --sweep_dry_run      # print the commands only
  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --config.train.steps=100   # applies to every trial

A sweep file defines `get_sweep()` returning a dict:
  config     the --config argument of every trial, e.g. 'configs/gpt.py:tiny' (a --config flag given
             with --sweep replaces it)
  overrides  {key: value} for every trial (optional)
  grid       {key: [values, ...]}: one trial per combination, in order (optional)
  trials     [{key: value, ...}, ...]: further trials, each its own overrides (optional)
  space      instead of grid/trials, a search space {key: entry}: {'low': 1e-4, 'high': 3e-2, 'log': True}
             (a float range; 'log' optional), {'low': 1, 'high': 3} (integer bounds: an integer range;
             'step' optional), or [32, 64] (a choice)
  sampler    with a space: 'random' (default) | 'qmc' (scrambled Sobol) | 'tpe' | 'gp' (needs torch) |
             'grid' (every combination of a space of choices); a dict {'name': 'tpe', 'n_startup_trials': 5}
             passes options to Optuna's sampler ('seed' among them is the sweep's seed)
  seed       the sampler's seed (default 0); each trial's proposal depends on (seed, its slot) only
  n_trials   with a space: the budget, met exactly once however many workers and hosts take part
  pruner     'none' (default) | 'median' | 'successive_halving' | 'hyperband', or {'name': 'median',
             'n_startup_trials': 3, ...} with Optuna's options; it needs an eval/ metric
  metric     what the study optimizes (default 'eval/loss'): an eval/<name> (scored during training, so
             prunable; the final value is the best checkpoint's over the whole validation split) or a
             test/<name> of the trial's final JSON line
  direction  'minimize' (default) or 'maximize'
Every mistake in the file (it does not run, get_sweep is missing or raises, a value of the wrong
shape, a key the trials' config lacks or a value it cannot take) is one line before any trial starts.

Each trial is `python launch.py --config=... --workdir=<workdir>/<trial> --config.<key>=<value> ...`
in its own process (a crash, OOM or bad config ends that trial only; its log is in
<workdir>/logs/<trial>.log). Overrides apply in the order: the sweep's `overrides`, --config.*
flags of the sweep command, the trial's own values. The trial's process knows nothing of the
sweep: its worker reads the evaluations it logs, reports them to the study and, when the pruner
says so, stops it through training's SIGTERM path (sweeps/evaluations.py).

The study lives in --sweep_storage (default <workdir>/study.journal, an Optuna journal file; a file
path on a disk several hosts share, or a database URL, lets hosts running the same command with
the same --workdir join it). --sweep_workers=N runs N trials at once; --sweep_devices=0,1,...
gives each its share of the accelerators. Rerunning the command resumes the study: finished
trials are not rerun, a trial interrupted by Ctrl-C or SIGTERM resumes from its checkpoint, and a
trial whose worker died (no heartbeat for 2 x --sweep_heartbeat seconds) is failed and run again
from its checkpoint. Results (sweeps/report.py), rewritten after every trial: sweep.csv,
sweep.md (with the best trial's command), eval_loss.png; at the end history.png, importance.png.
A sweep in which no trial finished ok ends with one error line (exit status 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import optuna
from optuna.trial import TrialState

import storage
from sweeps import evaluations, report, studies
from sweeps.studies import SweepError

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch.py')
SPEC_KEYS = ('config', 'overrides', 'grid', 'trials', 'space', 'sampler', 'seed', 'n_trials', 'pruner', 'metric',
             'direction')
POLL_S = 2  # how often a host with no trial left looks whether the others' trials have finished
WATCH_S = 0.5  # how often a worker reads its running trial's metrics
CHOICE_TYPES = (str, int, float, bool, type(None))  # what Optuna stores as a categorical value
SPACE_EXAMPLE = "{'train.lr': {'low': 1e-4, 'high': 3e-2, 'log': True}, 'model.num_layers': {'low': 1, 'high': 3}, " \
                "'model.width': [32, 64]}"


@dataclasses.dataclass(frozen=True)
class Sweep:
  config: str
  common: dict[str, Any]  # the sweep's `overrides`, for every trial
  keys: list[str]  # the swept keys, in the file's order (the table's columns)
  points: list[dict[str, Any]] | None  # grid + trials, each a trial's own overrides; None for a space
  space: dict[str, dict[str, Any]] | None  # checked entries (parse_space)
  sampler: tuple[str, dict]
  seed: int
  n_trials: int
  pruner: tuple[str, dict]
  metric: str
  direction: str

  def record(self, extra_args: list[str]) -> dict[str, Any]:
    """What makes a study this sweep's: hosts joining it and reruns must agree (a search's budget may grow)."""
    fields = {k: v for k, v in dataclasses.asdict(self).items() if k != 'n_trials' or self.points is not None}
    return json.loads(json.dumps({**fields, 'extra_args': list(extra_args)}))


# ---------------------------------------------------------------------------------------------- the sweep file
def trial_name(index: int, overrides: dict[str, Any]) -> str:
  """'03-lr=0.001-width=64': the index keeps names unique, the last key component keeps them short."""
  parts = [f'{key.split(".")[-1]}={value}' for key, value in overrides.items()]
  return re.sub(r'[^A-Za-z0-9_.=+-]', '_', '-'.join([f'{index:02d}', *parts]))[:120]


def _one_line(error: BaseException) -> str:
  return ' '.join(f'{type(error).__name__}: {error}'.split())[:300]


def load_sweep(path: str, config: str | None = None) -> Sweep:
  """Read and check a sweep file; `config` (the --config flag) replaces the file's `config`."""
  if not os.path.isfile(path):
    raise SweepError(f'--sweep={path} is not a file; sweep files live in configs/sweeps/.')
  spec_loader = importlib.util.spec_from_file_location('_sweep', path)
  module = importlib.util.module_from_spec(spec_loader)
  try:
    spec_loader.loader.exec_module(module)
  except SyntaxError as e:
    raise SweepError(f'{path}, line {e.lineno}: {e.msg}; fix the sweep file.') from None
  except Exception as e:  # noqa: BLE001 - whatever the file raises, as one line
    raise SweepError(f'{path} fails when it is read ({_one_line(e)}); fix the sweep file.') from None
  get_sweep = getattr(module, 'get_sweep', None)
  if not callable(get_sweep):
    raise SweepError(f'{path} must define get_sweep() returning a dict (see sweeps/runner.py).')
  try:
    spec = get_sweep()
  except Exception as e:  # noqa: BLE001
    raise SweepError(f'{path}: get_sweep() raised {_one_line(e)}; fix the sweep file.') from None
  if not isinstance(spec, dict):
    raise SweepError(f'{path}: get_sweep() returned a {type(spec).__name__}, not a dict such as '
                     f"{{'config': 'configs/gpt.py:tiny', 'grid': {{'train.lr': [1e-3, 3e-3]}}}}.")
  config = config or spec.get('config')
  if not config or not isinstance(config, str):
    raise SweepError(f"{path}: get_sweep() has no 'config' string (e.g. 'configs/gpt.py:tiny') and no --config was "
                     f'given.')
  return parse(spec, config)


def parse(spec: dict[str, Any], config: str) -> Sweep:
  """The Sweep of a get_sweep() dict; one SweepError per mistake, before anything runs."""
  points, space = _points_or_space(spec)
  name, options = _named(spec.get('sampler', 'grid' if points else 'random'), 'sampler', studies.SAMPLERS)
  seed = _seed(spec, options)
  if points is None and name == 'grid':
    if not all('choices' in entry for entry in space.values()):
      raise SweepError("sampler 'grid' takes a space of choices only (lists); use 'random' or 'qmc' for ranges.")
    points = [dict(zip(space, values)) for values in itertools.product(*(e['choices'] for e in space.values()))]
  elif points is not None and name != 'grid':
    raise SweepError(f"`grid` and `trials` run as listed; sampler {name!r} needs a `space` instead.")
  n_trials = spec.get('n_trials', len(points) if points else None)
  if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1 or (points and n_trials > len(points)):
    raise SweepError(f'n_trials={n_trials!r}: ' + (f'the grid has {len(points)} points.' if points else
                                                   'a search over a `space` needs a budget, e.g. n_trials=12.'))
  metric, direction = spec.get('metric', 'eval/loss'), spec.get('direction', 'minimize')
  pruner = _named(spec.get('pruner', 'none'), 'pruner', sorted(studies.PRUNERS))
  _check_objective(metric, direction, pruner[0])
  keys = list(dict.fromkeys(k for p in points for k in p)) if points else list(space)
  sweep = Sweep(config, dict(spec.get('overrides') or {}), keys, points and points[:n_trials],
                None if points else space, (name, options), seed, n_trials, pruner, metric, direction)
  studies.make_sampler(*sweep.sampler, seed, sweep.points, sweep.space)  # its options are checked now
  studies.make_pruner(*pruner)
  return sweep


def _seed(spec: dict[str, Any], sampler_options: dict) -> int:
  """The sweep's seed: `seed`, or the sampler's option 'seed' (taken out of its options)."""
  seed = spec.get('seed', 0)
  if 'seed' in sampler_options:
    given = sampler_options.pop('seed')
    if 'seed' in spec and given != seed:
      raise SweepError(f"seed={seed!r} and the sampler's seed={given!r} differ; give the seed once.")
    seed = given
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise SweepError(f'seed={seed!r} must be an integer.')
  return seed


def _points_or_space(spec: dict[str, Any]) -> tuple[list[dict] | None, dict | None]:
  unknown = set(spec) - set(SPEC_KEYS)
  if unknown:
    raise SweepError(f'Unknown sweep keys {sorted(unknown, key=str)}; use {", ".join(SPEC_KEYS)}.')
  _check_overrides(spec.get('overrides') or {}, '`overrides`', '{"train.steps": 60}')
  if 'space' not in spec:
    return expand(spec), None
  if spec.get('grid') or spec.get('trials'):
    raise SweepError('Give either a `space` to search or a `grid`/`trials` to run as listed, not both.')
  return None, parse_space(spec['space'])


def _check_overrides(overrides: Any, what: str, example: str) -> None:
  """`overrides` must be {config key: a number, string, boolean or None}."""
  if not isinstance(overrides, dict):
    raise SweepError(f'{what} must be a dict {{config key: value}}, e.g. {example}; got {overrides!r}.')
  for key, value in overrides.items():
    if not isinstance(key, str) or not key:
      raise SweepError(f'{what}: the key {key!r} is not a config key such as "train.lr".')
    if not isinstance(value, CHOICE_TYPES):
      raise SweepError(f'{what}: {key}={value!r}: swept values must be numbers, strings, booleans or None.')


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
  """The trials' own overrides: every combination of `grid`, then each entry of `trials`."""
  grid = spec.get('grid') or {}
  if not isinstance(grid, dict):
    raise SweepError(f"`grid` must be a dict {{config key: [values, ...]}}, e.g. {{'train.lr': [1e-3, 3e-3]}}; "
                     f'got {grid!r}.')
  for key, values in grid.items():
    if not isinstance(values, (list, tuple)) or not values:
      raise SweepError(f'grid[{key!r}] must be a non-empty list of values, got {values!r}.')
    for value in values:
      _check_overrides({key: value}, '`grid`', "{'train.lr': [1e-3, 3e-3]}")
  combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else []
  extra = spec.get('trials') or []
  if not isinstance(extra, (list, tuple)) or not all(isinstance(t, dict) for t in extra):
    raise SweepError(f'`trials` must be a list of dicts of overrides, e.g. [{{"train.lr": 1e-3}}]; got {extra!r}.')
  for point in extra:
    _check_overrides(point, '`trials`', '[{"train.lr": 1e-3}]')
  trials = combos + [dict(t) for t in extra]
  if not trials:
    raise SweepError('The sweep defines no trials: give a non-empty `grid`, `trials` or `space`.')
  return trials


def parse_space(space: Any) -> dict[str, dict[str, Any]]:
  """The checked `space`: {key: {'choices': [...]}} or {key: {'low', 'high', 'log', 'step', 'int'}}."""
  if not isinstance(space, dict) or not space:
    raise SweepError(f'`space` must be a non-empty dict of config keys, e.g. {SPACE_EXAMPLE}.')
  checked = {}
  for key, entry in space.items():
    if not isinstance(key, str) or not key:
      raise SweepError(f'`space`: the key {key!r} is not a config key such as "train.lr".')
    if isinstance(entry, (list, tuple)) and entry and all(isinstance(v, CHOICE_TYPES) for v in entry):
      checked[key] = {'choices': list(entry)}
    elif isinstance(entry, dict):
      checked[key] = _check_range(key, entry)
    else:
      raise SweepError(f"space[{key!r}] = {entry!r}: give a non-empty list of choices (numbers, strings), or "
                       f"{{'low': ..., 'high': ...}} with 'log': True for a log scale.")
  return checked


def _check_range(key: str, entry: dict) -> dict[str, Any]:
  unknown = set(entry) - {'low', 'high', 'log', 'step'}
  low, high, log, step = entry.get('low'), entry.get('high'), entry.get('log', False), entry.get('step')
  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  problem = (f'unknown keys {sorted(unknown, key=str)}' if unknown else
             "needs numbers 'low' and 'high'" if not (number(low) and number(high)) else
             f"'low' ({low}) must be below 'high' ({high})" if low >= high else
             "'log' must be True or False" if not isinstance(log, bool) else
             f"a log range needs 'low' > 0 (got {low})" if log and low <= 0 else
             "'step' must be a positive number, without 'log'" if step is not None and (
                 not number(step) or step <= 0 or log) else None)
  if problem:
    raise SweepError(f"space[{key!r}] = {entry!r}: {problem}; e.g. {{'low': 1e-4, 'high': 3e-2, 'log': True}}.")
  is_int = all(isinstance(v, int) for v in (low, high) + ((step,) if step is not None else ()))
  return {'low': low, 'high': high, 'log': log, 'step': step, 'int': is_int}


def _named(value: Any, what: str, names) -> tuple[str, dict]:
  """('median', {options}) from 'median' or {'name': 'median', option: value}."""
  if isinstance(value, dict) and isinstance(value.get('name'), str):
    options = dict(value)
    name = options.pop('name')
  elif isinstance(value, str):
    name, options = value, {}
  else:
    raise SweepError(f"`{what}` must be a name or {{'name': ..., option: value}}, got {value!r}.")
  if name not in names:
    raise SweepError(f'Unknown {what} {name!r}; use one of {", ".join(names)}.')
  return name, options


def _check_objective(metric: Any, direction: Any, pruner: str) -> None:
  if not isinstance(metric, str) or not re.fullmatch(r'(eval|test)/\S+', metric):
    raise SweepError(f'metric={metric!r} is not a result of a trial: use eval/<name> (e.g. eval/loss, scored '
                     f'during training) or test/<name> (e.g. test/bleu, scored once at the end).')
  if direction not in ('minimize', 'maximize'):
    raise SweepError(f"direction={direction!r}: use 'minimize' or 'maximize'.")
  if pruner != 'none' and not metric.startswith('eval/'):
    raise SweepError(f"pruner {pruner!r} reads the metric during training, and {metric} is scored only at the "
                     f"end: use an eval/ metric or 'pruner': 'none'.")


def override_arg(key: str, value: Any) -> str:
  return f'--config.{key}={value}'


def every_override(sweep: Sweep) -> list[str]:
  """Every `--config.<key>=<value>` the sweep may give a trial: its overrides, each value of its
  points and choices, and the bounds of its ranges (as the type the range draws: int or float),
  so that a value the trials' config cannot take is found before any trial starts."""
  values = [*sweep.common.items(), *(item for point in sweep.points or [] for item in point.items())]
  for key, entry in (sweep.space or {}).items():
    if 'choices' in entry:
      values += [(key, choice) for choice in entry['choices']]
    else:
      kind = int if entry['int'] else float
      values += [(key, kind(entry['low'])), (key, kind(entry['high']))]
  return list(dict.fromkeys(override_arg(key, value) for key, value in values))


def propose(sweep: Sweep, trial: optuna.Trial, slot: int) -> dict[str, Any]:
  """The trial's own overrides: an enqueued point's values, or the study's sampler's proposal (a
  retry gets back the values it had)."""
  if sweep.points is not None:
    choices = {k: list(dict.fromkeys(p[k] for p in sweep.points if k in p)) for k in sweep.keys}
    return {key: trial.suggest_categorical(key, choices[key]) for key in sweep.points[slot]}
  return {key: studies.suggest(trial, key, entry) for key, entry in sweep.space.items()}


def name_of(sweep: Sweep, slot: int, own: dict[str, Any]) -> str:
  """A grid's trials keep their exact values in their names, a search's are rounded to 4 digits."""
  if sweep.points is None:
    own = {k: f'{v:.4g}' if isinstance(v, float) else v for k, v in own.items()}
  return trial_name(slot, own)


def trial_command(sweep: Sweep, name: str, own: dict[str, Any], workdir: str, extra_args: list[str] = (),
                  program: tuple[str, str] = (sys.executable, LAUNCH)) -> list[str]:
  common = [override_arg(k, v) for k, v in sweep.common.items()]
  own = [override_arg(k, v) for k, v in own.items()]
  return [*program, f'--config={sweep.config}', f'--workdir={os.path.join(workdir, name)}', *common, *extra_args,
          *own]


def _error_line(stderr: str, returncode: int) -> str:
  lines = [line.strip() for line in stderr.splitlines() if line.strip()]
  for line in reversed(lines):
    if line.startswith('error:'):
      return line[len('error:'):].strip()
  return lines[-1] if lines else f'exit status {returncode}'


def _last_json(stdout: str) -> dict | None:
  lines = stdout.strip().splitlines()
  try:
    return json.loads(lines[-1]) if lines else None
  except ValueError:
    return None


# ---------------------------------------------------------------------------------------------- running trials
@dataclasses.dataclass
class Ended:
  """How a trial's process ended."""
  returncode: int
  stdout: str
  stderr: str
  seconds: float
  pruned: dict[str, float] | None  # the evaluation at which the pruner stopped it (a metrics.jsonl line)


class DevicePool:
  """--sweep_devices split evenly among the workers: a running trial holds one group and sees only
  it (CUDA_VISIBLE_DEVICES), so trials never share an accelerator."""

  def __init__(self, devices: str | None, workers: int):
    ids = [d.strip() for d in (devices or '').split(',') if d.strip()]
    if len(ids) % workers:
      raise SweepError(f'--sweep_devices={devices} has {len(ids)} devices for --sweep_workers={workers}; give a '
                       f'multiple of the workers (e.g. 8 GPUs for 8 or 4 workers).')
    size = len(ids) // workers
    self.free: queue.Queue = queue.Queue()
    for worker in range(workers):
      self.free.put(ids[worker * size:(worker + 1) * size] if ids else None)

  @contextlib.contextmanager
  def take(self):
    group = self.free.get()
    try:
      yield {} if group is None else {'CUDA_VISIBLE_DEVICES': ','.join(group)}
    finally:
      self.free.put(group)


class Runner:
  """Runs a study's trials as launch.py processes, `workers` threads at a time, each asking the
  study for a trial (`study.ask`), running it, and telling the study how it ended (`study.tell`),
  until the budget is done here or on other hosts."""

  def __init__(self, sweep: Sweep, study: optuna.Study, workdir: str, *, workers: int = 1,
               devices: DevicePool | None = None, heartbeat: int = 30, extra_args=(), env: dict | None = None):
    self.sweep, self.study, self.workdir = sweep, study, workdir
    self.workers, self.devices, self.heartbeat = workers, devices or DevicePool(None, workers), heartbeat
    self.extra_args, self.env = list(extra_args), env
    self.interrupted = False
    self.error: Exception | None = None  # what stopped a worker; run() raises it
    self.children: set[subprocess.Popen] = set()
    self.local: set[int] = set()  # the numbers of the trials this host's workers are running
    self.waiting_said = False
    self.lock = threading.Lock()  # the workers share the children, the result files and stdout

  def run(self) -> None:
    """Take trials until every slot of the budget is finished, here or on other hosts."""
    with self._signals():
      threads = [threading.Thread(target=self._work, name=f'sweep-worker-{i}', daemon=True)
                 for i in range(self.workers)]
      for thread in threads:
        thread.start()
      for thread in threads:
        while thread.is_alive():  # in short waits, so that the main thread takes Ctrl-C and SIGTERM
          thread.join(timeout=0.5)
    if self.error is not None:
      raise self.error

  def _work(self) -> None:
    try:
      while not self.interrupted:
        studies.fail_stale_trials(self.study, self.heartbeat)
        if not studies.unclaimed(self.study, self.sweep.n_trials):
          with self.lock:
            elsewhere = set(studies.running(self.study)) - self.local
          if not elsewhere:  # this host's own running trials end with their workers
            return
          self._wait_for(elsewhere)
          continue
        self._run_trial(self.study.ask())
    except Exception as e:  # noqa: BLE001 - a sweep-level failure (a metric no trial logs, a storage error)
      with self.lock:
        self.error = self.error or e
      self.interrupt(forward=True)

  def _wait_for(self, elsewhere: set[int]) -> None:
    if not self.waiting_said:
      self.waiting_said = True
      self._say(f'Waiting for {len(elsewhere)} trial(s) running elsewhere (a dead worker\'s are run again after '
                f'{2 * self.heartbeat} s without a heartbeat).')
    time.sleep(min(self.heartbeat, POLL_S))

  def _run_trial(self, trial: optuna.Trial) -> None:
    studies.beat(trial)
    slot = studies.take_slot(self.study, trial, self.sweep.n_trials)
    if slot is None:  # two workers asked for the last slot at once: this one runs nothing
      self._tell(trial, state=TrialState.FAIL)
      return
    with self.lock:
      self.local.add(trial.number)
    try:
      own = propose(self.sweep, trial, slot)
      if 'name' in trial.user_attrs:  # a retry: clear what its last attempt recorded
        trial.set_user_attr('interrupted', False)
        trial.set_user_attr('error', '')
      else:
        trial.set_user_attr('name', name_of(self.sweep, slot, own))
      name = trial.user_attrs['name']
      if self.interrupted:
        self._interrupted(trial, name, 0.0)
        return
      self._say(f'[{slot + 1}/{self.sweep.n_trials}] {name} ...')
      command = trial_command(self.sweep, name, own, self.workdir, self.extra_args)
      ended = self._launch(trial, os.path.join(self.workdir, name), command)
      self._write_log(name, ended.stdout + '\n--- stderr ---\n' + ended.stderr)
      trial.set_user_attr('seconds', ended.seconds)
      self._outcome(trial, name, ended)
    except BaseException:
      self._tell(trial, state=TrialState.FAIL, skip_if_finished=True)
      raise
    finally:
      with self.lock:
        self.local.discard(trial.number)
        self.write_results()

  def _tell(self, trial: optuna.Trial, **outcome) -> optuna.trial.FrozenTrial | None:
    """study.tell; None when another host has failed the trial as stale meanwhile (it runs again there)."""
    try:
      return self.study.tell(trial, **outcome)
    except optuna.exceptions.UpdateFinishedTrialError:
      return None

  def _write_log(self, name: str, text: str) -> None:
    """logs/<trial>.log: the trial's stdout and stderr, after those of its earlier attempts."""
    log = storage.path(os.path.join(self.workdir, 'logs', f'{name}.log'))
    log.parent.mkdir(parents=True, exist_ok=True)
    earlier = log.read_text() + '\n--- the next attempt (resumed) ---\n' if log.exists() else ''
    log.write_text(earlier + text)

  def _launch(self, trial: optuna.Trial, trial_dir: str, command: list[str]) -> Ended:
    """Run the trial's process on its accelerators; while it runs, beat its heartbeat and report
    its evaluations, and SIGTERM it when the pruner says so (sweeps/evaluations.py)."""
    reporter = evaluations.Reporter(self.study, trial, trial_dir, self.sweep.metric)
    prunable = self.sweep.pruner[0] != 'none'
    with self.devices.take() as device_env, tempfile.TemporaryFile('w+') as out, \
        tempfile.TemporaryFile('w+') as err:  # files, not pipes: a long trial's output would fill a pipe
      started = last_beat = time.time()
      process = subprocess.Popen(command, stdout=out, stderr=err, text=True,
                                 env={**(self.env or os.environ), **device_env})
      with self.lock:
        self.children.add(process)
      if self.interrupted:  # a SIGTERM that came while it started
        process.terminate()
      pruned = None
      try:
        while process.poll() is None:
          with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=WATCH_S)
          if time.time() - last_beat >= self.heartbeat:
            studies.beat(trial)
            last_beat = time.time()
          if pruned is None and process.returncode is None:
            pruned = reporter.report(may_prune=prunable and not self.interrupted)
            if pruned is not None:
              process.send_signal(signal.SIGTERM)  # training saves a checkpoint and stops
        if pruned is None:
          reporter.report(may_prune=False)  # what it logged since the last look
      finally:
        with self.lock:
          self.children.discard(process)
      out.seek(0)
      err.seek(0)
      return Ended(process.returncode, out.read(), err.read(), time.time() - started, pruned)

  def _outcome(self, trial: optuna.Trial, name: str, ended: Ended) -> None:
    """Tell the study how the trial ended: ok (its metric), pruned, interrupted (queued again) or failed."""
    final = _last_json(ended.stdout) if ended.returncode == 0 else None
    if ended.pruned is not None:
      self._pruned(trial, name, ended, final)
    elif final is not None and not final.get('preempted'):
      self._finished(trial, name, final, ended.seconds)
    elif self.interrupted or final is not None or ended.returncode in (130, -signal.SIGINT, -signal.SIGTERM):
      self._interrupted(trial, name, ended.seconds)
    else:
      self._failed(trial, name, ended)

  def _failed(self, trial: optuna.Trial, name: str, ended: Ended) -> None:
    error = _error_line(ended.stderr, ended.returncode) if ended.returncode else 'no final JSON line'
    trial.set_user_attr('error', error)
    self._tell(trial, state=TrialState.FAIL)
    self._say(f'    {name}: FAILED: {error} ({ended.seconds:.0f} s)')

  def _pruned(self, trial: optuna.Trial, name: str, ended: Ended, final: dict | None) -> None:
    """Its results are the evaluation at which it was pruned; its workdir keeps the checkpoint it
    saved when stopped (the step of its final line, or its last evaluation if it ended otherwise)."""
    at = int(ended.pruned['step'])
    stopped = final.get('step') if final else None
    trial.set_user_attr('metrics', {k: v for k, v in ended.pruned.items() if k == 'step' or k.startswith('eval/')})
    trial.set_user_attr('pruned_at', at)
    trial.set_user_attr('stopped_at', stopped)
    self._tell(trial, state=TrialState.PRUNED)
    saved = f', saved at step {stopped}' if stopped is not None else ''
    self._say(f'    {name}: pruned at step {at}{saved}, {self.sweep.metric}={ended.pruned[self.sweep.metric]:.4f} '
              f'({ended.seconds:.0f} s)')

  def _finished(self, trial: optuna.Trial, name: str, final: dict, seconds: float) -> None:
    metrics = {k: v for k, v in final.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    trial.set_user_attr('metrics', metrics)
    metric = self.sweep.metric
    if metric not in metrics:  # every trial of a family logs the same names: no trial would have it
      self._tell(trial, state=TrialState.FAIL)
      raise SweepError(f'metric={metric!r} is not among the results of trial {name}: '
                       f'{", ".join(sorted(metrics))}; set the sweep\'s metric to one of them and use a new --workdir.')
    if not math.isfinite(metrics[metric]):
      trial.set_user_attr('error', f'{metric}={metrics[metric]}')
      self._tell(trial, state=TrialState.FAIL)
      self._say(f'    {name}: FAILED: {metric}={metrics[metric]} ({seconds:.0f} s)')
      return
    self._tell(trial, values=metrics[metric])
    self._say(f'    {name}: {metric}={metrics[metric]:.4f} ({seconds:.0f} s)')

  def _interrupted(self, trial: optuna.Trial, name: str, seconds: float) -> None:
    """Ctrl-C or SIGTERM stopped the trial after it saved a checkpoint: queued to resume."""
    trial.set_user_attr('interrupted', True)
    failed = self._tell(trial, state=TrialState.FAIL)
    if failed is not None:
      studies.retry(self.study, failed, max_retry=None)
    self._say(f'    {name}: interrupted ({seconds:.0f} s); it resumes from its checkpoint when the sweep reruns')

  def write_results(self, final: bool = False) -> None:
    command = lambda t: trial_command(self.sweep, t.user_attrs['name'], {k: t.params[k] for k in self.sweep.keys
                                                                         if k in t.params}, self.workdir,
                                      self.extra_args, program=('python', 'launch.py'))
    report.write_results(self.sweep, self.study, self.workdir, command, final)

  def interrupt(self, forward: bool) -> None:
    """Stop taking trials; with `forward`, SIGTERM the running ones (each saves and stops)."""
    self.interrupted = True
    if forward:
      with self.lock:
        for child in self.children:
          with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

  @contextlib.contextmanager
  def _signals(self):
    """Ctrl-C reaches the trials from the terminal (one process group) and SIGTERM is passed on to
    them: each saves a checkpoint and stops, and the sweep ends once they have. A second Ctrl-C
    aborts them without saving (launch.py's rule). Rerunning the command resumes them."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    handler = lambda signum, frame: self.interrupt(forward=signum == signal.SIGTERM)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield
    finally:
      for signum, old in previous.items():
        signal.signal(signum, old)

  def _say(self, line: str) -> None:
    with self.lock:
      print(line, flush=True)


# ---------------------------------------------------------------------------------------------- entry points
def study_name(workdir: str) -> str:
  return workdir.rstrip('/') or '/'


def open_study(sweep: Sweep, workdir: str, storage_, extra_args=()) -> optuna.Study:
  """The sweep's study in `storage_` (None: in memory), created by the first host (or run) and
  joined by the others; SweepError when it holds another sweep."""
  return studies.create_or_join(
      storage_, study_name(workdir), studies.make_sampler(*sweep.sampler, sweep.seed, sweep.points, sweep.space),
      studies.make_pruner(*sweep.pruner), sweep.direction, sweep.points, sweep.record(extra_args))


def print_commands(sweep: Sweep, workdir: str, extra_args=()) -> None:
  """--sweep_dry_run: the first n_trials proposals, from an in-memory study with no results (TPE
  and GP proposals after their first trials depend on the results)."""
  study = open_study(sweep, workdir, None, extra_args)
  for _ in range(sweep.n_trials):
    trial = study.ask()
    slot = studies.take_slot(study, trial, sweep.n_trials)
    own = propose(sweep, trial, slot)
    print(shlex.join(trial_command(sweep, name_of(sweep, slot, own), own, workdir, extra_args)), flush=True)


def run_sweep(sweep: Sweep, workdir: str, *, storage_location: str | None = None, workers: int = 1,
              devices: str | None = None, heartbeat: int = 30, dry_run: bool = False, extra_args=(),
              env: dict | None = None) -> optuna.Study | None:
  """Run (or with `dry_run` print) the sweep's trials; write the results. KeyboardInterrupt after a
  Ctrl-C or SIGTERM, once the running trials have saved; SweepError when no trial finished ok."""
  warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)
  optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep prints one line per trial itself
  if dry_run:
    return print_commands(sweep, workdir, extra_args)
  if workers < 1 or heartbeat < 1:
    raise SweepError(f'--sweep_workers={workers} and --sweep_heartbeat={heartbeat} must be at least 1.')
  if storage_location is None and storage.is_remote(workdir):
    raise SweepError(f'--workdir={workdir}: the default study file needs a local disk; pass --sweep_storage (a '
                     f'journal file on a shared disk, or a database URL).')
  pool = DevicePool(devices, workers)
  if storage_location is None:
    storage.path(workdir).mkdir(parents=True, exist_ok=True)
  location = storage_location or os.path.join(workdir, 'study.journal')
  # A storage that fails leaves no workdir.
  study = open_study(sweep, workdir, studies.open_storage(location), extra_args)
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  runner = Runner(sweep, study, workdir, workers=workers, devices=pool, heartbeat=heartbeat, extra_args=extra_args,
                  env=env)
  try:
    runner.run()
  finally:
    runner.write_results(final=True)
  _summary(runner, location)
  if runner.interrupted:
    raise KeyboardInterrupt
  _check_some_trial_ok(study, workdir)
  return study


def _summary(runner: Runner, location: str) -> None:
  best = report.best_trial(runner.study)
  if best is not None:
    print(f'Best: {best.user_attrs["name"]} ({runner.sweep.metric}={best.value:.4f})', flush=True)
  print(f'Results: {os.path.join(runner.workdir, "sweep.md")}, sweep.csv, eval_loss.png, history.png, '
        f'importance.png; study: {location} (optuna-dashboard {location})', flush=True)


def _check_some_trial_ok(study: optuna.Study, workdir: str) -> None:
  """SweepError when the sweep ended with no trial ok (every one failed or was pruned)."""
  trials = report.budget_trials(study)
  if any(t.state == TrialState.COMPLETE for t in trials):
    return
  failed = [t for t in trials if t.state == TrialState.FAIL]
  first = f'; the first error: {failed[0].user_attrs["name"]}: {failed[0].user_attrs.get("error")}' if failed else ''
  raise SweepError(f'No trial of the sweep finished ok ({len(failed)} of {len(trials)} failed{first}); see '
                   f'{os.path.join(workdir, "sweep.md")} and the trials\' logs in {os.path.join(workdir, "logs")}.')


def run_sweep_from_flags(flags, argv: list[str], check_overrides=None) -> optuna.Study | None:
  """launch.py --sweep: the sweep file, --workdir, the --sweep_* flags, and --config / --config.*
  flags. `check_overrides(config, args)` raises for a `--config.<key>=<value>` the trials' config
  lacks or cannot take."""
  config = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  extra = [a for a in argv if a.startswith('--config.')]
  sweep = load_sweep(flags.sweep, config)
  if check_overrides:
    check_overrides(sweep.config, list(dict.fromkeys([*every_override(sweep), *extra])))
  if flags.sweep_storage and not flags.workdir:
    raise SweepError('--sweep_storage needs --workdir: every host of a study writes its trials under the same one.')
  name = os.path.splitext(os.path.basename(flags.sweep))[0]
  workdir = flags.workdir or os.path.join('runs', f'sweep-{name}-{time.strftime("%Y%m%d-%H%M%S")}')
  return run_sweep(sweep, workdir, storage_location=flags.sweep_storage, workers=flags.sweep_workers,
                   devices=flags.sweep_devices, heartbeat=flags.sweep_heartbeat, dry_run=flags.sweep_dry_run,
                   extra_args=extra)
