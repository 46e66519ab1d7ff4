"""The shared trainer: sharding equivalence, resume after SIGTERM, reload on other device counts,
divergence, grad accumulation, checkpoint retention, and the errors users meet first."""
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from numerics import assert_close, transformer_terms
from errors import ConfigError
from data.sources import DataError
from train import checkpoint as ckpt
from train.loop import TrainingDiverged
from train.rundir import load_run
from train.trainer import train_and_evaluate

# The tests train the tiny GPT with one block (ONE_BLOCK): sharding, resuming, accumulating gradients,
# diverging and the checks of a run's files do the same in one block as in two, and each training compiles
# its model afresh (a block more costs each about a third more compilation).
ONE_BLOCK = {'model.num_layers': 1}
# The reductions behind one step of that one-block GPT (tests/numerics.py; support.TINY_GPT_STEP_TERMS: two).
STEP_TERMS = transformer_terms(1, 32, 4 * 32, 32, vocab=32, positions=8 * 32)
# The runs compared across meshes and across a SIGTERM: dropout makes the PRNG streams part of every match
# (threefry draws the same bits under any sharding), and a constant rate after the warmup keeps the train
# step independent of train.steps (the runs share their programs).
COMPARED = {**ONE_BLOCK, 'model.dropout': 0.1, 'train.schedule': 'constant'}


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')))


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def train_loss_at(workdir, step):
  return next(m['train/loss'] for m in read_metrics(workdir) if m['step'] == step and 'train/loss' in m)


@pytest.fixture(scope='module')
def single_device_run(corpus, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('single') / 'run')
  overrides = {'data.source': corpus, 'mesh.data': 1, 'train.log_every': 1, **COMPARED}
  result = support.launch(['--config=configs/gpt.py:tiny', f'--workdir={workdir}', *support.override_args(overrides)],
                          devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, support.last_json(result.stdout)


@pytest.fixture(scope='module')
def fsdp_run(corpus, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('fsdp') / 'run')
  config = support.tiny_gpt_config(corpus, **{'mesh.data': 4, 'mesh.fsdp': 2, 'train.log_every': 1, **COMPARED})
  return workdir, train_and_evaluate(config, workdir)


def test_loss_decreases_and_metrics_are_written(fsdp_run):
  workdir, results = fsdp_run
  metrics = read_metrics(workdir)
  losses = [m['train/loss'] for m in metrics if 'train/loss' in m]
  assert losses[-1] < losses[0] - 0.5
  assert {'train/lr', 'train/grad_norm', 'train/tokens_per_s'} <= set(metrics[-2]) | set(metrics[-1])
  speeds = [m for m in metrics if 'train/tokens_per_s' in m]
  for m in speeds:  # no padding: the same count over the same seconds
    assert_close(m['train/real_tokens_per_s'], m['train/tokens_per_s'], terms=1)
  assert results['eval/loss'] < 4.0
  assert_close(results['eval/perplexity'], np.exp(results['eval/loss']), terms=1)
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(os.path.join(workdir, 'tensorboard')))
  assert json.load(open(os.path.join(workdir, 'config.json')))['mesh']['fsdp'] == 2


def test_eight_device_fsdp_matches_one_device(single_device_run, fsdp_run):
  (single_dir, single), (fsdp_dir, fsdp) = single_device_run, fsdp_run
  for step in (1, 10, 20):
    assert_close(train_loss_at(fsdp_dir, step), train_loss_at(single_dir, step), terms=step * STEP_TERMS)
  assert_close(fsdp['eval/loss'], single['eval/loss'], terms=21 * STEP_TERMS)


def test_tensor_parallel_matches_one_device(single_device_run, corpus, tmp_path):
  single_dir, _ = single_device_run
  config = support.tiny_gpt_config(corpus, **{'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2,
                                              'train.log_every': 1, **COMPARED})
  train_and_evaluate(config, str(tmp_path / 'tp'))
  for step in (10, 20):
    assert_close(train_loss_at(str(tmp_path / 'tp'), step), train_loss_at(single_dir, step), terms=step * STEP_TERMS)


