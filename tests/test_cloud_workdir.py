"""A gs:// workdir end to end against a GCS emulator on localhost: training, resume, --mode=eval,
--mode=predict and `load_run`, with every file of the run in the bucket and the numbers of a run
in a local directory; and the one-line errors of a gs:// workdir that cannot work."""
import json
import os
import sys

import numpy as np
import pytest

import storage
import support
from numerics import assert_close, transformer_terms

# The reductions behind one step of the tiny GPT with one block (support.TINY_GPT_STEP_TERMS's, one block;
# tests/numerics.py).
STEP_TERMS = transformer_terms(1, 32, 4 * 32, 32, vocab=32, positions=8 * 32)

BUCKET = 'bucket'
# constant: 3 + 3 steps = 6, the 6-step run's schedule; a few steps suffice to compare a resume with a straight run.
# One block: the run's files, resume and modes are the same; each of the five launch.py processes compiles (or
# loads) and traces smaller programs.
TRAIN = {'mesh.data': 1, 'model.num_layers': 1, 'train.log_every': 1, 'train.eval_every': 3,
         'train.checkpoint_every': 3, 'train.steps': 6, 'train.schedule': 'constant', 'decode.temperature': 0.0,
         'decode.prompts': 'alpha'}


@pytest.fixture(scope='session')
def emulator(tmp_path_factory):
  """A GCS emulator process (tests/gcs_emulator.py) serving the bucket `bucket`; yields the
  environment that points gcsfs and TensorStore at it (also set in this process, for load_run)."""
  try:
    import gcp_storage_emulator  # noqa: F401
  except ImportError:
    pytest.skip('gcp-storage-emulator is not installed (pip install -r requirements-dev.txt)')
  try:
    process, url = support.start_gcs_emulator(BUCKET, str(tmp_path_factory.mktemp('gcs_emulator') / 'emulator.log'))
  except RuntimeError as e:
    pytest.skip(str(e))
  environment = storage.emulator_environment(url)
  saved = {k: os.environ.get(k) for k in environment}
  os.environ.update(environment)
  yield environment
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  process.terminate()
  process.wait(timeout=10)


def launch(args, emulator_environment):
  result = support.launch(args, devices=1, env_overrides=emulator_environment)
  assert result.returncode == 0, result.stderr[:3000]
  return support.last_json(result.stdout)


def metrics_at(lines: list[dict], step: int, key: str) -> float:
  return next(m[key] for m in lines if m['step'] == step and key in m)


def test_a_gs_workdir_trains_resumes_evaluates_predicts_and_reloads(emulator, tmp_path):
  corpus = support.write_corpus(str(tmp_path / 'corpus'))
  args = ['--config=configs/gpt.py:tiny', *support.override_args({'data.source': corpus, **TRAIN})]
  workdir = f'gs://{BUCKET}/run'
  local = launch(args + [f'--workdir={tmp_path}/local'], {})  # 6 steps in one go, on local disk

  first = launch(args + [f'--workdir={workdir}', '--config.train.steps=3'], emulator)
  resumed = launch(args + [f'--workdir={workdir}'], emulator)
  assert (first['step'], resumed['step']) == (3, 6)
  # The resumed run restored parameters, optimizer and input position: it ends where the straight one does.
  assert_close(resumed['eval/loss'], local['eval/loss'], terms=7 * STEP_TERMS)  # 6 steps, then the evaluation

  bucket = storage.path(workdir)
  names = {str(p.relative_to(bucket)) for p in bucket.glob('*')}
  assert {'config.json', 'model.json', 'tokenizer.json', 'tokenizer_meta.json', 'metrics.jsonl', 'samples.json',
          'tensorboard', 'checkpoints'} <= names, names
  assert {p.name for p in (bucket / 'checkpoints').iterdir()} >= {'3', '6'}
  assert any(p.name.startswith('events.out.tfevents') for p in (bucket / 'tensorboard').iterdir())
  metrics = [json.loads(line) for line in (bucket / 'metrics.jsonl').read_text().splitlines()]
  local_metrics = [json.loads(line) for line in open(tmp_path / 'local' / 'metrics.jsonl')]
  for step in (2, 5, 6):  # both sessions' lines, continued in one file
    assert_close(metrics_at(metrics, step, 'train/loss'), metrics_at(local_metrics, step, 'train/loss'),
                 terms=step * STEP_TERMS)

  evaluation = launch(['--mode=eval', f'--workdir={workdir}'], emulator)
  assert evaluation['step'] == 6
  assert_close(evaluation['eval/loss'], resumed['eval/loss'], terms=STEP_TERMS)

  (bucket / 'prompts.txt').write_text('alpha beta\ngamma\n')
  prediction = launch(['--mode=predict', f'--workdir={workdir}', f'--input={workdir}/prompts.txt',
                       f'--output={workdir}/predictions.jsonl'], emulator)
  written = [json.loads(line) for line in (bucket / 'predictions.jsonl').read_text().splitlines()]
  assert written == prediction['outputs'] and len(written) == 2

  from train.rundir import load_run
  run = load_run(workdir)
  assert run.step == 6 and run.tokenizer.vocab_size == run.model_config.vocab_size
  assert run.predict(['alpha beta', 'gamma']) == prediction['outputs']


