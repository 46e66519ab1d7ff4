"""A fault soak: kill one training with SIGKILL at seeded random moments, resume it each time, lose nothing.

The run (configs/gpt.py:tiny on a small generated corpus, a checkpoint every 2 steps and an evaluation
every 6, unless --config says otherwise) is trained twice under --workdir: `reference/` once without
interruption, every checkpoint kept; then `soaked/`, killed --kills times and rerun with the same
command after each kill (launch.py resumes when the workdir holds a checkpoint). The kills are planned
from --seed (`plan_kills`): each aims at a phase, after 0-2 earlier events of that kind in the attempt:
start-up (reading the run, restoring its checkpoint: a moment uniform over the reference's time to its
loop, at the latest when the loop is ready), the first steps after the resume (compiling, no write in
flight yet), a later training step, the start of an evaluation, a checkpoint being written (polling the
checkpoints directory; Orbax's background writes included), or the final evaluation. Every phase is
aimed at once at the moment its event is seen, so that the kill lands in it (--kills is at least
len(PHASES)); the other kills draw their phases by PHASE_WEIGHTS and their moments at random after the
event; the final evaluation's kill is the last (only the end of training reaches it). It checks:
  - after each kill, the newest complete checkpoint (a step directory holding Orbax's
    commit_success.txt) restores and equals the reference's of that step bit for bit (parameters and
    every model variable, optimizer state, input position, progress and eval metrics; wall-clock
    seconds aside), and the next attempt resumes from exactly that step (its log's "Resumed from the
    checkpoint at step N"; a fresh start when there was none) without skipping a broken one;
  - the finished run's checkpoints, metrics.jsonl rows (throughput aside) and final evaluation equal the
    reference's bit for bit.
It prints one line per kill, `kills survived / kills sent`, the kills per phase (what the run was doing
when the kill landed, from its log and the checkpoints left unfinished) and one JSON line last. Exit
status 0 only when every kill was survived, every phase was hit (a kill landed in each of LOOP_PHASES,
one of them with a checkpoint write in flight) and the end state is bit-equal. A bad flag is one `error:`
line and status 1, before anything is written; so is a config launch.py refuses (its own line).

  python scripts/fault_soak.py --workdir=/tmp/soak --kills=30 --seed=0
  python scripts/fault_soak.py --workdir=gs://bucket/soak --emulator --kills=10   # GCS emulator on localhost
  python scripts/fault_soak.py --workdir=/tmp/soak-2p --processes=2 --kills=10    # two processes, CPU
  python scripts/fault_soak.py --workdir=/tmp/soak-sync --config.train.async_checkpoints=False

--config=FILE[:preset] and --config.<key>=<value> overrides are launch.py's, given to both runs.
Two processes run on localhost with 2 CPU devices each (jax.distributed, as tests/test_multiprocess.py);
a kill stops both, as a lost machine would. --emulator serves the gs:// bucket from tests/gcs_emulator.py
(requirements-dev.txt). Logs of every attempt: <workdir>/logs/ (a temporary directory for gs://).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import storage  # noqa: E402
from scripts import testbed  # noqa: E402

# The phases a kill aims at; the final evaluation's kill comes last, the others in a seeded order.
PHASES = ('start-up', 'steps', 'evaluation', 'checkpoint write', 'final evaluation')
PHASE_WEIGHTS = (0.1, 0.3, 0.3, 0.3)  # the kills beyond one per phase, before the last; start-up makes no progress
# What the training loop was doing when a kill landed (its log tells); a checkpoint write in flight is
# counted apart: Orbax writes in the background while steps and evaluations go on.
LOOP_PHASES = ('start-up', 'steps', 'evaluation', 'final evaluation')
# The soak run's defaults, before the user's overrides; train.steps follows from --kills (`soak_steps`).
RUN_DEFAULTS = {'train.log_every': 1, 'train.checkpoint_every': 2, 'train.eval_every': 6}
KEEP_ALL = 10**6  # the reference keeps every checkpoint: each resume is compared at its own step
# Measures of wall-clock time, which no two runs share; everything else must be bit-equal.
CLOCK_KEYS = re.compile(r'(_per_s$|seconds)')
OVERRIDE = re.compile(r'^--config\.[\w.]+=')
PROGRESS_LINE = re.compile(r'^step (\d+)/(\d+) ')
EVAL_LINE = re.compile(r'^step (\d+): eval/')
RESUMED_LINE = re.compile(r'^Resumed from the checkpoint at step (\d+) ')
LOOP_READY_LINE = 'Each evaluation during training scores'  # logged after the resume, before the first step
LOOP_DONE = re.compile(r'^(The train step was compiled|Final evaluation)')


class SoakInputError(Exception):
  """A bad flag: one `error:` line, exit status 1."""


# ============================================================================ the command line
class _Parser(argparse.ArgumentParser):
  def error(self, message):  # argparse's usage text and status 2: one line and status 1 here
    raise SoakInputError(message)


def parse_args(argv: list[str]):
  parser = _Parser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True,
                      help='a new directory, local or gs://: reference/ and soaked/ go there')
  parser.add_argument('--kills', type=int, default=30, help='SIGKILLs to send over the one run')
  parser.add_argument('--seed', type=int, default=0, help='seeds the kill moments (not the training)')
  parser.add_argument('--processes', type=int, default=1, help='1, or 2 processes on localhost (CPU devices)')
  parser.add_argument('--config', default='configs/gpt.py:tiny', help="launch.py's --config=FILE[:preset]")
  parser.add_argument('--emulator', action='store_true', help='serve the gs:// bucket from a local GCS emulator')
  parser.add_argument('--attempt_timeout', type=float, default=600, help='seconds one attempt may run')
  args, rest = parser.parse_known_args(argv)
  bad = [arg for arg in rest if not OVERRIDE.match(arg)]
  if bad:
    raise SoakInputError(f'{bad[0]}: not a flag of this script nor a --config.<key>=<value> override.')
  args.overrides = rest
  if args.kills < len(PHASES):
    raise SoakInputError(f'--kills={args.kills}: a soak aims a kill at each of its {len(PHASES)} phases '
                         f'({", ".join(PHASES)}); give --kills={len(PHASES)} or more.')
  if args.processes not in (1, 2):
    raise SoakInputError(f'--processes={args.processes}: 1 or 2.')
  if args.emulator and not storage.is_remote(args.workdir):
    raise SoakInputError(f'--emulator serves a gs:// bucket; --workdir={args.workdir} is local.')
  if not storage.is_remote(args.workdir) and os.path.exists(args.workdir) and os.listdir(args.workdir):
    raise SoakInputError(f'--workdir={args.workdir} is not empty; give a new directory.')
  every = {key: RUN_DEFAULTS[key] for key in ('train.eval_every', 'train.checkpoint_every')}
  for arg in rest:
    key, value = arg.removeprefix('--config.').split('=', 1)
    if key in every:
      if not value.isdigit() or int(value) < 1:
        raise SoakInputError(f'{arg}: a positive number of steps.')
      every[key] = int(value)
  args.plan = plan_kills(args.kills, args.seed)
  args.steps = soak_steps(args.plan, every['train.eval_every'], every['train.checkpoint_every'])
  return args


class Aim(NamedTuple):
  """What a kill aims at: `phase` (PHASES), after `skip` earlier events of its kind in the attempt,
  `exact`: at the event itself (landing in the phase), else at a random moment after it."""
  phase: str
  skip: int
  exact: bool


def plan_kills(kills: int, seed: int) -> list[Aim]:
  """The kills' aims, drawn from `seed`: one exact aim per phase but the last (a step's after at least
  one step, so that it lands after a logged step, not in the first step's compiling), the other kills'
  phases by PHASE_WEIGHTS, in a seeded order; then the final evaluation's, at a moment in the first
  half of the reference's final evaluation (any moment before the run's end lands in it)."""
  rng = random.Random(f'plan {seed}')
  during = PHASES[:-1]
  skips = {'start-up': lambda: 0, 'steps': lambda: rng.randrange(1, 3)}  # start-up counts no events
  aims = [Aim(phase, skips.get(phase, lambda: rng.randrange(3))(), True) for phase in during]
  for phase in rng.choices(during, PHASE_WEIGHTS, k=kills - len(PHASES)):
    aims.append(Aim(phase, 0 if phase == 'start-up' else rng.randrange(3), False))
  rng.shuffle(aims)
  return aims + [Aim('final evaluation', 0, False)]


def soak_steps(plan: list[Aim], eval_every: int, save_every: int) -> int:
  """train.steps that the kills before the last do not reach: an attempt moves the run at most to its
  aim's event (the `skip + 1`-th step, evaluation or save after its resume; a step's count passes an
  evaluated step) and, killed at a moment after it, a step or two further."""
  most = {'start-up': lambda skip: 0, 'steps': lambda skip: skip + 3,
          'evaluation': lambda skip: eval_every * (skip + 1) + 1,
          'checkpoint write': lambda skip: save_every * (skip + 1) + 2}
  return max(24, 1 + sum(most[aim.phase](aim.skip) for aim in plan[:-1]))


# ============================================================================ the runs
class Attempt:
  """One launch of the run (`processes` launch.py processes); process 0's output is read line by line."""

  def __init__(self, args: list[str], processes: int, env: dict, log_path: str):
    self.started = time.time()
    self.lines: queue.Queue = queue.Queue()
    self.log = open(log_path, 'w')
    self.processes = []
    if processes > 1:
      coordinator = [f'--coordinator_address=localhost:{testbed.free_port()}', f'--num_processes={processes}']
    for index in range(processes):
      command = [sys.executable, os.path.join(REPO, 'launch.py'), *args]
      if processes > 1:
        command += [*coordinator, f'--process_id={index}']
      output = subprocess.PIPE if index == 0 else open(f'{log_path}.process{index}', 'w')
      self.processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                             text=True, start_new_session=True))
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self) -> None:
    for line in self.processes[0].stdout:
      self.log.write(line)
      self.log.flush()
      self.lines.put(line.rstrip('\n'))
    self.lines.put(None)  # the end of process 0's output

  def kill(self) -> None:
    for process in self.processes:
      try:
        os.killpg(process.pid, signal.SIGKILL)
      except ProcessLookupError:  # it ended on its own meanwhile
        pass
    self.wait()

  def wait(self, timeout: float | None = None) -> list[int]:
    codes = [process.wait(timeout) for process in self.processes]
    self.reader.join()
    self.log.close()
    return codes


