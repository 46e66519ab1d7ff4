"""Shared test fixtures: a tiny deterministic corpus, a subprocess runner for launch.py, every preset."""
import glob
import importlib
import importlib.util
import json
import os
import pkgutil
import signal
import subprocess
import sys

import numpy as np

from numerics import transformer_terms
# The tests' corpus, ports and GCS emulator, shared with scripts/.
from scripts.testbed import WORDS, free_port, start_gcs_emulator, write_corpus  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_file(path: str):
  """The repository's file `path` ('scripts/make_figures.py') as a module: scripts and docs/ generators
  run as files, not imported as packages."""
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-len('.py')], os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def family_presets() -> list[tuple[str, str]]:
  """(family, preset) for each preset every configs/<family>.py declares (its PRESETS; 'default'
  for a file without)."""
  cases = []
  for path in sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))):
    name = os.path.basename(path)[:-3]
    if name in ('__init__', 'base', 'run', 'default'):  # the shared schema, a run's config.json, an alias
      continue
    cases += [(name, preset) for preset in getattr(importlib.import_module(f'configs.{name}'), 'PRESETS', ['default'])]
  return cases


def registered_families() -> list[str]:
  """Every family, as launch.py and train/task.py find them: a train/tasks/<family>.py (its Task) beside
  a configs/<family>.py (its presets). Tests that cover each family parametrize over this list, so a
  new family is tested without editing them."""
  tasks = {info.name for info in pkgutil.iter_modules([os.path.join(REPO, 'train', 'tasks')])
           if not info.name.startswith('_')}
  return sorted(name for name in tasks if os.path.isfile(os.path.join(REPO, 'configs', f'{name}.py')))


def smallest_preset(family: str) -> str:
  """The preset a test builds of `family`: 'tiny' where configs/<family>.py declares one, else 'default'."""
  return 'tiny' if 'tiny' in getattr(importlib.import_module(f'configs.{family}'), 'PRESETS', {}) else 'default'


def smallest_config(family: str, overrides: dict | None = None):
  """configs/<family>.py's `smallest_preset`, with `overrides` set."""
  return with_overrides(importlib.import_module(f'configs.{family}').get_config(smallest_preset(family)),
                        overrides or {})


def family_entry(table: dict, family: str, table_name: str):
  """table[family]: a test's data for one registered family (expected parameter names, shapes), or
  the test fails with one line naming the family and the table a new family needs an entry in."""
  if family not in table:
    import pytest
    pytest.fail(f'family {family!r} (train/tasks/{family}.py) has no entry in {table_name}: add one for it.',
                pytrace=False)
  return table[family]


def with_overrides(config, overrides: dict):
  """config with {'train.steps': 5, ...} set, as `--config.train.steps=5` would."""
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split('.')
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


# The reductions behind one training step of `tiny_gpt_config` on `write_corpus`'s text (2 blocks
# of width 32 on windows of 32 characters, ~30 ids, batches of 8): a training's losses and
# parameters carry every step's (tests/numerics.py).
TINY_GPT_STEP_TERMS = transformer_terms(2, 32, 4 * 32, 32, vocab=32, positions=8 * 32)


def tiny_gpt_config(source: str, **overrides):
  from configs import gpt
  config = gpt.get_config('tiny')
  config.data.source = source
  return with_overrides(config, overrides)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a subprocess with `devices` fake CPU devices, keeping the other flags the suite
  runs under (e.g. --xla_cpu_max_isa=AVX2)."""
  kept = [flag for flag in os.environ.get('XLA_FLAGS', '').split()
          if not flag.startswith('--xla_force_host_platform_device_count')]
  return ' '.join(kept + [f'--xla_force_host_platform_device_count={devices}'])


def launch(args, devices: int = 1, timeout: int = 300, env_overrides: dict | None = None, *, background: bool = False,
           stdin=None, start_new_session: bool = False):
  """Run launch.py in a new process with `devices` fake CPU devices: `subprocess.run`'s result, or
  with `background` a started process to use as a `subprocess.Popen` (pid, poll, wait, communicate,
  send_signal; text stdout and stderr; `stdin` an open file or None, `start_new_session` as Popen's).
  The process is forked from tests/preloaded_launcher.py (the imports done), unless `env_overrides`
  changes a variable JAX reads when it is imported: then it is a fresh interpreter."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS='cpu',
             **(env_overrides or {}))
  command = [sys.executable, os.path.join(REPO, 'launch.py'), *args]
  launcher = _preloaded_launcher()
  if _jax_environment(env) != launcher.jax_environment:
    if background:
      return subprocess.Popen(command, cwd=REPO, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=start_new_session)
    return subprocess.run(command, cwd=REPO, env=env, stdin=stdin, capture_output=True, text=True, timeout=timeout)
  process = launcher.start(command, env, stdin, start_new_session)
  if background:
    return process
  try:
    outputs = process.communicate(timeout)
  except subprocess.TimeoutExpired:  # as subprocess.run(timeout=...): kill it, then raise with what it wrote
    process.kill()
    raise subprocess.TimeoutExpired(command, timeout, *process.communicate()) from None
  return subprocess.CompletedProcess(command, process.returncode, *outputs)


