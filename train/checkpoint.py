"""Orbax checkpoints of a run, and `load_run` to reload one anywhere.

A checkpoint step holds three items, written together and atomically by Orbax:
  model      {'params': nnx.State, 'extra': nnx.State}  parameters plus every other model variable
             (dropout RNG streams, carried recurrent state)
  optimizer  the Optax state
  data       the input iterator position (JSON)
The workdir also holds `config.json` (the config the user asked for), `model.json` (the model
config that was built: the family's dataclass with everything resolved from the data) and the
tokenizer files, so a run reloads without its config file or data:

    from train.checkpoint import load_run
    run = load_run('runs/gpt-default-...')
    run.predict(['def fibonacci(n):'])

Restoring passes abstract arrays carrying the *current* mesh's shardings, so a run trained on 8
devices reloads on 1 (or the reverse).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

import storage
from errors import UserError

CHECKPOINT_DIR = 'checkpoints'
BROKEN_DIR = 'checkpoints_broken'  # checkpoints that failed to restore, moved aside by a resume
CONFIG_FILE = 'config.json'
MODEL_FILE = 'model.json'
DATA_KEYS = ('source', 'eval_source', 'test_source')  # config.data keys that name what a run reads
DATA_HISTORY = 'data_history'  # config.json: [{'step': the step it started at, 'source': ..., ...}], oldest first


class CheckpointError(UserError):
  """A missing, corrupt or incompatible checkpoint; the message names the fix."""


class DiskFullError(CheckpointError):
  """The disk (or the user's quota) filled while a checkpoint was written; earlier ones are intact."""


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# TensorStore (the arrays) reports a full disk as ValueError('RESOURCE_EXHAUSTED: ... No space left on
# device [os_error_code=28]'), without an errno: its text is matched too.
_DISK_FULL_TEXTS = tuple(os.strerror(code) for code in _DISK_FULL_ERRNOS)


def disk_full_reason(error: BaseException | None) -> str | None:
  """'No space left on device' or 'Disk quota exceeded' when `error`, or an exception it was raised
  from or while handling, is a full disk or quota; else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
      return os.strerror(error.errno)
    reason = next((text for text in _DISK_FULL_TEXTS if text in str(error)), None)
    if reason:
      return reason
    error = error.__cause__ or error.__context__
  return None


class _NoDiskFullTracebacks(logging.Filter):
  """Orbax's save threads log a full disk with a traceback each (129 of them in one run); the
  Checkpointer raises it in the main thread as one DiskFullError instead."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not (disk_full_reason(error) or any(text in record.getMessage() for text in _DISK_FULL_TEXTS))


def _without_closed_loop_callbacks(previous_hook):
  """sys.unraisablehook, less the "Event loop is closed" errors of TensorStore writes that finish after
  the save they belong to failed (a full disk): Orbax closed that save's event loop on the first
  failure, and the failure itself is raised by the save (on a 1 MB disk, 29 tracebacks of 6 lines)."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == 'Event loop is closed'):
      previous_hook(unraisable)

  return hook


sys.unraisablehook = _without_closed_loop_callbacks(sys.unraisablehook)


class _NoMissingMetricsWarning(logging.Filter):
  """Steps saved between evaluations (and on preemption) have no metrics by design."""

  def filter(self, record):
    return 'did not provide metrics' not in record.getMessage()


logging.getLogger('absl').addFilter(_NoMissingMetricsWarning())
logging.getLogger('absl').addFilter(_NoDiskFullTracebacks())


def _replica_parallel_saving_only_for_large_slices(min_bytes: int = 2**20) -> None:
  """Orbax's jax.Array handler, with replica-parallel saving (each replica of a replicated array
  writes one slice of it) kept for slices of at least `min_bytes`.

  Below that, slicing every small array (biases, LayerNorms, their optimizer moments) on every
  device costs more than it parallelises: on 8 CPU devices the two saves of a 4-step tiny
  Transformer run took 16.2 s, and 1.9 s with this. (Orbax already turns it off when
  JAX_PLATFORMS names a GPU.) The metadata store is the one Orbax's default handler has: it
  records which PRNG implementation a key array uses.
  """
  from orbax.checkpoint._src.metadata import array_metadata_store  # no public alias in Orbax 0.12
  handler = ocp.type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(),
                                           min_slice_bytes_for_replica_parallel=min_bytes)
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)  # the registry warns that it replaces the default handler
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl_logger.setLevel(level)


_replica_parallel_saving_only_for_large_slices()


class Checkpointer:
  """Keeps the latest `keep` checkpoints plus the best one by `best_metric`.

  Only checkpoints evaluated on the current validation data compete for best: each evaluated
  step's metrics carry `data_since`, the step at which the run's data last changed
  (`train.allow_data_change`); older scores were taken on other data and rank last."""

  def __init__(self, workdir: str, train_config=None, *, read_only: bool = False, data_since: int = 0):
    self.data_since = data_since
    location = workdir if storage.is_remote(workdir) else os.path.abspath(workdir)
    self.directory = storage.path(location) / CHECKPOINT_DIR
    policies = []
    best_metric, best_mode = 'eval/loss', 'min'
    if train_config is not None:
      best_metric, best_mode = train_config.best_metric, train_config.best_mode
    self.best_metric, self.best_mode = best_metric, best_mode
    self.keep = train_config.keep_checkpoints if train_config is not None else None
    self._in_flight: int | None = None  # the step of the newest save, whose writes may still run
    self._saved_bytes = 0  # the array bytes of that save
    if not read_only and train_config is not None:
      policies.append(ocp.checkpoint_managers.LatestN(n=train_config.keep_checkpoints))
      policies.append(ocp.checkpoint_managers.BestN(
          get_metric_fn=self._rank, reverse=best_mode == 'min', n=1, keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        create=not read_only, read_only=read_only,
        # best_fn only makes Orbax write each step's metrics (retention is the policies' job), so the
        # best checkpoint is still known after a resume and to `best_step`.
        best_fn=lambda metrics: metrics[best_metric], best_mode=best_mode,
        enable_async_checkpointing=bool(train_config and train_config.async_checkpoints),
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if policies else None)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=('model', 'optimizer', 'data'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _on_current_data(self, metrics: dict) -> bool:
    return metrics.get('data_since', 0) == self.data_since

  def _rank(self, metrics: dict) -> float:
    """BestN's sort key: the metric, or the worst value for scores taken on earlier data."""
    if self._on_current_data(metrics):
      return float(metrics[self.best_metric])
    return float('inf') if self.best_mode == 'min' else float('-inf')

  def best_step(self) -> tuple[int, float] | None:
    """(step, value) of the kept checkpoint with the best `best_metric`; None if none was saved
    with that metric (every evaluated step saves its eval metrics beside the checkpoint)."""
    scored = []
    for step in self.manager.all_steps():
      metrics = self.manager.metrics(step) or {}
      if self.best_metric in metrics and self._on_current_data(metrics):
        scored.append((float(metrics[self.best_metric]), step))
    if not scored:
      return None
    value, step = (min if self.best_mode == 'min' else max)(scored)
    return step, value

  def restore_newest_intact(self, abstract_model, abstract_opt=None, *, set_aside_broken: bool = False,
                            log=print) -> tuple[int | None, dict | None]:
    """(step, items) of the newest checkpoint that restores, or (None, None) when there is none.

    A newer checkpoint that fails while an older one restores into the same target is broken
    (a copy or upload cut short, a full disk): it is skipped with a message, and with
    `set_aside_broken` (training) moved to `checkpoints_broken/` so new saves can take its step.
    When no checkpoint restores, the newest one's error is raised: a model mismatch fails on every
    step and must not move anything."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    broken, first_error = [], None
    for step in steps:
      try:
        restored = self.restore(step, abstract_model, abstract_opt)
      except CheckpointError as e:
        broken.append(step)
        first_error = first_error or e
        continue
      for bad in broken:
        log(f'Skipped the checkpoint at step {bad} in {self.directory}: it does not restore '
            f'({str(first_error).splitlines()[0][:200]}). Using step {step}.')
        if set_aside_broken:
          self._set_aside(bad)
      return step, restored
    if first_error is not None:
      raise first_error
    return None, None

  def _set_aside(self, step: int) -> None:
    aside = self.directory.parent / BROKEN_DIR
    aside.mkdir(parents=True, exist_ok=True)
    (self.directory / str(step)).rename(aside / str(step))
    self.manager.reload()

  def save(self, step: int, model_state, opt_state, data_state: dict, metrics: dict | None = None) -> None:
    """Start writing the checkpoint of `step` (asynchronously when train.async_checkpoints). A full
    disk, here or in the previous save's background writes, raises DiskFullError."""
    self.wait()  # the previous save's failure is reported as that save's
    self._in_flight = step
    self._saved_bytes = sum(getattr(leaf, 'nbytes', 0) for leaf in jax.tree.leaves((model_state, opt_state)))
    if metrics is not None:
      metrics = {**metrics, 'data_since': self.data_since}
    with self._disk_full_as_error():
      self.manager.save(step, args=ocp.args.Composite(
          model=ocp.args.StandardSave(model_state), optimizer=ocp.args.StandardSave(opt_state),
          data=ocp.args.JsonSave(data_state)), metrics=metrics, force=True)

  def restore(self, step: int, abstract_model, abstract_opt=None) -> dict[str, Any]:
    """Restore `model` (and `optimizer` and `data` when `abstract_opt` is given) at `step`."""
    items = {'model': ocp.args.StandardRestore(abstract_model)}
    if abstract_opt is not None:
      items['optimizer'] = ocp.args.StandardRestore(abstract_opt)
      items['data'] = ocp.args.JsonRestore()
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax raises assorted types for corrupt files and shape mismatches.
      raise CheckpointError(
          f'Cannot restore the checkpoint at step {step} in {self.directory}: {type(e).__name__}: '
          f'{str(e)[:600]}\nThe checkpoint is corrupt or was written by a different model config. '
          f'Use the config the run was trained with (its config.json), or a fresh --workdir.') from e

  def wait(self) -> None:
    with self._disk_full_as_error():
      self.manager.wait_until_finished()

  def close(self) -> None:
    with self._disk_full_as_error():
      self.manager.close()

  @contextlib.contextmanager
  def _disk_full_as_error(self):
    try:
      yield
    except Exception as e:  # noqa: BLE001 - Orbax re-raises its threads' OSError / TensorStore ValueError
      reason = disk_full_reason(e)
      if reason is None:
        raise
      raise DiskFullError(self._disk_full_message(reason)) from e

  def _disk_full_message(self, reason: str) -> str:
    """What filled, where, how much the run needs there, and the step a rerun resumes from; the
    half-written checkpoint is removed first (its space is free again and no resume may read it)."""
    _join_orbax_threads()
    if jax.process_index() == 0:
      for unfinished in ocp.path.step.all_temporary_paths(self.directory):
        unfinished.get().rmtree(missing_ok=True)
    self.manager.reload()
    last = self.manager.latest_step()
    each = _tree_bytes(self.directory / str(last)) if last is not None else self._saved_bytes
    count = self.keep + 2  # the latest train.keep_checkpoints, the best one, the one being written
    free = '' if storage.is_remote(self.directory) else f' ({_size(shutil.disk_usage(self.directory).free)} free)'
    resume = (f'the last intact checkpoint is step {last}, where rerunning the same command resumes' if last is not None
              else 'no checkpoint is complete yet, so a rerun starts from step 0')
    return (f'{reason}: the checkpoint of step {self._in_flight} could not be written to {self.directory}{free}. '
            f'The run needs about {_size(count * each)} there ({count} checkpoints of {_size(each)}: '
            f'train.keep_checkpoints={self.keep}, the best one, the one being written): free space or lower '
            f'train.keep_checkpoints. Nothing half-written is left; {resume}.')