def launch_args(args, workdir: str, scratch: str, keep: int | None = None) -> list[str]:
  overrides = {**RUN_DEFAULTS, 'train.steps': args.steps,
               'data.source': testbed.write_corpus(os.path.join(scratch, 'corpus')),
               'data.cache_dir': os.path.join(scratch, 'cache')}
  if keep:
    overrides['train.keep_checkpoints'] = keep
  return [f'--config={args.config}', f'--workdir={workdir}', *(f'--config.{k}={v}' for k, v in overrides.items()),
          *args.overrides]  # the user's last: they win


def child_environment(processes: int) -> dict:
  env = dict(os.environ)
  if processes > 1:  # two processes share this host's CPU: 2 devices each
    flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')]
    env.update(JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(flags + ['--xla_force_host_platform_device_count=2']))
  return env


def run_reference(args, root: str, scratch: str, logs: str, env: dict) -> dict:
  """Train the reference without interruption: its result line, its seconds to the loop's readiness
  (start-up), from there to the first step's log line (the first steps, compiling), from the loop's end
  to the process's (the final evaluation), in all."""
  attempt = Attempt(launch_args(args, f'{root}/reference', scratch, keep=KEEP_ALL), args.processes, env,
                    os.path.join(logs, 'reference.log'))
  ready = first_step = loop_done = None
  lines = []
  while (line := attempt.lines.get()) is not None:
    lines.append(line)
    if ready is None and line.startswith(LOOP_READY_LINE):
      ready = time.time() - attempt.started
    if first_step is None and PROGRESS_LINE.match(line):
      first_step = time.time() - attempt.started
    if loop_done is None and LOOP_DONE.match(line):
      loop_done = time.time() - attempt.started
  codes = attempt.wait()
  seconds = time.time() - attempt.started
  if any(codes):
    reason = next((line for line in reversed(lines) if line.strip()), f'exit status {codes}').removeprefix('error: ')
    raise SoakInputError(f'the uninterrupted reference run failed: {reason} (log: {logs}/reference.log)')
  ready, first_step = ready or 1.0, first_step or 1.0
  return {'result': json.loads(lines[-1]), 'startup_s': ready, 'first_steps_s': max(first_step - ready, 0.0),
          'final_evaluation_s': seconds - (loop_done or seconds), 'seconds': seconds}


