"""One training per workdir: `<workdir>/train.lock` names the process that holds it.

Two trainings writing one workdir mix their metrics and overwrite each other's checkpoints, so a
second one is refused with one line. A lock whose holder is gone is stale and is taken over: on
the same host the holder's pid no longer runs; from another host (a pod's workdir on shared or
cloud storage) its heartbeat, refreshed every `HEARTBEAT_S` by a background thread, is older than
`STALE_AFTER_S`. Only process 0 of a multi-host run holds the lock.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import storage
from errors import UserError

LOCK_FILE = 'train.lock'
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0


class WorkdirBusy(UserError):
  """Another live training holds the workdir."""


class WorkdirLock:

  def __init__(self, workdir: str, log=print):
    self.path = storage.path(workdir) / LOCK_FILE
    self.log = log
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._record = {'host': socket.gethostname(), 'pid': os.getpid(), 'started': time.time()}

  def acquire(self) -> None:
    """Take the lock, or raise WorkdirBusy naming the live holder."""
    if not self._create():
      holder = self._read()
      reason = self._stale_reason(holder)
      if reason is None:
        started = time.strftime('%Y-%m-%d %H:%M', time.localtime(holder.get('started', 0)))
        raise WorkdirBusy(
            f'{self.path.parent} is being trained by pid {holder.get("pid")} on {holder.get("host")} (since '
            f'{started}); wait for it or stop it, or train into another --workdir. If that process is gone, '
            f'delete {self.path}.')
      self.log(f'Taking over the stale lock {self.path} ({reason}).')
      self._write()
    self._thread = threading.Thread(target=self._beat, name='workdir-lock-heartbeat', daemon=True)
    self._thread.start()

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    holder = self._read()
    if holder.get('pid') == self._record['pid'] and holder.get('host') == self._record['host']:
      self.path.unlink(missing_ok=True)

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

  # ---------------------------------------------------------------- internals
  def _create(self) -> bool:
    """Create the lock file unless it exists; atomic on local disks (O_EXCL)."""
    if storage.is_remote(self.path):
      if self.path.exists():  # object stores have no exclusive create: a narrow race remains
        return False
      self._write()
      return True
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'w') as f:
      json.dump({**self._record, 'heartbeat': time.time()}, f)
    return True

  def _write(self) -> None:
    self.path.write_text(json.dumps({**self._record, 'heartbeat': time.time()}))

  def _read(self) -> dict:
    try:
      return json.loads(self.path.read_text())
    except (FileNotFoundError, ValueError):  # removed meanwhile, or caught mid-write
      return {}

  def _stale_reason(self, holder: dict) -> str | None:
    if not holder:
      return 'unreadable'
    if holder.get('host') == self._record['host']:
      return None if _pid_alive(holder.get('pid')) else f'pid {holder.get("pid")} is not running'
    age = time.time() - float(holder.get('heartbeat', 0))
    return f'no heartbeat from {holder.get("host")} for {age / 60:.0f} min' if age > STALE_AFTER_S else None

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        self._write()
      except OSError as e:  # a storage hiccup must not kill training; the next beat retries
        self.log(f'Could not refresh {self.path}: {e}')


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ProcessLookupError, TypeError, ValueError):
    return False
  except PermissionError:  # alive, owned by another user
    return True
  return True
