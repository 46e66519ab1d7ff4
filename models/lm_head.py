"""The language-model head: final hidden states -> vocabulary logits, and its chunked cross-entropy.

One implementation for every model whose output layer is a vocabulary matrix (GPT's tied token
embedding or its own `lm_head`, BERT's masked-LM head): `vocab_logits` makes the logits, and
`chunked_lm_loss` the next-token cross-entropy of those logits without ever holding them all.

Vocabularies may be padded to V' >= V rows (models/layers.py `padded_vocab_size`): the padded
ids' logits are masked to the lowest finite value (`mask_padded_logits`), and `vocab_size` = V
keeps label smoothing on the real ids, so every loss equals the unpadded model's.

Two options of the decoder recipes (issue 33), both off (0) by default:
  softcap  logits -> softcap * tanh(logits / softcap) (Gemma 2; the NanoGPT speedrun): applied in
           `vocab_logits` before the padded ids are masked, so every loss, argmax and decoding step
           reads the capped logits; the chunked loss's hand-written gradient carries the tanh's
           derivative 1 - (capped / softcap)^2.
  z_loss   a coefficient on log(Z)^2 per token (PaLM, Chowdhery et al. 2022: 1e-4), Z the softmax's
           normalizer, added to the minimised loss and reported as its own metric 'z_loss' (the sum
           of coefficient * log(Z)^2); the 'loss' metric stays the plain cross-entropy.

The cross-entropy pieces (`cross_entropy_parts`, `target_distribution`, `token_weights`, `is_argmax`) are
shared with the losses on given logits (train/losses.py). Cross-entropies run in float32 whatever
the logits' dtype. Losses return (mean, {'loss', 'accuracy': (sum, count)}), plus 'z_loss' when its
coefficient is not 0: sums and counts, so averages stay exact across micro-batches, devices and
evaluation batches. The mean is what training minimises: the cross-entropy plus the z-loss term.

Shape legend: B batch, L length, E width, V vocabulary, V' padded vocabulary, C chunks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import leading_names, mask_padded_logits
from models.partitioning import constrain, shard_count

_SHARD_TABLE = ('batch', 'embed', 'vocab')  # logical axes of per-batch-shard [S, E, V'] table gradients


def vocab_logits(hidden: jax.Array, matrix: jax.Array, vocab_size: int, bias: jax.Array | None = None,
                 softcap: float = 0.0) -> jax.Array:
  """hidden [..., E] @ matrix [E, V'] (+ bias [V']) -> [..., V'] logits in hidden's dtype, soft-capped
  to (-softcap, softcap) when softcap > 0, ids >= vocab_size masked. The logits stay split like the
  hidden states' leading dimensions and by 'vocab'."""
  logits = constrain(hidden @ matrix.astype(hidden.dtype), (*leading_names(hidden.ndim - 1), 'vocab'))
  if bias is not None:
    logits = logits + bias.astype(logits.dtype)
  return mask_padded_logits(soft_cap(logits, softcap), vocab_size)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(logits / cap), in the logits' dtype; unchanged when cap = 0."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def z_loss_term(log_normalizer: jax.Array, coefficient: float) -> jax.Array:
  """[...] float32 coefficient * log(Z)^2, PaLM's auxiliary loss keeping the softmax normalizer near 1."""
  return coefficient * jnp.square(log_normalizer)


def token_weights(weights: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
  """float32 weights of `shape` [B, L] from None (ones), [B] (per example) or [B, L]."""
  if weights is None:
    return jnp.ones(shape, jnp.float32)
  weights = weights.astype(jnp.float32)
  return jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (len(shape) - weights.ndim)), shape)


def target_distribution(targets: jax.Array, padded: int, label_smoothing: float, vocab_size: int | None) -> jax.Array:
  """[..., V'] float32 (1 - eps) one-hot + eps / V on the ids below V (None: V'), from an iota
  compare (XLA fuses it into its consumers, so it is never stored). targets: [...] int."""
  target = jax.nn.one_hot(targets, padded, dtype=jnp.float32)
  if not label_smoothing:
    return target
  vocab = padded if vocab_size is None else vocab_size
  return (1 - label_smoothing) * target + label_smoothing / vocab * (jnp.arange(padded) < vocab)


