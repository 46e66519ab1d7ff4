"""scripts/fault_soak.py: its kills are planned so that each phase is hit, the final evaluation last; a
short soak (5 SIGKILLs of one tiny GPT run, local, one process) hits every phase, survives every kill
with an end state bit-equal to an uninterrupted run, and each attempt resumes from the newest complete
checkpoint; a bad flag is one `error:` line.

The soak runs in this process (the script's `main`), its launch.py processes forked from the suite's
preloaded server (support.launch; `preloaded_attempts`), then killed, waited for and checked by the
script's own code: a fresh interpreter each would spend ~2.7 s of CPU importing JAX before its start-up,
seven times. The script as a user runs it, fresh interpreters read through pipes, is CI's (.ci/run's
shown commands run its 30-kill soaks)."""
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

import support

SCRIPT = os.path.join(support.REPO, 'scripts', 'fault_soak.py')


def soak(*args, timeout: int = 400) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, SCRIPT, *args], cwd=support.REPO, capture_output=True, text=True,
                        timeout=timeout)


def test_the_plan_aims_at_every_phase_and_ends_in_the_final_evaluation():
  fault_soak = support.load_file('scripts/fault_soak.py')
  orders = set()
  for kills in (5, 6, 30):
    for seed in range(20):
      plan = fault_soak.plan_kills(kills, seed)
      assert plan == fault_soak.plan_kills(kills, seed) and len(plan) == kills
      assert plan[-1] == fault_soak.Aim('final evaluation', 0, False)
      exact = [aim for aim in plan if aim.exact]
      assert sorted(aim.phase for aim in exact) == sorted(fault_soak.PHASES[:-1])  # each once, at its event
      assert all(aim.skip >= 1 for aim in exact if aim.phase == 'steps')  # after a logged step, not compiling
      assert all(aim.phase != 'final evaluation' for aim in plan[:-1])
      orders.add(tuple(aim.phase for aim in exact))
  assert len(orders) > 6  # the seed orders them
  # train.steps beyond what the kills before the last can reach (eval every 6 steps, a save every 2).
  plan = [fault_soak.Aim('evaluation', 2, True), fault_soak.Aim('steps', 1, True), fault_soak.Aim('start-up', 0, True),
          fault_soak.Aim('checkpoint write', 0, True), fault_soak.Aim('final evaluation', 0, False)]
  assert fault_soak.soak_steps(plan, 6, 2) == 19 + 4 + 0 + 4 + 1
  assert fault_soak.soak_steps(plan[-2:], 6, 2) == 24  # at least 24
  assert fault_soak.soak_steps(plan[:-1] * 2 + plan[-1:], 6, 2) == 2 * 27 + 1


def in_own_session(pid: int) -> bool:
  try:
    return os.getpgid(pid) == pid
  except ProcessLookupError:  # it ended meanwhile
    return True


def preloaded_attempts(fault_soak):
  """fault_soak.Attempt with its launch.py forked from the preloaded server (in a session of its own,
  as the script's Popen starts it, so that the script's `kill` reaches it with os.killpg), its stdout
  read line by line from the file the server writes."""

  class PreloadedAttempt(fault_soak.Attempt):
    def __init__(self, args, processes, env, log_path):
      assert processes == 1 and env == dict(os.environ), 'the soak of this test: one process, this environment'
      self.started = time.time()
      self.lines = queue.Queue()
      self.log = open(log_path, 'w')
      process = support.launch(args, devices=8, background=True, start_new_session=True)  # conftest's 8 devices
      while process.poll() is None and not in_own_session(process.pid):  # as Popen's: for the script's killpg
        time.sleep(0.001)
      self.processes = [process]
      self.reader = threading.Thread(target=self._read_file, daemon=True)
      self.reader.start()

    def _read_file(self) -> None:
      process, (stdout, stderr) = self.processes[0], self.processes[0].outputs
      while not os.path.exists(stdout) and process.poll() is None:
        time.sleep(0.002)
      partial = ''
      with open(stdout) if os.path.exists(stdout) else open(os.devnull) as f:
        while True:
          ended = process.poll() is not None  # before the read: what it wrote before it ended is read now
          partial += f.read()
          *lines, partial = partial.split('\n')
          for line in lines:
            self.log.write(line + '\n')
            self.log.flush()
            self.lines.put(line)
          if ended:
            break
          if not lines:
            time.sleep(0.002)
      if partial:
        self.log.write(partial + '\n')
        self.lines.put(partial)
      if os.path.exists(stderr):  # into the log, after stdout (the script's pipe merges the two)
        with open(stderr) as f:
          self.log.write(f.read())
      self.lines.put(None)  # the end of its output

  return PreloadedAttempt