def test_an_emulator_half_configured_is_one_clear_line(tmp_path):
  environment = {'STORAGE_EMULATOR_HOST': 'http://localhost:1', 'TENSORSTORE_GCS_HTTP_URL': ''}
  result = support.launch(['--config=configs/gpt.py:tiny', '--workdir=gs://bucket/run'], devices=1,
                          env_overrides=environment)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[-1]]
  assert 'TENSORSTORE_GCS_HTTP_URL=http://localhost:1' in result.stderr


def test_missing_credentials_are_one_clear_line(tmp_path):
  environment = {'STORAGE_EMULATOR_HOST': '', 'GOOGLE_APPLICATION_CREDENTIALS': str(tmp_path / 'absent.json')}
  result = support.launch(['--mode=eval', '--workdir=gs://bucket/run'], devices=1, env_overrides=environment)
  assert result.returncode == 1
  assert result.stderr.strip().startswith('error: No Google Cloud credentials for gs://'), result.stderr[-2000:]
  assert len(result.stderr.strip().splitlines()) == 1


def test_missing_gcsfs_is_a_storage_error(monkeypatch):
  monkeypatch.setitem(sys.modules, 'gcsfs', None)  # import gcsfs raises ImportError
  with pytest.raises(storage.StorageError, match='needs gcsfs'):
    storage.check_gcs_access.__wrapped__()


def test_a_gs_token_cache_is_built_in_the_bucket_and_read_through_a_lazily_filled_local_mirror(
    emulator, tmp_path, monkeypatch):
  """data.cache_dir=gs://...: the shards and the shared tokenizer land in the bucket; a reader fetches a
  shard into a local mirror when it first reads it (none before), and reads what a local cache gives."""
  from configs import gpt
  from data import lm, token_cache, translation
  monkeypatch.setattr(token_cache, 'LOCAL_MIRROR', str(tmp_path / 'mirror'))
  config = gpt.get_config('tiny').data
  config.source = support.write_corpus(str(tmp_path / 'corpus'), files=4, lines=40)
  config.cache_shard_mb = 0.002  # several shards
  windows, mirrored = {}, lambda: sorted(p.name for p in (tmp_path / 'mirror').rglob('*.npy'))
  for where, cache_dir in (('local', str(tmp_path / 'cache')), ('gs', f'gs://{BUCKET}/cache')):
    config.cache_dir = cache_dir
    _, train, valid, _, caches = lm.lm_datasets(config, str(tmp_path / f'run-{where}'), seed=0)
    if where == 'gs':
      assert mirrored() == []  # planned, built and opened: nothing fetched yet
      train[0]
      assert mirrored() == ['00000.train.tokens.npy']  # the first window's shard only
    windows[where] = [np.stack([split[i]['tokens'] for i in range(len(split))]) for split in (train, valid)]
  bucket = storage.path(f'gs://{BUCKET}/cache/{caches["train"]}')
  names = {p.name for p in bucket.iterdir()}
  assert 'manifest.json' in names and '00000.json' in names and '00000.train.tokens.npy' in names, names
  assert any(name.endswith('.valid.tokens.npy') for name in names), names
  assert len(mirrored()) == len([name for name in names if name.endswith('.npy')])  # all read by now
  assert any(storage.path(f'gs://{BUCKET}/cache/tokenizers-v{token_cache.FORMAT}').iterdir())
  for local, remote in zip(windows['local'], windows['gs']):
    np.testing.assert_array_equal(local, remote)
  # An example cache too: rows and the test split's text.
  (tmp_path / 'pairs.tsv').write_text(''.join(f'source {i}\ttarget {i}\n' for i in range(300)))
  pair_config = translation_config(tmp_path)
  read = {}
  for where, cache_dir in (('local', str(tmp_path / 'pair-cache')), ('gs', f'gs://{BUCKET}/pair-cache')):
    pair_config.cache_dir = cache_dir
    _, splits, texts, _ = translation.pair_datasets(pair_config, str(tmp_path / f'pairs-{where}'), seed=0)
    read[where] = ([splits['train'][i]['source'] for i in range(len(splits['train']))], list(texts))
  np.testing.assert_array_equal(read['local'][0], read['gs'][0])
  assert read['local'][1] == read['gs'][1] and len(read['gs'][1]) > 5


def translation_config(tmp_path):
  from configs import transformer
  config = transformer.get_config('tiny').data
  config.update({'source': f'tsv:{tmp_path}/pairs.tsv', 'cache_shard_mb': 0.004, 'max_examples': 0})
  return config
