"""Orbax checkpoints of a run: saving, retention, restoring onto any mesh, a full disk.

A checkpoint step holds three items, written together and atomically by Orbax:
  model      {'params': nnx.State, 'extra': nnx.State}  parameters plus every other model variable
             (dropout RNG streams, carried recurrent state)
  optimizer  the Optax state; for an optimizer evaluated at averaged parameters (schedule-free
             AdamW, train/optim.py `averages`) {'state': the Optax state, 'params': the parameters
             training continues from}, while `model` holds the averaged ones: what every evaluation
             scored and `load_run`, `--mode=eval` and the Hugging Face export read
  data       the input iterator position (JSON)
They live in `<workdir>/checkpoints/`; the run's other files are train/rundir.py's.

Restoring passes abstract arrays carrying the *current* mesh's shardings (`restore_target`), so a
run trained on 8 devices restores on 1 (or the reverse).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store  # no public alias in Orbax 0.12

import storage
from errors import UserError
from train.state import with_shardings

CHECKPOINT_DIR = 'checkpoints'
BROKEN_DIR = 'checkpoints_broken'  # checkpoints that failed to restore, moved aside by a resume


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
  """Orbax's save threads log a full disk with a traceback each; the Checkpointer raises it in the
  main thread as one DiskFullError instead."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not (disk_full_reason(error) or any(text in record.getMessage() for text in _DISK_FULL_TEXTS))


def _without_closed_loop_callbacks(previous_hook):
  """sys.unraisablehook, less the "Event loop is closed" errors of TensorStore writes that finish after
  the save they belong to failed (a full disk): Orbax closed that save's event loop on the first
  failure, and the failure itself is raised by the save."""

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
  device costs more than it parallelises (docs/platform.md, Checkpoints). The metadata store is the one
  Orbax's default handler has: it records which PRNG implementation a key array uses.
  """
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
        best_fn=self._rank, best_mode=best_mode,
        enable_async_checkpointing=bool(train_config and train_config.async_checkpoints),
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if policies else None)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=('model', 'optimizer', 'data'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _on_current_data(self, metrics: dict) -> bool:
    return metrics.get('data_since', 0) == self.data_since

  def _rank(self, metrics: dict) -> float:
    """BestN's sort key: the metric, or the worst value for scores taken on earlier data and for
    evaluations without it (a task metric of train.eval_tasks, scored every train.eval_tasks_every)."""
    if self._on_current_data(metrics) and self.best_metric in metrics:
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


def restore_target(spec) -> dict:
  """The abstract {'params', 'extra'} model item of a checkpoint, with `spec`'s shardings."""
  return {'params': with_shardings(spec.abstract.params, spec.shardings.params),
          'extra': with_shardings(spec.abstract.extra, spec.shardings.extra)}


def optimizer_item(opt_state, params, averages: bool):
  """The checkpoint's optimizer item (see the module docstring): the Optax state, or with `averages`
  {'state': it, 'params': the trained parameters `params`}."""
  return {'state': opt_state, 'params': params} if averages else opt_state


def optimizer_target(spec, averages: bool):
  """The abstract optimizer item, with `spec`'s shardings (restore target)."""
  opt_state = with_shardings(spec.abstract.opt_state, spec.shardings.opt_state)
  return optimizer_item(opt_state, with_shardings(spec.abstract.params, spec.shardings.params), averages)


def trained_state(restored: dict, averages: bool) -> tuple[Any, Any]:
  """(the parameters training continues from, the Optax state) of a restored checkpoint."""
  if averages:
    return restored['optimizer']['params'], restored['optimizer']['state']
  return restored['model']['params'], restored['optimizer']
