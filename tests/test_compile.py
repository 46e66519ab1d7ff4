"""Start-up and compilation: few train-step shapes on variable-length data, the persistent
compilation cache across runs, and the PRNG switch keeping resumes bit-exact."""
import json
import os

import jax
import numpy as np
import pytest

import support
from train.checkpoint import CheckpointError
from train.rundir import load_run
from train.trainer import train_and_evaluate


def variable_length_pairs(path, count=800, seed=0):
  """Source/target pairs of 1 to 40 words: lengths spread over the whole range."""
  rng = np.random.default_rng(seed)
  words = support.WORDS
  lines = []
  for _ in range(count):
    n = int(rng.integers(1, 41))
    source = [words[i] for i in rng.integers(0, len(words), n)]
    lines.append(' '.join(source) + '\t' + ' '.join(reversed(source)))
  path.write_text('\n'.join(lines) + '\n')
  return f'tsv:{path}'


# The train step's compilations are what these runs count: one eval batch, and a final evaluation and
# decoding of one batch each, keep the evaluation's and the decoder's own length buckets from compiling too.
FEW_EVALUATED = {'train.eval_steps': 1, 'train.final_eval_examples': 16, 'train.final_decode_examples': 16}


def test_a_variable_length_corpus_compiles_the_train_step_once_per_length_bucket(tmp_path):
  from configs.transformer import get_config
  from data.batching import bucket_lengths
  assert bucket_lengths(96, 16) == [16, 24, 32, 48, 64, 96] and bucket_lengths(128, 16)[-2:] == [96, 128]
  config = support.with_overrides(get_config('tiny'), {
      'data.source': variable_length_pairs(tmp_path / 'pairs.tsv'), 'data.seq_len': 32, 'data.max_examples': 0,
      'data.vocab_size': 120, 'data.packing': False, 'train.steps': 12, 'train.batch_size': 8, 'train.eval_every': 12,
      'train.checkpoint_every': 12, 'decode.beam_size': 1, 'pictures.count': 0, 'train.eval_batch_size': 16,
      **FEW_EVALUATED})
  workdir = str(tmp_path / 'run')
  results = train_and_evaluate(config, workdir)
  # Pairs of 1 to 40 words cut to 32 tokens, 12 batches (the first 12 of this seed that use every bucket; a step
  # on 8 devices costs ~0.2 s): the batches really vary and each bucket compiles once, where padding each batch
  # to its longest example would compile once per length.
  assert results['train/compiles'] == len(bucket_lengths(32, 16)) == 3, results['train/compiles']


def test_packed_batches_compile_the_train_step_once(tmp_path):
  from configs.transformer import get_config
  config = support.with_overrides(get_config('tiny'), {
      'data.source': variable_length_pairs(tmp_path / 'pairs.tsv'), 'data.seq_len': 32, 'data.max_examples': 0,
      'data.vocab_size': 120, 'data.packing': True, 'train.steps': 8, 'train.batch_size': 8, 'train.eval_every': 8,
      'train.checkpoint_every': 8, 'decode.beam_size': 1, 'pictures.count': 0, 'train.eval_batch_size': 16,
      **FEW_EVALUATED})
  results = train_and_evaluate(config, str(tmp_path / 'run'))
  # The same pairs and seq_len as the test above, whose unpacked batches compile the step for each of 3 buckets
  # (its initialiser, evaluation and decoding programs are this run's too: loaded, not compiled again).
  assert results['train/compiles'] == 1, results['train/compiles']


def test_a_repeated_run_reads_its_compilations_from_the_persistent_cache(tmp_path):
  cache = str(tmp_path / 'cache')
  args = ['--config=configs/gpt.py:tiny', f'--config.data.source={support.write_corpus(str(tmp_path / "corpus"))}',
          f'--config.compile_cache={cache}', '--config.train.steps=2', '--config.train.eval_every=2',
          '--config.train.checkpoint_every=2', '--config.model.num_layers=1']  # one block: the first run compiles
  env = {'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}
  first = support.launch(args + [f'--workdir={tmp_path}/first'], env_overrides=env)
  assert first.returncode == 0, first.stderr[-2000:]
  assert ' 0 hits' in first.stdout + first.stderr and os.listdir(cache)
  second = support.launch(args + [f'--workdir={tmp_path}/second'], env_overrides=env)
  assert second.returncode == 0, second.stderr[-2000:]
  log = second.stdout + second.stderr
  hits = int(log.split(' hits')[0].rsplit(' ', 1)[-1])
  assert hits >= 2, log[-2000:]  # at least the train and eval steps
  assert support.last_json(first.stdout)['eval/loss'] == support.last_json(second.stdout)['eval/loss']


def test_rbg_runs_resume_bit_exactly(tmp_path):
  corpus = support.write_corpus(str(tmp_path / 'corpus'))
  # One block: dropout's keys and the resumed PRNG state are the same in one block as in two.
  overrides = {'rng_impl': 'rbg', 'model.dropout': 0.2, 'model.num_layers': 1, 'train.eval_every': 3,
               'train.checkpoint_every': 3, 'train.log_every': 1}
  straight = str(tmp_path / 'straight')
  train_and_evaluate(support.tiny_gpt_config(corpus, **overrides, **{'train.steps': 6}), straight)
  resumed = support.copy_run_back_to(straight, 3, str(tmp_path / 'resumed'))
  train_and_evaluate(support.tiny_gpt_config(corpus, **overrides, **{'train.steps': 6}), resumed)
  with open(os.path.join(resumed, 'model.json')) as f:
    assert json.load(f)['rng_impl'] == 'rbg'
  a, b = load_run(straight).model, load_run(resumed).model
  from flax import nnx
  leaves = lambda model: jax.tree.leaves(nnx.state(model))
  keys = [x for x in leaves(a) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  assert keys and all(str(k.dtype) == 'key<rbg>' for k in keys)
  for x, y in zip(leaves(a), leaves(b)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # A resume that asks for another PRNG than the run was built with is refused (a CheckpointError: launch.py
  # turns it into one line and exit 1, as tests/test_trainer.py checks for a resume with another model).
  with pytest.raises(CheckpointError, match="built with; resume with rng_impl='rbg'"):
    train_and_evaluate(support.tiny_gpt_config(corpus, **{**overrides, 'rng_impl': 'threefry', 'train.steps': 9}),
                       resumed)
  assert load_run(resumed).step == 6