# ============================================================================ what a checkpoint holds
def forget_listings(directory) -> None:
  """gcsfs caches what a gs:// directory lists; the training processes change it behind this one's back."""
  if storage.is_remote(directory):
    from etils.epath import backend  # epath's gs:// backend, whose gcsfs instance holds the cache
    backend.fsspec_backend.fs(os.fspath(directory)).invalidate_cache()  # all of it


def finished_steps(checkpoints) -> list[int]:
  """Steps whose checkpoint Orbax committed: a step directory holding commit_success.txt (written last,
  before a local directory is renamed from its temporary name; a gs:// directory's mark of completion)."""
  forget_listings(checkpoints)
  if not checkpoints.exists():
    return []
  return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and (p / 'commit_success.txt').exists())


def unfinished_entries(checkpoints) -> set[str]:
  """Checkpoint directories being written (or left half-written): Orbax's temporary names, or a gs://
  step directory without commit_success.txt."""
  forget_listings(checkpoints)
  if not checkpoints.exists():
    return set()
  return {p.name for p in checkpoints.iterdir()
          if not p.name.isdigit() or not (p / 'commit_success.txt').exists()}


def read_checkpoint(step_dir) -> dict:
  """{'model/<path>': array, 'optimizer/<path>': array, 'data': {...}, 'metrics': {...}} of one step,
  arrays as numpy whatever mesh wrote them; the clock's fields dropped."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  items = {}
  forget_listings(step_dir)
  with ocp.PyTreeCheckpointer() as checkpointer:
    for item in ('model', 'optimizer'):
      tree = checkpointer.metadata(step_dir / item).item_metadata.tree
      as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      restored = checkpointer.restore(step_dir / item, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
      items.update({f'{item}{jax.tree_util.keystr(path)}': leaf
                    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]})
  for item, name in (('data', 'metadata'), ('metrics', 'metrics')):
    if (step_dir / item / name).exists():
      items[item] = without_clock(json.loads((step_dir / item / name).read_text()))
  return items


def without_clock(value):
  if isinstance(value, dict):
    return {k: without_clock(v) for k, v in value.items() if not CLOCK_KEYS.search(k)}
  return value


def checkpoint_differences(soaked_dir, reference_dir) -> list[str]:
  """How the soaked checkpoint differs from the reference's of the same step ([] when bit-equal)."""
  import numpy as np
  try:
    soaked = read_checkpoint(soaked_dir)
  except Exception as e:  # noqa: BLE001 - whatever Orbax raises for a checkpoint that does not restore
    return [f'{soaked_dir} does not restore: {type(e).__name__}: {str(e)[:300]}']
  reference = read_checkpoint(reference_dir)
  if soaked.keys() != reference.keys():
    return [f'{soaked_dir} holds {sorted(soaked.keys() ^ reference.keys())[:5]} where the reference does not '
            f'(or the reverse)']
  differences = []
  for key, expected in reference.items():
    try:
      if isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(soaked[key], expected, strict=True)
      elif soaked[key] != expected:
        raise AssertionError(f'{soaked[key]} != {expected}')
    except AssertionError as e:
      differences.append(f'{soaked_dir} {key}: ' + ' '.join(str(e).split())[:300])
  return differences


