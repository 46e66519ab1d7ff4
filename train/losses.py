"""Losses shared by the families. Metrics are name -> (sum, count) so that averages stay exact
across gradient-accumulation micro-batches, devices and eval batches (see train/task.py).

Cross-entropies run in float32 whatever the logits' dtype. Logits may have a padded vocabulary
V' >= V (models/layers.py: the padded ids' logits are masked to the lowest finite value);
`vocab_size` = V then keeps label smoothing on the real ids, so the loss equals the unpadded one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from data.batching import EXAMPLE_WEIGHT
from models.layers import mask_padded_logits
from models.partitioning import constrain, shard_count

_SHARD_TABLE = ('batch', 'vocab', 'embed')  # logical axes of per-batch-shard [S, V', E] table gradients


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
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return _cross_entropy(logits, targets, label_smoothing, vocab_size), correct


def _target_distribution(targets, padded: int, label_smoothing: float, vocab_size: int | None):
  """[..., V'] float32 (1 - eps) one-hot + eps / V on the ids below V, from an iota compare (XLA
  fuses it into its consumers, so it is never stored)."""
  target = jax.nn.one_hot(targets, padded, dtype=jnp.float32)
  if not label_smoothing:
    return target
  vocab = padded if vocab_size is None else vocab_size
  return (1 - label_smoothing) * target + label_smoothing / vocab * (jnp.arange(padded) < vocab)


def _cross_entropy_parts(logits, targets, label_smoothing, vocab_size):
  """(loss [...], log-normalizer [...], target distribution [..., V']), all float32."""
  logits = logits.astype(jnp.float32)
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)
  target = _target_distribution(targets, logits.shape[-1], label_smoothing, vocab_size)
  return log_normalizer - jnp.sum(target * logits, axis=-1), log_normalizer, target  # -sum(target * log_softmax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(logits, targets, label_smoothing, vocab_size):
  """The loss of `token_cross_entropy`, with a hand-written gradient (softmax - target): autodiff
  of take_along_axis is a scatter-add into [..., V'] (on an H100 the slowest fusion of BERT's
  step was a scatter), and that of a one-hot product keeps the [..., V'] one-hot as a residual."""
  return _cross_entropy_parts(logits, targets, label_smoothing, vocab_size)[0]


def _cross_entropy_fwd(logits, targets, label_smoothing, vocab_size):
  loss, log_normalizer, _ = _cross_entropy_parts(logits, targets, label_smoothing, vocab_size)
  return loss, (logits, targets, log_normalizer)


def _cross_entropy_bwd(label_smoothing, vocab_size, residuals, d_loss):
  logits, targets, log_normalizer = residuals
  target = _target_distribution(targets, logits.shape[-1], label_smoothing, vocab_size)
  d_logits = d_loss[..., None] * (jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None]) - target)
  return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def lm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None, label_smoothing: float = 0.0,
            vocab_size: int | None = None):
  """Token cross-entropy. logits [B, L, V'] (V' may be a padded `vocab_size`), targets [B, L],
  weights [B, L] or [B] (per example; default ones) -> (mean loss, {'loss','accuracy': (sum, count)})."""
  weights = _token_weights(weights, targets.shape)
  per_token, correct = token_cross_entropy(logits, targets, label_smoothing, vocab_size)
  count = weights.sum()
  total = (per_token * weights).sum()
  return total / jnp.maximum(count, 1.0), {'loss': (total, count), 'accuracy': ((correct * weights).sum(), count)}


def _token_weights(weights: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
  """float32 weights of `shape` [B, L] from None (ones), [B] (per example) or [B, L]."""
  if weights is None:
    return jnp.ones(shape, jnp.float32)
  weights = weights.astype(jnp.float32)
  return jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (len(shape) - weights.ndim)), shape)