def cross_entropy_parts(logits: jax.Array, targets: jax.Array, label_smoothing: float, vocab_size: int | None):
  """logits [..., V'] (any float dtype), targets [...] int -> float32 (loss, log-normalizer, target
  logit, max logit), each [...]. The loss is -sum(target distribution * log_softmax(logits)) =
  log-normalizer - (1 - eps) * target logit - eps * mean logit over the ids below V (None: V').

  The target's logit is gathered rather than summed from a [..., V'] one-hot product, and the max
  is taken once (the log-normalizer's shift, and `is_argmax`'s): on CPU these passes over the
  logits cost as much as a third of the vocabulary matmul. The logits are cast where read, so a
  bf16 [..., V'] array is never stored again in float32."""
  top = jnp.max(logits, -1).astype(jnp.float32)
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0].astype(jnp.float32)
  logits_32 = logits.astype(jnp.float32)
  log_normalizer = top + jnp.log(jnp.sum(jnp.exp(logits_32 - top[..., None]), -1))
  expected_logit = target_logit  # sum(target distribution * logits)
  if label_smoothing:
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    mean_logit = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits_32, 0.0), -1) / vocab
    expected_logit = (1 - label_smoothing) * target_logit + label_smoothing * mean_logit
  return log_normalizer - expected_logit, log_normalizer, target_logit, top


