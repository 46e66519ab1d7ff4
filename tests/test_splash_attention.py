"""The Pallas splash-attention path (the TPU default) against a NumPy hand computation.

On CPU the kernel runs in Pallas's interpreter: the same kernel code, block-sparsity tables and
custom gradient as on a TPU, so masks, segment ids, padding and the shard_map over a device mesh
are all checked here; only the TPU speed is not.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from numerics import assert_close, assert_trees_close, transformer_terms
from train import sharding

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

L = 128  # one splash block
# An output: a head's dot product over D = 16, the normalizer and the weighted values over <= 256 keys.
TERMS = 16 + 2 * 2 * L
# Packed rows: segments 1..3, then padding (segment 0) in the first row.
SEGMENTS = np.stack([np.repeat([1, 2, 3, 0], [40, 50, 30, 8]), np.repeat([1, 2], [70, 58])]).astype(np.int32)
LENGTHS = np.array([128, 77])


def numpy_reference(q, k, v, allowed):
  """softmax(q k^T / sqrt(D)) v over the allowed keys: q [B, Lq, H, D], allowed [B, Lq, Lk]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  scores = np.where(allowed[:, None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum('bhqk,bkhd->bqhd', weights / weights.sum(-1, keepdims=True), v)


def qkv(seed, q_len=L, k_len=L, batch=2, heads=2, depth=16):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(batch, n, heads, depth)), jnp.float32) for n in (q_len, k_len, k_len))


causal = np.tril(np.ones((L, L), bool))[None]
same_segment = SEGMENTS[:, :, None] == SEGMENTS[:, None, :]
real_key = np.arange(L)[None, None, :] < LENGTHS[:, None, None]
# name -> (structured mask, allowed [B, Lq, Lk], which query rows have a defined output [B, Lq])
CASES = {
    'causal (GPT)': (attention.AttentionMask(causal=True), np.broadcast_to(causal, (2, L, L)), np.ones((2, L), bool)),
    'padding (BERT)': (attention.AttentionMask(key_lengths=jnp.asarray(LENGTHS)),
                       np.broadcast_to(real_key, (2, L, L)), np.ones((2, L), bool)),
    'causal + padding': (attention.AttentionMask(causal=True, key_lengths=jnp.asarray(LENGTHS)), causal & real_key,
                         np.arange(L)[None, :] < LENGTHS[:, None]),
    'causal + segments (packed decoder)': (
        attention.AttentionMask(causal=True, query_segment_ids=jnp.asarray(SEGMENTS),
                                key_segment_ids=jnp.asarray(SEGMENTS)), causal & same_segment, SEGMENTS > 0),
}


@pytest.mark.parametrize('case', CASES)
def test_splash_matches_the_hand_computation_and_the_einsum_gradients(case):
  mask, allowed, defined = CASES[case]
  q, k, v = qkv(0)
  out, weights = attention.dot_product_attention(q, k, v, mask, implementation='splash')
  assert weights is None  # the kernel ran, not the einsum path (which returns weights)
  rows = defined[:, :, None, None]
  assert_close(np.where(rows, out, 0), np.where(rows, numpy_reference(q, k, v, allowed), 0), terms=TERMS)

  def loss(implementation, q, k, v):  # over the rows every implementation defines
    out, _ = attention.dot_product_attention(q, k, v, mask, implementation=implementation)
    return jnp.sum(jnp.where(rows, jnp.sin(out), 0))

  grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)  # eagerly, each op compiles on its own
  splash = grad('splash', q, k, v)
  einsum = grad('xla', q, k, v)
  for a, b in zip(splash, einsum):
    assert_close(a, b, terms=2 * TERMS + L)  # + the backward's sum over the queries


def test_padded_queries_output_zeros_like_the_einsum_path():
  q, k, v = qkv(1)
  mask = attention.AttentionMask(query_lengths=jnp.asarray(LENGTHS), key_lengths=jnp.asarray(LENGTHS))
  out, _ = attention.dot_product_attention(q, k, v, mask, implementation='splash')
  reference, _ = attention.dot_product_attention(q, k, v, mask, implementation='xla')
  assert_close(out, reference, terms=TERMS)
  assert np.all(np.asarray(out)[1, 77:] == 0)