def test_run_trained_on_eight_devices_reloads_on_one(fsdp_run, tmp_path):
  workdir, results = fsdp_run
  # Each process says that the run's mesh (data=4 x fsdp=2) does not fit its one device (train/rundir.py).
  on_one_device = "does not fit the 1 devices here; using a data-parallel mesh over all of them."
  evaluation = support.launch(['--mode=eval', f'--workdir={workdir}'], devices=1)
  assert evaluation.returncode == 0, evaluation.stderr[-3000:]
  assert on_one_device in evaluation.stdout, evaluation.stdout[-3000:]
  assert_close(support.last_json(evaluation.stdout)['eval/loss'], results['eval/loss'], terms=STEP_TERMS)
  # load_run and predict (what --mode=predict runs) in a process of one device.
  lines = tmp_path / 'lines.txt'
  lines.write_text('alpha beta\n')
  prediction = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={lines}'], devices=1)
  assert prediction.returncode == 0, prediction.stderr[-3000:]
  assert on_one_device in prediction.stdout, prediction.stdout[-3000:]
  predicted = support.last_json(prediction.stdout)
  (continuation,) = predicted['outputs']
  assert predicted['step'] == 20 and len(continuation) > 0


def test_sigterm_saves_exits_zero_and_resumes_to_identical_results(single_device_run, corpus, tmp_path):
  # The uninterrupted run is single_device_run (20 steps, evaluations and checkpoints at steps 10 and 20), launched
  # as these are. The signal is sent at step 3, well before step 10, so that the resume passes an evaluation and
  # a checkpoint (step 10) before the last step's; dropout (COMPARED) makes the PRNG state part of the match.
  straight_dir, straight = single_device_run
  overrides = {'data.source': corpus, 'mesh.data': 1, 'train.log_every': 1, **COMPARED}
  args = ['--config=configs/gpt.py:tiny', *support.override_args(overrides)]

  workdir = f'{tmp_path}/interrupted'
  process = support.launch(args + [f'--workdir={workdir}'], devices=1, background=True, start_new_session=True)
  metrics_file = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 240
  while time.time() < deadline:
    if os.path.exists(metrics_file) and any(json.loads(l)['step'] >= 3 for l in open(metrics_file)):
      break
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  stdout, stderr = process.communicate(timeout=240)
  assert process.returncode == 0, stderr[-3000:]
  stopped_at = ckpt.Checkpointer(workdir, read_only=True).latest_step()
  assert 3 <= stopped_at < 20, stopped_at
  assert 'SIGTERM' in stdout + stderr

  resumed = support.launch(args + [f'--workdir={workdir}'], devices=1)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'Resumed from the checkpoint at step {stopped_at}' in resumed.stdout + resumed.stderr
  assert support.last_json(resumed.stdout)['eval/loss'] == straight['eval/loss']
  a, b = load_run(straight_dir), load_run(workdir)
  from flax import nnx
  for x, y in zip(jax.tree.leaves(nnx.state(a.model)), jax.tree.leaves(nnx.state(b.model))):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                                  np.asarray(jax.random.key_data(y) if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key) else y))


def test_gradient_accumulation_matches_the_full_batch(corpus, tmp_path):
  losses = []
  for accum in (1, 2):
    # Step 3's loss follows two updates, each from the gradient of 16 rows (summed over two micro-batches).
    config = support.tiny_gpt_config(corpus, **{'train.grad_accum': accum, 'train.batch_size': 16, 'train.steps': 3,
                                                'train.log_every': 1, 'train.eval_every': 3,
                                                'train.checkpoint_every': 3, **ONE_BLOCK})
    train_and_evaluate(config, str(tmp_path / f'accum{accum}'))
    losses.append(train_loss_at(str(tmp_path / f'accum{accum}'), 3))
  assert_close(losses[1], losses[0], terms=3 * 2 * STEP_TERMS)  # 3 steps of 16 rows


