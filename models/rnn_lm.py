"""Recurrent language model (D2L ch. 9.5-10.3): embedding, RNN/GRU/LSTM stack, linear output layer.

For training by sequential partitioning (truncated backpropagation through time) the model can
hold the hidden state carried from one batch to the next in a `CarriedState` variable, which the
trainer keeps with the rest of the non-parameter model state (and checkpoints).

Shape legend: B batch, T time, E embedding, H hidden, L layers, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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
    self.embedding = nnx.Embed(config.vocab_size, config.embed, dtype=dtype, rngs=rngs)
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
    return self.output(outputs).astype(jnp.float32), state
