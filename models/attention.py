"""Attention for the whole codebase: masks, masked softmax, scoring functions, multi-head attention.

Every model family (attention pooling, Bahdanau seq2seq, Transformer, BERT, GPT) uses these
pieces; there is no second attention implementation anywhere in the repository.

Masks of scaled dot-product attention are structure, not arrays: an `AttentionMask` says
"causal", "these padding lengths", "these segment ids", and `dot_product_attention` turns it into
whatever its kernel takes. The fused kernels (`jax.nn.dot_product_attention`, cuDNN flash attention
on GPU) take causality and padding lengths as arguments and skip the masked blocks; the einsum
path (which also returns the weights, for heatmaps) builds the dense [B|1, 1, Lq, Lk] boolean
mask with `AttentionMask.dense`.

Implementations (`model.attention`):
  'xla'     einsum + masked softmax, compiled by XLA; returns the weights. CPU and TPU default.
  'cudnn'   `jax.nn.dot_product_attention(implementation='cudnn')`: cuDNN flash attention (GPU,
            bfloat16/float16 only). GPU default for those dtypes.
  'jax_nn'  `jax.nn.dot_product_attention` with the same structured arguments, JAX choosing the
            kernel (XLA's today). GPU default for float32, which cuDNN does not take.
  'splash'  the Pallas splash-attention kernel (TPU flash attention, models/splash.py): causality
            as a static block mask, padding and packing as segment ids, so masked blocks are skipped.
            Sequence lengths must be multiples of 128 (others, and cached decoding, run 'xla'). TPU
            default. Compiled for any other platform, the kernel runs in Pallas's interpreter: for
            tests, slow.
  'auto'    resolved per platform and dtype by `default_attention_implementation`: the task resolves
            it for the devices the step is compiled for, a model called directly for its mesh's.

Shape legend: B batch, Lq / Lk query / key length, H heads, K key/value heads (K = H but for
grouped-query attention, where K divides H), D head width, E model width.
Boolean masks are True where attention is allowed and broadcast against [B, H, Lq, Lk].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import splash
from models.partitioning import constrain
from models.rope import apply_rope

# Large negative logit for masked positions: finite so fully masked rows stay NaN-free.
_MASKED_LOGIT = -1e9
ATTENTION_IMPLEMENTATIONS = ('auto', 'xla', 'cudnn', 'jax_nn', 'splash')
_FUSED = ('cudnn', 'jax_nn')  # the implementations calling jax.nn.dot_product_attention
HEADS = ('batch', 'length', 'heads', None)  # logical axes of [B, L, H, D] queries, keys, values, outputs


# ----------------------------------------------------------------------------- masks
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['query_lengths', 'key_lengths', 'query_segment_ids', 'key_segment_ids',
                                'q_offset'],
                   meta_fields=['causal'])
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Which keys each query may attend to, as structure. Every constraint given must hold.

  causal: query i (at absolute position q_offset + i) sees keys at positions <= its own.
  query_lengths: [B] int, real queries per row (right padding); padded queries attend to nothing
    and output zeros.
  key_lengths: [B] int, real keys per row (right padding); padded keys are never attended to.
  query_segment_ids: [B, Lq] int and key_segment_ids: [B, Lk] int, given together: a query sees
    only keys of its own segment (packed sequences; padding may be a segment of its own).
  q_offset: absolute position of the first query, a scalar (cached decoding); None = 0.
  """
  causal: bool = False
  query_lengths: jax.Array | None = None
  key_lengths: jax.Array | None = None
  query_segment_ids: jax.Array | None = None
  key_segment_ids: jax.Array | None = None
  q_offset: jax.Array | int | None = None

  def dense(self, q_len: int, k_len: int) -> jax.Array | None:
    """[B|1, 1, q_len, k_len] bool, True where attention is allowed (None: no constraint)."""
    parts = []
    if self.key_lengths is not None:
      parts.append((jnp.arange(k_len)[None, :] < jnp.asarray(self.key_lengths)[:, None])[:, None, None, :])
    if self.query_lengths is not None:
      parts.append((jnp.arange(q_len)[None, :] < jnp.asarray(self.query_lengths)[:, None])[:, None, :, None])
    if self.causal:
      q_pos = jnp.arange(q_len)[:, None] + (0 if self.q_offset is None else self.q_offset)
      parts.append((jnp.arange(k_len)[None, :] <= q_pos)[None, None])
    if (self.query_segment_ids is None) != (self.key_segment_ids is None):
      raise ValueError('AttentionMask needs both query_segment_ids and key_segment_ids, or neither.')
    if self.query_segment_ids is not None:
      parts.append((self.query_segment_ids[:, :, None] == self.key_segment_ids[:, None, :])[:, None])
    return functools.reduce(jnp.logical_and, parts) if parts else None


