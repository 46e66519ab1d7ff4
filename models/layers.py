"""Transformer building blocks shared by GPT, BERT, the translation Transformer and the classifier.

Padded vocabularies: an embedding whose transpose is the output layer gets
`padded_vocab_size(vocab_size, vocab_multiple)` rows, so that the [.., E] x [E, V'] logits matmul
fills whole hardware tiles (a multiple of 128 suits TPU lanes and GPU tensor cores; GPT-2's 50,257
ids become 50,304 rows). Ids past `vocab_size` are never inputs and `mask_padded_logits` keeps them
from ever being predicted.

Shape legend: B batch, L length, E model width, F feed-forward width, V vocabulary, V' padded vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import MultiHeadAttention
from models.partitioning import TOKENS, constrain

ACTIVATIONS = {
    'relu': jax.nn.relu,
    'gelu': functools.partial(jax.nn.gelu, approximate=False),
    'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's "gelu_new"
    'silu': jax.nn.silu,  # x * sigmoid(x), SwiGLU's gate (Llama's "silu")
    'relu2': lambda x: jnp.square(jax.nn.relu(x)),  # ReLU^2 (So et al. 2021, Primer; the NanoGPT speedrun's MLP)
}
NORMS = ('layernorm', 'rmsnorm')


@dataclasses.dataclass(frozen=True)
class BlockShape:
  """The sizes a model's Transformer blocks compute with, which the activations saved for the
  backward pass scale with (train/memory.py): a model config's `block_shape()`."""
  width: int  # E
  heads: int  # H
  layers: int  # blocks a training example passes through (encoder and decoder together)
  mlp_width: int  # F, the feed-forward hidden width
  vocab: int  # V, output logits per token
  dtype: str  # compute dtype of the saved activations
  remat: str = 'none'  # what the blocks recompute in the backward pass: 'none' | 'dots' | 'full'
  qk_norm: bool = False  # attention normalises its query and key heads (two more [E] activations per token)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
  """V' = vocab_size rounded up to a multiple of `multiple` (1: no padding)."""
  return -(-vocab_size // multiple) * multiple


def leading_names(ndim: int) -> tuple[str | None, ...]:
  """Logical names of the leading (token) dimensions [B], [B, L], [B, L, ...] of ids, their
  lookups and their logits."""
  return ('batch', 'length', *([None] * max(ndim - 2, 0)))[:ndim]


class Embed(nnx.Embed):
  """nnx.Embed whose table [N, E] is read split over its rows ('vocab') only, whole along the width.

  Under FSDP the table is stored split along its width too; reading it as ('vocab', 'embed') makes
  XLA gather the table (a weight, once per use) rather than the token ids and the [B, L, E]
  lookups of the global batch, and lets a tied output layer use the same gathered table. Lookups
  [B, L] -> [B, L, E] and `attend`'s logits [B, L, E] -> [B, L, N] keep the batch split (the
  logits also split by vocabulary where 'vocab' maps to a mesh axis). Without a mesh this is
  nnx.Embed exactly (models/partitioning.py).
  """

  def table(self) -> jax.Array:
    """The [N, E] table as the lookups and the tied output layer read it."""
    return constrain(self.embedding[...], ('vocab', 'embed'))

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError('Input type must be an integer or unsigned integer.')
    (table,) = self.promote_dtype((self.table(),), dtype=self.dtype, inexact=False)
    return constrain(jnp.take(table, inputs, axis=0), (*leading_names(inputs.ndim), 'embed'))

  def attend(self, query: jax.Array) -> jax.Array:
    """[..., E] -> [..., N] logits against every row (a tied output layer)."""
    query, table = self.promote_dtype((query, self.table()), dtype=self.dtype)
    return constrain(jnp.dot(query, table.T), (*leading_names(query.ndim - 1), 'vocab'))


def vocab_embedding(vocab_size: int, multiple: int, features: int, *, embedding_init, dtype: Any,
                    rngs: nnx.Rngs) -> Embed:
  """`Embed` with [V', features] rows; the padded rows start at zero (no id looks them up, and
  masked logits give them no gradient)."""
  def init(key, shape, dtype):
    return embedding_init(key, shape, dtype).at[vocab_size:].set(0)
  return Embed(padded_vocab_size(vocab_size, multiple), features, embedding_init=init, dtype=dtype, rngs=rngs)


def mask_padded_logits(logits: jax.Array, vocab_size: int) -> jax.Array:
  """[..., V'] logits with every id >= vocab_size at the dtype's lowest finite value, so that no
  softmax, argmax, sampling or loss picks it. Finite rather than -inf: a zero label-smoothing weight
  times it stays 0 (times -inf it is NaN). Unchanged when V' = vocab_size."""
  padded = logits.shape[-1]
  if padded == vocab_size:
    return logits
  return jnp.where(jnp.arange(padded) < vocab_size, logits, jnp.finfo(logits.dtype).min)


def sinusoidal_positions(max_len: int, features: int) -> np.ndarray:
  """[max_len, features] table PE(pos, 2i) = sin(pos / 10000^(2i/E)), PE(pos, 2i+1) = cos(...)."""
  position = np.arange(max_len, dtype=np.float64)[:, None]
  inv_freq = np.power(10000.0, -np.arange(0, features, 2, dtype=np.float64) / features)
  table = np.zeros((max_len, features), dtype=np.float64)
  table[:, 0::2] = np.sin(position * inv_freq)
  table[:, 1::2] = np.cos(position * inv_freq[: features // 2])
  return table.astype(np.float32)


def norm_layer(kind: str, features: int, *, epsilon: float, use_bias: bool, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
  """'layernorm' (with a bias unless use_bias=False) or 'rmsnorm' (Zhang & Sennrich 2019: x / rms(x)
  * scale, no centring, no bias) over the last axis of [..., features]."""
  if kind not in NORMS:
    raise ValueError(f'norm={kind!r} is not one of {NORMS}.')
  if kind == 'rmsnorm':
    return nnx.RMSNorm(features, epsilon=epsilon, dtype=dtype, rngs=rngs)
  return nnx.LayerNorm(features, epsilon=epsilon, use_bias=use_bias, dtype=dtype, rngs=rngs)


class FeedForward(nnx.Module):
  """Position-wise FFN: Linear(E -> F), activation, dropout, Linear(F -> E). [B, L, E] -> [B, L, E]."""

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs, activation: str = 'relu',
               dropout: float = 0.0, use_bias: bool = True, dtype: Any = None):
    self.up = nnx.Linear(features, hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, features, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.activation = ACTIVATIONS[activation]
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
    hidden = constrain(self.activation(self.up(x)), ('batch', 'length', 'mlp'))  # [B, L, F]
    return self.down(self.dropout(hidden, deterministic=deterministic))

  def output_projections(self) -> list[nnx.Linear]:
    return [self.down]


@jax.custom_vjp
def stacked_projection(x: jax.Array, kernels: jax.Array) -> jax.Array:
  """x [..., E] @ kernels [E, C, F] -> [..., C, F]: C projections of x in one matmul.

  The kernels' gradient is written as x^T @ d, not autodiff's (d^T @ x)^T: XLA:CPU then
  transposes x [N, E] for the matmul, rather than copying the C/E times larger d [N, C, F]
  through a transpose at every step (3% of the `llama-bench` step). The same numbers either way."""
  return jnp.einsum('...e,ecf->...cf', x, kernels)


def _stacked_projection_fwd(x, kernels):
  return stacked_projection(x, kernels), (x, kernels)


def _stacked_projection_bwd(residuals, d_out):
  x, kernels = residuals
  return jnp.einsum('...cf,ecf->...e', d_out, kernels), jnp.einsum('...e,...cf->ecf', x, d_out)


stacked_projection.defvjp(_stacked_projection_fwd, _stacked_projection_bwd)


class GatedFeedForward(nnx.Module):
  """Gated FFN (GLU variants, Shazeer 2020; SwiGLU with activation 'silu', as in Llama):
  down(dropout(activation(gate(x)) * up(x))). gate, up: [E, F]; down: [F, E]. [B, L, E] -> [B, L, E].

  Three matrices instead of two: at equal parameters F is 2/3 of the plain FFN's (Llama rounds
  8E/3 up to a multiple of 256). `up` and `down` keep FeedForward's names, so the tensor-parallel
  rules of train/sharding.py split `gate` like `up`.
  """

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs, activation: str = 'silu',
               dropout: float = 0.0, use_bias: bool = True, dtype: Any = None):
    linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.gate = linear(features, hidden)
    self.up = linear(features, hidden)
    self.down = linear(hidden, features)
    self.activation = ACTIVATIONS[activation]
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
    # gate and up as one einsum over their stacked kernels [E, 2, F]: XLA:CPU then takes both weight
    # gradients in one dot, not the gate's through a transposed copy of its gradient.
    kernels = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=1)
    dtype = self.gate.dtype or jnp.result_type(x.dtype, kernels.dtype)
    gate_up = stacked_projection(x.astype(dtype), kernels.astype(dtype))  # [B, L, 2, F]
    if self.gate.bias is not None:
      gate_up = gate_up + jnp.stack([self.gate.bias[...], self.up.bias[...]]).astype(dtype)
    hidden = self.activation(gate_up[..., 0, :]) * gate_up[..., 1, :]
    return self.down(self.dropout(hidden, deterministic=deterministic))

  def output_projections(self) -> list[nnx.Linear]:
    return [self.down]


class TransformerBlock(nnx.Module):
  """Self-attention (+ optional cross-attention) + FFN, each in dropout + residual + LayerNorm.

  `pre_norm=False` is the post-LN block of "Attention Is All You Need" and BERT
  (x = LN(x + Dropout(sublayer(x)))); `pre_norm=True` is GPT-2's (x = x + Dropout(sublayer(LN(x)))).
  Llama's steps, each on its own: `norm='rmsnorm'`, `gated_mlp` (GatedFeedForward), `use_bias=False`
  (no bias in any projection or norm), `num_kv_heads` (grouped-query self-attention) and `rope`
  (rotary self-attention at `positions`; see MultiHeadAttention). `qk_norm`: every attention of the
  block RMS-normalises its query and key heads (MultiHeadAttention, epsilon `layer_norm_epsilon`).
  `head_dim`: the self-attention's head width (default features / num_heads).
  `output_projections()` are the last matrices of the residual branches, which models initialise
  at zero with `zero_init_output_projections` (their `zero_init_out` option). `mlp`: a feed-forward
  module to use instead of the dense FFN (GPT's mixture of experts, models/moe.py), called as
  mlp(x, deterministic=...) and with an `output_projections()` of its own.

  Call:
    x: [B, L, E]; mask: self-attention AttentionMask over [L, L_keys] (None: every key).
    positions: [B, L] int positions of x's tokens (read by a rotary self-attention only).
    context: [B, Lc, E] encoder output for cross-attention; context_mask: AttentionMask over [L, Lc].
    cache: None or {'self': kv cache, 'cross': static kv} for decoding; cache_index: write offset.
  Returns: ([B, L, E], updated cache or None).
  """

  def __init__(self, features: int, num_heads: int, hidden: int, *, rngs: nnx.Rngs,
               dropout: float = 0.0, attention_dropout: float = 0.0, activation: str = 'relu',
               pre_norm: bool = False, cross_attention: bool = False, layer_norm_epsilon: float = 1e-5,
               dtype: Any = None, attention_implementation: str = 'xla', norm: str = 'layernorm',
               gated_mlp: bool = False, use_bias: bool = True, num_kv_heads: int | None = None,
               rope: Sequence[float] | None = None, qk_norm: bool = False, head_dim: int | None = None,
               mlp: nnx.Module | None = None):
    attention = functools.partial(MultiHeadAttention, features, num_heads, dropout=attention_dropout,
                                  use_bias=use_bias, dtype=dtype, implementation=attention_implementation,
                                  qk_norm=qk_norm, qk_norm_epsilon=layer_norm_epsilon, rngs=rngs)
    make_norm = functools.partial(norm_layer, norm, features, epsilon=layer_norm_epsilon, use_bias=use_bias,
                                  dtype=dtype, rngs=rngs)
    self.pre_norm = pre_norm
    self.self_attention = attention(num_kv_heads=num_kv_heads, rope=rope, head_dim=head_dim)
    self.self_attention_norm = make_norm()
    self.cross_attention = attention() if cross_attention else None
    self.cross_attention_norm = make_norm() if cross_attention else None
    if mlp is None:
      dense = GatedFeedForward if gated_mlp else FeedForward
      mlp = dense(features, hidden, activation=activation, dropout=dropout, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.mlp = mlp
    self.mlp_norm = make_norm()
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def output_projections(self) -> list[nnx.Linear]:
    """The linear layers whose outputs join the residual stream: each attention's `out` [E, E] and
    the MLP's (a dense FFN's `down` [F, E])."""
    attentions = [self.self_attention] + ([self.cross_attention] if self.cross_attention is not None else [])
    return [attention.out for attention in attentions] + self.mlp.output_projections()

  def _residual(self, x, norm, sublayer, deterministic):
    if self.pre_norm:
      y, aux = sublayer(norm(x))
      return x + self.dropout(y, deterministic=deterministic), aux
    y, aux = sublayer(x)
    return norm(x + self.dropout(y, deterministic=deterministic)), aux

  def __call__(self, x, mask=None, *, positions=None, context=None, context_mask=None, cache=None, cache_index=None,
               deterministic: bool = True):
    cache = cache or {}
    x = constrain(x, TOKENS)
    x, self_cache = self._residual(
        x, self.self_attention_norm,
        lambda h: self.self_attention(h, mask=mask, positions=positions, cache=cache.get('self'),
                                      cache_index=cache_index, deterministic=deterministic),
        deterministic)
    new_cache = {'self': self_cache} if self_cache is not None else {}
    if self.cross_attention is not None:
      x, cross_cache = self._residual(
          x, self.cross_attention_norm,
          lambda h: self.cross_attention(h, context, mask=context_mask, cache=cache.get('cross'),
                                         deterministic=deterministic),
          deterministic)
      if cross_cache is not None:
        new_cache['cross'] = cross_cache
    x, _ = self._residual(x, self.mlp_norm, lambda h: (self.mlp(h, deterministic=deterministic), None),
                          deterministic)
    return constrain(x, TOKENS), (new_cache or None)


def zero_init_output_projections(block: TransformerBlock) -> None:
  """Set the kernels and biases of `block.output_projections()` to zero (the NanoGPT speedrun's and
  muP's zero-initialised residual outputs): at initialisation every residual branch adds nothing,
  so the block passes its input through (pre-LN) or only normalises it (post-LN). Models call it
  after their own initialisation, so that it wins over any re-initialisation."""
  for linear in block.output_projections():
    linear.kernel.set_value(jnp.zeros_like(linear.kernel[...]))
    if linear.bias is not None:
      linear.bias.set_value(jnp.zeros_like(linear.bias[...]))
