"""RNN encoder-decoder for sequence-to-sequence learning (D2L ch. 10.7 and 11.4).

Encoder: embedding + multi-layer GRU over the source; padded source steps leave the state
unchanged, so the final state is the one after each sentence's last real token.

Decoder: multi-layer GRU started from the encoder's final state. Each step reads
[embedding of the previous target token; context] where the context is
  attention_type='none':      the encoder's final top-layer state, the same at every step;
  attention_type='bahdanau':  additive attention (Bahdanau et al., 2015) of the decoder's previous
                              top-layer state over all encoder outputs, masked to the real source
                              tokens (models.attention.AdditiveAttention).
Training (teacher forcing) and decoding run the same `_step`, under `jax.lax.scan` for a whole
target and over the tokens of each call in `decode_step`, the step function of models/decoding.py,
through which `translate` decodes greedily or with beam search.

Shape legend: B batch, S source length, T target length, E embedding, H hidden, L layers,
V target vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import decoding
from models.attention import AdditiveAttention
from models.layers import Embed
from models.partitioning import constrain
from models.rnn import StackedRNN

ATTENTION_TYPES = ('none', 'bahdanau')


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
  src_vocab_size: int
  tgt_vocab_size: int
  embed: int = 32
  hidden: int = 64
  num_layers: int = 2
  dropout: float = 0.1
  attention_type: str = 'none'
  attention_hidden: int = 0  # width of the additive score's tanh layer; 0 = hidden
  dtype: str = 'float32'


class Seq2Seq(nnx.Module):
  """GRU encoder-decoder, with or without Bahdanau attention.

  The decoding state is a dict whose leaves all have the batch axis first:
    'hidden' [B, L, H] decoder GRU state;
    'context' [B, H] (no attention) or 'memory' [B, S, H] + 'memory_valid' [B, S] (Bahdanau).
  """

  def __init__(self, config: Seq2SeqConfig, *, rngs: nnx.Rngs):
    if config.attention_type not in ATTENTION_TYPES:
      raise ValueError(f'Unknown model.attention_type {config.attention_type!r}; choose one of {ATTENTION_TYPES}.')
    self.config = config
    dtype = jnp.dtype(config.dtype)
    e, h = config.embed, config.hidden
    rnn = dict(num_layers=config.num_layers, dropout=config.dropout, dtype=dtype, rngs=rngs)
    self.src_embedding = Embed(config.src_vocab_size, e, dtype=dtype, rngs=rngs)
    self.encoder = StackedRNN('gru', e, h, **rnn)
    self.tgt_embedding = Embed(config.tgt_vocab_size, e, dtype=dtype, rngs=rngs)
    self.attention = (AdditiveAttention(h, h, config.attention_hidden or h, dtype=dtype, rngs=rngs)
                      if config.attention_type == 'bahdanau' else None)
    self.decoder = StackedRNN('gru', e + h, h, **rnn)
    self.output = nnx.Linear(h, config.tgt_vocab_size, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

  def encode(self, src: jax.Array, src_valid: jax.Array, *, deterministic: bool = True) -> dict[str, jax.Array]:
    """src [B, S] ids, src_valid [B, S] bool -> the initial decoding state."""
    embedded = self.dropout(self.src_embedding(src), deterministic=deterministic)
    memory, hidden = self.encoder(embedded, mask=src_valid, deterministic=deterministic)
    if self.attention is None:
      return {'hidden': hidden, 'context': hidden[:, -1]}
    return {'hidden': hidden, 'memory': memory, 'memory_valid': src_valid}

  def _step(self, embedded: jax.Array, state: dict[str, jax.Array], dropout_masks=None):
    """One decoder step: embedded [B, E] -> (top-layer output [B, H], state, weights [B, S] or None)."""
    if self.attention is None:
      context, weights = state['context'], None
    else:
      query = state['hidden'][:, -1:]  # the previous step's top-layer state, [B, 1, H]
      context, weights = self.attention(query, state['memory'], state['memory'], state['memory_valid'])
      context, weights = context[:, 0], weights[:, 0]
    inputs = constrain(jnp.concatenate([embedded, context.astype(embedded.dtype)], axis=-1), ('batch', None))
    out, hidden = self.decoder.step(inputs, state['hidden'], dropout_masks)
    hidden = constrain(hidden, ('batch', None, 'hidden'))  # [B, L, H]
    return constrain(out, ('batch', 'hidden')), {**state, 'hidden': hidden}, weights

  def decode_step(self, tokens: jax.Array, state: dict[str, jax.Array], index: Any = None):
    """The `step_fn` of models/decoding.py: tokens [N, T] -> (logits [N, T, V] float32, new state).
    `index` is unused: the recurrent state already knows the position."""
    def body(state, embedded_t):
      out, state, _ = self._step(embedded_t, state)
      return state, out

    state, outputs = jax.lax.scan(body, state, jnp.swapaxes(self.tgt_embedding(tokens), 0, 1))
    return self.output(jnp.swapaxes(outputs, 0, 1)).astype(jnp.float32), state

  def __call__(self, src: jax.Array, src_valid: jax.Array, tgt_in: jax.Array, *, deterministic: bool = True):
    """Teacher forcing: tgt_in [B, T] (BOS + target without its last token)
    -> (logits [B, T, V] float32, attention weights [B, T, S] or None)."""
    state = self.encode(src, src_valid, deterministic=deterministic)
    embedded = self.dropout(self.tgt_embedding(tgt_in), deterministic=deterministic)
    masks = self.decoder.dropout_masks(tgt_in.shape[0], deterministic=deterministic)

    # Only the GRU state is carried: the encoder outputs stay loop-invariant, so XLA can hoist
    # work on them (the attention's key projection) out of the time loop.
    def body(hidden, embedded_t):
      out, new_state, weights = self._step(embedded_t, {**state, 'hidden': hidden}, masks)
      return new_state['hidden'], (out, weights)

    _, (outputs, weights) = jax.lax.scan(body, state['hidden'], jnp.swapaxes(embedded, 0, 1))
    outputs = self.dropout(jnp.swapaxes(outputs, 0, 1), deterministic=deterministic)
    logits = constrain(self.output(outputs), ('batch', 'length', 'vocab')).astype(jnp.float32)
    return logits, (None if weights is None else jnp.swapaxes(weights, 0, 1))


@nnx.jit(static_argnames=('bos_id', 'eos_id', 'pad_id', 'max_len', 'beam_size', 'alpha', 'max_len_ratio',
                          'max_len_offset'))
def translate(model: Seq2Seq, source: jax.Array, *, bos_id: int, eos_id: int, pad_id: int, max_len: int,
              beam_size: int, alpha: float, max_len_ratio: float, max_len_offset: int = 10
              ) -> tuple[jax.Array, jax.Array]:
  """Compiled batched decoding: [B, S] padded source ids -> ([B, max_len] best output ids, [B] scores).

  Output rows end with EOS and are padded with pad_id; each row may generate at most
  max_len_ratio * (its source length) + max_len_offset tokens (and max_len). beam_size <= 1
  decodes greedily (the score is then the log-probability, without length penalty).
  """
  source_valid = source != pad_id
  state = model.encode(source, source_valid)
  limits = decoding.max_lengths_for(source_valid.sum(-1), max_len_ratio, max_len_offset, max_len)
  bos = jnp.full((source.shape[0], 1), bos_id, jnp.int32)
  if beam_size <= 1:
    result = decoding.decode(model.decode_step, state, bos, max_len=max_len, eos_id=eos_id, pad_id=pad_id,
                             max_lengths=limits)
    return result.tokens, result.logprobs
  result = decoding.beam_search(model.decode_step, state, bos, beam_size=beam_size, max_len=max_len, eos_id=eos_id,
                                pad_id=pad_id, alpha=alpha, max_lengths=limits)
  return result.tokens[:, 0], result.scores[:, 0]
