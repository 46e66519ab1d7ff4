"""GPT-2: a decoder-only Transformer language model.

Token + learned position embeddings, N pre-LayerNorm blocks of causal self-attention and a GELU
MLP, a final LayerNorm, and an output layer tied to the token embedding. `GPT2Config` defaults
are GPT-2 small (124,439,808 parameters with vocabulary 50,257 and 1,024 positions).

Shape legend: B batch, L length, E width, V vocabulary, L_max cache length.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import make_attention_mask
from models.layers import TransformerBlock


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int = 50257
  max_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  width: int = 768
  mlp_ratio: int = 4
  dropout: float = 0.1
  layer_norm_epsilon: float = 1e-5
  dtype: str = 'float32'
  attention: str = 'xla'

  @classmethod
  def from_config(cls, model_config, vocab_size: int) -> 'GPT2Config':
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in model_config.items() if k in fields}
    values['vocab_size'] = vocab_size
    return cls(**values)


class GPT(nnx.Module):

  def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    init = nnx.initializers.normal(0.02)
    # GPT-2 scales the init of residual-branch outputs by 1/sqrt(2 * layers).
    residual_init = nnx.initializers.normal(0.02 / (2 * config.num_layers) ** 0.5)
    self.token_embedding = nnx.Embed(config.vocab_size, config.width, embedding_init=init, dtype=dtype, rngs=rngs)
    self.position_embedding = nnx.Embed(config.max_len, config.width, embedding_init=nnx.initializers.normal(0.01),
                                        dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    blocks = []
    for _ in range(config.num_layers):
      block = TransformerBlock(
          config.width, config.num_heads, config.mlp_ratio * config.width, dropout=config.dropout,
          attention_dropout=config.dropout, activation='gelu_tanh', pre_norm=True,
          layer_norm_epsilon=config.layer_norm_epsilon, dtype=dtype,
          attention_implementation=config.attention, rngs=rngs)
      for linear in (block.self_attention.query, block.self_attention.key, block.self_attention.value,
                     block.mlp.up):
        linear.kernel[...] = init(rngs.params(), linear.kernel.shape)
      for linear in (block.self_attention.out, block.mlp.down):
        linear.kernel[...] = residual_init(rngs.params(), linear.kernel.shape)
      blocks.append(block)
    self.blocks = nnx.List(blocks)
    self.final_norm = nnx.LayerNorm(config.width, epsilon=config.layer_norm_epsilon, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               key_valid: jax.Array | None = None, cache: list | None = None,
               cache_index: jax.Array | int | None = None, deterministic: bool = True,
               return_hidden: bool = False):
    """Next-token logits.

    Args:
      tokens: [B, L] int token ids.
      positions: [B, L] position ids (default 0..L-1; left-padded prompts pass their own).
      key_valid: [B, L_keys] bool, False on padding keys (L_keys = L, or L_max with a cache).
      cache: per-layer key/value caches from `init_cache`, written at `cache_index`.
    Returns:
      ([B, L, V] float32 logits, updated cache or None); with `return_hidden`, the final
      [B, L, E] hidden states instead of logits.
    """
    batch, length = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(length) + (0 if cache_index is None else cache_index),
                                   (batch, length))
    x = self.token_embedding(tokens) + self.position_embedding(positions)
    x = self.dropout(x, deterministic=deterministic)
    k_len = length if cache is None else cache[0]['self']['k'].shape[1]
    mask = make_attention_mask(None, key_valid, causal=True, q_len=length, k_len=k_len,
                               q_offset=0 if cache_index is None else cache_index)
    new_cache = []
    for i, block in enumerate(self.blocks):
      x, layer_cache = block(x, mask, cache=None if cache is None else cache[i], cache_index=cache_index,
                             deterministic=deterministic)
      new_cache.append(layer_cache)
    x = self.final_norm(x)
    if return_hidden:
      return x, (new_cache if cache is not None else None)
    logits = self.token_embedding.attend(x).astype(jnp.float32)
    return logits, (new_cache if cache is not None else None)

  def init_cache(self, batch: int, max_len: int) -> list[dict[str, Any]]:
    dtype = jnp.dtype(self.config.dtype)
    return [{'self': block.self_attention.init_cache(batch, max_len, dtype)} for block in self.blocks]


def count_parameters(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
