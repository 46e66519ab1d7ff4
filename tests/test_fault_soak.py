"""scripts/fault_soak.py: a short soak (3 SIGKILLs of one tiny GPT run, local, one process) survives every
kill with an end state bit-equal to an uninterrupted run; a bad flag is one `error:` line."""
import json
import os
import subprocess
import sys

import support

SCRIPT = os.path.join(support.REPO, 'scripts', 'fault_soak.py')


def soak(*args, timeout: int = 400) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=support.REPO, capture_output=True, text=True,
                        timeout=timeout)


def test_three_kills_are_survived_bit_for_bit(tmp_path):
  result = soak(f'--workdir={tmp_path}/soak', '--kills=3', '--seed=0')
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert (summary['kills_sent'], summary['kills_survived'], summary['failures']) == (3, 3, [])
  assert summary['bit_equal'] is True
  assert summary['end_state_equal'] == {'checkpoints': True, 'metrics.jsonl': True, 'result': True}
  assert sum(summary['phases'].values()) == 3
  assert 'kills survived / kills sent: 3 / 3' in result.stdout
  # Three attempts were killed (SIGKILL leaves no result line) and a fourth finished the run.
  logs = sorted(os.listdir(tmp_path / 'soak' / 'logs'))
  assert [name for name in logs if name.startswith('attempt-')] == [f'attempt-0{i}.log' for i in range(3)]
  assert 'final.log' in logs and 'reference.log' in logs
  resumed = [line for name in ('attempt-01.log', 'attempt-02.log', 'final.log')
             for line in open(tmp_path / 'soak' / 'logs' / name) if line.startswith('Resumed from the checkpoint')]
  assert len(resumed) >= 1  # at least one kill came after a complete checkpoint


def test_bad_flags_are_one_error_line(tmp_path):
  cases = {('--kills=0',): '--kills=0', ('--processes=3',): '--processes=3', ('--emulator',): '--emulator',
           ('--config.train.steps',): '--config.train.steps', ('--unknown=1',): '--unknown=1',
           ('--kills=many',): 'many'}
  for extra, named in cases.items():
    result = soak(f'--workdir={tmp_path}/new', *extra, timeout=60)
    assert result.returncode == 1 and result.stdout == '', (extra, result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    assert line.startswith('error: ') and named in line, line
  assert not os.path.exists(tmp_path / 'new')  # refused before anything was written
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'file').write_text('x')
  result = soak(f'--workdir={tmp_path}/used', timeout=60)
  assert result.returncode == 1 and result.stderr.startswith('error: ') and 'not empty' in result.stderr
