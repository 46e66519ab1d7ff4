"""The workdir guard: one training holds a workdir, and a setup that fails leaves nothing behind.

    with WorkdirGuard(workdir) as guard:
      ...set up (read data, save the tokenizer, build the state)...
      guard.set_up()
      ...resume, train, evaluate...

Until `set_up()`, SIGTERM ends the setup like Ctrl-C (KeyboardInterrupt) and any failure removes a
workdir this guard created, so a killed or refused setup leaves no orphan tokenizer or empty run.
After it the workdir holds the run and is kept whatever happens. The lock (train/workdir_lock.py,
taken by process 0; every process learns the outcome) is held until the block exits.
"""
from __future__ import annotations

import contextlib
import signal
import threading

import jax

import storage
from errors import UserError
from train.multihost import agreed
from train.workdir_lock import WorkdirLock


class WorkdirGuard:

  def __init__(self, workdir: str):
    self.directory = storage.path(workdir)
    self.lock = WorkdirLock(workdir)
    self._created = False
    self._setting_up = False
    self._previous_sigterm = None

  def __enter__(self) -> 'WorkdirGuard':
    self._created = not self.directory.exists()
    self.directory.mkdir(parents=True, exist_ok=True)
    self._setting_up = True
    self._interrupt_on_sigterm()
    try:
      self._take_lock()
    except BaseException:
      self._leave(failed=True)
      raise
    return self

  def set_up(self) -> None:
    """The run's setup is done: from now on SIGTERM is training's to handle and the workdir is kept."""
    self._setting_up = False
    self._restore_sigterm()

  def __exit__(self, exc_type, exc, traceback) -> None:
    self._leave(failed=exc_type is not None)

  def _leave(self, failed: bool) -> None:
    self._restore_sigterm()
    if jax.process_index() == 0:
      self.lock.release()
    if failed and self._setting_up and self._created and jax.process_index() == 0:
      with contextlib.suppress(OSError):  # the original error matters, not a failed clean-up
        self.directory.rmtree()

  def _take_lock(self) -> None:
    error = None
    if jax.process_index() == 0:
      try:
        self.lock.acquire()
      except UserError as e:
        error = e
    if not agreed(error is None):
      raise error or UserError(f'Process 0 could not lock {self.lock.path}: another training holds the workdir.')

  def _interrupt_on_sigterm(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return

    def interrupt(signum, frame):
      raise KeyboardInterrupt

    self._previous_sigterm = signal.signal(signal.SIGTERM, interrupt)

  def _restore_sigterm(self) -> None:
    if self._previous_sigterm is not None:
      signal.signal(signal.SIGTERM, self._previous_sigterm)
      self._previous_sigterm = None
