"""RNN, GRU and LSTM cells against a NumPy transcription of the D2L equations, and the layers built on them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.rnn import GRUCell, LSTMCell, RNNCell, StackedRNN, run_cell

B, T, I, H = 3, 6, 5, 4


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def gate_weights(cell, names):
  """Split the fused kernels into D2L's named matrices (W_x?, W_h?, b_?) per gate."""
  w_x, w_h, b = (np.asarray(p[...], np.float64) for p in (cell.input_kernel, cell.recurrent_kernel, cell.bias))
  return {name: (w_x[:, k * H:(k + 1) * H], w_h[:, k * H:(k + 1) * H], b[k * H:(k + 1) * H])
          for k, name in enumerate(names)}


def numpy_step(kind, cell, x, carry):
  """One step of the chapter's equations in float64 NumPy."""
  if kind == 'rnn':
    (w_xh, w_hh, b_h), = gate_weights(cell, ['h']).values()
    h = np.tanh(x @ w_xh + carry @ w_hh + b_h)
    return h, h
  if kind == 'gru':
    w = gate_weights(cell, ['r', 'z', 'h'])
    r = sigmoid(x @ w['r'][0] + carry @ w['r'][1] + w['r'][2])
    z = sigmoid(x @ w['z'][0] + carry @ w['z'][1] + w['z'][2])
    h_tilde = np.tanh(x @ w['h'][0] + (r * carry) @ w['h'][1] + w['h'][2])
    h = z * carry + (1 - z) * h_tilde
    return h, h
  w = gate_weights(cell, ['i', 'f', 'o', 'c'])
  h, c = carry
  i, f, o = (sigmoid(x @ w[g][0] + h @ w[g][1] + w[g][2]) for g in 'ifo')
  c_tilde = np.tanh(x @ w['c'][0] + h @ w['c'][1] + w['c'][2])
  c = f * c + i * c_tilde
  h = o * np.tanh(c)
  return (h, c), h


CELLS = {'rnn': RNNCell, 'gru': GRUCell, 'lstm': LSTMCell}


def make(kind, seed=0, in_features=I):
  cell = CELLS[kind](in_features, H, rngs=nnx.Rngs(seed))
  # Non-zero biases so that a bias in the wrong gate block is caught.
  cell.bias[...] = jax.random.normal(jax.random.key(seed + 100), cell.bias.shape)
  return cell


def random_carry(kind, rng):
  h = rng.normal(size=(B, H))
  return (h, rng.normal(size=(B, H))) if kind == 'lstm' else h


@pytest.mark.parametrize('kind', ['rnn', 'gru', 'lstm'])
def test_cell_step_matches_numpy_equations(kind):
  rng = np.random.default_rng(0)
  cell = make(kind)
  x = rng.normal(size=(B, I))
  carry = random_carry(kind, rng)
  expected_carry, expected_out = numpy_step(kind, cell, x, carry)
  to_jax = lambda a: jnp.asarray(a, jnp.float32)
  new_carry, out = cell(jax.tree.map(to_jax, carry), to_jax(x))
  np.testing.assert_allclose(out, expected_out, atol=1e-5)
  for got, want in zip(jax.tree.leaves(new_carry), jax.tree.leaves(expected_carry)):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize('kind', ['gru', 'lstm'])
def test_scan_with_padding_matches_numpy_loop(kind):
  """Over a sequence, padded steps leave the carry alone and output zeros."""
  rng = np.random.default_rng(1)
  cell = make(kind, seed=1)
  x = rng.normal(size=(B, T, I))
  lengths = np.array([T, 3, 1])
  mask = np.arange(T)[None] < lengths[:, None]
  outputs, final = run_cell(cell, jnp.asarray(x, jnp.float32), mask=jnp.asarray(mask))
  for b in range(B):
    carry = jax.tree.map(lambda a: a[b:b + 1], random_carry(kind, rng))
    carry = jax.tree.map(np.zeros_like, carry)
    for t in range(lengths[b]):
      carry, out = numpy_step(kind, cell, x[b:b + 1, t], carry)
      np.testing.assert_allclose(outputs[b, t], out[0], atol=1e-5)
    np.testing.assert_allclose(outputs[b, lengths[b]:], 0.0)
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(carry)):
      np.testing.assert_allclose(got[b], want[0], atol=1e-5)