def _join_orbax_threads(timeout_s: float = 60) -> None:
  """Wait for Orbax's background threads (at most `timeout_s` in all). Orbax raises the first failure
  of a save while the save's other writes still run: without this they write into the directory
  after it was cleaned, and log tracebacks at exit."""
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and type(thread).__module__.startswith('orbax.'):
      with contextlib.suppress(Exception):  # Orbax's threads re-raise their error: the save's, reported already
        thread.join(max(0.0, deadline - time.monotonic()))


def _tree_bytes(directory) -> int:
  """Bytes of the files under `directory` (epath globs no `**`)."""
  return sum(_tree_bytes(p) if p.is_dir() else p.stat().length for p in directory.iterdir())


def _size(num_bytes: int) -> str:
  return f'{num_bytes / 2**30:.1f} GB' if num_bytes >= 2**30 else f'{num_bytes / 2**20:.1f} MB'


def save_config(config, workdir: str, data_history: list[dict] | None = None) -> None:
  """`config.json`: the config, and the run's `data_history` when given (see `data_history`)."""
  record = json.loads(config.to_json())
  if data_history:
    record[DATA_HISTORY] = data_history
  storage.write_atomically(os.path.join(workdir, CONFIG_FILE), json.dumps(record, indent=2))


def data_history(workdir: str) -> list[dict]:
  """[{'step', 'source', 'eval_source', 'test_source'}]: the data a run in `workdir` has read, each
  entry from the step it started at (a run saved before the history existed: its one source, from
  step 0); [] when the workdir holds no config.json."""
  if not (storage.path(workdir) / CONFIG_FILE).exists():
    return []
  saved = json.loads((storage.path(workdir) / CONFIG_FILE).read_text())
  if DATA_HISTORY in saved:
    return list(saved[DATA_HISTORY])
  return [{'step': 0, **{key: saved.get('data', {}).get(key, '') for key in DATA_KEYS}}]


