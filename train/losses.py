"""Losses shared by the families. Metrics are name -> (sum, count) so that averages stay exact
across gradient-accumulation micro-batches, devices and eval batches (see train/task.py).

These losses take given logits. A language model's head and its chunked cross-entropy, which never
holds the logits, are the model's (models/lm_head.py); both share that module's float32 pieces.

Cross-entropies run in float32 whatever the logits' dtype. Logits may have a padded vocabulary
V' >= V (models/layers.py: the padded ids' logits are masked to the lowest finite value);
`vocab_size` = V then keeps label smoothing on the real ids, so the loss equals the unpadded one.

z-loss (`train.z_loss`, PaLM): `lm_loss` and `token_losses` add coefficient * log(Z)^2 per token to
what training minimises and report it apart, as 'z_loss' (sum, count); their 'loss' metric, and so
eval/loss, the best-checkpoint metric and perplexities, stays the plain cross-entropy.
`classification_loss` (optax's cross-entropy of class logits) has none.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from data.batching import EXAMPLE_WEIGHT
from models.lm_head import cross_entropy_parts, is_argmax, target_distribution, token_weights, z_loss_term


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
  loss, _, correct = token_losses(logits, targets, label_smoothing, vocab_size)
  return loss, correct


def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0, vocab_size: int | None = None,
                 z_loss: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`token_cross_entropy` and the z-loss: (cross-entropy [...], z_loss * log(Z)^2 [...] (zeros when
  z_loss = 0), correct [...]), all float32, Z the softmax's normalizer over the ids below V."""
  correct = is_argmax(logits, targets).astype(jnp.float32)
  loss, z = _cross_entropy(logits, targets, label_smoothing, vocab_size, z_loss)
  return loss, z, correct


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _cross_entropy(logits, targets, label_smoothing, vocab_size, z_loss):
  """(cross-entropy, z-loss) of `token_losses`, with a hand-written gradient (softmax - target, and
  2 z_loss log Z softmax): autodiff of take_along_axis is a scatter-add into [..., V'] (on an H100
  the slowest fusion of BERT's step was a scatter), and that of a one-hot product keeps the
  [..., V'] one-hot as a residual."""
  return _cross_entropy_fwd(logits, targets, label_smoothing, vocab_size, z_loss)[0]


def _cross_entropy_fwd(logits, targets, label_smoothing, vocab_size, z_loss):
  loss, log_normalizer, *_ = cross_entropy_parts(logits, targets, label_smoothing, vocab_size)
  z = z_loss_term(log_normalizer, z_loss) if z_loss else jnp.zeros_like(loss)
  return (loss, z), (logits, targets, log_normalizer)


def _cross_entropy_bwd(label_smoothing, vocab_size, z_loss, residuals, cotangents):
  logits, targets, log_normalizer = residuals
  d_loss, d_z = cotangents
  target = target_distribution(targets, logits.shape[-1], label_smoothing, vocab_size)
  probabilities = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
  d_logits = d_loss[..., None] * (probabilities - target)
  if z_loss:  # d (c log^2 Z) / d logits = 2 c log Z softmax(logits)
    d_logits = d_logits + (d_z * 2 * z_loss * log_normalizer)[..., None] * probabilities
  return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def lm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None, label_smoothing: float = 0.0,
            vocab_size: int | None = None, z_loss: float = 0.0):
  """Token cross-entropy (+ z_loss * log(Z)^2 per token). logits [B, L, V'] (V' may be a padded
  `vocab_size`), targets [B, L], weights [B, L] or [B] (per example; default ones) -> (mean of
  cross-entropy + z-loss, {'loss' (the cross-entropy alone), 'accuracy', and with z_loss 'z_loss': (sum, count)})."""
  weights = token_weights(weights, targets.shape)
  per_token, z, correct = token_losses(logits, targets, label_smoothing, vocab_size, z_loss)
  count = weights.sum()
  total = (per_token * weights).sum()
  metrics = {'loss': (total, count), 'accuracy': ((correct * weights).sum(), count)}
  if not z_loss:
    return total / jnp.maximum(count, 1.0), metrics
  z_total = (z * weights).sum()
  return (total + z_total) / jnp.maximum(count, 1.0), {**metrics, 'z_loss': (z_total, count)}


def classification_loss(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0,
                        weights: jax.Array | None = None):
  """logits [B, C], labels [B], weights [B] (default ones) -> (mean cross-entropy, {'loss', 'accuracy': (sum, count)})."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  weights = token_weights(weights, labels.shape)
  per_example = optax.softmax_cross_entropy(logits, targets) * weights
  count = weights.sum()
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return per_example.sum() / jnp.maximum(count, 1.0), {'loss': (per_example.sum(), count), 'accuracy': (correct, count)}
