"""Recurrent language model (D2L ch. 9.5-10.3): embedding, RNN/GRU/LSTM stack, linear output layer.

For training by sequential partitioning (truncated backpropagation through time) the model can
hold the hidden state carried from one batch to the next in a `CarriedState` variable, which the
trainer keeps with the rest of the non-parameter model state (and checkpoints).

`generate` continues prompts through the shared decoding loop (models/decoding.py).

Shape legend: B batch, T time, E embedding, H hidden, L layers, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import decoding
from models.layers import Embed
from models.partitioning import constrain
from models.rnn import StackedRNN


@dataclasses.dataclass(frozen=True)
class RNNLMConfig:
  vocab_size: int
  cell: str = 'gru'  # 'rnn' | 'gru' | 'lstm'
  embed: int = 64
  hidden: int = 256
  num_layers: int = 1
  dropout: float = 0.0
  dtype: str = 'float32'
  carried_batch: int = 0  # > 0: hold the state carried between batches of that many streams (CarriedState)


class CarriedState(nnx.Variable):
  """The RNN state at the end of the previous training batch (sequential partitioning)."""


class RNNLM(nnx.Module):
  """Next-token model. `config.carried_batch` > 0 adds a `CarriedState` for that many streams."""

  def __init__(self, config: RNNLMConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    self.embedding = Embed(config.vocab_size, config.embed, dtype=dtype, rngs=rngs)
    self.rnn = StackedRNN(config.cell, config.embed, config.hidden, num_layers=config.num_layers,
                          dropout=config.dropout, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    self.output = nnx.Linear(config.hidden, config.vocab_size, dtype=dtype, rngs=rngs)
    self.carried = CarriedState(self.rnn.initial_state(config.carried_batch)) if config.carried_batch else None

  def initial_state(self, batch: int) -> Any:
    return self.rnn.initial_state(batch)

  def __call__(self, tokens: jax.Array, state: Any = None, mask: jax.Array | None = None, *,
               deterministic: bool = True) -> tuple[jax.Array, Any]:
    """tokens [B, T] -> (logits [B, T, V] float32, final state).

    state: the RNN state to start from (None: zeros); mask [B, T] bool: False on (left) padding,
    which leaves the state unchanged.
    """
    x = self.dropout(self.embedding(tokens), deterministic=deterministic)
    outputs, state = self.rnn(x, state, mask, deterministic=deterministic)
    outputs = self.dropout(outputs, deterministic=deterministic)
    return constrain(self.output(outputs), ('batch', 'length', 'vocab')).astype(jnp.float32), state


@nnx.jit(static_argnames=('max_new_tokens', 'temperature', 'top_k', 'top_p', 'eos_id', 'pad_id'))
def generate(model: RNNLM, tokens: jax.Array, valid: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, eos_id: int | None, pad_id: int
             ) -> tuple[jax.Array, jax.Array]:
  """Compiled continuation of prompts with models/decoding.py (temperature 0: greedy).

  Args:
    tokens: [B, P] prompt ids, left-padded (`decoding.left_pad`); valid: [B, P] bool, False on
      the padding, whose steps leave the RNN state unchanged.
  Returns:
    (tokens [B, N]: new tokens, pad_id after a row's EOS; lengths [B]: new tokens up to and
    including EOS), N = max_new_tokens.
  """
  batch, _ = tokens.shape

  def step_fn(step_tokens, cache, index):
    mask = jax.lax.dynamic_slice_in_dim(cache['valid'], index, step_tokens.shape[1], axis=1)
    logits, state = model(step_tokens, cache['state'], mask)
    return logits, {**cache, 'state': state}

  # The RNN state is the whole memory; 'valid' [B, P + N] masks the prompt's padding.
  cache = {'state': model.initial_state(batch),
           'valid': jnp.concatenate([valid, jnp.ones((batch, max_new_tokens), bool)], axis=1)}
  result = decoding.decode(step_fn, cache, tokens, rng, max_len=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                           temperature=temperature, top_k=top_k, top_p=top_p)
  return result.tokens, result.lengths