def test_bidirectional_is_forward_run_concat_reversed_backward_run():
  rnn = StackedRNN('gru', I, H, bidirectional=True, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(3), (B, T, I))
  outputs, state = rnn(x)
  forward, forward_final = run_cell(rnn.cells[0], x)
  backward_reversed, backward_final = run_cell(rnn.cells[1], x[:, ::-1])
  np.testing.assert_allclose(outputs, jnp.concatenate([forward, backward_reversed[:, ::-1]], -1), atol=1e-6)
  np.testing.assert_allclose(state, jnp.stack([forward_final, backward_final], 1), atol=1e-6)
  assert outputs.shape == (B, T, 2 * H) and rnn.output_features == 2 * H


def test_bidirectional_backward_direction_starts_at_last_real_token():
  rnn = StackedRNN('lstm', I, H, bidirectional=True, rngs=nnx.Rngs(4))
  x = jax.random.normal(jax.random.key(5), (2, T, I))
  mask = jnp.arange(T)[None] < jnp.array([[T], [4]])
  outputs, _ = rnn(x, mask=mask)
  short, _ = rnn(x[1:, :4])  # the second sequence alone, without padding
  np.testing.assert_allclose(outputs[1, :4], short[0], atol=1e-6)
  # Padding after the real tokens must not leak into them.
  noisy, _ = rnn(x.at[1, 4:].set(100.0), mask=mask)
  np.testing.assert_allclose(noisy, outputs, atol=1e-6)


def test_deep_stack_feeds_layers_in_order_and_returns_every_final_state():
  rnn = StackedRNN('lstm', I, H, num_layers=2, rngs=nnx.Rngs(6))
  x = jax.random.normal(jax.random.key(7), (B, T, I))
  outputs, (h, c) = rnn(x)
  first, first_final = run_cell(rnn.cells[0], x)
  second, second_final = run_cell(rnn.cells[1], first)
  np.testing.assert_allclose(outputs, second, atol=1e-6)
  assert h.shape == c.shape == (B, 2, H)
  np.testing.assert_allclose(h[:, 0], first_final[0], atol=1e-6)
  np.testing.assert_allclose(c[:, 1], second_final[1], atol=1e-6)


@pytest.mark.parametrize('kind', ['rnn', 'gru', 'lstm'])
def test_carried_state_equals_one_long_run(kind):
  """Truncated BPTT relies on this: two halves with the state carried == the whole sequence."""
  rnn = StackedRNN(kind, I, H, num_layers=2, rngs=nnx.Rngs(8))
  x = jax.random.normal(jax.random.key(9), (B, T, I))
  whole, whole_state = rnn(x)
  first, state = rnn(x[:, :2])
  second, state = rnn(x[:, 2:], jax.lax.stop_gradient(state))
  np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, atol=1e-6)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(whole_state)):
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_step_by_step_equals_whole_sequence():
  rnn = StackedRNN('gru', I, H, num_layers=3, rngs=nnx.Rngs(10))
  x = jax.random.normal(jax.random.key(11), (B, T, I))
  whole, whole_state = rnn(x)
  state = rnn.initial_state(B)
  for t in range(T):
    out, state = rnn.step(x[:, t], state)
    np.testing.assert_allclose(out, whole[:, t], atol=1e-6)
  np.testing.assert_allclose(state, whole_state, atol=1e-6)


def test_variational_dropout_shares_one_mask_across_time():
  rnn = StackedRNN('rnn', I, H, num_layers=2, dropout=0.5, rngs=nnx.Rngs(0, dropout=1))
  masks = rnn.dropout_masks(B, deterministic=False)
  assert len(masks) == 1 and masks[0].shape == (B, H)
  assert set(np.unique(np.asarray(masks[0]))) <= {0.0, 2.0}
  assert rnn.dropout_masks(B, deterministic=True) is None
  # In a whole-sequence run a unit dropped at one step is dropped at every step.
  x = jnp.ones((B, T, H))
  dropped = rnn.dropout(x, deterministic=False)
  np.testing.assert_array_equal(dropped, jnp.broadcast_to(dropped[:, :1], dropped.shape))


def test_bad_arguments_fail_clearly():
  with pytest.raises(ValueError, match='Unknown RNN cell'):
    StackedRNN('transformer', I, H, rngs=nnx.Rngs(0))
  rnn = StackedRNN('gru', I, H, bidirectional=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='bidirectional'):
    rnn.step(jnp.ones((B, I)), rnn.initial_state(B))
