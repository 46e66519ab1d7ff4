"""GPT-2: a decoder-only Transformer language model.

Token + learned position embeddings, N pre-LayerNorm blocks of causal self-attention and a GELU
MLP, a final LayerNorm, and an output layer tied to the token embedding. `GPT2Config` defaults
are GPT-2 small (124,439,808 parameters with vocabulary 50,257 and 1,024 positions).

`vocab_multiple` pads the token embedding to a multiple of that many rows (models/layers.py): run
configs use 128, so GPT-2 small stores 50,304 rows and 124,475,904 parameters, the 36,096 extra
ones zero and never used (their logits are masked). The default 1 (no padding) is what a
model.json without the field means.

Two switches for depth and size (as in MaxText):
  scan_layers  the blocks' parameters are stacked on a leading [num_layers] axis and the forward is
               one `nnx.scan` over them, so the compiled program holds one block whatever the depth
               (compile time stays flat); the KV cache is stacked the same way. Checkpoints of the two
               layouts differ, so a run keeps the layout it was trained with.
  remat        activation rematerialisation per block: 'none'; 'dots' saves only the outputs of the
               projection matmuls and recomputes the rest (attention scores, softmax, GELU, norms) in
               the backward pass; 'full' saves only each block's input.

Training windows cut from a token stream cross document borders; `document_segments` gives the
segment ids and positions that keep attention in each document (data.document_masking) on every
attention path (the einsum's dense mask, jax.nn/cuDNN's mask, splash's segment ids).

`logits` and `chunked_loss` are the output layer and its next-token loss (models/lm_head.py);
`generate` continues prompts through the shared decoding loop (models/decoding.py).

The Llama-style decoder (Llama, Mistral, Qwen2, SmolLM) is GPT-2 plus six steps, each a config
field usable alone (the defaults are GPT-2's):
  positions='rope'      rotary embeddings on the queries and keys at each token's position
                        (models/rope.py; `rope_theta`, Llama 3's `rope_scaling='llama3'`) instead
                        of a learned position table added to the token embedding
  norm='rmsnorm'        RMSNorm instead of LayerNorm
  mlp='swiglu'          silu(gate(x)) * up(x) -> down, `mlp_hidden` wide (0: mlp_ratio * width)
  num_kv_heads=K        grouped-query attention: K key/value heads shared by the query heads
                        (1: multi-query; 0 or num_heads: multi-head); the KV cache holds K heads
  use_bias=False        no bias in any projection or norm
  tie_embeddings=False  an output matrix `lm_head` [V', E] of its own instead of the token embedding

Four options of the NanoGPT speedrun's block (issue 33), each usable alone with either architecture
(the defaults leave the model as it was; Hugging Face's GPT-2 and Llama classes have none of the
first three, so `--mode=export_hf` refuses them):
  qk_norm=True          RMSNorm of each query and key head over its width, a learned [D] scale each,
                        before RoPE (models/attention.py; Dehghani et al. 2023, OLMo 2, Qwen3)
  mlp='relu2'           a plain MLP with relu(x)^2 instead of GELU (So et al. 2021, Primer)
  logit_softcap=c       logits -> c * tanh(logits / c) in every loss and in decoding (models/lm_head.py;
                        Gemma 2; the speedrun uses 30, then 15); 0 = off
  zero_init_out=True    the attention output and MLP down projections start at zero (every block
                        starts as the identity; models/layers.py `zero_init_output_projections`)
The fifth, the z-loss, is the loss's, not the model's: `chunked_loss(z_loss=...)` and `train.z_loss`.

Mixture of experts (models/moe.py), with either architecture: `moe_experts` N > 0 makes every
`moe_every`-th block (block i when (i + 1) % moe_every == 0) an MoE block, its MLP replaced by
`MoEFeedForward` (parameters blocks[i].mlp.router/gate/up/down, `shared` with `moe_shared_experts`):
each token through its `moe_top_k` experts of width `moe_hidden` (0: mlp_width), dropless with
grouped matmuls or, with `moe_capacity_factor` > 0, at most that many times an even share per
expert; `moe_norm_topk_prob` renormalises the chosen probabilities, `moe_router_bias` adds
DeepSeek-V3's load bias to the choice. With scan_layers every block is an MoE block
(moe_every = 1). `router_statistics` and `update_load_bias` serve the training loss
(train/tasks/gpt.py). `head_dim` sets the attention heads' width apart from width / num_heads (Qwen3).

Shape legend: B batch, L length, E width, V vocabulary, V' padded vocabulary, L_max cache length.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import decoding
from models.attention import AttentionMask
from models.layers import BlockShape, Embed, TransformerBlock, norm_layer, vocab_embedding, zero_init_output_projections
from models.lm_head import chunked_lm_loss, vocab_logits
from models.moe import MoEFeedForward, RouterStatistics, updated_load_bias
from models.rope import RopeConfig, inverse_frequencies


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  vocab_size: int = 50257  # the tokenizer's ids; the embedding has padded_vocab_size(vocab_size, vocab_multiple) rows
  vocab_multiple: int = 1
  max_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  width: int = 768
  mlp_ratio: int = 4
  dropout: float = 0.1
  layer_norm_epsilon: float = 1e-5
  dtype: str = 'float32'
  attention: str = 'xla'
  scan_layers: bool = False
  remat: str = 'none'  # a key of REMAT_POLICIES
  # The speedrun's options (module docstring); the defaults are the model as before them.
  qk_norm: bool = False
  logit_softcap: float = 0.0  # 0 = no cap
  zero_init_out: bool = False
  # The Llama steps (module docstring); the defaults are GPT-2, what a model.json without them means.
  positions: str = 'learned'  # a key of POSITIONS
  rope_theta: float = 10000.0
  rope_scaling: str = 'none'  # 'none' | 'llama3' (models/rope.py), with the four fields below
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  norm: str = 'layernorm'  # a key of models.layers.NORMS
  mlp: str = 'gelu'  # a key of MLPS
  mlp_hidden: int = 0  # the MLP's hidden width; 0 = mlp_ratio * width
  num_kv_heads: int = 0  # 0 = num_heads
  use_bias: bool = True
  tie_embeddings: bool = True
  head_dim: int = 0  # each attention head's width D; 0 = width // num_heads
  # Mixture of experts (module docstring); moe_experts = 0 is the dense model, what a model.json without them means.
  moe_experts: int = 0
  moe_top_k: int = 2
  moe_shared_experts: int = 0
  moe_every: int = 1
  moe_hidden: int = 0  # each expert's hidden width; 0 = mlp_width
  moe_norm_topk_prob: bool = True
  moe_capacity_factor: float = 0.0  # 0 = dropless
  moe_router_bias: bool = False

  @property
  def mlp_width(self) -> int:
    return self.mlp_hidden or self.mlp_ratio * self.width

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def head_width(self) -> int:
    return self.head_dim or self.width // self.num_heads

  @property
  def expert_width(self) -> int:
    return self.moe_hidden or self.mlp_width

  def is_moe_block(self, index: int) -> bool:
    """Whether block `index` (0-based) holds experts: every `moe_every`-th block, counting from 1."""
    return self.moe_experts > 0 and (index + 1) % self.moe_every == 0

  def moe_blocks(self) -> list[int]:
    return [i for i in range(self.num_layers) if self.is_moe_block(i)]

  def block_shape(self) -> BlockShape:
    # An MoE block's hidden activations: k (and the shared) experts' widths per token.
    mlp_width = (self.moe_top_k + self.moe_shared_experts) * self.expert_width if self.moe_experts else self.mlp_width
    return BlockShape(width=self.width, heads=self.num_heads, layers=self.num_layers, mlp_width=mlp_width,
                      vocab=self.vocab_size, dtype=self.dtype, remat=self.remat, qk_norm=self.qk_norm)

  @property
  def rope(self) -> RopeConfig:
    return RopeConfig(theta=self.rope_theta, scaling=self.rope_scaling, factor=self.rope_factor,
                      low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                      original_max_len=self.rope_original_max_len)


POSITIONS = ('learned', 'rope')
MLPS = {'gelu': ('gelu_tanh', False), 'swiglu': ('silu', True), 'relu2': ('relu2', False)}  # name: (activation, gated)


REMAT_POLICIES = {
    'none': None,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'full': jax.checkpoint_policies.nothing_saveable,
}


def decoder_mask(batch: int, length: int, key_valid: jax.Array | None, segment_ids: jax.Array | None,
                 cache_index: jax.Array | int | None) -> AttentionMask:
  """The causal mask of a [B, L] query block starting at `cache_index` (None: 0), with padding keys
  (key_valid [B, L_keys] bool) or packed segments (segment_ids [B, L]) when given."""
  mask = AttentionMask(causal=True, q_offset=cache_index)
  if key_valid is not None:
    # Left padding is no prefix length: the padding keys become segment 0, which no query is in.
    mask = dataclasses.replace(mask, query_segment_ids=jnp.ones((batch, length), jnp.int32),
                               key_segment_ids=key_valid.astype(jnp.int32))
  if segment_ids is not None:
    mask = dataclasses.replace(mask, query_segment_ids=segment_ids, key_segment_ids=segment_ids)
  return mask


def document_segments(tokens: jax.Array, eos_id: int) -> dict[str, jax.Array]:
  """[B, L] windows of a token stream whose documents end with `eos_id` -> the `segment_ids` and
  `positions` keyword arguments of `GPT.__call__` ([B, L] int32 each) that keep attention in each
  document (data.document_masking).

  Each EOS starts a segment and is its position 0: the EOS ending one document is the next one's
  BOS. So a document's last token predicts EOS from that document alone, the EOS predicts the next
  document's first token from itself alone, and no token reads another document; every token keeps
  its loss. The window's first segment (a document already under way) counts from 0 at the window's start.
  """
  starts = tokens == eos_id
  index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  return {'segment_ids': jnp.cumsum(starts, axis=1, dtype=jnp.int32),
          'positions': index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)}


class GPT(nnx.Module):

  def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    init = nnx.initializers.normal(0.02)
    # GPT-2 scales the init of residual-branch outputs by 1/sqrt(2 * layers).
    residual_init = nnx.initializers.normal(0.02 / (2 * config.num_layers) ** 0.5)
    self.token_embedding = vocab_embedding(config.vocab_size, config.vocab_multiple, config.width, embedding_init=init,
                                           dtype=dtype, rngs=rngs)
    if config.positions not in POSITIONS:
      raise ValueError(f'positions={config.positions!r} is not one of {POSITIONS}.')
    if config.mlp not in MLPS:
      raise ValueError(f'mlp={config.mlp!r} is not one of {tuple(MLPS)}.')
    if config.positions == 'learned':
      self.position_embedding = Embed(config.max_len, config.width, embedding_init=nnx.initializers.normal(0.01),
                                      dtype=dtype, rngs=rngs)
    # With rope the positions act inside attention: the blocks hold the [D/2] inverse frequencies.
    rope = inverse_frequencies(config.head_width, config.rope) if config.positions == 'rope' else None
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    if config.remat not in REMAT_POLICIES:
      raise ValueError(f'remat={config.remat!r} is not one of {tuple(REMAT_POLICIES)}.')
    activation, gated = MLPS[config.mlp]
    if config.scan_layers and config.moe_experts and config.moe_every != 1:
      raise ValueError(f'scan_layers stacks identical blocks: moe_every={config.moe_every} must be 1.')

    def make_block(rngs, moe: bool):
      experts = MoEFeedForward(
          config.width, config.expert_width, experts=config.moe_experts, top_k=config.moe_top_k,
          activation=activation, gated=gated, shared_experts=config.moe_shared_experts,
          capacity_factor=config.moe_capacity_factor, norm_topk_prob=config.moe_norm_topk_prob,
          router_bias=config.moe_router_bias, dropout=config.dropout, use_bias=config.use_bias, dtype=dtype,
          kernel_init=init, output_init=nnx.initializers.zeros if config.zero_init_out else residual_init,
          rngs=rngs) if moe else None
      block = TransformerBlock(
          config.width, config.num_heads, config.mlp_width, dropout=config.dropout,
          attention_dropout=config.dropout, activation=activation, pre_norm=True,
          layer_norm_epsilon=config.layer_norm_epsilon, dtype=dtype,
          attention_implementation=config.attention, norm=config.norm, gated_mlp=gated, use_bias=config.use_bias,
          num_kv_heads=config.num_kv_heads, rope=rope, qk_norm=config.qk_norm, head_dim=config.head_dim or None,
          mlp=experts, rngs=rngs)
      dense_mlp = block.mlp.shared if moe else block.mlp  # the routed experts drew their own initialisation
      mlp_inputs = () if dense_mlp is None else (dense_mlp.up,) + ((dense_mlp.gate,) if gated else ())
      for linear in (block.self_attention.query, block.self_attention.key, block.self_attention.value) + mlp_inputs:
        linear.kernel.set_value(init(rngs.params(), linear.kernel.shape))
      for linear in block.output_projections():
        linear.kernel.set_value(residual_init(rngs.params(), linear.kernel.shape))
      if config.zero_init_out:  # after the draws above, so every other parameter is the same either way
        zero_init_output_projections(block)
      return block

    if config.scan_layers:
      # One block's worth of modules whose every variable has a leading [num_layers] axis.
      make_stacked = functools.partial(make_block, moe=config.moe_experts > 0)
      self.blocks = nnx.split_rngs(splits=config.num_layers)(nnx.vmap(make_stacked, in_axes=0, out_axes=0))(rngs)
    else:
      self.blocks = nnx.List([make_block(rngs, config.is_moe_block(i)) for i in range(config.num_layers)])
    self.final_norm = norm_layer(config.norm, config.width, epsilon=config.layer_norm_epsilon,
                                 use_bias=config.use_bias, dtype=dtype, rngs=rngs)
    if not config.tie_embeddings:  # [V', E] like the token embedding, so logits and losses read either alike
      self.lm_head = vocab_embedding(config.vocab_size, config.vocab_multiple, config.width, embedding_init=init,
                                     dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               key_valid: jax.Array | None = None, segment_ids: jax.Array | None = None, cache: list | None = None,
               cache_index: jax.Array | int | None = None, deterministic: bool = True,
               return_hidden: bool = False):
    """Next-token logits.

    Args:
      tokens: [B, L] int token ids.
      positions: [B, L] position ids (default 0..L-1; left-padded prompts and packed rows pass their own).
      key_valid: [B, L_keys] bool, False on padding keys (L_keys = L, or L_max with a cache).
      segment_ids: [B, L] int, packed rows (no cache): a token attends only within its segment;
        give `positions` restarting at 0 in each segment too (`document_segments` gives both).
      cache: the key/value caches from `init_cache`, written at `cache_index`.
    Returns:
      ([B, L, V'] logits (see `logits`), updated cache or None); with `return_hidden`, the final
      [B, L, E] hidden states instead of logits.
    """
    batch, length = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(length) + (0 if cache_index is None else cache_index),
                                   (batch, length))
    x = self.token_embedding(tokens)
    if self.config.positions == 'learned':
      x = x + self.position_embedding(positions)
    x = self.dropout(x, deterministic=deterministic)
    mask = decoder_mask(batch, length, key_valid, segment_ids, cache_index)

    def run_block(block, x, layer_cache):
      return block(x, mask, positions=positions, cache=layer_cache, cache_index=cache_index,
                   deterministic=deterministic)

    # Remat decides what the backward pass keeps; decoding (a cache) has none, and its loop runs blocks
    # created outside it, which nnx.remat refuses.
    if self.config.remat != 'none' and cache is None:
      run_block = nnx.remat(run_block, policy=REMAT_POLICIES[self.config.remat])
    if self.config.scan_layers:
      # A plain lax.scan over the split state rather than nnx.scan, which refuses modules created at
      # another trace level (a model closed over by the decoding while_loop).
      graphdef, stacked = nnx.split(self.blocks)

      def scan_step(x, layer):
        block = nnx.merge(graphdef, layer['state'])
        x, layer_cache = run_block(block, x, layer['cache'])
        return x, (nnx.state(block), layer_cache)

      x, (stacked, new_cache) = jax.lax.scan(scan_step, x, {'state': stacked, 'cache': cache})
      # Dropout advanced the blocks' RNG counters; routers recording statistics sowed them (models/moe.py).
      nnx.update(self.blocks, stacked if not deterministic else nnx.filter_state(stacked, nnx.Intermediate))
    else:
      new_cache = []
      for i, block in enumerate(self.blocks):
        x, layer_cache = run_block(block, x, None if cache is None else cache[i])
        new_cache.append(layer_cache)
    x = self.final_norm(x)
    if return_hidden:
      return x, (new_cache if cache is not None else None)
    return self.logits(x), (new_cache if cache is not None else None)

  def output_embedding(self) -> jax.Array:
    """The [V', E] output matrix: the token embedding when tied, else `lm_head`."""
    return (self.token_embedding if self.config.tie_embeddings else self.lm_head).table()

  def logits(self, hidden: jax.Array, output_matrix: jax.Array | None = None) -> jax.Array:
    """[B, L, E] final hidden states -> [B, L, V'] logits in the compute dtype, soft-capped with
    `logit_softcap`, the padded ids masked (V' = the padded vocabulary; losses work in float32 themselves).

    output_matrix: the [E, V'] output layer when the caller transposed `output_embedding` once
    (decoding); default its transpose here.
    """
    head = self.output_embedding().T if output_matrix is None else output_matrix
    return vocab_logits(hidden, head, self.config.vocab_size, softcap=self.config.logit_softcap)

  def chunked_loss(self, hidden: jax.Array, targets: jax.Array, weights: jax.Array | None = None, *,
                   chunk_tokens: int, label_smoothing: float = 0.0, z_loss: float = 0.0):
    """Next-token cross-entropy of `logits(hidden)` (soft-capped as they are) computed `chunk_tokens`
    tokens at a time, never holding the [B, L, V'] logits (models/lm_head.py `chunked_lm_loss`),
    plus z_loss * log(Z)^2 per token when z_loss > 0.

    hidden: [B, L, E] from `__call__(..., return_hidden=True)`; targets: [B, L] int; weights: [B, L]
    or [B] per example (default ones). Returns (mean of cross-entropy + z-loss, {'loss' (the
    cross-entropy), 'accuracy', and with z_loss 'z_loss': (sum, count)}).
    """
    return chunked_lm_loss(hidden, self.output_embedding(), targets, weights, vocab_size=self.config.vocab_size,
                           label_smoothing=label_smoothing, chunk_tokens=chunk_tokens,
                           softcap=self.config.logit_softcap, z_loss=z_loss)

  def init_cache(self, batch: int, max_len: int) -> list[dict[str, Any]] | dict[str, Any]:
    """Per-layer {'self': {'k','v': [B, K, L_max, D]}} (K = the key/value heads): a list, or with
    scan_layers one dict of [num_layers, B, K, L_max, D] arrays."""
    dtype = jnp.dtype(self.config.dtype)
    if self.config.scan_layers:
      shape = (self.config.num_layers, batch, self.config.kv_heads, max_len, self.config.head_width)
      return {'self': {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}}
    return [{'self': block.self_attention.init_cache(batch, max_len, dtype)} for block in self.blocks]

  def router_statistics(self, recorded: list[tuple[str, RouterStatistics]]) -> RouterStatistics:
    """`models.moe.record_router_statistics`'s per-layer records of this model -> one RouterStatistics
    whose leaves lead with [M], the MoE blocks in order (`config.moe_blocks()`)."""
    by_path = dict(recorded)
    if self.config.scan_layers:
      return by_path['blocks/mlp']
    layers = [by_path[f'blocks/{i}/mlp'] for i in self.config.moe_blocks()]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)

  def update_load_bias(self, load: jax.Array, rate: float) -> None:
    """Move every MoE block's `load_bias` towards the even load (models/moe.py `updated_load_bias`),
    from `load` [M, N], the token-slots each block routed to each expert (`router_statistics`)."""
    if self.config.scan_layers:
      layers = [(self.blocks.mlp, load)]
    else:
      layers = [(self.blocks[i].mlp, load[row]) for row, i in enumerate(self.config.moe_blocks())]
    for layer, layer_load in layers:
      layer.load_bias.set_value(updated_load_bias(layer.load_bias[...], layer_load, rate))


@nnx.jit(static_argnames=('max_new_tokens', 'temperature', 'top_k', 'top_p', 'eos_id', 'pad_id'))
def generate(model: GPT, tokens: jax.Array, valid: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, eos_id: int | None, pad_id: int
             ) -> tuple[jax.Array, jax.Array]:
  """Compiled cached continuation of prompts with models/decoding.py (temperature 0: greedy).

  Args:
    tokens: [B, P] prompt ids, left-padded (`decoding.left_pad`); valid: [B, P] bool, False on
      the padding. P + max_new_tokens must not exceed config.max_len.
  Returns:
    (tokens [B, N]: new tokens, pad_id after a row's EOS; lengths [B]: new tokens up to and
    including EOS), N = max_new_tokens.
  """
  batch, prompt_len = tokens.shape
  # The output matrix, transposed once out here: inside the loop XLA would re-copy the [V, E]
  # embedding into [E, V] at every step.
  head = model.output_embedding().T

  def step_fn(step_tokens, cache, index):
    # Positions count real tokens only: a row's first real token is position 0 whatever its padding.
    positions = jnp.maximum(index + jnp.arange(step_tokens.shape[1])[None, :] - cache['padding'][:, None], 0)
    hidden, layers = model(step_tokens, positions=positions, key_valid=cache['key_valid'], cache=cache['layers'],
                           cache_index=index, return_hidden=True)
    return model.logits(hidden, head), {**cache, 'layers': layers}

  cache = {'layers': model.init_cache(batch, prompt_len + max_new_tokens),
           'key_valid': jnp.concatenate([valid, jnp.ones((batch, max_new_tokens), bool)], axis=1),  # [B, P + N]
           'padding': prompt_len - jnp.sum(valid, axis=1, dtype=jnp.int32)}  # [B] left-padding length
  result = decoding.decode(step_fn, cache, tokens, rng, max_len=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                           temperature=temperature, top_k=top_k, top_p=top_p)
  return result.tokens, result.lengths


def count_parameters(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
