"""launch.py runs for the tests, forked from a process that has already imported what launch.py imports.

Importing JAX, Flax, Grain, Orbax and the trainer takes ~2.5 s of CPU per process, and the suite
starts launch.py dozens of times. This server (one per test worker, started on first use) imports
them once, before any JAX backend exists, and serves each request by forking: the child sets the
request's environment, working directory and argv, redirects stdin from /dev/null and stdout /
stderr into files, runs launch.py as `__main__` and exits through the interpreter's normal shutdown,
as `python launch.py ...` would. XLA reads XLA_FLAGS (the fake device count) when the child first
starts a backend, so each child gets its own; variables JAX reads at import (JAX_*) cannot change
after the fork, so `support.launch` starts a fresh interpreter for a request that changes them.
The server restarts itself with glibc's huge-page tunable as launch.py does (huge_pages.py), and
its children keep that GLIBC_TUNABLES, so launch.py sees it set and does not restart them.
Forking is safe while no backend exists: JAX itself only warns about os.fork once it has started
one (xla_bridge installs its at-fork warning then). The one thread jaxlib starts at import waits
idle on a futex; Python 3.12+ warns about any fork of a process with a second thread, so that
warning is silenced here.

Several children may run at once (two hosts of a sweep, two processes of one distributed run).
Protocol (one JSON object per line): request {id, argv, env, cwd, stdin, stdout, stderr, new_session}
on stdin (stdin: a file to read, or null for /dev/null; new_session: the child calls setsid, as
Popen(start_new_session=True) does); replies {id, pid} when the child starts and {id, returncode}
(negative: killed by that signal) when it ends, on stdout.
"""
import gc
import json
import os
import runpy
import select
import signal
import sys
import warnings

REAP_EVERY_S = 0.02  # how often the server looks for ended children while any runs


def preload() -> None:
  """Import what launch.py's modes import, and start nothing (no backend, no thread)."""
  import jax  # noqa: F401
  import optax  # noqa: F401
  from flax import nnx  # noqa: F401
  from train import evaluation, metrics, rundir, trainer  # noqa: F401
  metrics.summary_writer_class()  # tensorboardX as the trainer imports it: without torch (1.2 s)


def serve() -> dict | None:
  """Answer requests until stdin closes and every child has ended (None); in a forked child, return its request."""
  warnings.filterwarnings('ignore', message=r'.*use of fork\(\) may lead to deadlocks', category=DeprecationWarning)
  children, unread, reading = {}, b'', True  # children: pid -> request id
  while reading or children:
    if select.select([0] if reading else [], [], [], REAP_EVERY_S if children else None)[0]:
      chunk = os.read(0, 1 << 16)
      reading, unread = bool(chunk), unread + chunk
      *lines, unread = unread.split(b'\n')
      for line in lines:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
          return request
        children[pid] = request['id']
        reply({'id': request['id'], 'pid': pid})
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      reply({'id': children.pop(pid), 'returncode': os.waitstatus_to_exitcode(status)})
  return None


def reply(message: dict) -> None:
  sys.stdout.write(json.dumps(message) + '\n')
  sys.stdout.flush()


def run_launch(request: dict) -> None:
  """In the child: become `cd cwd && env ... python launch.py argv... <stdin >stdout 2>stderr`."""
  if request['new_session']:
    os.setsid()
  signal.signal(signal.SIGINT, signal.default_int_handler)
  server_tunables = os.environ.get('GLIBC_TUNABLES')
  os.environ.clear()
  os.environ.update(request['env'])
  if server_tunables is not None:  # the child's malloc is the server's, set up when it started: say so, or
    os.environ['GLIBC_TUNABLES'] = server_tunables  # launch.py would restart it as the server (huge_pages.py)
  os.chdir(request['cwd'])
  written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
  for fd, path, flags in ((0, request['stdin'] or os.devnull, os.O_RDONLY), (1, request['stdout'], written),
                          (2, request['stderr'], written)):
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)
  sys.stdin = open(0, closefd=False)
  script = os.path.join(request['cwd'], 'launch.py')
  sys.argv = [script, *request['argv']]
  runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, as for launch.py
  import huge_pages
  huge_pages.restart_with_huge_pages()  # as launch.py does, so that the forked children's malloc is a launch's
  preload()
  gc.freeze()  # the imports stay out of the children's full garbage collections (and their pages shared)
  child_request = serve()
  if child_request is not None:
    run_launch(child_request)  # its SystemExit (or its return) ends the child like launch.py's process