def data_since(workdir: str) -> int:
  """The step at which the run's current data started (0 unless `train.allow_data_change` was used)."""
  history = data_history(workdir)
  return history[-1]['step'] if history else 0


def read_config(workdir: str) -> ml_collections.ConfigDict:
  path = storage.path(workdir) / CONFIG_FILE
  if not path.exists():
    raise CheckpointError(f'{path} not found: {workdir} is not a run directory '
                          f'(expected config.json, tokenizer and checkpoints/).')
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def save_model_config(model_config, rng_impl: str, workdir: str) -> None:
  """`model.json`: {'class': the dataclass name, 'fields': its values, 'rng_impl': the PRNG of its
  random streams (the shape of the dropout keys the checkpoints hold)}."""
  storage.write_atomically(os.path.join(workdir, MODEL_FILE), json.dumps(
      {'class': type(model_config).__name__, 'fields': dataclasses.asdict(model_config), 'rng_impl': rng_impl},
      indent=2))


def read_rng_impl(workdir: str) -> str | None:
  """The PRNG a run's model was built with (None: no run in `workdir`; runs saved before
  model.json used threefry)."""
  from train.state import LEGACY_RNG_IMPL
  path = storage.path(workdir) / MODEL_FILE
  if not path.exists():
    return LEGACY_RNG_IMPL if (storage.path(workdir) / CONFIG_FILE).exists() else None
  return json.loads(path.read_text())['rng_impl']


