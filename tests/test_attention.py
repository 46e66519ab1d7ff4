"""The shared attention module against NumPy hand computations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from numerics import assert_close

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

# A scaled dot-product attention output: a head's dot product over D = 8, then the normalizer and the
# weighted sum of values over <= 6 keys.
ATTENTION_TERMS = 8 + 2 * 6


def numpy_attention(q, k, v, mask):
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  scores = np.where(mask, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights = weights / weights.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', weights, v)


def einsum_with_dense_mask(q, k, v, dense):
  """The einsum path as it was before structured masks: a dense boolean mask into the masked softmax."""
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', attention.masked_softmax(scores, dense), v)


def qkv(seed, batch=2, q_len=6, k_len=6, heads=2, depth=8):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(batch, length, heads, depth)), jnp.float32)
               for length in (q_len, k_len, k_len))


SEGMENTS = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3]])
# name -> (structured mask, the same mask written out by hand [B|1, 1, Lq, Lk], Lq, Lk)
MASK_KINDS = {
    'padding': (attention.AttentionMask(query_lengths=jnp.array([6, 3]), key_lengths=jnp.array([4, 3])),
                (np.arange(6)[None, :, None] < np.array([6, 3])[:, None, None])
                & (np.arange(6)[None, None, :] < np.array([4, 3])[:, None, None]), 6, 6),
    'causal': (attention.AttentionMask(causal=True), np.tril(np.ones((6, 6), bool))[None], 6, 6),
    'causal+padding': (attention.AttentionMask(causal=True, key_lengths=jnp.array([6, 4])),
                       np.tril(np.ones((6, 6), bool))[None] & (np.arange(6) < np.array([6, 4])[:, None])[:, None],
                       6, 6),
    'causal+offset': (attention.AttentionMask(causal=True, q_offset=jnp.asarray(3)),
                      np.arange(6)[None, None, :] <= np.arange(3, 5)[None, :, None], 2, 6),
    'segments': (attention.AttentionMask(query_segment_ids=jnp.asarray(SEGMENTS),
                                         key_segment_ids=jnp.asarray(SEGMENTS)),
                 SEGMENTS[:, :, None] == SEGMENTS[:, None, :], 6, 6),
    'causal+segments': (attention.AttentionMask(causal=True, query_segment_ids=jnp.asarray(SEGMENTS),
                                                key_segment_ids=jnp.asarray(SEGMENTS)),
                        (SEGMENTS[:, :, None] == SEGMENTS[:, None, :]) & np.tril(np.ones((6, 6), bool))[None], 6, 6),
}


@pytest.mark.parametrize('kind', MASK_KINDS)
def test_dense_form_of_each_structured_mask(kind):
  mask, expected, q_len, k_len = MASK_KINDS[kind]
  dense = np.asarray(mask.dense(q_len, k_len))
  assert dense.ndim == 4 and dense.shape[1] == 1
  np.testing.assert_array_equal(np.broadcast_to(dense[:, 0], (2, q_len, k_len)),
                                np.broadcast_to(expected, (2, q_len, k_len)))


@pytest.mark.parametrize('kind', MASK_KINDS)
def test_structured_masks_give_the_dense_mask_outputs_on_every_path(kind):
  mask, expected, q_len, k_len = MASK_KINDS[kind]
  q, k, v = qkv(3, q_len=q_len, k_len=k_len)
  reference = einsum_with_dense_mask(q, k, v, jnp.asarray(expected)[:, None])
  out, weights = attention.dot_product_attention(q, k, v, mask, implementation='xla')
  assert_close(out, reference, terms=ATTENTION_TERMS)
  assert weights.shape == (2, 2, q_len, k_len)
  # The arguments cuDNN gets on GPU, through jax.nn's XLA implementation here.
  fused, none = attention.dot_product_attention(q, k, v, mask, implementation='jax_nn')
  assert none is None
  assert_close(fused, reference, terms=ATTENTION_TERMS)


def test_padding_and_causal_reach_jax_nn_without_a_dense_mask():
  lengths = jnp.array([5, 2])
  args = attention.jax_nn_arguments(attention.AttentionMask(causal=True, query_lengths=lengths,
                                                            key_lengths=lengths), 5, 5)
  assert args['mask'] is None and args['is_causal'] is True
  for name in ('query_seq_lengths', 'key_value_seq_lengths'):
    assert args[name].dtype == jnp.int32
    np.testing.assert_array_equal(args[name], lengths)
  args = attention.jax_nn_arguments(attention.AttentionMask(key_lengths=lengths), 1, 5)
  assert args['mask'] is None and args['is_causal'] is False and args['query_seq_lengths'] is None
  # Segments and a decoding offset are not jax.nn arguments: those alone become a dense mask.
  for kind in ('causal+offset', 'segments', 'causal+segments'):
    mask, expected, q_len, k_len = MASK_KINDS[kind]
    args = attention.jax_nn_arguments(mask, q_len, k_len)
    assert args['mask'] is not None and args['mask'].dtype == bool
    assert args['is_causal'] == (kind == 'causal+segments')


def test_attention_dropout_keeps_a_fused_layer_on_the_einsum_path():
  x = jax.random.normal(jax.random.key(0), (2, 4, 8))
  for implementation, forced in (('cudnn', True), ('xla', False)):
    layer = attention.MultiHeadAttention(8, 2, dropout=0.5, implementation=implementation, rngs=nnx.Rngs(0))
    assert attention.attention_dropout_forces_einsum(layer) == forced
    # cuDNN cannot run on CPU: this training call returns because it takes the einsum path.
    out, _ = layer(x, mask=attention.AttentionMask(causal=True), deterministic=False)
    assert np.all(np.isfinite(out))
  assert not attention.attention_dropout_forces_einsum(
      attention.MultiHeadAttention(8, 2, implementation='cudnn', rngs=nnx.Rngs(0)))


def test_auto_resolves_to_the_einsum_path_on_cpu():
  assert attention.default_attention_implementation('bfloat16') == 'xla'


def test_masked_softmax_zero_weight_and_empty_rows():
  scores = jnp.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
  mask = jnp.array([[True, True, False], [False, False, False]])
  weights = np.asarray(attention.masked_softmax(scores, mask))
  e = np.exp([1.0, 2.0])
  assert_close(weights[0], [e[0] / e.sum(), e[1] / e.sum(), 0.0], terms=2)
  np.testing.assert_array_equal(weights[1], [0.0, 0.0, 0.0])


def test_dot_product_attention_matches_numpy():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((2, 3, 2, 4), (2, 5, 2, 4), (2, 5, 2, 4)))
  out, weights = attention.dot_product_attention(q, k, v, attention.AttentionMask(key_lengths=jnp.array([5, 2])))
  dense = np.arange(5)[None, None, None, :] < np.array([5, 2])[:, None, None, None]
  assert_close(out, numpy_attention(q, k, v, dense), terms=4 + 2 * 5)
  assert_close(np.asarray(weights).sum(-1), np.ones((2, 2, 3)), terms=5)
  assert np.all(np.asarray(weights)[1, :, :, 2:] == 0)


def test_implementations_agree_in_outputs_and_gradients():
  q, k, v = qkv(1)
  mask = attention.AttentionMask(causal=True, key_lengths=jnp.array([6, 4]))

  def loss(impl, q, k, v):
    out, _ = attention.dot_product_attention(q, k, v, mask, implementation=impl)
    return jnp.sum(jnp.sin(out))

  # Compiled (once per implementation): eagerly, each op of the forward and backward passes compiles on its own.
  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
  reference = value_and_grad('xla', q, k, v)
  other = value_and_grad('jax_nn', q, k, v)
  # The loss sums 2 x 6 x 2 x 8 outputs; a gradient adds the backward's sums over queries and keys.
  assert_close(other[0], reference[0], terms=ATTENTION_TERMS + 2 * 6 * 2 * 8)
  for a, b in zip(reference[1], other[1]):
    assert_close(b, a, terms=2 * ATTENTION_TERMS + 6)


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
  score_terms = 3 + 4 + 5  # W_q q, W_k k and w_v over the hidden 5
  assert_close(weights[:, :, :3], expected_w, terms=score_terms + 4)
  assert_close(context, expected_w @ v[:, :3], terms=score_terms + 2 * 4)


def test_multi_head_cache_matches_full_pass_and_records_weights():
  layer = attention.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  full, _ = layer(x, mask=attention.AttentionMask(causal=True))
  cache = layer.init_cache(2, 5)
  # One compiled step for every position (eagerly, each op compiles on its own for each position).
  step = nnx.jit(lambda layer, x, cache, t: layer(x, mask=attention.AttentionMask(causal=True, q_offset=t),
                                                  cache=cache, cache_index=t))
  outs = []
  for t in range(5):
    out, cache = step(layer, x[:, t:t + 1], cache, jnp.asarray(t))
    outs.append(out)
  assert_close(jnp.concatenate(outs, 1), full, terms=3 * 8 + 4 + 2 * 5)  # projections, a head, 5 keys
  _, weights = attention.record_attention_weights(layer, layer, x)
  (w,) = weights.values()
  assert w.shape == (2, 2, 5, 5)
  assert_close(np.asarray(w).sum(-1), np.ones(w.shape[:-1]), terms=5)
