"""CI: run the commands the docs show that tests/shown_commands.py marks as run as written (`RUN`).

Each is run by bash in the repository root, in `SHOWN`'s order, with the caller's environment (no flag
or variable of the test suite's), and must exit 0 within COMMAND_SECONDS. The outputs the docs give
them (`/tmp/...`, `runs/...`) are removed first, so that a second run of CI on one machine starts as
the first did; a command that reads a run (`--mode=eval --workdir=runs/x`) keeps the one an earlier
command wrote. A `mkdocs serve` command runs until it serves the site's first page, then is stopped.
Each command's seconds are printed; a failure prints the end of its output and exits 1.

Usage: python .ci/shown_commands.py [--list]
"""
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))
import shown_commands  # noqa: E402  (tests/shown_commands.py: the table of every command shown)

COMMAND_SECONDS = 15 * 60
SERVE_URL, SERVE_SECONDS = 'http://127.0.0.1:8000/', 180


def new_workdir_modes() -> tuple[str, ...]:
  """launch.py's NEW_WORKDIR_MODES: the modes that write a workdir; the others read a run's."""
  with open(os.path.join(REPO, 'launch.py')) as f:
    return ast.literal_eval(re.search(r'^NEW_WORKDIR_MODES = (\(.*?\))', f.read(), re.M).group(1))


def outputs(command: str) -> list[str]:
  """The local paths a command writes that it names (--out_dir=/tmp/x, --out=..., and the --workdir=/tmp/x
  of a launch that writes one; `--mode=eval --workdir=runs/x` reads the run an earlier command wrote)."""
  mode = re.search(r'--mode=(\w+)', command)
  flags = 'out_dir|out|workdir' if not mode or mode.group(1) in new_workdir_modes() else 'out_dir|out'
  return [path for path in re.findall(rf'--(?:{flags})=(\S+)', command) if not path.startswith('gs://')]


def serve(command: str) -> None:
  """Start `command` (a `mkdocs serve`), wait until it serves the site's index page, stop it."""
  process = subprocess.Popen(['bash', '-c', command], cwd=REPO, start_new_session=True)
  try:
    deadline = time.time() + SERVE_SECONDS
    while time.time() < deadline:
      if process.poll() is not None:
        raise SystemExit(f'error: {command!r} exited with status {process.returncode} before serving {SERVE_URL}')
      try:
        page = urllib.request.urlopen(SERVE_URL, timeout=5).read().decode()
        if '<title>' in page and 'attention-lineage' in page:
          return
      except OSError:
        pass
      time.sleep(1)
    raise SystemExit(f'error: {command!r} served no page at {SERVE_URL} in {SERVE_SECONDS} s')
  finally:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait()


def run(command: str) -> None:
  for path in outputs(command):
    shutil.rmtree(path, ignore_errors=True)
  if command.endswith('mkdocs serve'):
    serve(command)
    return
  try:
    result = subprocess.run(['bash', '-c', command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=COMMAND_SECONDS)
  except subprocess.TimeoutExpired:
    raise SystemExit(f'error: {command!r} ran past {COMMAND_SECONDS} s') from None
  if result.returncode:
    print(result.stdout[-6000:])
    raise SystemExit(f'error: {command!r} exited with status {result.returncode}')


def main() -> None:
  commands = [text for text, how in shown_commands.SHOWN.items() if how == shown_commands.RUN]
  if sys.argv[1:] == ['--list']:
    print('\n'.join(commands))
    return
  started = time.time()
  for i, command in enumerate(commands, 1):
    begun = time.time()
    print(f'[{i}/{len(commands)}] $ {command}', flush=True)
    run(command)
    print(f'    {time.time() - begun:.0f} s', flush=True)
  print(f'{len(commands)} commands shown in the docs ran as written in {time.time() - started:.0f} s')


if __name__ == '__main__':
  main()