def read_model_config(workdir: str, model_config_class: type):
  """The model config saved in `workdir/model.json`, or None for runs saved before it existed."""
  path = storage.path(workdir) / MODEL_FILE
  if not path.exists():
    return None
  saved = json.loads(path.read_text())
  if saved['class'] != model_config_class.__name__:
    raise CheckpointError(f'{path} holds a {saved["class"]}, not the {model_config_class.__name__} of this family; '
                          f'the run directory belongs to another model family.')
  types = {f.name: f.type for f in dataclasses.fields(model_config_class)}
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in saved['fields'].items() if k in types}
  return model_config_class(**fields)


def run_config(workdir: str, overrides: dict | None = None):
  """(the run's config, its resolved model config): `config.json` with `overrides` applied and
  checked, and `model.json` (or, for runs saved before model.json, the model config the family
  derives from the old config.json, whose keys that are no longer inputs are dropped)."""
  from train.task import get_task
  from train.validation import validate_config
  config = read_config(workdir)
  task = get_task(config)
  model_config = read_model_config(workdir, task.model_config_class)
  if model_config is None:
    task = get_task(_model_fields_only(config, task.model_config_class))
    model_config = task.legacy_model_config(config, task.load_tokenizer(workdir))
  config = _in_current_schema(config)
  for key, value in (overrides or {}).items():
    _set(config, key, value, workdir)
    model_config = _with_model_override(model_config, key, value, workdir)
  config = _on_these_devices(config)
  validate_config(config)
  return config, model_config


def _model_fields_only(saved, model_config_class: type):
  """A copy of a saved config without the `model.*` keys that are not fields of `model_config_class`
  (keys an older schema had, e.g. `model.attention` of families without attention)."""
  config = saved.copy_and_resolve_references()
  fields = {f.name for f in dataclasses.fields(model_config_class)}
  with config.unlocked():
    for key in [k for k in config.model if k not in fields]:
      del config.model[key]
  return config


