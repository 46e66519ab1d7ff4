"""Losses shared by the families. Metrics are name -> (sum, count) so that averages stay exact
across gradient-accumulation micro-batches, devices and eval batches (see train/task.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def lm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None, label_smoothing: float = 0.0):
  """Token cross-entropy. logits [B, L, V], targets [B, L] -> (mean loss, {'loss','accuracy': (sum, count)})."""
  weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  vocab = logits.shape[-1]
  labels = optax.smooth_labels(jax.nn.one_hot(targets, vocab), label_smoothing) if label_smoothing else None
  if labels is None:
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  else:
    per_token = optax.softmax_cross_entropy(logits, labels)
  count = weights.sum()
  total = (per_token * weights).sum()
  correct = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  return total / jnp.maximum(count, 1.0), {'loss': (total, count), 'accuracy': (correct, count)}


def classification_loss(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0):
  """logits [B, C], labels [B] -> (mean cross-entropy, {'loss', 'accuracy': (sum, count)})."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  per_example = optax.softmax_cross_entropy(logits, targets)
  count = jnp.asarray(labels.shape[0], jnp.float32)
  correct = (jnp.argmax(logits, -1) == labels).sum().astype(jnp.float32)
  return per_example.mean(), {'loss': (per_example.sum(), count), 'accuracy': (correct, count)}