def test_cross_attention_with_other_lengths_and_packed_segments():
  q, k, v = qkv(2, q_len=L, k_len=2 * L)
  key_segments = np.stack([np.repeat([1, 2, 3, 0], [100, 60, 90, 6]), np.repeat([1, 2], [200, 56])]).astype(np.int32)
  mask = attention.AttentionMask(query_segment_ids=jnp.asarray(SEGMENTS), key_segment_ids=jnp.asarray(key_segments))
  out, _ = attention.dot_product_attention(q, k, v, mask, implementation='splash')
  allowed = SEGMENTS[:, :, None] == key_segments[:, None, :]
  rows = (SEGMENTS > 0)[:, :, None, None]
  assert_close(np.where(rows, out, 0), np.where(rows, numpy_reference(q, k, v, allowed), 0), terms=TERMS)


def test_lengths_off_the_block_and_cached_decoding_run_the_einsum_path():
  q, k, v = qkv(3, q_len=6, k_len=6)
  out, weights = attention.dot_product_attention(q, k, v, attention.AttentionMask(causal=True),
                                                 implementation='splash')
  assert weights is not None  # 6 is not a multiple of the 128 block: einsum, bit for bit the 'xla' result
  np.testing.assert_array_equal(out, attention.dot_product_attention(q, k, v, attention.AttentionMask(causal=True))[0])
  assert not attention.splash_fits(attention.AttentionMask(causal=True, q_offset=jnp.asarray(3)), L, L)


def test_on_a_mesh_the_kernel_runs_per_shard_with_the_same_numbers():
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  q, k, v = qkv(4, batch=4, heads=4)
  mask, allowed, defined = CASES['causal + segments (packed decoder)']
  mask = attention.AttentionMask(causal=True, query_segment_ids=jnp.asarray(np.tile(SEGMENTS, (2, 1))),
                                 key_segment_ids=jnp.asarray(np.tile(SEGMENTS, (2, 1))))
  attend = jax.jit(lambda q, k, v, mask: attention.dot_product_attention(q, k, v, mask, implementation='splash')[0])
  with sharding.use_mesh(mesh):  # the activation rules name the mesh axes the kernel is split over
    batch_sharded = jax.sharding.NamedSharding(mesh, jax.P(sharding.BATCH_AXES))
    q, k, v = (jax.device_put(x, batch_sharded) for x in (q, k, v))
    hlo = attend.lower(q, k, v, mask).as_text()
    out = attend(q, k, v, mask)
  assert 'shard_map' in hlo or 'sdy.manual_computation' in hlo, 'the kernel was not split over the mesh'
  # Split like the [B, L, H, D] activations: batch 4 over data x fsdp, heads 4 over tensor.
  assert '"data", "fsdp"' in hlo and '"tensor"' in hlo
  rows = np.tile(defined, (2, 1))[:, :, None, None]
  expected = numpy_reference(q, k, v, np.tile(allowed, (2, 1, 1)))
  assert_close(np.where(rows, out, 0), np.where(rows, expected, 0), terms=TERMS)


def test_a_gpt_trains_the_same_with_splash_as_with_einsum():
  from models.gpt import GPT, GPT2Config
  config = dict(vocab_size=64, max_len=L, num_layers=2, num_heads=2, width=32, dropout=0.0)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, size=(2, L)), jnp.int32)

  def loss_and_grads(implementation):  # jitted: eagerly, every op of the model and the kernel compiles alone
    # Built eagerly: the two models' parameters have the same shapes, whose initialisers compile once.
    model = GPT(GPT2Config(**config, attention=implementation), rngs=nnx.Rngs(0))
    loss = lambda model: jnp.mean(jax.nn.log_softmax(model(tokens)[0].astype(jnp.float32))[..., 0])
    return nnx.jit(nnx.value_and_grad(loss))(model)

  (splash_loss, splash_grads), (einsum_loss, einsum_grads) = loss_and_grads('splash'), loss_and_grads('xla')
  terms = transformer_terms(2, 32, 4 * 32, L, vocab=64, positions=2 * L)
  assert_close(splash_loss, einsum_loss, terms=terms)
  assert_trees_close(splash_grads, einsum_grads, terms=terms)