def test_divergence_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
  config = support.tiny_gpt_config(corpus, **{'train.lr': 1e30, 'train.schedule': 'constant', 'train.warmup_steps': 2,
                                              'train.checkpoint_every': 1, 'train.grad_clip': 0.0,
                                              'train.async_checkpoints': False, **ONE_BLOCK})
  with pytest.raises(TrainingDiverged, match='last good checkpoint'):
    train_and_evaluate(config, str(tmp_path / 'nan'))
  run = load_run(str(tmp_path / 'nan'))
  assert run.step >= 1
  from flax import nnx
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(nnx.state(run.model, nnx.Param)))


def test_checkpoints_keep_the_latest_and_the_best(tmp_path):
  from configs import gpt
  train_config = gpt.get_config('tiny').train
  train_config.keep_checkpoints = 2
  train_config.async_checkpoints = False
  checkpointer = ckpt.Checkpointer(str(tmp_path), train_config)
  state = {'params': {'w': np.ones(3)}, 'extra': {}}
  for step, loss in zip(range(1, 6), [5.0, 1.0, 4.0, 3.0, 2.0]):
    checkpointer.save(step, state, {'mu': np.zeros(3)}, {'next_index': step}, {'eval/loss': loss})
  checkpointer.wait()
  assert sorted(checkpointer.manager.all_steps()) == [2, 4, 5]


@pytest.mark.parametrize('overrides, message', [
    ({'model.num_heads': 3}, 'num_heads=3 does not divide'),
    ({'mesh.fsdp': 16}, 'config.mesh'),
    ({'train.batch_size': 12, 'mesh.data': 8}, 'not divisible by mesh data'),
    ({'mesh.data': 4, 'mesh.expert': 2}, r'mesh.expert=2 splits experts, but this model has none \(model.moe_experts=0\)'),
    ({'train.schedule': 'warmup'}, 'train.schedule'),
    ({'train.steps': 0}, 'train.steps=0 must be positive'),
    ({'data.seq_len': 1000}, 'exceeds config.model.max_len'),
    ({'train.eval_batch_size': -8}, 'train.eval_batch_size=-8'),
    ({'train.warmup_steps': -1}, 'train.warmup_steps=-1'),
    ({'train.schedule': 'wsd', 'train.steps': 100, 'train.warmup_steps': 90, 'train.max_minutes': 5.0},
     r"^config.train.warmup_steps=90 outlasts wsd's stable phase: .* starts at step 80; lower"),
    ({'decode.max_new_tokens': -5}, r'decode.max_new_tokens=-5 must be at least 1'),
    ({'decode.temperature': -1.0}, r'decode.temperature=-1.0 must be >= 0'),
    ({'decode.top_p': 1.5}, r'decode.top_p=1.5 must be in \(0, 1\]'),
])
def test_bad_config_values_fail_before_any_workdir(corpus, tmp_path, overrides, message):
  config = support.tiny_gpt_config(corpus, **overrides)
  with pytest.raises(ConfigError, match=message):
    train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')


def test_unknown_key_and_wrong_type_are_rejected(corpus, tmp_path):
  config = support.tiny_gpt_config(corpus)
  with config.unlocked():
    config.train.lrr = 0.1
  with pytest.raises(ConfigError, match="Unknown config key 'train.lrr'. Did you mean 'train.lr'"):
    train_and_evaluate(config, str(tmp_path / 'run'))
  result = support.launch(['--config=configs/gpt.py:tiny', '--config.train.lrr=3', f'--workdir={tmp_path}/cli'])
  assert result.returncode == 1
  assert "Unknown config key 'train.lrr'. Did you mean 'train.lr'?" in result.stderr
  assert 'Traceback' not in result.stderr and not os.path.exists(tmp_path / 'cli')
  result = support.launch(['--config=configs/gpt.py:tiny', '--config.train.steps=many'])
  assert result.returncode == 1 and 'train.steps' in result.stderr and 'Traceback' not in result.stderr
  result = support.launch(['--config=configs/gpt.py:nope', f'--workdir={tmp_path}/preset'])
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      "error: bad flag or config override: Unknown gpt preset 'nope'; choose one of "
      "['bench', 'default', 'gpt2', 'gpt2-medium', 'llama', 'llama-3.2-1b', 'llama-bench', 'mixtral-8x7b', "
      "'moe', 'olmoe-1b-7b', 'qwen3-30b-a3b', 'smollm-135m', 'tiny']."
  ], result.stderr
  assert not os.path.exists(tmp_path / 'preset')


