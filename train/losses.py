"""Losses shared by the families. Metrics are name -> (sum, count) so that averages stay exact
across gradient-accumulation micro-batches, devices and eval batches (see train/task.py).

These losses take given logits. A language model's head and its chunked cross-entropy, which never
holds the logits, are the model's (models/lm_head.py); both share that module's float32 pieces.

Cross-entropies run in float32 whatever the logits' dtype. Logits may have a padded vocabulary
V' >= V (models/layers.py: the padded ids' logits are masked to the lowest finite value);
`vocab_size` = V then keeps label smoothing on the real ids, so the loss equals the unpadded one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from data.batching import EXAMPLE_WEIGHT
from models.lm_head import cross_entropy_parts, is_argmax, target_distribution, token_weights


def example_weights(batch: dict, weights: jax.Array | None = None) -> jax.Array | None:
  """`weights` (per example [B] or per token [B, ...]; None = all ones) times the batch's
  `example_weight` [B] when it has one (evaluation fillers weigh 0, data/batching.py); float32."""
  if EXAMPLE_WEIGHT not in batch:
    return None if weights is None else weights.astype(jnp.float32)
  row = batch[EXAMPLE_WEIGHT].astype(jnp.float32)
  if weights is None:
    return row
  return weights.astype(jnp.float32) * row.reshape(row.shape + (1,) * (weights.ndim - 1))


def token_cross_entropy(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0,
                        vocab_size: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-token float32 cross-entropy against (1 - eps) one-hot + eps / V on the real ids.

  Args:
    logits: [..., V'] any float dtype, ids >= vocab_size masked; targets: [...] int.
    vocab_size: V (default V').
  Returns:
    (loss [...], correct [...] float32: argmax == target).
  """
  correct = is_argmax(logits, targets).astype(jnp.float32)
  return _cross_entropy(logits, targets, label_smoothing, vocab_size), correct


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(logits, targets, label_smoothing, vocab_size):
  """The loss of `token_cross_entropy`, with a hand-written gradient (softmax - target): autodiff
  of take_along_axis is a scatter-add into [..., V'] (on an H100 the slowest fusion of BERT's
  step was a scatter), and that of a one-hot product keeps the [..., V'] one-hot as a residual."""
  return cross_entropy_parts(logits, targets, label_smoothing, vocab_size)[0]


def _cross_entropy_fwd(logits, targets, label_smoothing, vocab_size):
  loss, log_normalizer, *_ = cross_entropy_parts(logits, targets, label_smoothing, vocab_size)
  return loss, (logits, targets, log_normalizer)


def _cross_entropy_bwd(label_smoothing, vocab_size, residuals, d_loss):
  logits, targets, log_normalizer = residuals
  target = target_distribution(targets, logits.shape[-1], label_smoothing, vocab_size)
  d_logits = d_loss[..., None] * (jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None]) - target)
  return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def lm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None, label_smoothing: float = 0.0,
            vocab_size: int | None = None):
  """Token cross-entropy. logits [B, L, V'] (V' may be a padded `vocab_size`), targets [B, L],
  weights [B, L] or [B] (per example; default ones) -> (mean loss, {'loss','accuracy': (sum, count)})."""
  weights = token_weights(weights, targets.shape)
  per_token, correct = token_cross_entropy(logits, targets, label_smoothing, vocab_size)
  count = weights.sum()
  total = (per_token * weights).sum()
  return total / jnp.maximum(count, 1.0), {'loss': (total, count), 'accuracy': ((correct * weights).sum(), count)}


def classification_loss(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0,
                        weights: jax.Array | None = None):
  """logits [B, C], labels [B], weights [B] (default ones) -> (mean cross-entropy, {'loss', 'accuracy': (sum, count)})."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  weights = token_weights(weights, labels.shape)
  per_example = optax.softmax_cross_entropy(logits, targets) * weights
  count = weights.sum()
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return per_example.sum() / jnp.maximum(count, 1.0), {'loss': (per_example.sum(), count), 'accuracy': (correct, count)}