def _jax_environment(env: dict) -> dict:
  """The variables JAX reads when it is imported (its config's defaults)."""
  return {key: value for key, value in env.items() if key.startswith('JAX_')}


class _PreloadedLauncher:
  """The client of one tests/preloaded_launcher.py server (see its docstring)."""

  def __init__(self):
    import atexit
    import itertools
    import shutil
    import tempfile
    import threading
    self.jax_environment = _jax_environment(os.environ)
    self.server = subprocess.Popen([sys.executable, os.path.join(REPO, 'tests', 'preloaded_launcher.py')], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    self.outputs = tempfile.mkdtemp(prefix='launch-outputs-')
    atexit.register(shutil.rmtree, self.outputs, ignore_errors=True)
    self.ids, self.writing = itertools.count(), threading.Lock()
    self.replies, self.arrived, self.closed = {}, threading.Condition(), False  # replies: id -> {pid, returncode}
    threading.Thread(target=self._read_replies, daemon=True).start()

  def _read_replies(self) -> None:
    for line in self.server.stdout:
      message = json.loads(line)
      with self.arrived:
        self.replies.setdefault(message['id'], {}).update(message)
        self.arrived.notify_all()
    with self.arrived:
      self.closed = True
      self.arrived.notify_all()

  def reply(self, request_id: int, key: str, timeout: float | None = None):
    """The server's `key` ('pid' | 'returncode') for the request, or None when `timeout` seconds pass first."""
    with self.arrived:
      if not self.arrived.wait_for(lambda: key in self.replies.get(request_id, {}) or self.closed, timeout):
        return None
      if key not in self.replies.get(request_id, {}):
        raise RuntimeError(f'tests/preloaded_launcher.py exited ({self.server.wait()}); its stderr is above.')
      return self.replies[request_id][key]

  def start(self, command: list[str], env: dict, stdin, new_session: bool) -> 'PreloadedProcess':
    request_id = next(self.ids)
    stdout, stderr = (os.path.join(self.outputs, f'{request_id}.{name}') for name in ('stdout', 'stderr'))
    request = {'id': request_id, 'argv': command[2:], 'env': env, 'cwd': REPO, 'stdin': stdin and stdin.name,
               'stdout': stdout, 'stderr': stderr, 'new_session': new_session}
    with self.writing:
      self.server.stdin.write((json.dumps(request) + '\n').encode())
    return PreloadedProcess(self, request_id, command, stdout, stderr)


class PreloadedProcess:
  """A launch.py forked by the server, used as a text-mode `subprocess.Popen` with captured outputs."""

  def __init__(self, launcher: _PreloadedLauncher, request_id: int, args: list[str], stdout: str, stderr: str):
    self.launcher, self.request_id, self.args, self.outputs = launcher, request_id, args, (stdout, stderr)
    self.pid, self.returncode = launcher.reply(request_id, 'pid'), None

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self.launcher.reply(self.request_id, 'returncode', 0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      self.returncode = self.launcher.reply(self.request_id, 'returncode', timeout)
    if self.returncode is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def communicate(self, timeout: float | None = None) -> tuple[str, str]:
    self.wait(timeout)
    written = []
    for path in self.outputs:
      with open(path) as f:
        written.append(f.read())
    return tuple(written)

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:  # never a pid the server has already reaped (and the system may reuse)
      os.kill(self.pid, signum)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


_LAUNCHERS = {}


def _preloaded_launcher() -> _PreloadedLauncher:
  """This test process's server (forked children cannot share their parent's)."""
  if os.getpid() not in _LAUNCHERS:
    _LAUNCHERS[os.getpid()] = _PreloadedLauncher()
  return _LAUNCHERS[os.getpid()]


def last_json(stdout: str) -> dict:
  return json.loads(stdout.strip().splitlines()[-1])


def override_args(config_overrides: dict) -> list[str]:
  return [f'--config.{k}={v}' for k, v in config_overrides.items()]


def real_logits(logits, vocab_size: int) -> np.ndarray:
  """[..., V'] logits of a model with a padded vocabulary -> [..., vocab_size], after checking
  that every padded id's logit is masked to the dtype's lowest value."""
  logits = np.asarray(logits)
  assert logits.shape[-1] % 128 == 0 or logits.shape[-1] == vocab_size, logits.shape
  assert np.all(logits[..., vocab_size:] == np.finfo(logits.dtype).min)
  return logits[..., :vocab_size]


def copy_run_back_to(workdir: str, step: int, destination: str) -> str:
  """A copy of the finished run `workdir` as it stood when it saved `step`: the later checkpoints
  removed, so that training `destination` resumes from `step`. Resuming it and comparing with
  `workdir` checks a resume against the uninterrupted run in two trainings instead of three."""
  import shutil
  shutil.copytree(workdir, destination)
  checkpoints = os.path.join(destination, 'checkpoints')
  for name in os.listdir(checkpoints):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(checkpoints, name))
  return destination


def abstract_parameter_count(config, build) -> int:
  """Parameters of the model `build(config)`, counted from shapes only (nothing is allocated)."""
  from flax import nnx
  from models.gpt import count_parameters
  from models.tracing import tracer_errors_without_origin
  with tracer_errors_without_origin():  # the build traces in time linear in its depth (models/tracing.py)
    return count_parameters(nnx.eval_shape(lambda: build(config)))


def scripted_clock(**clock_args):
  """A run's clock (train/budget.py `RunClock`, `clock_args` its keywords) on seconds the test adds to
  its `now`, with no compilation; `evaluate(seconds)` is an evaluation during training of that long,
  timed as train/loop.py `evaluate_step` times one."""
  from train import budget, loop

  class ScriptedClock(budget.RunClock):
    now = 0.0

    def seconds(self):
      return self.now

    def compile_seconds(self):
      return 0.0

    def evaluate(self, seconds: float) -> None:
      _, self.progress.eval_seconds = self.measure(lambda: setattr(self, 'now', self.now + seconds))

  return ScriptedClock(loop.Progress(), 0.0, **clock_args)


def slow_train_steps(monkeypatch, seconds: float) -> None:
  """Each training step of the runs that follow waits `seconds` before it runs, as the step of a larger
  model would take that long (train/loop.py's step is train/steps.py's `jit_train_step`; its
  compilation and its count are the real ones). A real-clock test then fills its budget with a few
  dozen steps, mostly waiting, instead of a tiny model's hundreds of steps burning the CPU."""
  import time
  from train import steps
  jit_train_step = steps.jit_train_step

  def slowed_train_step(*args, **kwargs):
    train_step = jit_train_step(*args, **kwargs)

    def slow(state, batch):
      time.sleep(seconds)
      return train_step(state, batch)
    return slow

  monkeypatch.setattr(steps, 'jit_train_step', slowed_train_step)


def compiled_call(model, *args):
  """`model(*args)` compiled as one program (nnx.jit; one per model structure and argument shapes),
  not op by op: run eagerly, a forward pass compiles each of its operations' new shapes on its own."""
  return _compiled_call()(model, *args)


def _compiled_call():
  if not _COMPILED_CALL:
    from flax import nnx
    _COMPILED_CALL.append(nnx.jit(lambda model, *args: model(*args)))
  return _COMPILED_CALL[0]


_COMPILED_CALL = []


def numpy_valued(abstract, seed: int = 0, scale: float = 0.1):
  """A concrete copy of `abstract` (an nnx.eval_shape'd module) whose floating variables are N(0, scale)
  draws of NumPy, integer ones zero and random keys made from `seed`: built without JAX's initialisers,
  which compile a random program for each new parameter shape when run eagerly. For tests whose
  assertions hold for any values (exports, imports, refusals)."""
  import jax
  from flax import nnx
  rng = np.random.default_rng(seed)

  def value(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(np.zeros((*x.shape, 2), np.uint32) + np.uint32(seed))
    if jax.dtypes.issubdtype(x.dtype, np.floating):
      return (scale * rng.standard_normal(x.shape)).astype(x.dtype)
    return np.zeros(x.shape, x.dtype)
  graphdef, state = nnx.split(abstract)
  return nnx.merge(graphdef, jax.device_put(jax.tree.map(value, state)))


def placed_like(x, value: np.ndarray):
  """`value` (a NumPy array of `x`'s shape) on the devices of the jax.Array `x`: committed to its sharding
  when `x` is, else uncommitted on the default device (as an array JAX made eagerly)."""
  import jax
  return jax.device_put(value, x.sharding) if x.committed else jax.device_put(value)
