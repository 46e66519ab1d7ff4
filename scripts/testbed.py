"""What the tests and the scripts that drive launch.py on this machine (scripts/fault_soak.py) share:
a free localhost port, a small generated corpus, a local GCS emulator. The tests import it
(tests/support.py); it imports nothing of theirs (it runs tests/gcs_emulator.py, the emulator as the
tests patch it, as a program)."""
import os
import socket
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau '
         'upsilon phi chi psi omega').split()


def free_port() -> int:
  """A TCP port of localhost that no process listens on now (the OS's pick)."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def write_corpus(directory, files: int = 6, lines: int = 60, seed: int = 0) -> str:
  """Small text files doc<i>.txt of pseudo-sentences (3-8 words of WORDS in order, from a seeded
  start); returns a `text:` source for them."""
  rng = np.random.default_rng(seed)
  os.makedirs(directory, exist_ok=True)
  for f in range(files):
    with open(os.path.join(directory, f'doc{f}.txt'), 'w') as out:
      for _ in range(lines):
        start = rng.integers(len(WORDS))
        out.write(' '.join(WORDS[(start + k) % len(WORDS)] for k in range(rng.integers(3, 9))) + '.\n')
  return f'text:{directory}/*.txt'


def start_gcs_emulator(bucket: str, log_path: str, timeout: float = 30) -> tuple[subprocess.Popen, str]:
  """(the process, its http://localhost:<port> URL) of a GCS emulator (tests/gcs_emulator.py) serving
  `bucket` in memory, once it accepts connections; RuntimeError when it does not within `timeout`
  seconds (the emulator stopped, or not installed: requirements-dev.txt). Its output goes to
  `log_path`, never to a pipe: it prints a traceback for every connection a client drops, and once an
  unread pipe's 64 KiB fill up, it blocks and every request hangs."""
  port = free_port()
  command = [sys.executable, os.path.join(REPO, 'tests', 'gcs_emulator.py'), 'start', f'--port={port}',
             '--in-memory', f'--default-bucket={bucket}', '--quiet']
  with open(log_path, 'w') as log:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + timeout
  while True:
    try:
      socket.create_connection(('localhost', port), timeout=1).close()
      return process, f'http://localhost:{port}'
    except OSError:
      if process.poll() is not None or time.time() > deadline:
        process.kill()
        process.wait()
        with open(log_path) as log:
          raise RuntimeError(f'the GCS emulator did not start on port {port}: {log.read()[-500:]}') from None
      time.sleep(0.1)