def test_five_kills_hit_every_phase_and_are_survived_bit_for_bit(tmp_path, monkeypatch, capsys):
  # One layer: each of the seven launch.py processes compiles and runs a smaller program; the phases,
  # kills and resumes are the same. A save every 3 steps, not the script's 2: the soak's 24 steps all the same
  # (the plan's least), each run writing a third fewer checkpoints, and the kill aimed at a write still lands in one.
  from absl import logging
  fault_soak = support.load_file('scripts/fault_soak.py')
  monkeypatch.setattr(fault_soak, 'Attempt', preloaded_attempts(fault_soak))
  verbosity = logging.get_verbosity()
  try:
    status = fault_soak.main([f'--workdir={tmp_path}/soak', '--kills=5', '--seed=0', '--config.model.num_layers=1',
                              '--config.train.checkpoint_every=3', '--attempt_timeout=300'])
  finally:
    logging.set_verbosity(verbosity)  # main() quiets absl's logging for Orbax
  result = subprocess.CompletedProcess(['fault_soak.main'], status, *capsys.readouterr())
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert (summary['kills_sent'], summary['kills_survived'], summary['failures']) == (5, 5, [])
  assert summary['bit_equal'] is True
  assert summary['end_state_equal'] == {'checkpoints': True, 'metrics.jsonl': True, 'result': True}
  phases = summary['phases']
  assert set(phases) == {'start-up', 'steps', 'evaluation', 'final evaluation'} and min(phases.values()) >= 1
  assert sum(phases.values()) == 5 and summary['kills_during_checkpoint_writes'] >= 1
  assert 'kills survived / kills sent: 5 / 5' in result.stdout
  # Five attempts were killed (SIGKILL leaves no result line) and a sixth finished the run; each attempt
  # after a kill resumed from the newest complete checkpoint that kill left (one killed in its start-up
  # may die before it says so), the last from the last step.
  logs = tmp_path / 'soak' / 'logs'
  assert sorted(name for name in os.listdir(logs) if name.startswith('attempt-')) == [
      f'attempt-0{i}.log' for i in range(5)]
  kills = re.findall(r'^kill \d/5 .*?landed in ([a-z -]+?)(?: with| \().*?(?:newest complete checkpoint: step (\d+)|'
                     r'no complete checkpoint yet)', result.stdout, re.M)
  assert len(kills) == 5
  for kill, name in enumerate([f'attempt-0{i}.log' for i in range(1, 5)] + ['final.log']):
    found = re.findall(r'^Resumed from the checkpoint at step (\d+) ', (logs / name).read_text(), re.M)
    newest = int(kills[kill][1]) if kills[kill][1] else None
    if found or newest is None or name == 'final.log' or kills[kill + 1][0] != 'start-up':
      assert [int(step) for step in found] == ([newest] if newest is not None else []), name
  assert kills[-1][0] == 'final evaluation' and int(kills[-1][1]) == summary['train_steps']


def test_bad_flags_are_one_error_line(tmp_path):
  # parse_args refuses each flag before main() starts anything: the cases in-process, one through the
  # script for its exit status and its one `error:` line.
  fault_soak = support.load_file('scripts/fault_soak.py')
  cases = {('--kills=0',): '--kills=0', ('--kills=4',): 'give --kills=5 or more', ('--processes=3',): '--processes=3',
           ('--emulator',): '--emulator',
           ('--config.train.steps',): '--config.train.steps', ('--unknown=1',): '--unknown=1',
           ('--kills=many',): 'many', ('--config.train.eval_every=0',): '--config.train.eval_every=0'}
  for extra, named in cases.items():
    with pytest.raises(fault_soak.SoakInputError) as error:
      fault_soak.parse_args([f'--workdir={tmp_path}/new', *extra])
    assert named in str(error.value) and '\n' not in str(error.value), (extra, str(error.value))
  result = soak(f'--workdir={tmp_path}/new', '--kills=4', timeout=60)
  assert result.returncode == 1 and result.stdout == '', (result.stdout, result.stderr)
  [line] = result.stderr.splitlines()
  assert line.startswith('error: ') and 'give --kills=5 or more' in line, line
  assert not os.path.exists(tmp_path / 'new')  # refused before anything was written
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'file').write_text('x')
  with pytest.raises(fault_soak.SoakInputError, match='not empty'):
    fault_soak.parse_args([f'--workdir={tmp_path}/used'])


def test_result_lines_compare_with_the_files_they_name_relative_to_their_runs():
  """An MoE run's result line names its expert-load picture inside its own workdir: the soaked run's and
  the reference's lines are equal once each path is relative to its run."""
  fault_soak = support.load_file('scripts/fault_soak.py')
  soaked = {'eval/loss': 2.5, 'images': {'moe/expert_load': '/r/soaked/moe_expert_load.png'}}
  reference = {'eval/loss': 2.5, 'images': {'moe/expert_load': '/r/reference/moe_expert_load.png'}}
  assert fault_soak.in_run(soaked, '/r/soaked/') == fault_soak.in_run(reference, '/r/reference/')
  assert fault_soak.in_run({**soaked, 'eval/loss': 2.4}, '/r/soaked/') != fault_soak.in_run(reference, '/r/reference/')
