"""The shared attention module against NumPy hand computations."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import attention


def numpy_attention(q, k, v, mask):
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  scores = np.where(mask, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights = weights / weights.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', weights, v)


def test_masks():
  np.testing.assert_array_equal(attention.padding_mask(jnp.array([1, 3]), 4),
                                [[True, False, False, False], [True, True, True, False]])
  np.testing.assert_array_equal(attention.causal_mask(2, 4, q_offset=1),
                                [[True, True, False, False], [True, True, True, False]])
  mask = attention.make_attention_mask(jnp.array([[True, False]]), jnp.array([[True, True, False]]), causal=True)
  assert mask.shape == (1, 1, 2, 3)
  np.testing.assert_array_equal(mask[0, 0], [[True, False, False], [False, False, False]])


def test_masked_softmax_zero_weight_and_empty_rows():
  scores = jnp.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
  mask = jnp.array([[True, True, False], [False, False, False]])
  weights = np.asarray(attention.masked_softmax(scores, mask))
  e = np.exp([1.0, 2.0])
  np.testing.assert_allclose(weights[0], [e[0] / e.sum(), e[1] / e.sum(), 0.0], rtol=1e-6)
  np.testing.assert_array_equal(weights[1], [0.0, 0.0, 0.0])


def test_dot_product_attention_matches_numpy():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((2, 3, 2, 4), (2, 5, 2, 4), (2, 5, 2, 4)))
  mask = attention.make_attention_mask(None, attention.padding_mask(jnp.array([5, 2]), 5), q_len=3)
  out, weights = attention.dot_product_attention(q, k, v, mask)
  np.testing.assert_allclose(out, numpy_attention(q, k, v, np.asarray(mask)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
  assert np.all(np.asarray(weights)[1, :, :, 2:] == 0)


def test_implementations_agree_in_outputs_and_gradients():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32) for _ in range(3))
  mask = attention.make_attention_mask(None, attention.padding_mask(jnp.array([6, 4]), 6), causal=True,
                                       q_len=6, k_len=6)

  def loss(impl, q, k, v):
    out, _ = attention.dot_product_attention(q, k, v, mask, implementation=impl)
    return jnp.sum(jnp.sin(out))

  reference = jax.value_and_grad(loss, argnums=(1, 2, 3))('xla', q, k, v)
  other = jax.value_and_grad(loss, argnums=(1, 2, 3))('jax_nn', q, k, v)
  np.testing.assert_allclose(reference[0], other[0], rtol=1e-5)
  for a, b in zip(reference[1], other[1]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_additive_attention_matches_numpy():
  layer = attention.AdditiveAttention(3, 4, 5, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  q, k, v = rng.normal(size=(1, 2, 3)), rng.normal(size=(1, 4, 4)), rng.normal(size=(1, 4, 2))
  context, weights = layer(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                           jnp.array([[True, True, True, False]]))
  wq, wk, wv = (np.asarray(m.kernel[...]) for m in (layer.score.w_q, layer.score.w_k, layer.score.w_v))
  scores = np.tanh((q @ wq)[:, :, None, :] + (k @ wk)[:, None, :, :]) @ wv
  scores = scores[..., 0][:, :, :3]
  expected_w = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
  np.testing.assert_allclose(weights[:, :, :3], expected_w, rtol=1e-5)
  np.testing.assert_allclose(context, expected_w @ v[:, :3], rtol=1e-5, atol=1e-6)


def test_multi_head_cache_matches_full_pass_and_records_weights():
  layer = attention.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  full, _ = layer(x, mask=attention.make_attention_mask(causal=True, q_len=5, k_len=5))
  cache = layer.init_cache(2, 5)
  outs = []
  for t in range(5):
    mask = attention.make_attention_mask(causal=True, q_len=1, k_len=5, q_offset=t)
    out, cache = layer(x[:, t:t + 1], mask=mask, cache=cache, cache_index=t)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-6)
  _, weights = attention.record_attention_weights(layer, layer, x)
  (w,) = weights.values()
  assert w.shape == (2, 2, 5, 5)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-5)