def test_a_missing_config_file_is_one_line(tmp_path):
  result = support.launch(['--config=configs/nope.py', f'--workdir={tmp_path}/run'])
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      'error: --config=configs/nope.py: configs/nope.py does not exist. Name a config file, one of configs/'
      '{attention_pooling.py,bert.py,classifier.py,default.py,gpt.py,rnn_lm.py,seq2seq.py,transformer.py} with an '
      'optional :preset, e.g. --config=configs/gpt.py:tiny.'], result.stderr[-2000:]
  assert not os.path.exists(tmp_path / 'run')


def test_bad_data_fails_clearly_and_leaves_no_workdir(tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'a.txt').write_text('  \n')
  latin = tmp_path / 'latin'
  latin.mkdir()
  (latin / 'b.txt').write_bytes('caf\xe9'.encode('latin-1'))
  cases = [(f'text:{tmp_path}/missing/*.txt', 'matched no files'), (f'text:{empty}/*.txt', 'only empty files'),
           (f'text:{latin}/*.txt', 'not UTF-8'), ('tfds:no_such_dataset_xyz', 'could not be opened'),
           ('nonsense', 'Unknown LM data source')]
  for source, message in cases:
    with pytest.raises(DataError, match=message):
      train_and_evaluate(support.tiny_gpt_config(source), str(tmp_path / 'run'))
    assert not os.path.exists(tmp_path / 'run')


def test_corrupt_or_mismatched_checkpoint_gets_a_clear_error(fsdp_run, tmp_path):
  import shutil
  workdir, _ = fsdp_run
  copy = str(tmp_path / 'copy')
  shutil.copytree(workdir, copy)
  source = json.load(open(f'{copy}/config.json'))['data']['source']
  mismatched = support.launch(['--config.model.width=64', '--mode=eval', f'--workdir={copy}'])
  assert mismatched.returncode == 1 and 'its model has width=32' in mismatched.stderr, mismatched.stderr[-2000:]
  # Resuming with a config that builds another model names the keys and leaves the run's files alone.
  saved = {name: open(os.path.join(copy, name)).read() for name in ('config.json', 'model.json')}
  resumed = support.launch(['--config=configs/gpt.py:tiny', '--config.model.width=64', f'--workdir={copy}',
                            '--config.model.num_layers=1', f'--config.data.source={source}', '--config.train.steps=30'])
  assert resumed.returncode == 1 and 'holds a model with width=32' in resumed.stderr, resumed.stderr[-2000:]
  assert 'Traceback' not in resumed.stderr
  assert saved == {name: open(os.path.join(copy, name)).read() for name in ('config.json', 'model.json')}
  for root, _, files in os.walk(os.path.join(copy, 'checkpoints', '20', 'model')):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'garbage')
  corrupt = support.launch(['--mode=eval', f'--workdir={copy}'])
  assert corrupt.returncode == 1 and 'corrupt' in corrupt.stderr and 'Traceback' not in corrupt.stderr


def test_bfloat16_compute_keeps_float32_parameters(corpus, tmp_path):
  # One block: the parameters' and the logits' dtypes, and learning, are the same in one block as in two.
  config = support.tiny_gpt_config(corpus, **{'model.dtype': 'bfloat16', 'train.log_every': 1, **ONE_BLOCK})
  results = train_and_evaluate(config, str(tmp_path / 'bf16'))
  losses = [m['train/loss'] for m in read_metrics(str(tmp_path / 'bf16')) if 'train/loss' in m]
  assert losses[-1] < losses[0] - 0.5 and np.isfinite(results['eval/loss'])
  run = load_run(str(tmp_path / 'bf16'))
  from flax import nnx
  assert {x.dtype for x in jax.tree.leaves(nnx.state(run.model, nnx.Param))} == {np.dtype('float32')}
  logits, _ = nnx.jit(lambda model, tokens: model(tokens))(run.model, np.zeros((1, 4), np.int32))  # one compile, not ~70
  assert logits.dtype == jnp.bfloat16  # kept in the compute dtype; the cross-entropy upcasts chunk by chunk