def jax_nn_arguments(mask: AttentionMask | None, q_len: int, k_len: int) -> dict[str, Any]:
  """Keyword arguments of `jax.nn.dot_product_attention` expressing `mask`.

  Causality from position 0 and padding lengths are arguments the fused kernel handles without
  any [B, 1, Lq, Lk] array (cuDNN does not even compute the masked blocks). jax.nn has no
  segment-id argument and its causal mask always starts at position 0, so segments and the
  causal mask of cached decoding (q_offset) go in as a dense boolean `mask`, which cuDNN reads as
  an additive bias: still fused, but with a [B, 1, Lq, Lk] tensor in memory.
  """
  if mask is None:
    return {}
  offset_free_causal = mask.causal and mask.q_offset is None
  rest = dataclasses.replace(mask, causal=mask.causal and not offset_free_causal, query_lengths=None,
                             key_lengths=None)
  lengths = lambda x: None if x is None else jnp.asarray(x).astype(jnp.int32)
  return {'mask': rest.dense(q_len, k_len), 'is_causal': offset_free_causal,
          'query_seq_lengths': lengths(mask.query_lengths), 'key_value_seq_lengths': lengths(mask.key_lengths)}


def masked_softmax(scores: jax.Array, mask: jax.Array | None, axis: int = -1) -> jax.Array:
  """Softmax over `axis` where masked entries (mask False) get exactly zero weight.

  A row whose keys are all masked returns zeros rather than NaN or a uniform distribution,
  so padded queries contribute nothing downstream.
  """
  if mask is None:
    return jax.nn.softmax(scores, axis=axis)
  scores = jnp.where(mask, scores, _MASKED_LOGIT)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=axis)
  return jnp.where(mask, weights, 0.0).astype(scores.dtype)