def _with_model_override(model_config, key: str, value, workdir: str):
  """A `model.<field>` override of a reloaded run: runtime fields (attention, dtype, ...) change its
  model config; fields that fix what the checkpoint holds cannot."""
  from train.task import RUNTIME_FIELDS
  section, _, field = key.partition('.')
  if section != 'model' or field not in {f.name for f in dataclasses.fields(model_config)}:
    return model_config
  if field in RUNTIME_FIELDS:
    return dataclasses.replace(model_config, **{field: value})
  if getattr(model_config, field) != value:
    raise CheckpointError(f'--config.{key}={value!r} cannot apply to {workdir}: its model has {field}='
                          f'{getattr(model_config, field)!r} ({os.path.join(workdir, MODEL_FILE)}). Train a new run '
                          f'for another model.')
  return model_config


def _in_current_schema(saved):
  """The family's current schema with the saved values of the keys it still has: keys a run saved
  that are no longer inputs are dropped, keys added since take their defaults."""
  from train.validation import flatten, reference_config
  config = reference_config(saved)
  known = flatten(config)
  for key, value in flatten(saved).items():
    if key in known:
      *parents, leaf = key.split('.')
      target = config
      for parent in parents:
        target = target[parent]
      target[leaf] = value
  return config


def _set(config, key: str, value, workdir: str) -> None:
  target = config
  *parents, leaf = key.split('.')
  for parent in parents:
    target = target.get(parent) if isinstance(target, ml_collections.ConfigDict) else None
  if not isinstance(target, ml_collections.ConfigDict) or leaf not in target:
    raise CheckpointError(f"Unknown config key '{key}': {os.path.join(workdir, CONFIG_FILE)} has no such "
                          f"setting, so the override cannot apply to this run.")
  target[leaf] = value


def _on_these_devices(config):
  """`config` with a data-parallel mesh over the devices present when its own mesh does not fit
  them (a run trained on 8 devices evaluates on 1: checkpoints restore onto any mesh)."""
  from train import sharding
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
    return config
  except ValueError:
    print(f"Note: the run's mesh {dict(config.mesh)} does not fit the {jax.device_count()} devices here; "
          f'using a data-parallel mesh over all of them.', flush=True)
    config = config.copy_and_resolve_references()
    config.mesh.update({'data': -1, 'fsdp': 1, 'tensor': 1})
    return config


@dataclasses.dataclass
class Run:
  """A reloaded run: call `run.model(...)` directly, or `run.predict(lines)`."""
  config: ml_collections.ConfigDict
  model_config: Any
  model: nnx.Module
  tokenizer: Any
  step: int
  task: Any
  workdir: str

  def predict(self, lines: list[str]) -> list[Any]:
    """One output per line; inputs longer than the model's window are cut, with a note on stderr."""
    for note in self.task.predict_truncation(lines):
      print(f'note: {note}', file=sys.stderr, flush=True)
    return self.task.predict(self.model, lines, self.workdir)


def load_run(workdir: str, step: int | None = None, config_overrides: dict | None = None) -> Run:
  """Reload a run's model (parameters bound), tokenizer and config on the current devices.

  `step` None is the newest checkpoint that restores (see `Checkpointer.best_step` for the best).

  The model is rebuilt from `model.json`. `config_overrides` ({'task': 'features'}) change
  settings of the saved config.json (behaviour such as decoding or the BERT task, not the model's
  shape); keys it lacks are an error."""
  from train import sharding, state
  from train.task import Prepared, get_task
  config, model_config = run_config(workdir, config_overrides)
  task = get_task(config)
  task.bind(Prepared(datasets=None, tokenizer=task.load_tokenizer(workdir), model_config=model_config))
  checkpointer = Checkpointer(workdir, read_only=True)
  if checkpointer.latest_step() is None:
    raise CheckpointError(f'No checkpoint in {checkpointer.directory}; train first (python launch.py '
                          f'--config=... --workdir={workdir}).')
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1, 'tensor': 1})
  spec = state.state_spec(task.build_model, mesh, read_rng_impl(workdir))
  if step is None:
    step, restored = checkpointer.restore_newest_intact(restore_target(spec))
  else:
    restored = checkpointer.restore(step, restore_target(spec))
  restored = restored['model']
  checkpointer.close()
  model = nnx.merge(spec.graphdef, restored['params'], restored['extra'])
  model.eval()
  return Run(config=config, model_config=model_config, model=model, tokenizer=task.tokenizer, step=step, task=task,
             workdir=workdir)


def restore_target(spec) -> dict:
  """The abstract {'params', 'extra'} model item of a checkpoint, with `spec`'s shardings."""
  from train.state import with_shardings
  return {'params': with_shardings(spec.abstract.params, spec.shardings.params),
          'extra': with_shardings(spec.abstract.extra, spec.shardings.extra)}
