"""tests/numerics.py's tolerance: summation order passes it, a real defect does not."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import assert_close, tolerance

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only


@pytest.mark.parametrize('n', [16, 1_000, 100_000])
def test_a_sum_in_any_order_is_within_the_tolerance(n):
  x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
  exact = np.sum(x.astype(np.float64))
  orders = {'pairwise (numpy)': np.sum(x), 'left to right': np.cumsum(x)[-1], 'sorted': np.cumsum(np.sort(x))[-1],
            'reversed': np.cumsum(x[::-1])[-1], 'eight lanes': np.sum(x.reshape(-1, 8).sum(0)),
            'XLA': jnp.sum(jnp.asarray(x))}
  scale = float(np.abs(x).sum())  # a sum that cancels: its error scales with the terms, not the result
  for name, total in orders.items():
    assert_close(total, exact, terms=n, scale=scale, err_msg=name)
  # ... and the rule is not vacuous: for a long sum it is far below the result's own size.
  assert tolerance(terms=n, scale=scale) < 1e-3 * scale


def _projection_gradients(scale=1.0):
  """(the hand-written VJP's gradients of x and the kernels, autodiff's of the same einsum): the
  comparison tests/test_llama.py makes, with the hand-written one optionally scaled."""
  from models.layers import stacked_projection
  keys = jax.random.split(jax.random.key(0), 3)
  x, kernels = jax.random.normal(keys[0], (3, 5, 8)), jax.random.normal(keys[1], (8, 2, 6))
  cotangent = jax.random.normal(keys[2], (3, 5, 2, 6))
  loss = lambda project: lambda x, w: jnp.sum(project(x, w) * cotangent)
  ours = jax.grad(loss(stacked_projection), (0, 1))(x, kernels)
  autodiff = jax.grad(loss(lambda x, w: jnp.einsum('...e,ecf->...cf', x, w)), (0, 1))(x, kernels)
  return [g * scale for g in ours], autodiff


def test_a_gradient_scaled_by_one_part_in_a_thousand_fails():
  ours, autodiff = _projection_gradients()
  for a, b in zip(ours, autodiff):
    assert_close(a, b, terms=15)  # the kernel's gradient sums 3 x 5 positions
  scaled, autodiff = _projection_gradients(1 + 1e-3)
  for a, b in zip(scaled, autodiff):
    with pytest.raises(AssertionError):
      assert_close(a, b, terms=15)


def test_a_loss_with_one_term_missing_fails():
  from models.lm_head import chunked_lm_loss
  keys = jax.random.split(jax.random.key(1), 3)
  hidden = jax.random.normal(keys[0], (4, 16, 32))
  table = jax.random.normal(keys[1], (256, 32)) * 0.2
  targets = jax.random.randint(keys[2], (4, 16), 0, 256)
  logits = hidden @ table.T
  per_token = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  loss, _ = chunked_lm_loss(hidden, table, targets, vocab_size=256, chunk_tokens=16)
  terms = 32 + 256 + 64  # the logits' dot product, the normalizer's sum, the mean over tokens
  assert_close(loss, per_token.mean(), terms=terms)
  dropped = per_token.reshape(-1)[1:].sum() / per_token.size  # one token's term missing
  with pytest.raises(AssertionError):
    assert_close(loss, dropped, terms=terms)
