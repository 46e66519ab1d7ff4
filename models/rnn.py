"""Recurrent networks: RNN (tanh), GRU and LSTM cells, a layer that scans a cell over time, and
deep / bidirectional stacks.

The gate equations are those of Dive into Deep Learning (ch. 9-10), with X_t [B, I] the input
and H_{t-1} [B, H] the previous hidden state:

  RNN:  H_t = tanh(X_t W_xh + H_{t-1} W_hh + b_h)
  GRU:  R_t = sigmoid(X_t W_xr + H_{t-1} W_hr + b_r)          reset gate
        Z_t = sigmoid(X_t W_xz + H_{t-1} W_hz + b_z)          update gate
        H~_t = tanh(X_t W_xh + (R_t * H_{t-1}) W_hh + b_h)
        H_t = Z_t * H_{t-1} + (1 - Z_t) * H~_t
  LSTM: I_t, F_t, O_t = sigmoid(X_t W_x{i,f,o} + H_{t-1} W_h{i,f,o} + b_{i,f,o})
        C~_t = tanh(X_t W_xc + H_{t-1} W_hc + b_c)
        C_t = F_t * C_{t-1} + I_t * C~_t;   H_t = O_t * tanh(C_t)

Each cell stores the per-gate matrices side by side, in the order listed above:
`input_kernel` [I, G*H] = [W_x*], `recurrent_kernel` [H, G*H] = [W_h*], `bias` [G*H]. The
input projection X W_x + b of a whole sequence is one matmul done before the time loop; only
the recurrent part runs inside `jax.lax.scan`.

A cell's carry is H_t [B, H] (RNN, GRU) or the pair (H_t, C_t) (LSTM). A stack's state stacks
the carries of all layers and directions on axis 1: [B, num_layers * num_directions, H] (a pair
of those for LSTM), index layer * num_directions + direction, so the batch axis leads every leaf
(beam search reorders states along it).

Shape legend: B batch, T time, I input width, H hidden width, G gates.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.partitioning import constrain

Carry = Any  # jax.Array [B, H], or a pair of them for LSTM


class _Cell(nnx.Module):
  """Parameters and input projection shared by the three cells; subclasses define `step`."""
  num_gates: int = 1

  def __init__(self, in_features: int, hidden: int, *, rngs: nnx.Rngs, dtype: Any = None):
    self.in_features = in_features
    self.hidden = hidden
    self.dtype = dtype
    gates = self.num_gates
    self.input_kernel = nnx.Param(
        nnx.initializers.glorot_uniform()(rngs.params(), (in_features, gates * hidden)))
    # Orthogonal recurrent matrices per gate keep the repeated H W_hh products well conditioned.
    orthogonal = nnx.initializers.orthogonal()
    self.recurrent_kernel = nnx.Param(
        jnp.concatenate([orthogonal(rngs.params(), (hidden, hidden)) for _ in range(gates)], axis=1))
    self.bias = nnx.Param(self.initial_bias())

  def initial_bias(self) -> jax.Array:
    return jnp.zeros((self.num_gates * self.hidden,))

  def _cast(self, x: jax.Array) -> jax.Array:
    return x if self.dtype is None else x.astype(self.dtype)

  def initial_carry(self, batch: int) -> Carry:
    return jnp.zeros((batch, self.hidden), self.dtype or jnp.float32)

  def _whole(self, kernel: nnx.Param) -> jax.Array:
    """A kernel in the compute dtype, whole on every device (gathered where FSDP splits it): the
    [B, ...] activations it multiplies stay split by batch, also inside the time loop, where a
    split kernel would move the state or partial products at every step."""
    return self._cast(constrain(kernel[...], (None, None)))

  def recurrent_matrix(self) -> jax.Array:
    """[H, G*H] W_h*, whole (`_whole`)."""
    return self._whole(self.recurrent_kernel)

  def project_inputs(self, x: jax.Array) -> jax.Array:
    """[..., I] -> [..., G*H]: X W_x + b for every gate (no dependence on time order)."""
    return self._cast(x) @ self._whole(self.input_kernel) + self._cast(self.bias[...])

  def step(self, carry: Carry, projected: jax.Array) -> tuple[Carry, jax.Array]:
    """One time step from projected inputs [B, G*H] -> (new carry, output H_t [B, H])."""
    raise NotImplementedError

  def __call__(self, carry: Carry, x: jax.Array) -> tuple[Carry, jax.Array]:
    """One time step from raw inputs x [B, I] -> (new carry, output H_t [B, H])."""
    return self.step(carry, self.project_inputs(x))


class RNNCell(_Cell):
  """Elman RNN cell with tanh: H_t = tanh(X_t W_xh + H_{t-1} W_hh + b_h)."""
  num_gates = 1

  def step(self, carry, projected):
    h = jnp.tanh(projected + carry @ self.recurrent_matrix())
    return h, h


class GRUCell(_Cell):
  """GRU cell; gate blocks in the kernels: reset R, update Z, candidate H~."""
  num_gates = 3

  def step(self, carry, projected):
    w_h = self.recurrent_matrix()
    size = self.hidden
    gates = jax.nn.sigmoid(projected[:, :2 * size] + carry @ w_h[:, :2 * size])
    reset, update = gates[:, :size], gates[:, size:]
    # The reset gate multiplies H_{t-1} before its matmul (D2L / Cho et al.), so this
    # matmul cannot be fused with the gates' one.
    candidate = jnp.tanh(projected[:, 2 * size:] + (reset * carry) @ w_h[:, 2 * size:])
    h = update * carry + (1.0 - update) * candidate
    return h, h


class LSTMCell(_Cell):
  """LSTM cell; gate blocks in the kernels: input I, forget F, output O, candidate C~."""
  num_gates = 4

  def initial_bias(self):
    # Forget-gate bias 1 (Jozefowicz et al., 2015): the cell keeps its memory by default
    # early in training instead of halving it every step.
    size = self.hidden
    return jnp.zeros((4 * size,)).at[size:2 * size].set(1.0)

  def initial_carry(self, batch):
    zeros = jnp.zeros((batch, self.hidden), self.dtype or jnp.float32)
    return zeros, zeros

  def step(self, carry, projected):
    h, c = carry
    size = self.hidden
    z = projected + h @ self.recurrent_matrix()
    input_gate, forget_gate, output_gate = (jax.nn.sigmoid(z[:, k * size:(k + 1) * size]) for k in range(3))
    candidate = jnp.tanh(z[:, 3 * size:])
    c = forget_gate * c + input_gate * candidate
    h = output_gate * jnp.tanh(c)
    return (h, c), h


CELLS = {'rnn': RNNCell, 'gru': GRUCell, 'lstm': LSTMCell}


def make_cell(kind: str, in_features: int, hidden: int, *, rngs: nnx.Rngs, dtype: Any = None) -> _Cell:
  if kind not in CELLS:
    raise ValueError(f'Unknown RNN cell {kind!r}; choose one of {sorted(CELLS)}.')
  return CELLS[kind](in_features, hidden, rngs=rngs, dtype=dtype)


# Logical axes: the time-major projected inputs [T, B, G*H] and a carry [B, H], split by batch.
_TIME_MAJOR = ('length', 'batch', 'hidden')
_STATE = ('batch', 'hidden')


def run_cell(cell: _Cell, x: jax.Array, carry: Carry | None = None, mask: jax.Array | None = None,
             *, reverse: bool = False) -> tuple[jax.Array, Carry]:
  """Scan `cell` over the time axis of x [B, T, I].

  Args:
    carry: initial carry (None: zeros).
    mask: [B, T] bool, False on padding. A padded step leaves the carry unchanged and outputs
      zeros, so the final carry is the one after each sequence's last real token, and a
      reversed run starts at that token.
    reverse: run from t = T-1 down to 0 (outputs stay in input order).
  Returns:
    (outputs [B, T, H], final carry).
  """
  batch, length = x.shape[:2]
  if carry is None:
    carry = cell.initial_carry(batch)
  if mask is None:
    mask = jnp.ones((batch, length), bool)
  projected = constrain(jnp.swapaxes(cell.project_inputs(x), 0, 1), _TIME_MAJOR)  # [T, B, G*H]
  steps_mask = jnp.swapaxes(mask, 0, 1)[..., None]  # [T, B, 1]

  def body(carry, inputs):
    projected_t, valid_t = inputs
    new_carry, out = cell.step(carry, projected_t)
    carry = jax.tree.map(lambda new, old: constrain(jnp.where(valid_t, new, old), _STATE), new_carry, carry)
    return carry, jnp.where(valid_t, out, 0).astype(out.dtype)

  carry, outputs = jax.lax.scan(body, carry, (projected, steps_mask), reverse=reverse)
  return constrain(jnp.swapaxes(outputs, 0, 1), ('batch', 'length', 'hidden')), carry


def _stack(carries: list[Carry]) -> Carry:
  return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *carries)


def _select(state: Carry, index: int) -> Carry:
  return jax.tree.map(lambda s: s[:, index], state)


class StackedRNN(nnx.Module):
  """`num_layers` recurrent layers, each optionally bidirectional; layer k+1 reads layer k's outputs.

  Dropout acts between layers (not on the last layer's outputs) with one mask per sequence,
  shared by all time steps (variational dropout, Gal & Ghahramani 2016): a whole-sequence run and
  a step-by-step run (`step`, used by decoders) then apply the same kind of noise.

  Call: x [B, T, I], state (None: zeros), mask [B, T] bool
  -> (outputs [B, T, num_directions * H], final state).
  """

  def __init__(self, cell: str, in_features: int, hidden: int, *, rngs: nnx.Rngs, num_layers: int = 1,
               bidirectional: bool = False, dropout: float = 0.0, dtype: Any = None):
    if num_layers < 1:
      raise ValueError(f'num_layers must be >= 1, got {num_layers}.')
    self.hidden = hidden
    self.num_layers = num_layers
    self.num_directions = 2 if bidirectional else 1
    cells = []
    for layer in range(num_layers):
      width = in_features if layer == 0 else self.num_directions * hidden
      cells.extend(make_cell(cell, width, hidden, rngs=rngs, dtype=dtype) for _ in range(self.num_directions))
    self.cells = nnx.List(cells)
    self.dropout = nnx.Dropout(dropout, broadcast_dims=(1,), rngs=rngs)

  @property
  def output_features(self) -> int:
    return self.num_directions * self.hidden

  def initial_state(self, batch: int) -> Carry:
    return _stack([cell.initial_carry(batch) for cell in self.cells])

  def __call__(self, x: jax.Array, state: Carry | None = None, mask: jax.Array | None = None, *,
               deterministic: bool = True) -> tuple[jax.Array, Carry]:
    if state is None:
      state = self.initial_state(x.shape[0])
    finals = []
    for layer in range(self.num_layers):
      if layer > 0:
        x = self.dropout(x, deterministic=deterministic)
      outputs = []
      for direction in range(self.num_directions):
        index = layer * self.num_directions + direction
        out, final = run_cell(self.cells[index], x, _select(state, index), mask, reverse=direction == 1)
        outputs.append(out)
        finals.append(final)
      x = jnp.concatenate(outputs, axis=-1) if len(outputs) > 1 else outputs[0]
    return x, _stack(finals)

  def dropout_masks(self, batch: int, *, deterministic: bool) -> list[jax.Array] | None:
    """Per-sequence masks [B, H] for the inputs of layers 1.., already scaled by 1/(1-rate).

    Drawn once outside a time loop and passed to every `step`, because random state cannot be
    advanced inside `jax.lax.scan`. None when there is nothing to drop.
    """
    if deterministic or self.dropout.rate == 0 or self.num_layers == 1:
      return None
    ones = jnp.ones((batch, 1, self.hidden))
    return [self.dropout(ones, deterministic=False)[:, 0] for _ in range(self.num_layers - 1)]

  def step(self, x: jax.Array, state: Carry, dropout_masks: list[jax.Array] | None = None
           ) -> tuple[jax.Array, Carry]:
    """One time step through all layers (unidirectional stacks only): x [B, I] -> ([B, H], state)."""
    if self.num_directions != 1:
      raise ValueError('StackedRNN.step runs one time step forward; a bidirectional stack needs '
                       'the whole sequence (call the module instead).')
    finals = []
    for layer, cell in enumerate(self.cells):
      if layer > 0 and dropout_masks is not None:
        x = x * dropout_masks[layer - 1].astype(x.dtype)
      carry, x = cell(_select(state, layer), x)
      finals.append(carry)
    return x, _stack(finals)
