"""Tests run on 8 fake CPU devices so that sharding is exercised everywhere."""
import gc
import os
import sys

import pytest

# Appended to XLA flags the caller set: `XLA_FLAGS=--xla_cpu_max_isa=AVX2 pytest` runs the suite with
# XLA:CPU's code kept to AVX2, the summation order of a CPU without AVX-512 (.ci/run does it too).
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
# The two compiler settings below make the suite faster; users' runs get neither. With
# ATTENTION_LINEAGE_TEST_COMPILER=default the tests (and the launch.py processes they start) keep XLA's
# default settings instead: .ci/run reruns the `numerics` tests so. 'fast' (the default): the settings.
TEST_COMPILER = os.environ.setdefault('ATTENTION_LINEAGE_TEST_COMPILER', 'fast')
if TEST_COMPILER not in ('fast', 'default'):
  raise SystemExit(f"ATTENTION_LINEAGE_TEST_COMPILER={TEST_COMPILER!r}: use 'fast' or 'default' (XLA's own settings).")
# XLA:CPU's older elemental emitters compile the tests' tiny programs in about two thirds of the time
# of its MLIR fusion emitters (the default, what users run): a tiny Transformer's programs 10.5 s
# instead of 15.5 s, an eager op 40 ms instead of 60 ms. The results agree to the tolerances the
# tests allow (tests/numerics.py); the launch.py processes the tests start inherit the flag.
if TEST_COMPILER == 'fast' and '--xla_cpu_use_fusion_emitters' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_cpu_use_fusion_emitters=false'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The tests' models are tiny: compiling them costs more than running them, so XLA skips LLVM's
# expensive passes (about a quarter of the suite's CPU time). HLO passes (fusion, sharding) still run.
if TEST_COMPILER == 'fast':
  os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
# Every program goes to one persistent compilation cache (the trainer's default `config.compile_cache`),
# however quickly it compiled: the tests and their launch.py processes build the same tiny programs
# again and again. The suite starts on whatever the cache holds (CI: an empty one).
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.expanduser('~/.cache/attention-lineage/jax'))
# Token caches and shared tokenizers (data.cache_dir's default, `token_cache.CACHE_DIR_VARIABLE`) go to
# one temporary folder per session, never the user's ~/.cache/attention-lineage/data: a cache written by
# the code under test must not be read by a later version, nor the user's runs read the tests'. Set
# before the xdist workers and launch.py processes start, which inherit it; removed by the process
# that made it. A folder named by the caller is kept.
if not os.environ.get('ATTENTION_LINEAGE_DATA_CACHE'):
  import atexit
  import shutil
  import tempfile

  def _remove_data_cache(folder: str, made_by: int) -> None:
    if os.getpid() == made_by:  # not when a forked child exits
      shutil.rmtree(folder, ignore_errors=True)

  os.environ['ATTENTION_LINEAGE_DATA_CACHE'] = tempfile.mkdtemp(prefix='attention-lineage-test-data-')
  atexit.register(_remove_data_cache, os.environ['ATTENTION_LINEAGE_DATA_CACHE'], os.getpid())
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The files that take one worker longest, handed out first (pytest.ini: --no-loadscope-reorder, so
# pytest-xdist's loadfile keeps this order): a long file started last would leave the other worker
# idle at the end. Only the order depends on this list; a file missing from it runs after these.
SLOWEST_FILES = ('test_sweep.py', 'test_run_layout.py', 'test_trainer.py', 'test_daily_loop.py', 'test_fault_soak.py',
                 'test_moe.py', 'test_lm_eval.py', 'test_transformer.py', 'test_lora.py', 'test_compile.py',
                 'test_cloud_workdir.py', 'test_interop_errors.py', 'test_budget.py', 'test_cooldown.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


# Python's full (oldest-generation) garbage collections walk every live object, and a test worker holds
# more and more of them as the session goes on: JAX's caches of traced and compiled programs, module
# fixtures' runs. Freezing what is alive when a test starts keeps those collections to the objects made
# since, as forking servers do (`gc.freeze`); the cost: a reference cycle made by an earlier test and
# dropped later is never collected, a little memory per worker.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  gc.freeze()
