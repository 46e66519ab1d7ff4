"""The chunked cross-entropy equals the plain one: values, metrics and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.lm_head import chunked_lm_loss, is_argmax
from numerics import assert_close, assert_trees_close, transformer_terms
from train.losses import lm_loss

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only


@functools.cache
def loss_inputs():
  keys = jax.random.split(jax.random.key(0), 4)
  hidden = jax.random.normal(keys[0], (3, 7, 16))
  table = jax.random.normal(keys[1], (50, 16))
  targets = jax.random.randint(keys[2], (3, 7), 0, 50)
  weights = (jax.random.uniform(keys[3], (3, 7)) > 0.3).astype(jnp.float32)
  return hidden, table, targets, weights


def loss_and_gradients(loss_fn):
  """loss_fn(hidden, table, targets, weights) -> (loss, metrics), as training and evaluation run it: one
  compiled program (eagerly, every op would compile on its own) of the loss alone (evaluation's path)
  and the gradients with respect to hidden and table (training's)."""
  grad = jax.grad(lambda *args: loss_fn(*args)[0], argnums=(0, 1))
  return jax.jit(lambda *args: (loss_fn(*args), grad(*args)))


@functools.cache
def plain_loss_and_gradients(label_smoothing):
  """The plain cross-entropy's program, shared by the chunk sizes."""
  return loss_and_gradients(lambda h, w, targets, weights: lm_loss(h @ w.T, targets, weights, label_smoothing))


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
@pytest.mark.parametrize('chunk', [4, 5, 1000])  # several chunks, a ragged last chunk, one chunk
def test_chunked_cross_entropy_equals_the_plain_one(label_smoothing, chunk):
  chunked = loss_and_gradients(lambda h, w, targets, weights: chunked_lm_loss(
      h, w, targets, weights, vocab_size=50, label_smoothing=label_smoothing, chunk_tokens=chunk))
  ((loss, metrics), grads), ((loss_c, metrics_c), grads_c) = (plain_loss_and_gradients(label_smoothing)(*loss_inputs()),
                                                              chunked(*loss_inputs()))
  terms = 16 + 50 + 21  # a logit's dot product, the normalizer over the vocabulary, the sum over 3 x 7 tokens
  assert_close(loss_c, loss, terms=terms)
  assert_close(metrics_c['loss'][0], metrics['loss'][0], terms=terms)
  for name in ('loss', 'accuracy'):  # the weight count, and the count of correct tokens: exact
    np.testing.assert_array_equal(metrics_c[name][1], metrics[name][1])
  np.testing.assert_array_equal(metrics_c['accuracy'][0], metrics['accuracy'][0])
  for g, g_c in zip(grads, grads_c):
    assert_close(g_c, g, terms=terms)


@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
def test_token_cross_entropy_equals_optax(label_smoothing):
  # An independent reference: optax's softmax cross-entropy against smoothed one-hot labels.
  import optax
  from train.losses import token_cross_entropy
  keys = jax.random.split(jax.random.key(2))
  logits = 3 * jax.random.normal(keys[0], (4, 9, 50))
  targets = jax.random.randint(keys[1], (4, 9), 0, 50)
  labels = optax.smooth_labels(jax.nn.one_hot(targets, 50), label_smoothing)
  ours = lambda x: token_cross_entropy(x, targets, label_smoothing)
  theirs = lambda x: optax.softmax_cross_entropy(x, labels)

  @jax.jit  # one program: eagerly, each op of the four computations compiles on its own
  def losses_and_gradients(x):
    return ours(x), theirs(x), jax.grad(lambda x: ours(x)[0].sum())(x), jax.grad(lambda x: theirs(x).sum())(x)

  (loss, correct), expected, grad, expected_grad = losses_and_gradients(logits)
  assert_close(loss, expected, terms=50)  # the normalizer and the smoothed labels' sum over 50 ids
  np.testing.assert_array_equal(correct, (jnp.argmax(logits, -1) == targets).astype(jnp.float32))
  assert_close(grad, expected_grad, terms=50)


def test_accuracy_is_argmax_equals_target_ties_included():
  # Logits from a few levels, so most rows hold ties: the lowest tied id is argmax's (and greedy
  # decoding's) prediction; a uniform row predicts id 0 only. Every target id is tried per row.
  levels = jax.random.randint(jax.random.key(1), (64, 6), 0, 3).astype(jnp.float32)
  logits = jnp.concatenate([levels, jnp.zeros((1, 6)), jnp.full((1, 6), -1.5)])  # [66, 6], two uniform rows
  targets = jnp.broadcast_to(jnp.arange(6), logits.shape)
  rows = jnp.broadcast_to(logits[:, None, :], (*logits.shape, 6))  # [66, 6 targets, 6 ids]
  expected = jnp.argmax(rows, -1) == targets
  np.testing.assert_array_equal(is_argmax(rows, targets), expected)
  assert int(expected[64].sum()) == 1 and bool(expected[64, 0])  # uniform: id 0 only
  assert 0 < int(expected.sum()) < expected.size


def test_gpt_task_loss_is_the_same_chunked_or_not():
  from configs import gpt
  from data.tokenizers import CharTokenizer
  from train.task import task_without_data
  losses, model = [], None
  for chunk in (0, 24):
    config = gpt.get_config('tiny')
    config.train.loss_chunk_tokens = chunk
    task = task_without_data(config, CharTokenizer('abcdefghijklmnop'))
    # One model for both (the chunk size is the loss's): built eagerly, each parameter shape's initialiser
    # compiles once (as one program, every parameter's random draw compiles again).
    model = model or task.build_model(nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in task.example_batch(4).items()}
    # Differentiated as one compiled program: run op by op, it compiles ~240 tiny ones.
    loss_fn = lambda m: task.loss(m, batch, deterministic=True)[0]
    losses.append(nnx.jit(nnx.value_and_grad(loss_fn))(model))
  c = task.model_config  # the tiny GPT: 2 layers, width 32, 4 x 32 wide MLP, windows of 32, 4 rows
  terms = transformer_terms(c.num_layers, c.width, c.mlp_width, 32, vocab=c.vocab_size, positions=4 * 32)
  assert_close(losses[1][0], losses[0][0], terms=terms)
  assert_trees_close(losses[1][1], losses[0][1], terms=terms)
