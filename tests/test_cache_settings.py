"""Where token caches go and how many processes build them: the tests' caches live in a temporary
folder (tests/conftest.py sets token_cache.CACHE_DIR_VARIABLE), in this process and in the launch.py
processes it starts, never in the user's ~/.cache/attention-lineage/data; data.cache_workers below
0 is one config error line."""
import json
import os

import ml_collections

import support
from configs import gpt
from data import token_cache
from train import rundir

USERS_CACHE = os.path.realpath(os.path.expanduser('~/.cache/attention-lineage'))


def test_the_default_cache_dir_is_the_named_folder_in_configs_saved_before_too(monkeypatch, tmp_path):
  folder = os.environ[token_cache.CACHE_DIR_VARIABLE]  # the session's, from tests/conftest.py
  assert os.path.isdir(folder) and not os.path.realpath(folder).startswith(USERS_CACHE)
  assert gpt.get_config('tiny').data.cache_dir == token_cache.DEFAULT_CACHE_DIR  # what config.json keeps
  assert token_cache.cache_dir(gpt.get_config('tiny').data) == folder
  # A run saved with the default, or before data.cache_dir existed, reads the named folder too.
  assert token_cache.cache_dir(ml_collections.ConfigDict({'cache_dir': '~/.cache/attention-lineage/data'})) == folder
  assert token_cache.cache_dir(ml_collections.ConfigDict({})) == folder
  assert token_cache.cache_dir(ml_collections.ConfigDict({'cache_dir': str(tmp_path)})) == str(tmp_path)
  assert token_cache.LOCAL_MIRROR == os.path.join(folder, 'gs-mirror')
  monkeypatch.delenv(token_cache.CACHE_DIR_VARIABLE)  # a user's run: the default as written
  assert token_cache.cache_dir(gpt.get_config('tiny').data) == '~/.cache/attention-lineage/data'


def test_a_launch_of_the_tests_builds_its_caches_in_the_temporary_folder(tmp_path):
  """--mode=prepare builds the caches in the tests' folder; a training launch on the same data, in a
  workdir of its own (docs/data.md's two commands), trains on them as built."""
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=3, lines=20)
  data = ['--config=configs/gpt.py:tiny', f'--config.data.source={corpus}', '--config.data.tokenizer=char']
  result = support.launch(['--mode=prepare', *data])
  assert result.returncode == 0, result.stderr[-3000:]
  prepared = support.last_json(result.stdout)['caches']
  caches = set(prepared.values())
  folder = os.environ[token_cache.CACHE_DIR_VARIABLE]
  manifests = {name: os.path.join(folder, name, 'manifest.json') for name in caches}
  for name, manifest in manifests.items():
    with open(manifest) as f:
      assert json.load(f)['source'] == corpus
    assert not os.path.exists(os.path.join(USERS_CACHE, 'data', name))
  built = {name: os.stat(manifest).st_mtime_ns for name, manifest in manifests.items()}
  workdir = str(tmp_path / 'run')
  # One block: the caches are what is checked, not the model.
  trained = support.launch([*data, '--config.model.num_layers=1', '--config.train.steps=1',
                            '--config.train.eval_steps=1', f'--workdir={workdir}'])
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert rundir.data_history(workdir)[-1]['caches'] == prepared
  assert {name: os.stat(manifest).st_mtime_ns for name, manifest in manifests.items()} == built  # none rebuilt


def test_cache_workers_below_zero_is_one_config_error_before_any_workdir(tmp_path):
  result = support.launch(['--config=configs/gpt.py:tiny', '--config.data.cache_workers=-3',
                           f'--workdir={tmp_path}/run'])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == ['error: config.data.cache_workers=-3 must be >= 0.'], result.stderr
  assert not os.path.exists(tmp_path / 'run')