# ============================================================================ the soak
class Soak:
  """Kills, resumes and the checks after each kill; `run()` ends with the end state compared."""

  def __init__(self, args, root: str, scratch: str, logs: str, env: dict, reference: dict):
    self.args, self.root, self.logs, self.env, self.reference = args, root, logs, env, reference
    self.rng = random.Random(args.seed)
    self.command = launch_args(args, f'{root}/soaked', scratch)
    self.checkpoints = storage.path(f'{root}/soaked') / 'checkpoints'
    self.reference_checkpoints = storage.path(f'{root}/reference') / 'checkpoints'
    config = json.loads((storage.path(f'{root}/reference') / 'config.json').read_text())['train']
    self.steps, self.eval_every, self.save_every = config['steps'], config['eval_every'], config['checkpoint_every']
    self.sent, self.survived, self.failures, self.phases = 0, 0, [], {phase: 0 for phase in LOOP_PHASES}
    self.in_flight = 0  # kills that left a checkpoint write unfinished
    self.expected_resume = None  # the step the next attempt must resume from (None: start fresh)
    self.pending = []  # (kill, how its checkpoint differs) of the kills whose resume no attempt has shown yet
    self.checked = {}  # step -> how the soaked checkpoint of that step differs from the reference's

  def run(self) -> int | None:
    """Send the kills, then let the run finish; its last attempt's exit status (None: it never ended)."""
    for aim in self.args.plan:
      attempt = self.start(f'attempt-{self.sent:02d}')
      watch = self.watch(attempt, aim)
      if watch['ended']:
        return self.finish(attempt, watch, early=True)
      self.after_kill(attempt, watch)
      if self.failures:
        return None
    attempt = self.start('final')
    status = self.finish(attempt, self.watch(attempt, None))
    self.failures += [f'no kill landed in the {phase}' for phase, count in self.phases.items() if not count]
    if not self.in_flight:
      self.failures.append('no kill landed while a checkpoint was being written')
    return status

  def start(self, name: str) -> Attempt:
    return Attempt(self.command, self.args.processes, self.env, os.path.join(self.logs, f'{name}.log'))

  def watch(self, attempt: Attempt, aim: Aim | None) -> dict:
    """Follow the attempt until the moment `aim` gives, then kill it; None: until it ends. What its log
    showed: the resume, the last step, evaluations, the end."""
    phase, skip = (aim.phase, aim.skip) if aim else (None, 0)
    after = lambda most: 0.0 if aim.exact else self.rng.uniform(0, most)  # seconds from the event to the kill
    seen = {'resumed': None, 'ready': False, 'last_step': None, 'evals': set(), 'done': False, 'ended': False,
            'lines': [], 'events': 0, 'kill_at': None}
    if phase == 'start-up':
      seen['kill_at'] = attempt.started + self.rng.uniform(0, self.reference['startup_s'])
    new_writes, before = set(), unfinished_entries(self.checkpoints) if phase == 'checkpoint write' else set()
    deadline = attempt.started + self.args.attempt_timeout
    while True:
      try:
        line = attempt.lines.get(timeout=0.002)
      except queue.Empty:
        line = ''
      if line is None:
        seen['ended'] = True
        return seen
      if line:
        self.note(seen, line, phase)
        if phase == 'start-up' and line.startswith(LOOP_READY_LINE):  # start-up's end: at the latest now
          seen['kill_at'] = min(seen['kill_at'], time.time())
        if phase == 'steps' and not skip and line.startswith(LOOP_READY_LINE):  # the first steps: no write yet
          seen['kill_at'] = time.time() + after(self.reference['first_steps_s'])
      if phase == 'checkpoint write' and seen['ready']:
        fresh = unfinished_entries(self.checkpoints) - before - new_writes
        if fresh:
          new_writes |= fresh
          seen['events'] += 1
          if seen['events'] > skip and seen['kill_at'] is None:
            seen['kill_at'] = time.time() + after(0.05)
      if phase in ('steps', 'evaluation') and seen['events'] > skip and seen['kill_at'] is None:
        seen['kill_at'] = time.time() + (after(0.02) if phase == 'steps' else 0)
      if phase == 'final evaluation' and seen['done'] and seen['kill_at'] is None:
        seen['kill_at'] = time.time() + after(self.reference['final_evaluation_s'] / 2)
      if seen['kill_at'] is not None and time.time() >= seen['kill_at']:
        seen['killed_after'] = time.time() - attempt.started
        attempt.kill()
        while (line := attempt.lines.get()) is not None:  # what it wrote before it died
          self.note(seen, line, None)
        seen['aimed'] = phase if phase in ('start-up', 'final evaluation') else f'{phase} (after {skip} earlier)'
        return seen
      if time.time() > deadline:
        attempt.kill()
        self.failures.append(f'{attempt.log.name}: still running after --attempt_timeout={self.args.attempt_timeout}s')
        seen['ended'] = True
        return seen

  def note(self, seen: dict, line: str, phase: str | None) -> None:
    seen['lines'].append(line)
    if match := RESUMED_LINE.match(line):
      seen['resumed'] = int(match[1])
    elif line.startswith(LOOP_READY_LINE):
      seen['ready'] = True
    elif match := PROGRESS_LINE.match(line):
      seen['last_step'] = step = int(match[1])
      evaluates = step % self.eval_every == 0 or step == self.steps
      if (phase == 'evaluation' and evaluates) or (phase == 'steps' and not evaluates):
        seen['events'] += 1
    elif match := EVAL_LINE.match(line):
      seen['evals'].add(int(match[1]))
    elif LOOP_DONE.match(line):
      seen['done'] = True

  def phase_now(self, seen: dict) -> str:
    """What the loop was doing when the kill landed: its log's last lines."""
    if seen['done']:
      return 'final evaluation'
    step = seen['last_step']
    if step is None:
      return 'start-up'
    evaluates = step % self.eval_every == 0 or step == self.steps
    return 'evaluation' if evaluates and step not in seen['evals'] else 'steps'

  def after_kill(self, attempt: Attempt, seen: dict) -> None:
    """Check the attempt's own resume, then what the next one must resume from."""
    self.sent += 1
    self.check_resume(attempt, seen)
    finished = finished_steps(self.checkpoints)
    newest = finished[-1] if finished else None
    started_saves = self.saves_started(seen)
    writing = bool(started_saves) and max(started_saves) > (newest or 0)  # a save it began is not complete
    phase = self.phase_now(seen)
    self.in_flight += writing
    self.phases[phase] += 1
    if newest is not None and newest not in self.checked:
      self.checked[newest] = checkpoint_differences(self.checkpoints / str(newest),
                                                    self.reference_checkpoints / str(newest))
    differences = self.checked.get(newest, [])
    self.expected_resume = newest
    self.pending.append((self.sent, differences))
    state = f'newest complete checkpoint: step {newest}' if newest is not None else 'no complete checkpoint yet'
    verdict = 'bit-equal to the reference' if not differences else 'DIFFERS: ' + '; '.join(differences[:3])
    print(f'kill {self.sent}/{self.args.kills} at {seen["killed_after"]:.2f} s into {attempt.log.name}: '
          f'aimed at {seen["aimed"]}, landed in {phase}' + (' with a checkpoint write in flight' if writing else '')
          + f' (last step logged: {seen["last_step"]}); {state}'
          + (f', {verdict}' if newest is not None else ''), flush=True)

  def saves_started(self, seen: dict) -> list[int]:
    """Steps this attempt began saving: each save step it logged (an evaluated one once its evaluation was)."""
    first = (seen['resumed'] or 0) + 1
    last = seen['last_step'] or 0
    return [step for step in range(first, last + 1)
            if (step % self.eval_every == 0 or step == self.steps) and step in seen['evals']
            or step % self.save_every == 0 and not (step % self.eval_every == 0 or step == self.steps)]

  def check_resume(self, attempt: Attempt, seen: dict) -> None:
    """The attempt after a kill resumed from the newest complete checkpoint, which was bit-equal; counts
    that kill as survived. An attempt killed before its resume was logged leaves the check to the next."""
    if not self.pending or not seen['ready']:
      return
    skipped = [line for line in seen['lines'] if line.startswith('Skipped the checkpoint')]
    if seen['resumed'] != self.expected_resume:
      skipped.append(f'{attempt.log.name} resumed from step {seen["resumed"]}, not from the newest complete '
                     f'checkpoint, step {self.expected_resume}')
    for kill, differences in self.pending:
      if differences or skipped:
        self.failures.append(f'kill {kill}: ' + '; '.join(differences + skipped))
      else:
        self.survived += 1
    self.pending = []

  def finish(self, attempt: Attempt, seen: dict, early: bool = False) -> int | None:
    codes = attempt.wait()
    self.check_resume(attempt, seen)
    if any(codes):
      tail = '\n'.join(seen['lines'][-15:])
      self.failures.append(f'{attempt.log.name} exited with status {codes}:\n{tail}')
      return max(codes)
    if early:
      self.failures.append(f'the run finished after {self.sent} of {self.args.kills} kills; raise train.steps '
                           f'(now {self.steps})')
    seen['result'] = json.loads(seen['lines'][-1])
    self.final = seen
    return 0


