"""CI: README.md's first command run as a user runs it, then `--mode=eval` and `--mode=predict` on its workdir.

The command is read from README.md (the first indented line after `## Two commands`), less its
`pip install -r ... &&` (CI's virtual environment has requirements.txt installed), and run by bash in
the repository root with the caller's environment: no flag or variable of the test suite's. Its
result line (the last line it prints: JSON with the run's workdir and final evaluation) must hold
eval/ or test/ numbers, and `python launch.py --mode=eval --workdir=<that workdir>` must give each
of them to the last digit: the same evaluation of the same checkpoint. The docs' commands on that run
(tests/shown_commands.py's `Ci('README command 1')` on `runs/transformer-default-...`: the eval and
the stdin predict of docs/families/transformer.md) run as shown on the workdir it printed; the predict
must translate its English number into the French words of num2words, as the training data does.
The workdir stays (runs/ is git-ignored), as a user's run does.

Usage: python .ci/readme_command.py   (exit status 1, with one line saying why, when a check fails)
"""
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, 'tests')]
import shown_commands  # noqa: E402  (tests/shown_commands.py: the table of every command shown)
from data.translation import english_number, number_pair  # noqa: E402

HEADING = '## Two commands'
# How the docs show a run of configs/transformer.py:default, which command 1 trains (configs/default.py
# is that preset; its workdir is named runs/default-default-<time>).
SHOWN_WORKDIR = 'runs/transformer-default-...'
README_STEP = shown_commands.Ci('README command 1')


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
  on_the_run = {command.split('--mode=')[1].split()[0]: command.replace(SHOWN_WORKDIR, shlex.quote(trained['workdir']))
                for command, how in shown_commands.SHOWN.items() if how == README_STEP and SHOWN_WORKDIR in command}
  if sorted(on_the_run) != ['eval', 'predict']:
    raise CheckFailed(f'tests/shown_commands.py gives {README_STEP} the modes {sorted(on_the_run)} on {SHOWN_WORKDIR}; '
                      'this script runs eval and predict there')
  evaluated = run(on_the_run['eval'])
  differing = {key: (value, evaluated.get(key)) for key, value in numbers.items() if evaluated.get(key) != value}
  if differing or evaluated.get('step') != trained.get('final_eval_step'):
    raise CheckFailed(f"--mode=eval differs from `{command}`'s result line: {differing} (step "
                      f"{evaluated.get('step')} against final_eval_step {trained.get('final_eval_step')})")
  shown = ', '.join(f'{key}={value}' for key, value in numbers.items())
  return (f'README command 1 `{command}`: {trained_seconds:.0f} s, workdir {trained["workdir"]}; --mode=eval gives '
          f'its {len(numbers)} numbers to the last digit ({shown}); {check_predict(on_the_run["predict"])}')


def check_predict(command: str) -> str:
  """Run the docs' `echo '<English number>' | ... --mode=predict ... --input=-`: its one output must be
  that number's French words."""
  english = shlex.split(command)[1]
  expected = number_pair('cardinal', english_number(english))[1]
  outputs = run(command).get('outputs')
  if outputs != [expected]:
    raise CheckFailed(f'`{command}` translated {english!r} as {outputs}, not [{expected!r}]')
  return f'--mode=predict translates {english!r} as {expected!r}'



def main() -> int:
  try:
    print(check_readme_command(), flush=True)
  except CheckFailed as failure:
    print(f'error: {failure}', file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
