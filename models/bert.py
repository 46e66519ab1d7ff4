"""BERT: a bidirectional Transformer encoder with masked-LM, next-sentence and classification heads.

Input is WordPiece ids `[CLS] A [SEP] (B [SEP])`; the embedding is token + learned position +
segment (A = 0, B = 1), then LayerNorm and dropout. The encoder is a stack of post-LN GELU blocks
(`models.layers.TransformerBlock`) and a pooler (dense + tanh on the [CLS] vector). Heads:
masked LM (dense + GELU + LayerNorm + output projection tied to the token embedding, with its own
bias), next-sentence prediction (2-way on the pooled vector) and sequence classification.

`BertConfig` defaults are BERT-base; with vocabulary 30,522 and 512 positions `BertEncoder` has
109,482,240 parameters, exactly `transformers.BertModel`'s (large: 335,141,888). `vocab_multiple`
pads the token embedding and the MLM bias (models/layers.py): run configs use 128, so BERT-base
stores 30,592 rows, 53,760 more parameters (zero, never used: their logits are masked); the
default 1 (no padding) is what a model.json without the field means. Parameter names follow the structure
of Hugging Face's BERT closely enough for `interop.hf_bert` to map them one to one.

Shape legend: B batch, L length, E width, V vocabulary, V' padded vocabulary, P masked positions,
C classes.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import AttentionMask
from models.layers import (ACTIVATIONS, BlockShape, Embed, TransformerBlock, padded_vocab_size, vocab_embedding,
                           zero_init_output_projections)
from models.lm_head import vocab_logits
from models.partitioning import constrain


HEADS = ('pretraining', 'classifier', 'none')


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: int = 30522  # the tokenizer's ids; the embedding has padded_vocab_size(vocab_size, vocab_multiple) rows
  vocab_multiple: int = 1
  max_len: int = 512
  type_vocab_size: int = 2
  num_layers: int = 12
  num_heads: int = 12
  width: int = 768
  mlp_dim: int = 3072
  dropout: float = 0.1
  attention_dropout: float = 0.1
  layer_norm_epsilon: float = 1e-12
  activation: str = 'gelu'  # a key of models.layers.ACTIVATIONS
  init_std: float = 0.02
  dtype: str = 'float32'
  attention: str = 'xla'
  qk_norm: bool = False  # RMSNorm of query and key heads (models/attention.py); no Hugging Face BERT has it
  zero_init_out: bool = False  # attention output and FFN down projections start at zero
  heads: str = 'none'  # what `build_bert` adds to the encoder: 'pretraining' | 'classifier' | 'none'
  num_classes: int = 0  # 'classifier' heads
  labels: tuple[str, ...] = ()  # 'classifier' heads: class names in logit order

  def __post_init__(self):
    if self.heads not in HEADS:
      raise ValueError(f'heads={self.heads!r} is not one of {HEADS}.')
    if self.labels and len(self.labels) != self.num_classes:
      raise ValueError(f'{len(self.labels)} label names for num_classes={self.num_classes}.')

  def block_shape(self) -> BlockShape:
    return BlockShape(width=self.width, heads=self.num_heads, layers=self.num_layers, mlp_width=self.mlp_dim,
                      vocab=self.vocab_size, dtype=self.dtype, qk_norm=self.qk_norm)


class BertOutput(NamedTuple):
  """sequence: [B, L, E] last layer; pooled: [B, E]; hidden_states: num_layers + 1 arrays [B, L, E]
  (the embedding output, then each block's output)."""
  sequence: jax.Array
  pooled: jax.Array
  hidden_states: tuple[jax.Array, ...]


class BertPretrainingOutput(NamedTuple):
  """mlm_logits: [B, P, V'] in the compute dtype, padded ids masked (or [B, L, V'] without masked
  positions); nsp_logits: [B, 2] float32."""
  mlm_logits: jax.Array
  nsp_logits: jax.Array
  encoder: BertOutput


def _reinit_linears(module: nnx.Module, init, rngs: nnx.Rngs) -> None:
  """BERT initialises every dense kernel from N(0, init_std) (truncated); biases stay zero."""
  for _, m in nnx.iter_modules(module):
    if isinstance(m, nnx.Linear):
      m.kernel.set_value(init(rngs.params(), m.kernel.shape, m.kernel.dtype))


class BertEmbeddings(nnx.Module):
  """tokens, segments: [B, L] ints -> [B, L, E], positions 0..L-1.

  Only the token lookup is a gather (its gradient a scatter-add into [V', E]); positions are a
  slice of their table and segments a one-hot product, whose gradients are a sum over the batch
  and a small matmul rather than two more scatter-adds.
  """

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    init = nnx.initializers.truncated_normal(config.init_std)
    embed = lambda n: nnx.Embed(n, config.width, embedding_init=init, dtype=dtype, rngs=rngs)
    self.token = vocab_embedding(config.vocab_size, config.vocab_multiple, config.width, embedding_init=init,
                                 dtype=dtype, rngs=rngs)
    self.position = embed(config.max_len)
    self.segment = embed(config.type_vocab_size)
    self.norm = nnx.LayerNorm(config.width, epsilon=config.layer_norm_epsilon, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

  def __call__(self, tokens, segments, *, deterministic: bool = True):
    dtype = self.position.dtype
    positions = self.position.embedding[:tokens.shape[1]].astype(dtype)  # [L, E]
    segment_one_hot = jax.nn.one_hot(segments, self.segment.num_embeddings, dtype=dtype)  # [B, L, type_vocab_size]
    segment = jnp.einsum('bls,se->ble', segment_one_hot, self.segment.embedding[...].astype(dtype),
                         precision=jax.lax.Precision.HIGHEST)  # exact: no reduced-precision passes of the table
    x = self.token(tokens) + positions + segment
    return self.dropout(self.norm(x), deterministic=deterministic)


class BertEncoder(nnx.Module):
  """Embeddings, post-LN blocks and the pooler: the part shared by every BERT head."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    self.embeddings = BertEmbeddings(config, rngs=rngs)
    self.blocks = nnx.List([
        TransformerBlock(config.width, config.num_heads, config.mlp_dim, dropout=config.dropout,
                         attention_dropout=config.attention_dropout, activation=config.activation, pre_norm=False,
                         layer_norm_epsilon=config.layer_norm_epsilon, dtype=dtype,
                         attention_implementation=config.attention, qk_norm=config.qk_norm, rngs=rngs)
        for _ in range(config.num_layers)])
    self.pooler = nnx.Linear(config.width, config.width, dtype=dtype, rngs=rngs)
    _reinit_linears(self, nnx.initializers.truncated_normal(config.init_std), rngs)
    if config.zero_init_out:  # after the re-initialisation, which would overwrite it
      for block in self.blocks:
        zero_init_output_projections(block)

  def __call__(self, tokens: jax.Array, segments: jax.Array | None = None, valid: jax.Array | None = None,
               *, deterministic: bool = True) -> BertOutput:
    """Encode a batch.

    Args:
      tokens: [B, L] ids. segments: [B, L] 0/1 sentence ids (None: all 0).
      valid: [B, L] bool, False on padding, which follows the real tokens (None: no padding).
        Padded positions are never attended to; their own outputs are computed but meaningless.
    """
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f'Sequence length {length} exceeds the {self.config.max_len} learned positions '
                       f'(model.max_len); shorten data.seq_len.')
    segments = jnp.zeros_like(tokens) if segments is None else segments
    x = self.embeddings(tokens, segments, deterministic=deterministic)
    mask = AttentionMask(key_lengths=valid.sum(-1)) if valid is not None else None
    hidden_states = [x]
    for block in self.blocks:
      x, _ = block(x, mask, deterministic=deterministic)
      hidden_states.append(x)
    # The [CLS] vectors stay split by batch: XLA would rather gather these small activations than the pooler's kernel.
    pooled = jnp.tanh(self.pooler(constrain(x[:, 0], ('batch', 'embed'))))
    return BertOutput(x, pooled, tuple(hidden_states))


class BertMLMHead(nnx.Module):
  """[..., E] hidden -> [..., V'] logits in the compute dtype through the (tied) token embedding plus
  a per-token bias, the padded ids masked (models/lm_head.py `vocab_logits`)."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.dense = nnx.Linear(config.width, config.width, dtype=dtype, rngs=rngs,
                            kernel_init=nnx.initializers.truncated_normal(config.init_std))
    self.activation = ACTIVATIONS[config.activation]
    self.norm = nnx.LayerNorm(config.width, epsilon=config.layer_norm_epsilon, dtype=dtype, rngs=rngs)
    self.vocab_size = config.vocab_size
    self.bias = nnx.Param(jnp.zeros((padded_vocab_size(config.vocab_size, config.vocab_multiple),), jnp.float32))

  def __call__(self, x: jax.Array, token_embedding: Embed) -> jax.Array:
    h = self.norm(self.activation(self.dense(x)))
    return vocab_logits(h, token_embedding.table().T, self.vocab_size, bias=self.bias[...])


class BertForPretraining(nnx.Module):
  """Encoder + masked-LM head + next-sentence head."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.encoder = BertEncoder(config, rngs=rngs)
    self.mlm = BertMLMHead(config, rngs=rngs)
    self.nsp = nnx.Linear(config.width, 2, dtype=jnp.dtype(config.dtype), rngs=rngs,
                          kernel_init=nnx.initializers.truncated_normal(config.init_std))

  def __call__(self, tokens, segments=None, valid=None, *, masked_positions: jax.Array | None = None,
               deterministic: bool = True) -> BertPretrainingOutput:
    """masked_positions: [B, P] indices into L where MLM logits are wanted (None: all positions).
    Projecting only the ~15% chosen positions onto the vocabulary saves most of the head's cost."""
    out = self.encoder(tokens, segments, valid, deterministic=deterministic)
    hidden = out.sequence
    if masked_positions is not None:
      # [B, P, L] one-hot x [B, L, E] rather than take_along_axis: the gradient is a batched matmul
      # instead of a scatter-add into [B, L, E], slow on GPUs. P ~ 0.15 L, so the product costs
      # 2 B P L E FLOPs, little beside the encoder.
      select = jax.nn.one_hot(masked_positions, hidden.shape[1], dtype=hidden.dtype)
      hidden = jnp.einsum('bpl,ble->bpe', select, hidden, precision=jax.lax.Precision.HIGHEST)
    mlm_logits = self.mlm(hidden, self.encoder.embeddings.token)
    nsp_logits = self.nsp(out.pooled).astype(jnp.float32)
    return BertPretrainingOutput(mlm_logits, nsp_logits, out)


class BertClassifier(nnx.Module):
  """Encoder + dropout + linear layer on the pooled [CLS] vector: [B, L] -> [B, C] logits."""

  def __init__(self, config: BertConfig, num_classes: int, *, rngs: nnx.Rngs):
    self.config = config
    self.encoder = BertEncoder(config, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    self.classifier = nnx.Linear(config.width, num_classes, dtype=jnp.dtype(config.dtype), rngs=rngs,
                                 kernel_init=nnx.initializers.truncated_normal(config.init_std))

  def __call__(self, tokens, segments=None, valid=None, *, deterministic: bool = True) -> jax.Array:
    pooled = self.encoder(tokens, segments, valid, deterministic=deterministic).pooled
    return self.classifier(self.dropout(pooled, deterministic=deterministic)).astype(jnp.float32)


def build_bert(config: BertConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The model `config.heads` names: BertForPretraining, BertClassifier or the bare BertEncoder."""
  if config.heads == 'pretraining':
    return BertForPretraining(config, rngs=rngs)
  if config.heads == 'classifier':
    return BertClassifier(config, config.num_classes, rngs=rngs)
  return BertEncoder(config, rngs=rngs)
