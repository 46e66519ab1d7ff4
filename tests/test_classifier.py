"""The from-scratch Transformer text classifier: padding invariance, pooling, shapes."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.classifier import ClassifierConfig, TransformerClassifier

# Compiled calls: eager op-by-op execution compiles every small op separately and is slower.
forward = nnx.jit(lambda model, tokens, valid: model(tokens, valid))
encode = nnx.jit(lambda model, tokens, valid: model.encode(tokens, valid))


@functools.cache
def build(pooling='mean', pre_norm=True):
  config = ClassifierConfig(vocab_size=40, num_classes=3, max_len=32, num_layers=2, num_heads=2, width=16,
                            mlp_dim=32, dropout=0.1, pooling=pooling, pre_norm=pre_norm)
  return nnx.jit(lambda: TransformerClassifier(config, rngs=nnx.Rngs(0)))()


@pytest.mark.parametrize('pooling,pre_norm', [('mean', True), ('cls', False)])
def test_padding_changes_no_logit(pooling, pre_norm):
  model = build(pooling=pooling, pre_norm=pre_norm)
  rng = np.random.default_rng(0)
  lengths = [3, 7]
  texts = [rng.integers(5, 40, n) for n in lengths]
  alone = [np.asarray(forward(model, jnp.asarray(t[None]), jnp.ones((1, len(t)), bool)))[0] for t in texts]
  for padded_len in (7, 12):
    # Padding slots hold arbitrary ids: only `valid` may decide what is padding.
    tokens = rng.integers(0, 40, (len(texts), padded_len))
    valid = np.zeros((len(texts), padded_len), bool)
    for i, t in enumerate(texts):
      tokens[i, :len(t)] = t
      valid[i, :len(t)] = True
    logits = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
    np.testing.assert_allclose(logits, np.stack(alone), atol=1e-5)
  # The check has teeth: treating the padding as text changes the logits.
  unmasked = np.asarray(forward(model, jnp.asarray(tokens), jnp.ones_like(valid)))
  assert np.abs(unmasked - logits).max() > 1e-3


def test_mean_pooling_averages_real_positions():
  model = build()
  tokens = jnp.asarray([[7, 8, 9, 0, 0]])
  valid = jnp.asarray([[True, True, True, False, False]])
  states = np.asarray(encode(model, tokens, valid))
  expected = states[0, :3].mean(0) @ np.asarray(model.head.kernel[...]) + np.asarray(model.head.bias[...])
  np.testing.assert_allclose(np.asarray(forward(model, tokens, valid))[0], expected, atol=1e-5)


def test_rejects_sequences_longer_than_max_len():
  with pytest.raises(ValueError, match='max_len'):
    forward(build(), jnp.zeros((1, 33), jnp.int32), jnp.ones((1, 33), bool))
