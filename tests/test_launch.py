"""The launcher itself: importing it only defines flags, every --mode has its function, and the
config file runs exactly once per launch, whatever the outcome."""
import os
import subprocess
import sys
import textwrap

import support

COUNTING_CONFIG = '''
import os
with open(os.environ['CONFIG_RUNS'], 'a') as f:
  f.write('ran\\n')

from configs import gpt


def get_config(preset='tiny'):
  return gpt.get_config(preset)
'''


def test_importing_launch_only_defines_flags():
  """No JAX, no environment change, no config loaded and no argv read at import, even with
  --mode=compile on the command line (the environment is set when the flags are parsed)."""
  check = textwrap.dedent('''
      import os, sys
      sys.argv = ['launch.py', '--mode=compile', '--compile_target=cpu-8', '--config=configs/nope.py']
      environment = dict(os.environ)
      import launch
      assert dict(os.environ) == environment
      assert not launch.FLAGS.is_parsed() and 'config' not in launch.FLAGS
      assert not any(name == 'jax' or name.startswith(('jax.', 'train', 'configs')) for name in sys.modules)
      assert sorted(launch.MODES) == sorted(launch.FLAGS['mode'].parser.enum_values)
  ''')
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  result = subprocess.run([sys.executable, '-c', check], cwd=support.REPO, env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def test_the_config_file_runs_once_per_launch(tmp_path):
  config = tmp_path / 'counting.py'
  config.write_text(COUNTING_CONFIG)
  runs = tmp_path / 'runs.txt'
  not_a_run = f'--workdir={tmp_path / "none"}'
  cases = [  # (arguments, what stderr says): each ends after the config is loaded and its flags parsed
      ([f'--config={config}:tiny', '--config.train.steps=3', '--mode=eval', not_a_run], 'is not a run directory'),
      (['--config', str(config), '--mode=bench', '--bench_steps=0'], 'time at least 1 step'),
      ([f'--config={config}', '--config.train.stepz=3'], "Did you mean 'train.steps'?"),
      ([f'--config={config}', '--config.train.steps=many'], 'train.steps'),
  ]
  for args, message in cases:
    runs.unlink(missing_ok=True)
    result = support.launch(args, env_overrides={'CONFIG_RUNS': str(runs)})
    assert result.returncode == 1 and message in result.stderr, (args, result.stderr[-2000:])
    assert runs.read_text() == 'ran\n', args



HUGE_PAGE_PROBE = """
import ctypes, os
import huge_pages
huge_pages.restart_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 96 << 20  # over glibc's largest mmap threshold: malloc maps it afresh, as it does XLA's temporaries
ctypes.memset(libc.malloc(size), 1, size)
rollup = dict(line.split(':', 1) for line in open('/proc/self/smaps_rollup') if ':' in line)
print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), int(rollup['AnonHugePages'].split()[0]) >> 10)
"""


def probe_huge_pages(tunables: str | None) -> tuple[bool, str, int]:
  """(pid kept, GLIBC_TUNABLES as the probe saw it, MiB of its memory on huge pages)."""
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  env.update({'GLIBC_TUNABLES': tunables} if tunables is not None else {})
  process = subprocess.Popen([sys.executable, '-c', HUGE_PAGE_PROBE], cwd=support.REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = process.communicate(timeout=60)
  assert process.returncode == 0, err[-2000:]
  pid, seen, huge_mib = out.split()
  return int(pid) == process.pid, seen, int(huge_mib)


def test_a_launch_restarts_once_with_large_mallocs_on_huge_pages():
  """huge_pages.py: the restart adds the tunable to the user's own (once: no second exec), keeps the
  pid, and glibc then backs a 96 MiB malloc with transparent huge pages, which it does not without
  the tunable or with `glibc.malloc.hugetlb=0`. Where the machine cannot (not glibc >= 2.35, the
  kernel's huge pages off) nothing restarts."""
  import huge_pages
  if huge_pages.environment_with_huge_pages({}) is None:
    assert probe_huge_pages(None)[:2] == (True, 'None')
    return
  kept_pid, seen, huge_mib = probe_huge_pages('glibc.malloc.check=0')
  assert kept_pid and seen == 'glibc.malloc.check=0:glibc.malloc.hugetlb=1' and huge_mib >= 90
  assert probe_huge_pages('glibc.malloc.hugetlb=0') == (True, 'glibc.malloc.hugetlb=0', 0)
