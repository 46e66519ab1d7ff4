"""A throwaway PostgreSQL server on localhost for the tests: the newest of Debian's `postgresql`
binaries (.ci/run installs the package when they are missing), else `initdb` and `postgres` on PATH
(Fedora's postgresql-server, Homebrew's postgresql), a new cluster in a temporary directory, TCP on
127.0.0.1 at a free port, trust authentication, and no fsync (nothing outlives the test). Without a
server the tests that need one are skipped with one line naming what to install (MISSING).

    with PostgresServer() as server:
      url = server.url  # postgresql://sweeps@127.0.0.1:PORT/postgres

PostgreSQL refuses to run as root: as root (CI), the cluster belongs to the `postgres` user the
Debian package creates, and the server runs as that user.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

from scripts.testbed import free_port

USER = 'sweeps'  # the database role the tests connect as (initdb's superuser)
DEBIAN_SERVERS = '/usr/lib/postgresql/*/bin'  # Debian's server programs, one folder per major version
MISSING = ('PostgreSQL server not found (initdb and postgres): apt-get install postgresql (Debian) / dnf install '
           'postgresql-server (Fedora) / brew install postgresql (macOS)')


def programs() -> dict[str, str] | None:
  """{'initdb': path, 'postgres': path} of the newest Debian PostgreSQL server, else of the programs
  on PATH; None when neither has both."""
  for folder in sorted(glob.glob(DEBIAN_SERVERS), key=lambda p: int(os.path.basename(os.path.dirname(p))),
                       reverse=True):
    found = {name: os.path.join(folder, name) for name in ('initdb', 'postgres')}
    if all(os.access(path, os.X_OK) for path in found.values()):
      return found
  found = {name: shutil.which(name) for name in ('initdb', 'postgres')}
  return found if all(found.values()) else None


class PostgresServer:

  def __init__(self, start_timeout: float = 60):
    self.start_timeout = start_timeout
    self.process: subprocess.Popen | None = None

  def __enter__(self) -> 'PostgresServer':
    found = programs()
    if found is None:
      import pytest
      pytest.skip(MISSING)
    self.root = tempfile.mkdtemp(prefix='sweep-postgres-')  # not pytest's tmp_path: the postgres user cannot enter it
    user = None
    if os.geteuid() == 0:
      user = 'postgres'
      entry = pwd.getpwnam(user)
      os.chown(self.root, entry.pw_uid, entry.pw_gid)
    data = os.path.join(self.root, 'data')
    subprocess.run([found['initdb'], '-D', data, '-U', USER, '--auth=trust', '-E', 'UTF8',
                    '--no-sync'], user=user, check=True, capture_output=True, timeout=120)
    self.port = free_port()
    self.log = os.path.join(self.root, 'server.log')
    with open(self.log, 'w') as log:
      if user:
        os.chown(self.log, os.stat(self.root).st_uid, os.stat(self.root).st_gid)
      self.process = subprocess.Popen(
          [found['postgres'], '-D', data, '-h', '127.0.0.1', '-p', str(self.port), '-k', self.root,
           '-c', 'fsync=off', '-c', 'full_page_writes=off', '-c', 'synchronous_commit=off'],
          user=user, stdout=log, stderr=subprocess.STDOUT)
    self.url = f'postgresql://{USER}@127.0.0.1:{self.port}/postgres'
    self._wait_until_up()
    return self

  def _wait_until_up(self) -> None:
    import psycopg
    deadline = time.time() + self.start_timeout
    while True:
      try:
        psycopg.connect(host='127.0.0.1', port=self.port, user=USER, dbname='postgres', connect_timeout=5).close()
        return
      except psycopg.OperationalError:
        if self.process.poll() is not None or time.time() > deadline:
          self.__exit__()
          raise RuntimeError(f'PostgreSQL did not start: {open(self.log).read()[-2000:]}') from None
        time.sleep(0.1)

  def __exit__(self, *exc) -> None:
    if self.process is not None and self.process.poll() is None:
      self.process.send_signal(signal.SIGINT)  # fast shutdown: SIGTERM would wait for clients to disconnect
      try:
        self.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    shutil.rmtree(self.root, ignore_errors=True)
