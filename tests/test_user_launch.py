"""launch.py as a user starts it: a fresh interpreter (`python launch.py ...`, not forked from
tests/preloaded_launcher.py) on one CPU device, in an environment without the suite's compiler and
cache settings (tests/conftest.py: JAX_DISABLE_MOST_OPTIMIZATIONS, --xla_cpu_use_fusion_emitters=false),
so that XLA compiles with the settings a user's run gets (the token caches stay in the suite's
temporary folder). A tiny GPT trains a few steps, and `--mode=eval` on its workdir gives the numbers
of its result line."""
import os
import subprocess
import sys

import support

# What tests/conftest.py sets for the suite's speed (users' runs have none of them).
SUITE_VARIABLES = ('JAX_DISABLE_MOST_OPTIMIZATIONS', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                   'JAX_COMPILATION_CACHE_DIR', 'ATTENTION_LINEAGE_TEST_COMPILER')
SUITE_FLAGS = ('--xla_cpu_use_fusion_emitters', '--xla_force_host_platform_device_count')


def user_environment() -> dict:
  """os.environ without the suite's settings; XLA flags the caller set (e.g. --xla_cpu_max_isa=AVX2) stay."""
  env = {key: value for key, value in os.environ.items() if key not in SUITE_VARIABLES}
  flags = [flag for flag in env.pop('XLA_FLAGS', '').split() if not flag.startswith(SUITE_FLAGS)]
  return {**env, **({'XLA_FLAGS': ' '.join(flags)} if flags else {})}


def user_launch(args: list[str]) -> dict:
  """`python launch.py *args` in a fresh interpreter: its result line (the last line of its stdout)."""
  process = subprocess.run([sys.executable, 'launch.py', *args], cwd=support.REPO, env=user_environment(),
                           capture_output=True, text=True, timeout=300)
  assert process.returncode == 0, process.stderr[-3000:]
  return support.last_json(process.stdout)


def test_the_user_environment_has_none_of_the_suites_settings():
  env = user_environment()
  assert not set(SUITE_VARIABLES) & set(env)
  assert not any(flag in env.get('XLA_FLAGS', '') for flag in SUITE_FLAGS)


def test_a_fresh_launch_with_xlas_default_settings_trains_and_evaluates_to_its_result_line(tmp_path):
  workdir = str(tmp_path / 'run')
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=2, lines=40)
  held_out = support.write_corpus(str(tmp_path / 'held_out'), files=1, lines=30, seed=1)
  # One block, two steps: XLA's default settings compile the same programs at half the size, and a
  # trained step's checkpoint is still evaluated again by --mode=eval.
  trained = user_launch(['--config=configs/gpt.py:tiny', f'--workdir={workdir}', f'--config.data.source={corpus}',
                         f'--config.data.eval_source={held_out}', '--config.model.num_layers=1',
                         '--config.train.steps=2', '--config.train.eval_every=2',
                         '--config.train.checkpoint_every=2'])
  assert trained['mode'] == 'train' and trained['workdir'] == workdir and trained['step'] == 2, trained
  evaluated = user_launch(['--mode=eval', f'--workdir={workdir}'])
  numbers = lambda result: {key: value for key, value in result.items()
                            if key.startswith(('eval/', 'test/')) and isinstance(value, float)}
  # The same evaluation program on the same checkpoint and batches: equal to the last digit.
  assert numbers(trained) and numbers(evaluated) == numbers(trained), (trained, evaluated)
  assert evaluated['step'] == trained['final_eval_step'] == 2


def test_ci_reads_readme_command_1_from_the_readme():
  # .ci/readme_command.py runs this command (a couple of minutes: CI's own step, not the suite's).
  module = support.load_file('.ci/readme_command.py')
  with open(os.path.join(support.REPO, 'README.md')) as f:
    command = module.readme_command(f.read())
  assert command.startswith('python launch.py') and 'pip' not in command, command
