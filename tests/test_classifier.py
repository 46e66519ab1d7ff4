"""The from-scratch Transformer text classifier: padding invariance, pooling, training end to end."""
import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.classifier import ClassifierConfig, TransformerClassifier
from numerics import assert_close, transformer_terms

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

# `build`'s logits: 2 blocks (width 16, MLP 32) over <= 12 tokens, the pooling over them, the head.
TERMS = transformer_terms(2, 16, 32, 12) + 12

# Compiled calls: eager op-by-op execution compiles every small op separately and is slower.
forward = nnx.jit(lambda model, tokens, valid: model(tokens, valid))
encode = nnx.jit(lambda model, tokens, valid: model.encode(tokens, valid))


@functools.cache
def build(pooling='mean', pre_norm=True, token_dropout=0.0):
  config = ClassifierConfig(vocab_size=40, num_classes=3, max_len=32, num_layers=2, num_heads=2, width=16,
                            mlp_dim=32, dropout=0.1, pooling=pooling, pre_norm=pre_norm, token_dropout=token_dropout)
  # Built eagerly: its initialisers compile once per parameter shape, and the variants share every shape (one
  # compiled initialiser per variant compiles each parameter's random draw again).
  return TransformerClassifier(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('pooling,pre_norm', [('mean', True), ('cls', False)])
def test_padding_changes_no_logit(pooling, pre_norm):
  model = build(pooling=pooling, pre_norm=pre_norm)
  rng = np.random.default_rng(0)
  lengths = [3, 7]
  texts = [rng.integers(5, 40, n) for n in lengths]
  alone = [np.asarray(forward(model, jnp.asarray(t[None]), jnp.ones((1, len(t)), bool)))[0] for t in texts]
  # Both rows padded (to 12). Padding slots hold arbitrary ids: only `valid` may decide what is padding.
  tokens = rng.integers(0, 40, (len(texts), 12))
  valid = np.zeros((len(texts), 12), bool)
  for i, t in enumerate(texts):
    tokens[i, :len(t)] = t
    valid[i, :len(t)] = True
  logits = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
  assert_close(logits, np.stack(alone), terms=TERMS)
  # The check has teeth: treating the padding as text changes the logits.
  unmasked = np.asarray(forward(model, jnp.asarray(tokens), jnp.ones_like(valid)))
  assert np.abs(unmasked - logits).max() > 1e-3


def test_mean_pooling_averages_real_positions():
  model = build()
  tokens = jnp.asarray([[7, 8, 9, 0, 0]])
  valid = jnp.asarray([[True, True, True, False, False]])
  states = np.asarray(encode(model, tokens, valid))
  expected = states[0, :3].mean(0) @ np.asarray(model.head.kernel[...]) + np.asarray(model.head.bias[...])
  assert_close(np.asarray(forward(model, tokens, valid))[0], expected, terms=TERMS)


def test_token_dropout_drops_whole_tokens_in_training_only():
  model = build(token_dropout=0.5)
  embeddings = jnp.ones((4, 12, 16))
  dropped = np.asarray(model.token_dropout(embeddings, deterministic=False))
  per_token = dropped[..., 0]
  assert (dropped == per_token[..., None]).all()  # one draw per token, shared by its 16 features
  assert set(np.unique(per_token)) == {0.0, 2.0}  # dropped, or kept and scaled by 1 / (1 - 0.5)
  tokens, valid = jnp.asarray([[7, 8, 9, 10]]), jnp.ones((1, 4), bool)
  without = nnx.clone(model)
  without.token_dropout = None
  np.testing.assert_array_equal(forward(model, tokens, valid), forward(without, tokens, valid))  # evaluation


def test_rejects_sequences_longer_than_max_len():
  with pytest.raises(ValueError, match='max_len'):
    forward(build(), jnp.zeros((1, 33), jnp.int32), jnp.ones((1, 33), bool))


def test_trains_on_a_tsv_and_reloads_with_label_names(tmp_path):
  """A separable toy task end to end: the trainer, the saved labels, evaluation files, predict."""
  from configs import classifier as classifier_configs
  from train.rundir import load_run
  from train.trainer import train_and_evaluate
  rng = np.random.default_rng(0)
  words = {'sport': 'goal match team win'.split(), 'money': 'bank shares profit market'.split()}
  filler = 'the a of and to in'.split()
  lines = []
  for i in range(200):
    label = ('sport', 'money')[i % 2]
    text = ' '.join(rng.choice(filler + words[label], rng.integers(3, 14)))
    lines.append(f'{text} {words[label][i % 4]}\t{label}\n')
  (tmp_path / 'toy.tsv').write_text(''.join(lines))
  config = classifier_configs.get_config('tiny')
  config.data.source = f'tsv:{tmp_path / "toy.tsv"}'
  config.data.vocab_size = 100
  config.train.update(steps=40, lr=3e-3, eval_every=40, checkpoint_every=40)
  # Texts of 6-17 tokens: batches cut to 12 or 16 of the 32 positions (16 holds nearly all: few shapes to compile).
  config.data.min_bucket_len = 12
  workdir = str(tmp_path / 'run')
  results = train_and_evaluate(config, workdir)
  assert results['test/accuracy'] >= 0.95 and results['test/macro_f1'] >= 0.95
  assert results['train/compiles'] > 1  # one train step per bucket length
  assert os.path.exists(os.path.join(workdir, 'confusion.png'))
  run = load_run(workdir)
  predictions = run.predict(['goal goal team match win', 'bank profit shares market'])
  assert [p['label'] for p in predictions] == ['sport', 'money']
  assert run.model_config.labels == ('money', 'sport')


@pytest.mark.parametrize('rate', [-0.1, 1.0, 1.5])
def test_a_token_dropout_outside_0_1_fails_before_any_workdir(tmp_path, rate):
  from configs import classifier as classifier_configs
  from errors import ConfigError
  from train.trainer import train_and_evaluate
  config = classifier_configs.get_config('tiny')
  config.model.token_dropout = rate
  with pytest.raises(ConfigError, match=rf'token_dropout={rate} must be in \[0, 1\)'):
    train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')


def test_a_negative_bucket_length_fails_before_any_workdir(tmp_path):
  from configs import classifier as classifier_configs
  from errors import ConfigError
  from train.trainer import train_and_evaluate
  config = classifier_configs.get_config('tiny')
  config.data.min_bucket_len = -8
  with pytest.raises(ConfigError, match='min_bucket_len=-8 is negative'):
    train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')