def in_run(value, run_dir: str):
  """A result line's value with the files it names (`images`: {name: path}) relative to their run's
  directory `run_dir`, so that two runs' lines compare."""
  if isinstance(value, dict):
    return {k: in_run(v, run_dir) for k, v in value.items()}
  return value.removeprefix(run_dir) if isinstance(value, str) else value


def end_state_differences(soak: Soak) -> dict[str, list[str]]:
  """How the finished soaked run differs from the reference, in {'checkpoints': every one it kept,
  'metrics.jsonl': its rows, 'result': the final result line} ([] each when bit-equal)."""
  differences = []
  kept = finished_steps(soak.checkpoints)  # (gs://: gcsfs's cached listings dropped)
  if not kept or kept[-1] != soak.steps:
    differences.append(f'the soaked run kept checkpoints {kept}, without the last step {soak.steps}')
  for step in kept:
    differences += checkpoint_differences(soak.checkpoints / str(step), soak.reference_checkpoints / str(step))
  broken = storage.path(f'{soak.root}/soaked') / 'checkpoints_broken'
  if broken.exists():
    differences.append(f'a resume set broken checkpoints aside: {sorted(p.name for p in broken.iterdir())}')
  found = {'checkpoints': differences, 'metrics.jsonl': [], 'result': []}
  rows = {name: [without_clock(json.loads(line)) for line in
                 (storage.path(f'{soak.root}/{name}') / 'metrics.jsonl').read_text().splitlines()]
          for name in ('soaked', 'reference')}
  if rows['soaked'] != rows['reference']:
    first = next((i for i, (a, b) in enumerate(zip(rows['soaked'], rows['reference'])) if a != b),
                 min(len(rows['soaked']), len(rows['reference'])))
    found['metrics.jsonl'].append(f'metrics.jsonl: {len(rows["soaked"])} rows against the reference\'s '
                                  f'{len(rows["reference"])}, first difference at row {first}: '
                       f'{rows["soaked"][first] if first < len(rows["soaked"]) else "(none)"} against '
                       f'{rows["reference"][first] if first < len(rows["reference"]) else "(none)"}')
  ignored = ('workdir', 'train/compiles')  # a resume at the last step compiles no train step
  results = [{k: in_run(v, f'{soak.root}/{name}/') for k, v in result.items() if k not in ignored}
             for name, result in (('soaked', soak.final['result']), ('reference', soak.reference['result']))]
  if results[0] != results[1]:
    found['result'].append(f'final result line {results[0]} against the reference\'s {results[1]}')
  return found


