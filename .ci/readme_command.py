"""CI: README.md's first command run as a user runs it, then `--mode=eval` on the workdir it printed.

The command is read from README.md (the first indented line after `## Two commands`), less its
`pip install -r ... &&` (CI's virtual environment has requirements.txt installed), and run by bash in
the repository root with the caller's environment: no flag or variable of the test suite's. Its
result line (the last line it prints: JSON with the run's workdir and final evaluation) must hold
eval/ or test/ numbers, and `python launch.py --mode=eval --workdir=<that workdir>` must give each
of them to the last digit: the same evaluation of the same checkpoint. The workdir stays (runs/ is
git-ignored), as a user's run does.

Usage: python .ci/readme_command.py   (exit status 1, with one line saying why, when a check fails)
"""
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = '## Two commands'


class CheckFailed(Exception):
  """One line: which check failed and what was seen."""


def readme_command(readme: str) -> str:
  """The first indented line after `## Two commands`, without its `pip install ...` parts."""
  lines = readme.splitlines()
  if HEADING not in lines:
    raise CheckFailed(f'README.md has no line {HEADING!r}: nothing says which command to run.')
  block = lines[lines.index(HEADING) + 1:]
  command = next((line.strip() for line in block if line.startswith(('    ', '\t')) and line.strip()), None)
  if command is None:
    raise CheckFailed(f'README.md has no indented command line after {HEADING!r}.')
  kept = [part.strip() for part in command.split('&&') if not part.split()[:2] == ['pip', 'install']
          and not part.split()[:4] == ['python', '-m', 'pip', 'install']]
  if len(kept) != 1 or 'launch.py' not in kept[0]:
    raise CheckFailed(f'README.md\'s first command {command!r} is not `pip install ... && python launch.py ...`.')
  return kept[0]


def run(command: str) -> dict:
  """Run `command` with bash in the repository root, its output shown as it comes: its result line."""
  print(f'$ {command}', flush=True)
  process = subprocess.Popen(['bash', '-c', command], cwd=REPO, stdout=subprocess.PIPE, text=True)
  last = ''
  for line in process.stdout:
    print(line, end='', flush=True)
    last = line if line.strip() else last
  if process.wait() != 0:
    raise CheckFailed(f'`{command}` exited with status {process.returncode}.')
  try:
    result = json.loads(last)
  except ValueError:
    raise CheckFailed(f'`{command}` did not end with a JSON result line: {last.strip()[:200]!r}') from None
  if not isinstance(result, dict) or 'workdir' not in result:
    raise CheckFailed(f'`{command}`\'s result line names no workdir: {last.strip()[:200]!r}')
  return result


def check_readme_command() -> str:
  with open(os.path.join(REPO, 'README.md')) as f:
    command = readme_command(f.read())
  started = time.monotonic()
  trained = run(command)
  trained_seconds = time.monotonic() - started
  numbers = {key: value for key, value in trained.items() if key.startswith(('eval/', 'test/'))}
  if trained.get('mode') != 'train' or not numbers:
    raise CheckFailed(f'`{command}` is no training with a final evaluation: {json.dumps(trained)[:300]}')
  evaluated = run(f"python launch.py --mode=eval --workdir={shlex.quote(trained['workdir'])}")
  differing = {key: (value, evaluated.get(key)) for key, value in numbers.items() if evaluated.get(key) != value}
  if differing or evaluated.get('step') != trained.get('final_eval_step'):
    raise CheckFailed(f"--mode=eval differs from `{command}`'s result line: {differing} (step "
                      f"{evaluated.get('step')} against final_eval_step {trained.get('final_eval_step')})")
  shown = ', '.join(f'{key}={value}' for key, value in numbers.items())
  return (f'README command 1 `{command}`: {trained_seconds:.0f} s, workdir {trained["workdir"]}; --mode=eval gives '
          f'its {len(numbers)} numbers to the last digit ({shown})')


def main() -> int:
  try:
    print(check_readme_command(), flush=True)
  except CheckFailed as failure:
    print(f'error: {failure}', file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
