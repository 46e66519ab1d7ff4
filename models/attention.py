"""Attention for the whole codebase: masks, masked softmax, scoring functions, multi-head attention.

Every model family (attention pooling, Bahdanau seq2seq, Transformer, BERT, GPT) uses these
pieces; there is no second attention implementation anywhere in the repository.

Shape legend: B batch, Lq / Lk query / key length, H heads, D head width, E model width.
Masks are boolean, True where attention is allowed, and broadcast against [B, H, Lq, Lk].
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# Large negative logit for masked positions: finite so fully masked rows stay NaN-free.
_MASKED_LOGIT = -1e9
ATTENTION_IMPLEMENTATIONS = ('auto', 'xla', 'jax_nn')


# ----------------------------------------------------------------------------- masks
def padding_mask(valid_lengths: jax.Array, max_len: int) -> jax.Array:
  """[B] valid lengths -> [B, max_len] bool, True on real (non-pad) positions."""
  return jnp.arange(max_len)[None, :] < jnp.asarray(valid_lengths)[:, None]


def causal_mask(q_len: int, k_len: int, q_offset: jax.Array | int = 0) -> jax.Array:
  """[q_len, k_len] bool: query i (at absolute position q_offset + i) sees keys <= its position."""
  q_pos = jnp.arange(q_len)[:, None] + q_offset
  return jnp.arange(k_len)[None, :] <= q_pos


def make_attention_mask(
    query_valid: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    *,
    causal: bool = False,
    q_len: int | None = None,
    k_len: int | None = None,
    q_offset: jax.Array | int = 0,
) -> jax.Array | None:
  """Combine padding and causal constraints into one [B|1, 1, Lq, Lk] bool mask.

  Args:
    query_valid: [B, Lq] bool, True on real query positions (None: all real).
    key_valid: [B, Lk] bool, True on real key positions (None: all real).
    causal: add the autoregressive constraint.
    q_len, k_len: lengths, needed only when the corresponding validity array is None.
    q_offset: absolute position of the first query (cached decoding).
  """
  q_len = query_valid.shape[-1] if query_valid is not None else q_len
  k_len = key_valid.shape[-1] if key_valid is not None else k_len
  mask = None
  if key_valid is not None:
    mask = key_valid[:, None, None, :]
  if query_valid is not None:
    q = query_valid[:, None, :, None]
    mask = q if mask is None else mask & q
  if causal:
    if q_len is None or k_len is None:
      raise ValueError('causal masks need q_len and k_len (or validity arrays).')
    c = causal_mask(q_len, k_len, q_offset)[None, None]
    mask = c if mask is None else mask & c
  return mask


def masked_softmax(scores: jax.Array, mask: jax.Array | None, axis: int = -1) -> jax.Array:
  """Softmax over `axis` where masked entries get exactly zero weight.

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
    mask: jax.Array | None = None,
    *,
    dropout: nnx.Dropout | None = None,
    deterministic: bool = True,
    implementation: str = 'xla',
) -> tuple[jax.Array, jax.Array | None]:
  """Scaled dot-product attention softmax(q k^T / sqrt(D)) v.

  Args:
    query: [B, Lq, H, D]; key, value: [B, Lk, H, D].
    mask: bool, broadcastable to [B, H, Lq, Lk].
    dropout: optional dropout applied to the attention weights (xla path only).
    implementation: 'xla' (einsum + masked softmax, returns weights) or 'jax_nn'
      (`jax.nn.dot_product_attention`: cuDNN flash attention on GPU; no weights returned).
  Returns:
    ([B, Lq, H, D] output, [B, H, Lq, Lk] weights or None).
  """
  if implementation == 'auto':
    implementation = default_attention_implementation()
  if implementation == 'jax_nn' and (dropout is None or deterministic):
    out = jax.nn.dot_product_attention(query, key, value, mask=mask)
    return out, None
  if implementation not in ('xla', 'jax_nn'):
    raise ValueError(f'Unknown attention implementation {implementation!r}; '
                     f'choose one of {ATTENTION_IMPLEMENTATIONS}.')
  depth = query.shape[-1]
  scores = jnp.einsum('bqhd,bkhd->bhqk', query, key) / jnp.sqrt(depth).astype(query.dtype)
  weights = masked_softmax(scores, mask)
  if dropout is not None:
    weights = dropout(weights, deterministic=deterministic)
  out = jnp.einsum('bhqk,bkhd->bqhd', weights, value)
  return out, weights


@functools.cache
def default_attention_implementation() -> str:
  """Per-platform default: cuDNN-backed `jax.nn` attention on GPU, einsum elsewhere."""
  return 'jax_nn' if jax.default_backend() == 'gpu' else 'xla'


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

  Projections are separate [E, H*D] matrices so tensor parallelism can split them by head.

  Call:
    inputs_q: [B, Lq, E]; inputs_kv: [B, Lk, E_kv] (None: self-attention).
    mask: bool broadcastable to [B, H, Lq, Lk_total].
    cache: None, or {'k','v': [B, H, L_max, D]}. With `cache_index` the new keys/values are
      written at positions [cache_index, cache_index + Lq) and attention runs over the whole
      cache (self-attention decoding). Without `cache_index` the cache is used as the
      precomputed keys/values of `inputs_kv` (cross-attention decoding).
  Returns: ([B, Lq, E] output, updated cache or None).
  """

  def __init__(self, features: int, num_heads: int, *, rngs: nnx.Rngs, kv_features: int | None = None,
               dropout: float = 0.0, use_bias: bool = True, dtype: Any = None,
               implementation: str = 'xla'):
    if features % num_heads:
      raise ValueError(f'features={features} is not divisible by num_heads={num_heads}.')
    kv_features = kv_features or features
    self.num_heads = num_heads
    self.head_dim = features // num_heads
    self.implementation = implementation
    self.record_weights = False
    linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.query = linear(features, features)
    self.key = linear(kv_features, features)
    self.value = linear(kv_features, features)
    self.out = linear(features, features)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

  def _split_heads(self, x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

  def project_kv(self, inputs_kv: jax.Array) -> dict[str, jax.Array]:
    """[B, Lk, E_kv] -> {'k','v': [B, H, Lk, D]}: the static cache of a cross-attention.

    Caches are head-major, the layout the score and value matmuls read: a [B, L, H, D] cache
    would be transposed in full at every decoding step (measured: 70% of a GPT decode step).
    """
    return {'k': jnp.swapaxes(self._split_heads(self.key(inputs_kv)), 1, 2),
            'v': jnp.swapaxes(self._split_heads(self.value(inputs_kv)), 1, 2)}

  def __call__(self, inputs_q, inputs_kv=None, mask=None, *, cache=None, cache_index=None,
               deterministic: bool = True):
    query = self._split_heads(self.query(inputs_q))
    if cache is not None and cache_index is None:
      kv = cache
    else:
      kv = self.project_kv(inputs_q if inputs_kv is None else inputs_kv)
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
    out = self.out(out.reshape(*out.shape[:-2], -1))
    new_cache = kv if cache is not None and cache_index is not None else cache
    return out, new_cache

  def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    shape = (batch, self.num_heads, max_len, self.head_dim)
    return {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}


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