# ----------------------------------------------------------------------------- scoring
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: AttentionMask | None = None,
    *,
    dropout: nnx.Dropout | None = None,
    deterministic: bool = True,
    implementation: str = 'xla',
) -> tuple[jax.Array, jax.Array | None]:
  """Scaled dot-product attention softmax(q k^T / sqrt(D)) v.

  Args:
    query: [B, Lq, H, D]; key, value: [B, Lk, K, D] with K dividing H: grouped-query attention
      (K = H: multi-head, K = 1: multi-query), query head h reading key/value head h // (H / K).
      No path repeats the K/V heads in memory: the einsum groups the query heads, jax.nn takes
      grouped heads natively, splash runs its multi-query kernel once per K/V head.
    mask: which keys each query sees (None: all).
    dropout: optional dropout on the attention weights. The fused kernels cannot drop weights,
      so while it is active (training) every implementation runs the einsum path
      (`attention_dropout_forces_einsum` tells the benchmark).
    implementation: one of ATTENTION_IMPLEMENTATIONS (see the module docstring).
  Returns:
    ([B, Lq, H, D] output, [B, H, Lq, Lk] weights, or None from a fused kernel).
  """
  if implementation == 'auto':
    implementation = default_attention_implementation(query.dtype, traced_platform())
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f'Unknown attention implementation {implementation!r}; '
                     f'choose one of {ATTENTION_IMPLEMENTATIONS}.')
  q_len, k_len = query.shape[1], key.shape[1]
  fused_allowed = dropout is None or deterministic
  if implementation in _FUSED and fused_allowed:
    out = jax.nn.dot_product_attention(query, key, value, **jax_nn_arguments(mask, q_len, k_len),
                                       implementation='cudnn' if implementation == 'cudnn' else None)
    return out, None
  if implementation == 'splash' and fused_allowed and splash_fits(mask, q_len, k_len):
    return _splash_attention(query, key, value, mask), None
  batch, _, num_heads, depth = query.shape
  kv_heads = key.shape[2]
  if kv_heads == num_heads:  # multi-head (K = H)
    scores = jnp.einsum('bqhd,bkhd->bhqk', query, key)
  else:  # query heads grouped by the K/V head they read, G = H / K, head h = k * G + g
    # Head-major operands [B, K, G, Lq, D] and [B, K, Lk, D]: each einsum is then a plain batched
    # matmul whose output is the [B, H, Lq, Lk] scores as laid out, where grouping [B, Lq, K, G, D]
    # in place makes XLA:CPU copy the scores and weights through transposes (slower; measurements/code_comments.csv).
    groups = num_heads // kv_heads
    grouped = jnp.transpose(query.reshape(batch, q_len, kv_heads, groups, depth), (0, 2, 3, 1, 4))
    scores = jnp.einsum('bkgqd,bksd->bkgqs', grouped, jnp.swapaxes(key, 1, 2)).reshape(batch, num_heads, q_len, k_len)
  scores = scores / jnp.sqrt(depth).astype(query.dtype)
  weights = masked_softmax(scores, None if mask is None else mask.dense(q_len, k_len))
  if dropout is not None:
    weights = dropout(weights, deterministic=deterministic)
  if kv_heads == num_heads:
    return jnp.einsum('bhqk,bkhd->bqhd', weights, value), weights
  grouped_weights = weights.reshape(batch, kv_heads, groups, q_len, k_len)
  out = jnp.einsum('bkgqs,bksd->bkgqd', grouped_weights, jnp.swapaxes(value, 1, 2))
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(query.shape), weights


# ----------------------------------------------------------------------------- splash (TPU)
def splash_fits(mask: AttentionMask | None, q_len: int, k_len: int) -> bool:
  """Whether the splash kernel takes these lengths and mask (whole blocks; causal from position 0).
  Where the installed JAX lacks the kernel, nothing fits and attention takes the einsum path."""
  return (mask is None or mask.q_offset is None) and splash.fits(q_len, k_len)


def splash_arguments(mask: AttentionMask | None, batch: int, q_len: int, k_len: int) -> dict[str, Any]:
  """Keyword arguments of `splash.attention` expressing `mask`, but for its query padding.

  Causality (from position 0) is the kernel's static block mask; segments and key padding are
  ([B, Lq], [B, Lk]) int32 segment ids, or None. A padded key gets an id no query has, so it is
  never attended to. Padded queries keep their ids (a row with no visible key is undefined in the
  kernel); `_splash_attention` zeroes their outputs afterwards.
  """
  causal = mask is not None and mask.causal
  if mask is None or (mask.query_segment_ids is None and mask.key_lengths is None):
    return {'causal': causal, 'segment_ids': None}
  if (mask.query_segment_ids is None) != (mask.key_segment_ids is None):
    raise ValueError('AttentionMask needs both query_segment_ids and key_segment_ids, or neither.')
  zeros = lambda length: jnp.zeros((batch, length), jnp.int32)
  q_ids = zeros(q_len) if mask.query_segment_ids is None else mask.query_segment_ids.astype(jnp.int32)
  k_ids = zeros(k_len) if mask.key_segment_ids is None else mask.key_segment_ids.astype(jnp.int32)
  if mask.key_lengths is not None:
    real_key = jnp.arange(k_len)[None, :] < jnp.asarray(mask.key_lengths)[:, None]
    k_ids = jnp.where(real_key, k_ids, jnp.iinfo(jnp.int32).min)
  return {'causal': causal, 'segment_ids': (q_ids, k_ids)}


