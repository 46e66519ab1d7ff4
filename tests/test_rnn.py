"""RNN, GRU and LSTM cells against a NumPy transcription of the D2L equations, and the layers built on them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.rnn import GRUCell, LSTMCell, RNNCell, StackedRNN, run_cell
from numerics import assert_close

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

B, T, I, H = 3, 6, 5, 4
STEP_TERMS = I + H  # one step's reductions: x @ W_x and h @ W_h


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
  assert_close(out, expected_out, terms=STEP_TERMS)
  for got, want in zip(jax.tree.leaves(new_carry), jax.tree.leaves(expected_carry)):
    assert_close(got, want, terms=STEP_TERMS)


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
      assert_close(outputs[b, t], out[0], terms=(t + 1) * STEP_TERMS)
    np.testing.assert_array_equal(outputs[b, lengths[b]:], 0.0)
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(carry)):
      assert_close(got[b], want[0], terms=T * STEP_TERMS)


def test_bidirectional_is_forward_run_concat_reversed_backward_run():
  rnn = StackedRNN('gru', I, H, bidirectional=True, rngs=nnx.Rngs(2))
  x = jax.random.normal(jax.random.key(3), (B, T, I))
  outputs, state = rnn(x)
  forward, forward_final = run_cell(rnn.cells[0], x)
  backward_reversed, backward_final = run_cell(rnn.cells[1], x[:, ::-1])
  assert_close(outputs, jnp.concatenate([forward, backward_reversed[:, ::-1]], -1), terms=T * STEP_TERMS)
  assert_close(state, jnp.stack([forward_final, backward_final], 1), terms=T * STEP_TERMS)
  assert outputs.shape == (B, T, 2 * H) and rnn.output_features == 2 * H


def test_bidirectional_backward_direction_starts_at_last_real_token():
  rnn = StackedRNN('lstm', I, H, bidirectional=True, rngs=nnx.Rngs(4))
  x = jax.random.normal(jax.random.key(5), (2, T, I))
  mask = jnp.arange(T)[None] < jnp.array([[T], [4]])
  outputs, _ = rnn(x, mask=mask)
  short, _ = rnn(x[1:, :4])  # the second sequence alone, without padding
  assert_close(outputs[1, :4], short[0], terms=T * STEP_TERMS)
  # Padding after the real tokens must not leak into them.
  noisy, _ = rnn(x.at[1, 4:].set(100.0), mask=mask)
  assert_close(noisy, outputs, terms=T * STEP_TERMS)


def test_deep_stack_feeds_layers_in_order_and_returns_every_final_state():
  rnn = StackedRNN('lstm', I, H, num_layers=2, rngs=nnx.Rngs(6))
  x = jax.random.normal(jax.random.key(7), (B, T, I))
  outputs, (h, c) = rnn(x)
  first, first_final = run_cell(rnn.cells[0], x)
  second, second_final = run_cell(rnn.cells[1], first)
  assert_close(outputs, second, terms=2 * T * STEP_TERMS)
  assert h.shape == c.shape == (B, 2, H)
  assert_close(h[:, 0], first_final[0], terms=T * STEP_TERMS)
  assert_close(c[:, 1], second_final[1], terms=2 * T * STEP_TERMS)


@pytest.mark.parametrize('kind', ['rnn', 'gru', 'lstm'])
def test_carried_state_equals_one_long_run(kind):
  """Truncated BPTT relies on this: two halves with the state carried == the whole sequence."""
  rnn = StackedRNN(kind, I, H, num_layers=2, rngs=nnx.Rngs(8))
  x = jax.random.normal(jax.random.key(9), (B, T, I))
  whole, whole_state = rnn(x)
  first, state = rnn(x[:, :2])
  second, state = rnn(x[:, 2:], jax.lax.stop_gradient(state))
  assert_close(jnp.concatenate([first, second], 1), whole, terms=2 * T * STEP_TERMS)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(whole_state)):
    assert_close(got, want, terms=2 * T * STEP_TERMS)


def test_step_by_step_equals_whole_sequence():
  rnn = StackedRNN('gru', I, H, num_layers=3, rngs=nnx.Rngs(10))
  x = jax.random.normal(jax.random.key(11), (B, T, I))
  whole, whole_state = rnn(x)
  state = rnn.initial_state(B)
  for t in range(T):
    out, state = rnn.step(x[:, t], state)
    assert_close(out, whole[:, t], terms=3 * (t + 1) * STEP_TERMS)
  assert_close(state, whole_state, terms=3 * T * STEP_TERMS)


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


# ----------------------------------------------------------------------------- the language-model task
def lm_task(sampler, batch_size=4, seq_len=5):
  from configs import rnn_lm
  from data.tokenizers import CharTokenizer
  from train.tasks.rnn_lm import Task
  config = rnn_lm.get_config('tiny')
  config.data.sampler = sampler
  config.data.seq_len = seq_len
  config.train.batch_size = batch_size
  return Task(config, Task.without_data(config, CharTokenizer('abcdefghij')))


def test_the_samplers_choose_shuffled_windows_or_carried_stream_rows():
  from data import batching
  assert lm_task('random').batch_plan() == batching.Shuffled()
  assert lm_task('sequential', seq_len=5).batch_plan() == batching.Stream(seq_len=5)


def test_trainer_step_carries_and_detaches_the_state():
  """Through the trainer's jitted step: the state after batch k is the model's final state on
  batch k, it starts batch k+1, it is reset by the 'reset' flag, and no gradient crosses it."""
  import optax
  from train.state import TrainState
  from train.steps import make_train_step
  task = lm_task('sequential')
  model = task.build_model(nnx.Rngs(params=0, dropout=1))
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  tx = optax.sgd(0.0)  # parameters stay fixed, so states can be recomputed outside
  state = TrainState(params, extra, tx.init(params), jnp.zeros((), jnp.int32))
  step = jax.jit(make_train_step(task, graphdef, tx, grad_accum=1))
  rng = np.random.default_rng(0)
  tokens = [rng.integers(4, task.tokenizer.vocab_size, (4, 6)).astype(np.int32) for _ in range(3)]
  resets = [np.ones(4, bool), np.zeros(4, bool), np.array([True, False, False, True])]
  reference = nnx.merge(graphdef, params, extra)
  # The recomputed states: one compiled program (eagerly, each op compiles on its own), from zeros or a given state.
  forward = nnx.jit(lambda model, tokens, start: model(tokens, start))
  expected = None
  for batch_tokens, reset in zip(tokens, resets):
    state, (scalars, _) = step(state, {'tokens': batch_tokens, 'reset': reset})
    start = None if expected is None else expected * (~reset)[:, None, None]
    logits, expected = forward(reference, jnp.asarray(batch_tokens[:, :-1]), start)
    carried = nnx.merge(graphdef, state.params, state.extra).carried.get_value()
    # Three batches of 5 GRU steps (embed 16 + hidden 32 terms each) carried through; the loss adds
    # the output layer (32), the normalizer over the vocabulary and the mean over 4 x 5 tokens.
    steps_terms = 3 * 5 * (16 + 32)
    assert_close(carried, expected, terms=steps_terms)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch_tokens[:, 1:]).mean()
    assert_close(scalars['loss'], loss, terms=steps_terms + 32 + task.tokenizer.vocab_size + 20)

  # Gradients stop at the batch border: they equal those of a fresh forward from the given state.
  batch = {'tokens': tokens[1], 'reset': np.zeros(4, bool)}
  def loss_from(params, start):
    model = nnx.merge(graphdef, params, extra, copy=True)
    model.carried.set_value(start)
    return task.loss(model, batch, deterministic=False)[0]
  start = jnp.ones_like(carried)
  state_grad = jax.jit(jax.grad(loss_from, argnums=1))(params, start)  # one program, not one per op
  np.testing.assert_array_equal(state_grad, 0.0)


def test_sequential_sampler_rejects_gradient_accumulation():
  from configs import rnn_lm
  from errors import ConfigError
  from train.validation import validate_config
  config = rnn_lm.get_config('tiny')
  config.train.grad_accum = 2
  with pytest.raises(ConfigError, match='grad_accum'):
    validate_config(config)


def test_sampling_a_left_padded_prompt_ignores_the_padding():
  """The shared sampler pads prompts on the left; padded steps must not change the RNN state."""
  from models.rnn_lm import generate
  task = lm_task('random')
  model = task.build_model(nnx.Rngs(0))
  prompts = [[5, 6, 7, 8], [9, 10]]
  from models.decoding import left_pad
  tokens, valid = left_pad(prompts, 0)
  out, _ = generate(model, tokens, valid, jax.random.key(0), max_new_tokens=4, temperature=0.0, top_k=0,
                    top_p=1.0, eos_id=None, pad_id=0)
  alone, _ = generate(model, jnp.asarray([prompts[1]]), jnp.ones((1, 2), bool), jax.random.key(0),
                      max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
  np.testing.assert_array_equal(out[1], alone[0])
  # Greedy continuation equals the argmax of the model run on the growing sequence, right-padded to one length
  # (the RNN reads left to right: what follows a position never changes its output), in one compiled program.
  forward = nnx.jit(lambda model, tokens: model(tokens)[0])
  sequence = list(prompts[1])
  for _ in range(4):
    logits = forward(model, jnp.asarray([sequence + [0] * (6 - len(sequence))]))
    sequence.append(int(jnp.argmax(logits[0, len(sequence) - 1])))
  np.testing.assert_array_equal(alone[0], sequence[2:])


# 2 files of 20 lines: 1,207 characters with one EOS each (char tokenizer), (1,207 - 1) // 16 = 75 windows.
@pytest.mark.parametrize('max_examples, windows', [(0, 75), (10, 10)])
def test_max_examples_caps_training_windows_and_zero_keeps_the_whole_stream(tmp_path, max_examples, windows):
  import support
  from configs import rnn_lm
  from train.tasks.rnn_lm import Task
  config = rnn_lm.get_config('tiny')
  config.data.update(source=support.write_corpus(str(tmp_path / 'corpus'), files=2, lines=20), sampler='random',
                     max_examples=max_examples, eval_source=support.write_corpus(str(tmp_path / 'eval'), files=1))
  prepared = Task.prepare(config, str(tmp_path / 'run'))
  assert len(prepared.datasets.train) == windows
