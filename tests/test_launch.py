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
