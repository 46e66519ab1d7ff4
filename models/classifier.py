"""A Transformer text classifier trained from scratch: encoder blocks, pooling, a linear head.

Token embedding scaled by sqrt(E) (in training, whole token vectors dropped at rate
`token_dropout`) + sinusoidal positions, dropout, N self-attention blocks
(`models.layers.TransformerBlock`) whose attention ignores padding, then one vector per text:
the mean of the real (non-padding) positions, or the first position ([CLS]). Dropout and a
linear layer give the class logits. Padding changes no logit: padded keys get zero attention
weight and padded positions are left out of the mean.

Shape legend: B batch, L length, E width, C classes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import AttentionMask
from models.layers import BlockShape, Embed, TransformerBlock, sinusoidal_positions, zero_init_output_projections

POOLINGS = ('mean', 'cls')


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
  vocab_size: int = 8000
  num_classes: int = 2
  max_len: int = 512
  num_layers: int = 2
  num_heads: int = 4
  width: int = 128
  mlp_dim: int = 512
  dropout: float = 0.1
  attention_dropout: float = 0.0
  pooling: str = 'mean'  # 'mean' over real tokens | 'cls' (the first token)
  pre_norm: bool = True  # pre-LN trains from scratch without a careful warmup
  layer_norm_epsilon: float = 1e-6
  dtype: str = 'float32'
  attention: str = 'xla'
  labels: tuple[str, ...] = ()  # class names in logit order, when known (predictions, exports)
  qk_norm: bool = False  # RMSNorm of query and key heads (models/attention.py)
  zero_init_out: bool = False  # attention output and FFN down projections start at zero
  token_dropout: float = 0.0  # training: the rate at which whole token embeddings are zeroed (word dropout)

  def __post_init__(self):
    if self.labels and len(self.labels) != self.num_classes:
      raise ValueError(f'{len(self.labels)} label names for num_classes={self.num_classes}.')

  def block_shape(self) -> BlockShape:
    return BlockShape(width=self.width, heads=self.num_heads, layers=self.num_layers, mlp_width=self.mlp_dim,
                      vocab=self.vocab_size, dtype=self.dtype, qk_norm=self.qk_norm)


class TransformerClassifier(nnx.Module):

  def __init__(self, config: ClassifierConfig, *, rngs: nnx.Rngs):
    if config.pooling not in POOLINGS:
      raise ValueError(f'pooling={config.pooling!r} is not one of {POOLINGS}.')
    self.config = config
    dtype = jnp.dtype(config.dtype)
    # Unit-variance token vectors after the sqrt(E) scaling, like the positional sinusoids.
    self.embedding = Embed(config.vocab_size, config.width, embedding_init=nnx.initializers.normal(
        config.width ** -0.5), dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    # One draw per token, shared by its E features: a dropped word is gone, not just noisier. Only
    # built when used: its RNG state is part of the checkpoint, and older runs must still restore.
    self.token_dropout = nnx.Dropout(config.token_dropout, broadcast_dims=(2,),
                                     rngs=rngs) if config.token_dropout else None
    self.blocks = nnx.List([
        TransformerBlock(config.width, config.num_heads, config.mlp_dim, dropout=config.dropout,
                         attention_dropout=config.attention_dropout, activation='gelu', pre_norm=config.pre_norm,
                         layer_norm_epsilon=config.layer_norm_epsilon, dtype=dtype,
                         attention_implementation=config.attention, qk_norm=config.qk_norm, rngs=rngs)
        for _ in range(config.num_layers)])
    if config.zero_init_out:
      for block in self.blocks:
        zero_init_output_projections(block)
    self.final_norm = nnx.LayerNorm(config.width, epsilon=config.layer_norm_epsilon, dtype=dtype,
                                    rngs=rngs) if config.pre_norm else None
    self.head = nnx.Linear(config.width, config.num_classes, dtype=dtype, rngs=rngs)

  def encode(self, tokens: jax.Array, valid: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """tokens [B, L] ids, valid [B, L] bool (False on padding, which follows the real tokens)
    -> [B, L] x [E] states."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f'Sequence of length {length} exceeds model max_len={self.config.max_len}; '
                       f'raise model.max_len or lower data.seq_len.')
    x = self.embedding(tokens)
    if self.token_dropout is not None:
      x = self.token_dropout(x, deterministic=deterministic)
    x = x * self.config.width ** 0.5
    x = self.dropout(x + sinusoidal_positions(length, self.config.width).astype(x.dtype), deterministic=deterministic)
    mask = AttentionMask(key_lengths=valid.sum(-1))
    for block in self.blocks:
      x, _ = block(x, mask, deterministic=deterministic)
    return x if self.final_norm is None else self.final_norm(x)

  def pool(self, states: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, L, E] states -> [B, E] text vectors."""
    if self.config.pooling == 'cls':
      return states[:, 0]
    weights = valid.astype(states.dtype)[..., None]
    return (states * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)

  def __call__(self, tokens: jax.Array, valid: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """[B, L] ids and validity -> [B, C] float32 logits."""
    pooled = self.pool(self.encode(tokens, valid, deterministic=deterministic), valid)
    return self.head(self.dropout(pooled, deterministic=deterministic)).astype(jnp.float32)
