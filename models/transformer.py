"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Encoder: token embedding scaled by sqrt(E) + sinusoidal positions, dropout, N self-attention
blocks. Decoder: the same embedding of the target shifted right behind BOS, N blocks of causal
self-attention, cross-attention over the encoder output and an FFN, then a projection onto the
target vocabulary. Blocks are `models.layers.TransformerBlock`: post-LayerNorm as in the paper,
or pre-LayerNorm (`pre_norm=True`, which adds a final LayerNorm after each stack).

With `share_embeddings` (the paper's setting, which needs a joint vocabulary) one matrix embeds
source and target tokens and, transposed, produces the output logits. Source padding is masked
in encoder self-attention and in cross-attention (padding follows the real tokens, so the masks
are source lengths); target padding only needs the causal mask and is excluded from the loss by
the task.

Options of every attention and block (models/layers.py), off by default: `qk_norm` (RMSNorm of
query and key heads, self- and cross-attention alike; cross-attention caches hold normalised keys)
and `zero_init_out` (attention output and FFN down projections start at zero).

Packed rows (several pairs per row, training with `data.packing`) carry segment ids, 1, 2, ... per
pair and 0 on padding: positions restart at each segment, and every attention (encoder self,
causal decoder self, cross) stays within a segment, so each pair is computed exactly as alone.

Shape legend: B batch, S source length, T target length, E width, V vocabulary,
T_max decoding cache length.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import decoding
from models.attention import AttentionMask
from models.layers import BlockShape, Embed, TransformerBlock, sinusoidal_positions, zero_init_output_projections
from models.tracing import tracer_errors_without_origin


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Defaults are the paper's base model: 63.1M parameters with a 37,000-token joint vocabulary
  (the paper reports 65M; its exact vocabulary size is not given)."""
  vocab_size: int = 37000
  width: int = 512
  num_heads: int = 8
  encoder_layers: int = 6
  decoder_layers: int = 6
  mlp_dim: int = 2048
  dropout: float = 0.1  # residual, embedding and FFN-hidden dropout (the paper's P_drop)
  attention_dropout: float = 0.0  # on attention weights (not in the paper; tensor2tensor uses it)
  max_len: int = 256  # longest source or target the positional table covers
  pre_norm: bool = False
  share_embeddings: bool = True
  layer_norm_epsilon: float = 1e-6
  pad_id: int = 0
  dtype: str = 'float32'
  attention: str = 'xla'
  qk_norm: bool = False  # RMSNorm of query and key heads in every attention (models/attention.py)
  zero_init_out: bool = False  # attention output and FFN down projections start at zero

  def block_shape(self) -> BlockShape:
    return BlockShape(width=self.width, heads=self.num_heads, layers=self.encoder_layers + self.decoder_layers,
                      mlp_width=self.mlp_dim, vocab=self.vocab_size, dtype=self.dtype, qk_norm=self.qk_norm)


class Transformer(nnx.Module):

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    # Unit-variance embeddings after the sqrt(E) scaling, and unit-scale logits when tied.
    init = nnx.initializers.normal(config.width ** -0.5)
    embed = lambda: Embed(config.vocab_size, config.width, embedding_init=init, dtype=dtype, rngs=rngs)
    self.source_embedding = embed()
    self.target_embedding = None if config.share_embeddings else embed()
    self.output = None if config.share_embeddings else nnx.Linear(
        config.width, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def block(cross_attention):
      return TransformerBlock(
          config.width, config.num_heads, config.mlp_dim, dropout=config.dropout,
          attention_dropout=config.attention_dropout, activation='relu', pre_norm=config.pre_norm,
          cross_attention=cross_attention, layer_norm_epsilon=config.layer_norm_epsilon, dtype=dtype,
          attention_implementation=config.attention, qk_norm=config.qk_norm, rngs=rngs)

    self.encoder_blocks = nnx.List([block(False) for _ in range(config.encoder_layers)])
    self.decoder_blocks = nnx.List([block(True) for _ in range(config.decoder_layers)])
    if config.zero_init_out:
      for b in (*self.encoder_blocks, *self.decoder_blocks):
        zero_init_output_projections(b)
    norm = lambda: nnx.LayerNorm(config.width, epsilon=config.layer_norm_epsilon, dtype=dtype, rngs=rngs)
    self.encoder_norm = norm() if config.pre_norm else None
    self.decoder_norm = norm() if config.pre_norm else None

  def _embed(self, embedding: Embed, tokens: jax.Array, offset: jax.Array | int,
             segment_ids: jax.Array | None, deterministic: bool) -> jax.Array:
    """[B, L] ids at positions offset.. (or from 0 in each segment of `segment_ids` [B, L])
    -> [B, L, E] scaled embeddings + sinusoids, with dropout."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f'Sequence of length {length} exceeds model max_len={self.config.max_len}; '
                       f'raise model.max_len.')
    table = jnp.asarray(sinusoidal_positions(self.config.max_len, self.config.width))
    if segment_ids is None:
      positions = jax.lax.dynamic_slice_in_dim(table, offset, length)
    else:
      positions = table[positions_in_segments(segment_ids)]
    x = embedding(tokens) * self.config.width ** 0.5
    return self.dropout(x + positions.astype(x.dtype), deterministic=deterministic)

  def source_lengths(self, source: jax.Array) -> jax.Array:
    """[B, S] right-padded source ids -> [B] int32 real lengths."""
    return jnp.sum(source != self.config.pad_id, axis=1, dtype=jnp.int32)

  def encode(self, source: jax.Array, source_lengths: jax.Array | None = None, *,
             source_segments: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    """[B, S] source ids -> [B, S, E] encoder states.

    source_lengths: [B] real source tokens per row (default: the non-pad ones).
    source_segments: [B, S] segment ids of packed rows (then lengths are not used).
    """
    if source_segments is not None:
      mask = AttentionMask(query_segment_ids=source_segments, key_segment_ids=source_segments)
    else:
      mask = AttentionMask(key_lengths=self.source_lengths(source) if source_lengths is None else source_lengths)
    x = self._embed(self.source_embedding, source, 0, source_segments, deterministic)
    for block in self.encoder_blocks:
      x, _ = block(x, mask, deterministic=deterministic)
    return x if self.encoder_norm is None else self.encoder_norm(x)

  def decode(self, target_in: jax.Array, memory: jax.Array | None, source_lengths: jax.Array | None, *,
             source_segments: jax.Array | None = None, target_segments: jax.Array | None = None,
             cache: dict | None = None, cache_index: jax.Array | int | None = None,
             deterministic: bool = True) -> tuple[jax.Array, dict | None]:
    """Next-token logits for the (shifted-right) target.

    Args:
      target_in: [B, T] ids: BOS followed by the target (teacher forcing), or [B, 1] while
        decoding with a cache.
      memory: [B, S, E] encoder states (None when `cache` holds the cross-attention keys/values).
      source_lengths: [B] real source tokens per row.
      source_segments, target_segments: [B, S], [B, T] segment ids of packed rows (training
        only; then `source_lengths` is not used).
      cache: from `init_cache`; new self-attention keys/values are written at `cache_index`.
    Returns:
      ([B, T, V] float32 logits, updated cache or None).
    """
    offset = 0 if cache_index is None else cache_index
    embedding = self.source_embedding if self.target_embedding is None else self.target_embedding
    x = self._embed(embedding, target_in, offset, target_segments, deterministic)
    self_mask = AttentionMask(causal=True, q_offset=cache_index, query_segment_ids=target_segments,
                              key_segment_ids=target_segments)
    if target_segments is not None:
      cross_mask = AttentionMask(query_segment_ids=target_segments, key_segment_ids=source_segments)
    else:
      cross_mask = AttentionMask(key_lengths=source_lengths)
    new_layers = []
    for i, block in enumerate(self.decoder_blocks):
      x, layer_cache = block(x, self_mask, context=memory, context_mask=cross_mask,
                             cache=None if cache is None else cache['layers'][i], cache_index=cache_index,
                             deterministic=deterministic)
      new_layers.append(layer_cache)
    if self.decoder_norm is not None:
      x = self.decoder_norm(x)
    logits = embedding.attend(x) if self.output is None else self.output(x)
    new_cache = None if cache is None else {'layers': new_layers, 'source_lengths': cache['source_lengths']}
    return logits.astype(jnp.float32), new_cache

  def __call__(self, source: jax.Array, target_in: jax.Array, *, source_lengths: jax.Array | None = None,
               source_segments: jax.Array | None = None, target_segments: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """Teacher-forced logits: [B, S] source, [B, T] BOS + target -> [B, T, V].

    Packed rows pass both `source_segments` [B, S] and `target_segments` [B, T] (see the module
    docstring); otherwise padding is given by `source_lengths` [B] (default: the non-pad tokens).
    """
    if source_segments is None and source_lengths is None:
      source_lengths = self.source_lengths(source)
    memory = self.encode(source, source_lengths, source_segments=source_segments, deterministic=deterministic)
    logits, _ = self.decode(target_in, memory, source_lengths, source_segments=source_segments,
                            target_segments=target_segments, deterministic=deterministic)
    return logits

  def init_cache(self, source: jax.Array, memory: jax.Array, max_len: int) -> dict[str, Any]:
    """Decoding state for `decode(..., cache=, cache_index=)`; every leaf is batch-leading.

    {'source_lengths': [B] int32, 'layers': [{'self': {'k','v': [B, H, T_max, D]},
                                               'cross': {'k','v': [B, H, S, D]}}] per decoder layer}.
    The cross-attention keys/values of `memory` are projected once here.
    """
    dtype = jnp.dtype(self.config.dtype)
    layers = [{'self': block.self_attention.init_cache(source.shape[0], max_len, dtype),
               'cross': block.cross_attention.project_kv(memory)} for block in self.decoder_blocks]
    return {'source_lengths': self.source_lengths(source), 'layers': layers}

  def decode_step(self, tokens: jax.Array, cache: dict, index: jax.Array | int) -> tuple[jax.Array, dict]:
    """One cached decoding step, the `step_fn` of models/decoding.py.

    tokens: [N, T] ids at positions index.. (BOS at 0); cache: from `init_cache` (N = B, or
    B * beams after tiling). Returns ([N, T, V] next-token logits, updated cache).
    """
    return self.decode(tokens, None, cache['source_lengths'], cache=cache, cache_index=index)


def positions_in_segments(segment_ids: jax.Array) -> jax.Array:
  """[B, L] segment ids (each segment contiguous) -> [B, L] positions counted from each segment's start."""
  index = jnp.arange(segment_ids.shape[1])[None, :]
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


@nnx.jit(static_argnames=('bos_id', 'eos_id', 'beam_size', 'alpha', 'max_len_ratio', 'max_len_offset'))
def translate(model: Transformer, source: jax.Array, *, bos_id: int, eos_id: int, beam_size: int = 4,
              alpha: float = 0.6, max_len_ratio: float = 1.5, max_len_offset: int = 10
              ) -> tuple[jax.Array, jax.Array]:
  """Compiled batched decoding: [B, S] source ids -> ([B, T_max] best output ids, [B] scores).

  Output rows end with EOS and are padded with pad_id. Each row may generate at most
  max_len_ratio * (its source length) + max_len_offset tokens, and T_max (the longest any row
  may need, capped at model.max_len) fixes the cache size. beam_size <= 1 decodes greedily
  (the score is then the log-probability, without length penalty).
  """
  config = model.config
  max_len = min(config.max_len, int(max_len_ratio * source.shape[1]) + max_len_offset)
  limits = decoding.max_lengths_for(model.source_lengths(source), max_len_ratio, max_len_offset, max_len)
  memory = model.encode(source)
  cache = model.init_cache(source, memory, max_len)
  bos = jnp.full((source.shape[0], 1), bos_id, jnp.int32)
  if beam_size <= 1:
    result = decoding.decode(model.decode_step, cache, bos, max_len=max_len, eos_id=eos_id, pad_id=config.pad_id,
                             max_lengths=limits)
    return result.tokens, result.logprobs
  result = decoding.beam_search(model.decode_step, cache, bos, beam_size=beam_size, max_len=max_len, eos_id=eos_id,
                                pad_id=config.pad_id, alpha=alpha, max_lengths=limits)
  return result.tokens[:, 0], result.scores[:, 0]


def count_parameters(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def parameter_count(config: TransformerConfig) -> int:
  """Parameters of a model with `config`, counted from shapes only (nothing is allocated)."""
  with tracer_errors_without_origin():
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return count_parameters(abstract)
