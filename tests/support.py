"""Shared test fixtures: a tiny deterministic corpus, a subprocess runner for launch.py, every preset."""
import glob
import importlib
import json
import os
import subprocess
import sys

import numpy as np

from numerics import transformer_terms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau '
         'upsilon phi chi psi omega').split()


def write_corpus(directory, files: int = 6, lines: int = 60, seed: int = 0) -> str:
  """Small text files of pseudo-sentences; returns a `text:` source for them."""
  rng = np.random.default_rng(seed)
  os.makedirs(directory, exist_ok=True)
  for f in range(files):
    with open(os.path.join(directory, f'doc{f}.txt'), 'w') as out:
      for _ in range(lines):
        start = rng.integers(len(WORDS))
        out.write(' '.join(WORDS[(start + k) % len(WORDS)] for k in range(rng.integers(3, 9))) + '.\n')
  return f'text:{directory}/*.txt'


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


def launch(args, devices: int = 1, timeout: int = 300, env_overrides: dict | None = None, **popen):
  """Run launch.py in a new process with `devices` fake CPU devices: `subprocess.run`'s result, or
  with Popen arguments (stdin, start_new_session...) the `subprocess.Popen` of a fresh interpreter.
  Without them the process is forked from tests/preloaded_launcher.py (the imports done), unless
  `env_overrides` changes a variable JAX reads when it is imported."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS='cpu',
             **(env_overrides or {}))
  command = [sys.executable, os.path.join(REPO, 'launch.py'), *args]
  if popen:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
  launcher = _preloaded_launcher()
  if _jax_environment(env) != launcher.jax_environment:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  return launcher.run(command, env, timeout)


def _jax_environment(env: dict) -> dict:
  """The variables JAX reads when it is imported (its config's defaults)."""
  return {key: value for key, value in env.items() if key.startswith('JAX_')}


class _PreloadedLauncher:
  """The client of one tests/preloaded_launcher.py server (see its docstring)."""

  def __init__(self):
    import atexit
    import shutil
    import tempfile
    import threading
    self.jax_environment = _jax_environment(os.environ)
    self.server = subprocess.Popen([sys.executable, os.path.join(REPO, 'tests', 'preloaded_launcher.py')], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    self.unread = b''
    self.outputs = tempfile.mkdtemp(prefix='launch-outputs-')
    atexit.register(shutil.rmtree, self.outputs, ignore_errors=True)
    self.lock = threading.Lock()

  def reply(self, timeout: float | None = None) -> dict | None:
    """The server's next JSON line, or None when `timeout` seconds pass without one."""
    import select
    while b'\n' not in self.unread:
      if not select.select([self.server.stdout], [], [], timeout)[0]:
        return None
      chunk = os.read(self.server.stdout.fileno(), 4096)
      if not chunk:
        raise RuntimeError(f'tests/preloaded_launcher.py exited ({self.server.wait()}); its stderr is above.')
      self.unread += chunk
    line, self.unread = self.unread.split(b'\n', 1)
    return json.loads(line)

  def run(self, command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    import signal
    with self.lock:
      stdout, stderr = os.path.join(self.outputs, 'stdout'), os.path.join(self.outputs, 'stderr')
      request = {'argv': command[2:], 'env': env, 'cwd': REPO, 'stdout': stdout, 'stderr': stderr}
      self.server.stdin.write((json.dumps(request) + '\n').encode())
      pid = self.reply()['pid']
      done = self.reply(timeout)
      if done is None:  # as subprocess.run(timeout=...): kill it, then raise with what it wrote
        os.kill(pid, signal.SIGKILL)
        self.reply()
      with open(stdout) as out, open(stderr) as err:
        written = out.read(), err.read()
    if done is None:
      raise subprocess.TimeoutExpired(command, timeout, *written)
    return subprocess.CompletedProcess(command, done['returncode'], *written)


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


def count_at_depth(config, build) -> int:
  """Parameters of the model `build(config)` at config.num_layers, counted on abstract one- and
  two-layer models: the layers are identical, and tracing all 24 layers of a large model takes ~15 s."""
  import dataclasses
  from flax import nnx
  from models.gpt import count_parameters
  one, two = (count_parameters(nnx.eval_shape(lambda n=n: build(dataclasses.replace(config, num_layers=n))))
              for n in (1, 2))
  return one + (config.num_layers - 1) * (two - one)