def _splash_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: AttentionMask | None) -> jax.Array:
  """query [B, Lq, H, D], key/value [B, Lk, K, D] -> [B, Lq, H, D] by models/splash.py's kernel,
  split over the mesh like the [B, L, H, D] activations (HEADS); padded queries output zeros."""
  batch, q_len = query.shape[:2]
  out = splash.attention(query, key, value, **splash_arguments(mask, batch, q_len, key.shape[1]), axes=HEADS,
                         interpret=traced_platform() != 'tpu')  # Mosaic compiles the kernel for TPUs only
  if mask is not None and mask.query_lengths is not None:
    real_query = jnp.arange(q_len)[None, :] < jnp.asarray(mask.query_lengths)[:, None]
    out = jnp.where(real_query[:, :, None, None], out, 0)
  return out


def traced_platform() -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the mesh the computation being traced runs on (set by
  `jax.set_mesh`; a compile-only target's devices need not be this process's), else this process's
  default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device  # None: an AbstractMesh made without devices
  return jax.default_backend() if device is None else device.platform


def resolve_compute_dtype(dtype: str, platform: str | None = None) -> str:
  """A model config's `dtype` for `platform` ('cpu', 'gpu', 'tpu'; None: this process's default
  backend): 'auto' is bfloat16 on GPU and TPU (parameters and optimizer state stay float32) and
  float32 on CPU, where XLA computes bfloat16 matmuls in float32 anyway; other names unchanged."""
  if dtype != 'auto':
    return dtype
  return 'float32' if (platform or jax.default_backend()) == 'cpu' else 'bfloat16'


@functools.cache
def default_attention_implementation(dtype: Any = 'float32', platform: str | None = None) -> str:
  """Per platform ('cpu', 'gpu', 'tpu'; None: this process's default backend) and compute dtype:
  cuDNN flash attention on GPU for bfloat16/float16 (the only dtypes it takes), `jax.nn`'s own
  choice on GPU for float32, splash on TPU, the einsum path elsewhere."""
  platform = platform or jax.default_backend()
  if platform == 'tpu':
    return 'splash'
  if platform != 'gpu':
    return 'xla'
  return 'cudnn' if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else 'jax_nn'


class AdditiveScore(nnx.Module):
  """Bahdanau scoring a(q, k) = w_v^T tanh(W_q q + W_k k).

  Call: query [B, Lq, Dq], key [B, Lk, Dk] -> scores [B, Lq, Lk].
  """

  def __init__(self, query_features: int, key_features: int, hidden: int, *, rngs: nnx.Rngs,
               dtype: Any = None):
    self.w_q = nnx.Linear(query_features, hidden, use_bias=False, dtype=dtype, rngs=rngs)
    self.w_k = nnx.Linear(key_features, hidden, use_bias=False, dtype=dtype, rngs=rngs)
    self.w_v = nnx.Linear(hidden, 1, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, query: jax.Array, key: jax.Array) -> jax.Array:
    features = jnp.tanh(self.w_q(query)[:, :, None, :] + self.w_k(key)[:, None, :, :])
    return self.w_v(features)[..., 0]