def chunked_lm_loss(hidden: jax.Array, table: jax.Array, targets: jax.Array, weights: jax.Array | None = None, *,
                 vocab_size: int, label_smoothing: float = 0.0, chunk_tokens: int = 2048, softcap: float = 0.0,
                 z_loss: float = 0.0):
  """Token cross-entropy of the logits `vocab_logits(hidden, table.T, softcap=softcap)`, `chunk_tokens`
  tokens at a time, plus z_loss * log(Z)^2 per token when z_loss > 0.

  No [B, L, V'] logits tensor exists, in the forward or the backward pass: each chunk's logits are
  made in the compute dtype and reduced in float32 to its loss and accuracy sums, and the gradients
  with respect to the chunk's hidden states and the table are taken right there (the softmax minus
  the smoothed targets), so nothing is recomputed and the largest temporary is [chunk_tokens, V']
  float32. Chunk c holds the tokens c, c + C, c + 2C, ... of the C chunks, so on a mesh each chunk
  is split like the batch and its logits are computed where its hidden states are (the table, a
  weight, is what moves: models/layers.py `Embed.table`).

  Args:
    hidden: [B, L, E] final hidden states (compute dtype).
    table: [V', E] the output layer (a tied token embedding, or an untied output matrix).
    targets: [B, L] int; weights: [B, L] or [B] per example (default ones).
    vocab_size: V; the logits of the padded ids past it are masked and get no gradient. On
      XLA:CPU the masked [chunk, V'] logits are one more stored temporary when V' > V.
    softcap: the logits' soft cap (0: none); z_loss: the z-loss coefficient (0: none).
  Returns:
    (mean of cross-entropy + z-loss, {'loss' (the cross-entropy alone), 'accuracy', and with z_loss
    'z_loss': (sum, count)}).
  """
  batch, length, _ = hidden.shape
  tokens = batch * length
  weights = token_weights(weights, targets.shape)
  chunk = min(chunk_tokens, tokens)
  chunks = -(-tokens // chunk)
  pad = chunks * chunk - tokens  # padded tokens have weight 0

  def flat(x):  # [B, L, ...] -> [C, chunk, ...]: chunk c holds the tokens c, c + C, c + 2C, ...
    padded = jnp.pad(x.reshape(tokens, *x.shape[2:]), [(0, pad)] + [(0, 0)] * (x.ndim - 2))
    # Strided rather than contiguous chunks: each chunk takes tokens from every row, so the chunks
    # stay split like the batch and every device computes its share of each chunk's logits.
    strided = jnp.swapaxes(padded.reshape(chunk, chunks, *x.shape[2:]), 0, 1)
    return constrain(strided, (None, 'batch', 'embed')[:x.ndim])

  objective, total, z_total, correct = _chunked_sums(flat(hidden), table.astype(hidden.dtype), flat(targets),
                                                     flat(weights), label_smoothing, vocab_size, softcap, z_loss)
  count = weights.sum()
  metrics = {'loss': (total, count), 'accuracy': (correct, count)}
  if z_loss:
    metrics['z_loss'] = (z_total, count)
  return objective / jnp.maximum(count, 1.0), metrics


def is_argmax(logits: jax.Array, targets: jax.Array, target_logit: jax.Array | None = None,
              top: jax.Array | None = None) -> jax.Array:
  """[..., V'] logits, [...] int targets -> [...] bool: jnp.argmax(logits, -1) == targets (ties go to
  the lowest id, as in argmax and greedy decoding): the target's logit is the largest and no lower
  id reaches it. Plain reductions, where XLA:CPU runs argmax as a (value, index) pair reduction
  several times slower. target_logit [...] and top (the max logit) [...] are reused when given."""
  if target_logit is None:
    target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  if top is None:
    top = jnp.max(logits, -1)
  lower_ids = jnp.arange(logits.shape[-1]) < targets[..., None]
  lower_tie = jnp.any((logits >= target_logit[..., None]) & lower_ids, -1)  # an or-reduction: 4x a count's speed
  return (target_logit >= top) & ~lower_tie


def _chunk_forward(h, table, t, w, label_smoothing, vocab_size, softcap, z_loss):
  """One chunk, h [chunk, E], t and w [chunk]: (cross-entropy sum, z-loss sum, correct sum, d (cross-entropy
  + z-loss) / d logits before the soft cap [chunk, V'] float32)."""
  logits = vocab_logits(h, table.T, vocab_size, softcap=softcap)  # [chunk, V'] in the compute dtype
  loss, log_normalizer, target_logit, top = cross_entropy_parts(logits, t, label_smoothing, vocab_size)
  correct = is_argmax(logits, t, target_logit, top).astype(jnp.float32)
  target = target_distribution(t, logits.shape[-1], label_smoothing, vocab_size)
  probabilities = jnp.exp(logits.astype(jnp.float32) - log_normalizer[:, None])
  d_logits = probabilities - target
  z_sum = jnp.zeros((), jnp.float32)
  if z_loss:  # d (c log^2 Z) / d logits = 2 c log Z softmax(logits)
    d_logits = d_logits + (2 * z_loss * log_normalizer)[:, None] * probabilities
    z_sum = (z_loss_term(log_normalizer, z_loss) * w).sum()
  if softcap:  # through capped = c tanh(z / c): d capped / d z = 1 - tanh^2 = 1 - (capped / c)^2
    # Clipped so that the masked padded ids (the lowest finite value, where d_logits is 0) give 0, not NaN.
    d_logits = d_logits * (1 - jnp.square(jnp.clip(logits.astype(jnp.float32) / softcap, -1.0, 1.0)))
  return (loss * w).sum(), z_sum, (correct * w).sum(), d_logits * w[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked_sums(hidden_chunks, table, target_chunks, weight_chunks, label_smoothing, vocab_size, softcap, z_loss):
  """(cross-entropy + z-loss sum, cross-entropy sum, z-loss sum, correct sum) over [C, chunk, E] hidden
  states; see `chunked_lm_loss`. Only the first, the minimised objective, has a gradient: the other
  three are metrics. Without a gradient (evaluation) only the sums are computed."""
  def step(carry, chunk_inputs):
    loss, z, correct, _ = _chunk_forward(chunk_inputs[0], table, *chunk_inputs[1:], label_smoothing, vocab_size,
                                         softcap, z_loss)
    return (carry[0] + loss, carry[1] + z, carry[2] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (loss, z, correct), _ = jax.lax.scan(step, (zero, zero, zero), (hidden_chunks, target_chunks, weight_chunks))
  return loss + z, loss, z, correct


def _chunked_sums_fwd(hidden_chunks, table, target_chunks, weight_chunks, label_smoothing, vocab_size, softcap, z_loss):
  # The table's gradient is accumulated as one partial sum per batch shard, [S, E, V'] split over S
  # (S = 1 without a mesh), and summed once after the loop: one reduction of the table per step,
  # where a single carry would be all-reduced at every chunk. Transposed ([E, V'], turned once at
  # the end): h^T @ d_logits writes its output faster on XLA:CPU than d_logits^T @ h
  # (measurements/code_comments.csv).
  shards = shard_count('batch', hidden_chunks.shape[1])
  per_shard = lambda x: x.reshape(shards, x.shape[0] // shards, x.shape[1])

  def step(carry, chunk_inputs):
    loss_sum, z_sum, correct_sum, d_table = carry
    h, t, w = chunk_inputs
    loss, z, correct, d_logits = _chunk_forward(h, table, t, w, label_smoothing, vocab_size, softcap, z_loss)
    d_hidden = (d_logits.astype(h.dtype) @ table).astype(h.dtype)
    # In the compute dtype, summed in float32: a bfloat16 model's largest matmul stays a bfloat16 one.
    d_table = d_table + jnp.einsum('sce,sck->sek', per_shard(h), per_shard(d_logits.astype(h.dtype)),
                                   preferred_element_type=jnp.float32)
    return (loss_sum + loss, z_sum + z, correct_sum + correct, constrain(d_table, _SHARD_TABLE)), d_hidden

  zero = jnp.zeros((), jnp.float32)
  d_table = constrain(jnp.zeros((shards, *table.shape[::-1]), jnp.float32), _SHARD_TABLE)
  (loss, z, correct, d_table), d_hidden = jax.lax.scan(
      step, (zero, zero, zero, d_table), (hidden_chunks, target_chunks, weight_chunks))
  return (loss + z, loss, z, correct), (d_hidden, d_table.sum(0).T.astype(table.dtype), target_chunks, weight_chunks)


def _chunked_sums_bwd(label_smoothing, vocab_size, softcap, z_loss, residuals, cotangents):
  d_hidden, d_table, target_chunks, weight_chunks = residuals
  scale = cotangents[0]  # the objective's; the three metric sums have no gradient
  return ((scale * d_hidden).astype(d_hidden.dtype), (scale * d_table).astype(d_table.dtype),
          np.zeros(target_chunks.shape, jax.dtypes.float0), jnp.zeros_like(weight_chunks))


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