# ============================================================================ main
def start_emulator(workdir: str, logs: str):
  """A GCS emulator (tests/gcs_emulator.py) serving the workdir's bucket; its environment set here and for children."""
  try:
    process, url = testbed.start_gcs_emulator(workdir.removeprefix('gs://').split('/')[0],
                                              os.path.join(logs, 'emulator.log'))
  except RuntimeError:
    raise SoakInputError(f'the GCS emulator did not start (pip install -r requirements-dev.txt); '
                         f'its log: {logs}/emulator.log') from None
  os.environ.update(storage.emulator_environment(url))
  return process


def soak(args) -> dict:
  started = time.time()
  root = args.workdir.rstrip('/')
  remote = storage.is_remote(root)
  scratch = tempfile.mkdtemp(prefix='fault-soak-')  # the corpus and its token cache
  logs = tempfile.mkdtemp(prefix='fault-soak-logs-') if remote else os.path.join(root, 'logs')
  os.makedirs(logs, exist_ok=True)
  emulator = start_emulator(root, logs) if args.emulator else None
  try:
    if remote and any((storage.path(root) / name).exists() for name in ('reference', 'soaked')):
      raise SoakInputError(f'--workdir={root} holds an earlier soak; give a new directory.')
    env = child_environment(args.processes)
    print(f'Reference run (uninterrupted, every checkpoint kept): {root}/reference', flush=True)
    reference = run_reference(args, root, scratch, logs, env)
    print(f'  {reference["seconds"]:.1f} s, the first step after {reference["startup_s"]:.1f} s. '
          f'Soaked run: {root}/soaked, {args.kills} kills (seed {args.seed}); logs: {logs}', flush=True)
    run = Soak(args, root, scratch, logs, env, reference)
    status = run.run()
    end_state = end_state_differences(run) if status == 0 else {}
    run.failures += [difference for found in end_state.values() for difference in found]
  finally:
    if emulator is not None:
      emulator.terminate()
      emulator.wait()
    shutil.rmtree(scratch, ignore_errors=True)
  return {'kills_sent': run.sent, 'kills_survived': run.survived, 'phases': run.phases,
          'kills_during_checkpoint_writes': run.in_flight, 'bit_equal': status == 0 and not run.failures,
          'end_state_equal': {part: not found for part, found in end_state.items()},  # {} when the run never ended
          'failures': run.failures, 'processes': args.processes, 'workdir': root, 'seed': args.seed,
          'train_steps': run.steps, 'seconds': round(time.time() - started, 1)}


def main(argv: list[str]) -> int:
  try:
    args = parse_args(argv)
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the checks read checkpoints here: never take an accelerator
    from absl import logging
    logging.set_verbosity(logging.ERROR)  # Orbax warns about every item's missing step metadata
    summary = soak(args)
  except SoakInputError as error:
    print(f'error: {error}', file=sys.stderr)
    return 1
  for failure in summary['failures']:
    print(f'FAILED: {failure}', flush=True)
  phases = ', '.join(f'{name} {count}' for name, count in summary['phases'].items())
  parts = ', '.join(f'{part} {"bit-equal" if equal else "NOT equal"}'
                    for part, equal in summary['end_state_equal'].items())
  print(f'kills survived / kills sent: {summary["kills_survived"]} / {summary["kills_sent"]} (landed in: {phases}; '
        f'{summary["kills_during_checkpoint_writes"]} of them with a checkpoint write in flight); end state against '
        f'the uninterrupted run: {parts or "the run did not finish"}; {summary["seconds"]:.0f} s', flush=True)
  print(json.dumps(summary), flush=True)
  ok = summary['bit_equal'] and summary['kills_survived'] == summary['kills_sent'] == args.kills
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