class AdditiveAttention(nnx.Module):
  """Additive attention: masked softmax of `AdditiveScore` over keys, then a weighted sum of values.

  Call: query [B, Lq, Dq], key [B, Lk, Dk], value [B, Lk, Dv], key_valid [B, Lk] bool
  -> (context [B, Lq, Dv], weights [B, Lq, Lk]).
  """

  def __init__(self, query_features: int, key_features: int, hidden: int, *, rngs: nnx.Rngs,
               dropout: float = 0.0, dtype: Any = None):
    self.score = AdditiveScore(query_features, key_features, hidden, rngs=rngs, dtype=dtype)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, query, key, value, key_valid=None, *, deterministic: bool = True):
    scores = self.score(query, key)
    mask = None if key_valid is None else key_valid[:, None, :]
    weights = masked_softmax(scores, mask)
    context = jnp.einsum('bqk,bkd->bqd', self.dropout(weights, deterministic=deterministic), value)
    return context, weights


class AttentionWeights(nnx.Intermediate):
  """Attention weights recorded by `MultiHeadAttention` while `record_weights` is on."""


class MultiHeadAttention(nnx.Module):
  """Multi-head self- or cross-attention with an optional key/value cache.

  Projections are separate [E, H*D] matrices so tensor parallelism can split them by head; the
  head width D is E / H unless `head_dim` sets it (Qwen3: H*D != E). `num_kv_heads` K < H is
  grouped-query attention (Ainslie et al. 2023; K = 1: multi-query): the key and value
  projections are [E_kv, K*D] and the cache holds K heads. `rope` (models/rope.py's inverse
  frequencies) rotates the queries and the new keys by their `positions` before the keys
  are cached, so a cached key keeps the rotation of the position it was written at. `qk_norm`
  (Dehghani et al. 2023; as in OLMo 2 and Qwen3) RMS-normalises each query and key head over its D
  features, with a learned [D] scale each (`query_norm`, `key_norm`), before the rotation: every
  attention path reads the normalised heads, and caches hold normalised keys.

  Call:
    inputs_q: [B, Lq, E]; inputs_kv: [B, Lk, E_kv] (None: self-attention).
    mask: AttentionMask over [Lq, Lk_total] (None: every key).
    positions: [B, Lq] int positions of the queries (and of the new keys), read with `rope` only.
    cache: None, or {'k','v': [B, K, L_max, D]}. With `cache_index` the new keys/values are
      written at positions [cache_index, cache_index + Lq) and attention runs over the whole
      cache (self-attention decoding). Without `cache_index` the cache is used as the
      precomputed keys/values of `inputs_kv` (cross-attention decoding).
  Returns: ([B, Lq, E] output, updated cache or None).
  """

  def __init__(self, features: int, num_heads: int, *, rngs: nnx.Rngs, kv_features: int | None = None,
               dropout: float = 0.0, use_bias: bool = True, dtype: Any = None,
               implementation: str = 'xla', num_kv_heads: int | None = None, rope: Sequence[float] | None = None,
               qk_norm: bool = False, qk_norm_epsilon: float = 1e-6, head_dim: int | None = None):
    num_kv_heads = num_kv_heads or num_heads
    if head_dim is None and features % num_heads:
      raise ValueError(f'features={features} is not divisible by num_heads={num_heads}.')
    if num_heads % num_kv_heads:
      raise ValueError(f'num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}.')
    kv_features = kv_features or features
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim or features // num_heads
    self.implementation = implementation
    # [D/2] inverse frequencies, static (a tuple): constants of the architecture, in no checkpoint.
    self.rope = None if rope is None else tuple(float(f) for f in rope)
    self.record_weights = False
    linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.query = linear(features, num_heads * self.head_dim)
    self.key = linear(kv_features, num_kv_heads * self.head_dim)
    self.value = linear(kv_features, num_kv_heads * self.head_dim)
    self.out = linear(num_heads * self.head_dim, features)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
    if qk_norm:  # shared by the heads: x / sqrt(mean(x^2) + eps) * scale over each head's D features
      head_norm = functools.partial(nnx.RMSNorm, self.head_dim, epsilon=qk_norm_epsilon, dtype=dtype, rngs=rngs)
      self.query_norm, self.key_norm = head_norm(), head_norm()
    else:
      self.query_norm = self.key_norm = None

  def _split_heads(self, x: jax.Array) -> jax.Array:
    """[B, L, H*D] -> [B, L, H, D] (H: query heads, or K key/value heads), split by batch and heads."""
    return constrain(x.reshape(*x.shape[:-1], -1, self.head_dim), HEADS)

  def project_kv(self, inputs_kv: jax.Array, positions: jax.Array | None = None) -> dict[str, jax.Array]:
    """[B, Lk, E_kv] -> {'k','v': [B, K, Lk, D]}: the static cache of a cross-attention, or the
    new entries of a self-attention's (keys normalised with qk_norm, then rotated to `positions`
    [B, Lk] with rope).

    Caches are head-major, the layout the score and value matmuls read: a [B, L, H, D] cache
    would be transposed in full at every decoding step.
    """
    key = self._split_heads(self.key(inputs_kv))
    if self.key_norm is not None:
      key = self.key_norm(key)
    if self.rope is not None:
      key = apply_rope(key, positions, self.rope)
    return {'k': jnp.swapaxes(key, 1, 2), 'v': jnp.swapaxes(self._split_heads(self.value(inputs_kv)), 1, 2)}

  def __call__(self, inputs_q, inputs_kv=None, mask=None, *, positions=None, cache=None, cache_index=None,
               deterministic: bool = True):
    query = self._split_heads(self.query(inputs_q))
    if self.query_norm is not None:
      query = self.query_norm(query)
    if self.rope is not None:
      if positions is None:
        raise ValueError('A rotary attention needs the positions of its queries.')
      query = apply_rope(query, positions, self.rope)
    if cache is not None and cache_index is None:
      kv = cache
    else:
      kv = self.project_kv(inputs_q if inputs_kv is None else inputs_kv, positions)
      if cache is not None:
        start = (0, 0, cache_index, 0)
        kv = {name: jax.lax.dynamic_update_slice(cache[name], kv[name].astype(cache[name].dtype), start)
              for name in ('k', 'v')}
    key, value = (jnp.swapaxes(kv[name], 1, 2).astype(query.dtype) for name in ('k', 'v'))
    out, weights = dot_product_attention(
        query, key, value, mask,
        dropout=self.dropout, deterministic=deterministic,
        implementation='xla' if self.record_weights else self.implementation)
    if self.record_weights:
      self.sow(AttentionWeights, 'weights', weights)
    out = self.out(constrain(out, HEADS).reshape(*out.shape[:-2], -1))
    new_cache = kv if cache is not None and cache_index is not None else cache
    return out, new_cache

  def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    shape = (batch, self.num_kv_heads, max_len, self.head_dim)
    return {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}