def classification_loss(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0,
                        weights: jax.Array | None = None):
  """logits [B, C], labels [B], weights [B] (default ones) -> (mean cross-entropy, {'loss', 'accuracy': (sum, count)})."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  weights = _token_weights(weights, labels.shape)
  per_example = optax.softmax_cross_entropy(logits, targets) * weights
  count = weights.sum()
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return per_example.sum() / jnp.maximum(count, 1.0), {'loss': (per_example.sum(), count), 'accuracy': (correct, count)}


def chunked_lm_loss(hidden: jax.Array, output_embedding: jax.Array, targets: jax.Array,
                    weights: jax.Array | None = None, label_smoothing: float = 0.0, chunk_tokens: int = 2048,
                    vocab_size: int | None = None):
  """`lm_loss` of the logits hidden @ output_embedding.T, computed `chunk_tokens` tokens at a time.

  No [B, L, V] logits tensor exists, in the forward or the backward pass: each chunk's logits are
  made in the compute dtype and reduced in float32 to its loss and accuracy sums, and the gradients
  with respect to the chunk's hidden states and the output embedding are taken right there (the
  softmax minus the smoothed targets), so nothing is recomputed and the largest temporary is
  [chunk_tokens, V] float32. Chunk c holds the tokens c, c + C, c + 2C, ... of the C chunks, so on a
  mesh each chunk is split like the batch and its logits are computed where its hidden states are
  (the table, a weight, is what moves: models/layers.py `Embed.table`).

  Args:
    hidden: [B, L, E] final hidden states (compute dtype).
    output_embedding: [V', E] the output layer (GPT's tied token embedding).
    targets: [B, L] int; weights: [B, L] or [B] per example (default ones).
    vocab_size: V when the output layer's rows are padded (default V'): the logits of the ids
      past it are masked (models.layers.mask_padded_logits) and get no gradient. On XLA:CPU the
      masked [chunk, V'] logits are one more stored temporary (+394 MB at the bench shapes with
      GPT-2's vocabulary).
  Returns:
    (mean loss, {'loss', 'accuracy': (sum, count)}), as `lm_loss`.
  """
  batch, length, width = hidden.shape
  tokens = batch * length
  weights = _token_weights(weights, targets.shape)
  chunk = min(chunk_tokens, tokens)
  chunks = -(-tokens // chunk)
  pad = chunks * chunk - tokens  # padded tokens have weight 0

  def flat(x):  # [B, L, ...] -> [chunks, chunk, ...]: chunk c holds the tokens c, c + chunks, c + 2 chunks, ...
    padded = jnp.pad(x.reshape(tokens, *x.shape[2:]), [(0, pad)] + [(0, 0)] * (x.ndim - 2))
    # Strided rather than contiguous chunks: each chunk takes tokens from every row, so the chunks
    # stay split like the batch and every device computes its share of each chunk's logits.
    strided = jnp.swapaxes(padded.reshape(chunk, chunks, *x.shape[2:]), 0, 1)
    return constrain(strided, (None, 'batch', 'embed')[:x.ndim])

  vocab_size = output_embedding.shape[0] if vocab_size is None else vocab_size
  total, correct = _chunked_sums(flat(hidden), output_embedding.astype(hidden.dtype), flat(targets), flat(weights),
                                 label_smoothing, vocab_size)
  count = weights.sum()
  return total / jnp.maximum(count, 1.0), {'loss': (total, count), 'accuracy': (correct, count)}


def _chunk_forward(h, table, t, w, label_smoothing, vocab_size):
  """One chunk: (loss sum, correct sum, d loss / d logits [chunk, V'] float32)."""
  logits = mask_padded_logits(constrain(h @ table.T, ('batch', 'vocab')), vocab_size)
  nll, log_normalizer, target = _cross_entropy_parts(logits, t, label_smoothing, vocab_size)
  correct = (jnp.argmax(logits, -1) == t).astype(jnp.float32)
  d_logits = (jnp.exp(logits.astype(jnp.float32) - log_normalizer[:, None]) - target) * w[:, None]
  return (nll * w).sum(), (correct * w).sum(), d_logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_sums(hidden_chunks, table, target_chunks, weight_chunks, label_smoothing, vocab_size):
  """(loss sum, correct sum) over [C, chunk, E] hidden states; see `chunked_lm_loss`. Without a
  gradient (evaluation) only the sums are computed."""
  def step(carry, chunk_inputs):
    loss, correct, _ = _chunk_forward(chunk_inputs[0], table, *chunk_inputs[1:], label_smoothing, vocab_size)
    return (carry[0] + loss, carry[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  sums, _ = jax.lax.scan(step, (zero, zero), (hidden_chunks, target_chunks, weight_chunks))
  return sums


def _chunked_sums_fwd(hidden_chunks, table, target_chunks, weight_chunks, label_smoothing, vocab_size):
  # The table's gradient is accumulated as one partial sum per batch shard, [S, V', E] split over S
  # (S = 1 without a mesh), and summed once after the loop: one reduction of the table per step,
  # where a single [V', E] carry would be all-reduced at every chunk.
  shards = shard_count('batch', hidden_chunks.shape[1])
  per_shard = lambda x: x.reshape(shards, x.shape[0] // shards, x.shape[1])

  def step(carry, chunk_inputs):
    loss_sum, correct_sum, d_table = carry
    h, t, w = chunk_inputs
    loss, correct, d_logits = _chunk_forward(h, table, t, w, label_smoothing, vocab_size)
    d_hidden = (d_logits.astype(h.dtype) @ table).astype(h.dtype)
    d_table = d_table + jnp.einsum('sck,sce->ske', per_shard(d_logits), per_shard(h.astype(jnp.float32)))
    return (loss_sum + loss, correct_sum + correct, constrain(d_table, _SHARD_TABLE)), d_hidden

  zero = jnp.zeros((), jnp.float32)
  d_table = constrain(jnp.zeros((shards, *table.shape), jnp.float32), _SHARD_TABLE)
  (loss, correct, d_table), d_hidden = jax.lax.scan(
      step, (zero, zero, d_table), (hidden_chunks, target_chunks, weight_chunks))
  return (loss, correct), (d_hidden, d_table.sum(0).astype(table.dtype), target_chunks, weight_chunks)


def _chunked_sums_bwd(label_smoothing, vocab_size, residuals, cotangents):
  d_hidden, d_table, target_chunks, weight_chunks = residuals
  scale = cotangents[0]  # the accuracy sum has no gradient
  return ((scale * d_hidden).astype(d_hidden.dtype), (scale * d_table).astype(d_table.dtype),
          np.zeros(target_chunks.shape, jax.dtypes.float0), jnp.zeros_like(weight_chunks))


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