def attention_dropout_forces_einsum(model: nnx.Module) -> bool:
  """Whether some attention layer of `model`, set to a fused kernel, trains on the einsum path
  instead because it drops attention weights (which the fused kernels cannot)."""
  return any(m.dropout is not None and m.implementation != 'xla'
             for _, m in nnx.iter_modules(model) if isinstance(m, MultiHeadAttention))


def record_attention_weights(model: nnx.Module, fn, *args, **kwargs):
  """Run `fn(*args, **kwargs)` with every MultiHeadAttention of `model` recording its weights.

  Returns (fn's result, {module path 'a/b/c': [B, H, Lq, Lk] weights}).
  """
  attentions = [m for _, m in nnx.iter_modules(model) if isinstance(m, MultiHeadAttention)]
  for m in attentions:
    m.record_weights = True
  try:
    result, recorded = nnx.capture(lambda _, *a, **k: fn(*a, **k), AttentionWeights)(model, *args, **kwargs)
  finally:
    for m in attentions:
      m.record_weights = False
  weights = {}
  for path, variable in nnx.to_flat_state(recorded):
    value = variable.get_value() if hasattr(variable, 'get_value') else variable
    weights['/'.join(str(p) for p in path[:-1])] = value[0] if isinstance(value, tuple) else value
  return result, weights
