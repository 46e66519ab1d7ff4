"""Greedy and beam search over any cached autoregressive step function.

Shared by the Transformer, the RNN seq2seq model and GPT. A model exposes

  step_fn(tokens, cache, index) -> (logits, cache)

  tokens: [N, 1] int32, the token at position `index` of every row (BOS at index 0);
  cache:  any pytree whose leaves all have the row axis N first (KV caches, RNN states, encoder
          keys/values, source masks), so beam search can tile it by beam and reorder it;
  index:  int32 scalar position of `tokens`;
  logits: [N, V] or [N, 1, V] scores of the next token.

Both searches are pure JAX (`jax.lax.while_loop`, static shapes) and run batched under `jit`;
they stop early once every row is finished.

Conventions. Outputs are [.., max_len] token arrays that hold the generated tokens (not BOS),
end with `eos_id` and are filled with `pad_id` after it. Every hypothesis ends with EOS: at a
row's last allowed position (`max_lengths`, e.g. from `max_lengths_for(source lengths)`, else
`max_len`) EOS is the only token allowed. A sequence's log-probability is the sum of the
model's log-softmax over its tokens, EOS included; beam search ranks finished hypotheses by the
GNMT score log p / lp with lp = ((5 + n) / 6) ** alpha and n the generated length with EOS.

Beam search keeps `beam_size` live hypotheses; of the 2 * beam_size best expansions, those
ending in EOS among the top beam_size are finished, the best beam_size others stay live, and the
best beam_size finished ones are kept. A row is done at its maximum length, or once it holds
beam_size finished hypotheses and even the worst of them scores at least as well as the best
live one would if it ended now (the heuristic Hugging Face uses by default). Stopping as soon
as beam_size hypotheses have finished is not enough: with peaked models, poor hypotheses end
early and fill the finished set before the good one ends. With beam_size 1 this is exactly
greedy search.

Shape legend: B batch rows, K beams, V vocabulary, L = max_len.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

StepFn = Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


class GreedyResult(NamedTuple):
  tokens: jax.Array  # [B, L] int32
  logprobs: jax.Array  # [B] float32 sum of token log-probabilities


class BeamResult(NamedTuple):
  tokens: jax.Array  # [B, K, L] int32, best first
  scores: jax.Array  # [B, K] length-penalised scores; -inf for empty slots
  logprobs: jax.Array  # [B, K]


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


def max_lengths_for(source_lengths: jax.Array, ratio: float, offset: int, max_len: int) -> jax.Array:
  """Per-row generation limits from source lengths: ratio * length + offset, clipped to [1, max_len]."""
  limits = jnp.floor(ratio * jnp.asarray(source_lengths, jnp.float32)).astype(jnp.int32) + offset
  return jnp.clip(limits, 1, max_len)


def tile_beams(tree: Any, beam_size: int) -> Any:
  """Repeat every [B, ...] leaf beam_size times: [B * K, ...], row b * K + k is beam k of b."""
  return jax.tree.map(lambda x: jnp.repeat(x, beam_size, axis=0), tree)


def gather_beams(tree: Any, beam_indices: jax.Array, beam_size: int) -> Any:
  """Reorder [B * K, ...] leaves so that new beam k of row b is old beam beam_indices[b, k]."""
  batch = beam_indices.shape[0]
  rows = (jnp.arange(batch)[:, None] * beam_size + beam_indices).reshape(-1)
  return jax.tree.map(lambda x: x[rows], tree)


def _next_logprobs(step_fn: StepFn, tokens: jax.Array, cache: Any, index: jax.Array,
                   eos_id: int, force_eos: jax.Array) -> tuple[jax.Array, Any]:
  """[N] tokens -> ([N, V] log-probabilities, cache); rows with force_eos [N] may only emit EOS."""
  logits, cache = step_fn(tokens[:, None], cache, index)
  if logits.ndim == 3:
    logits = logits[:, 0]
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  only_eos = force_eos[:, None] & (jnp.arange(logprobs.shape[-1]) != eos_id)[None, :]
  return jnp.where(only_eos, -jnp.inf, logprobs), cache


def _row_limits(max_lengths, batch: int, max_len: int) -> jax.Array:
  if max_lengths is None:
    return jnp.full((batch,), max_len, jnp.int32)
  return jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_len)


def greedy_search(step_fn: StepFn, cache: Any, bos: jax.Array, *, max_len: int, eos_id: int,
                  pad_id: int = 0, max_lengths: jax.Array | None = None) -> GreedyResult:
  """Argmax decoding.

  Args:
    step_fn, cache: the model's step function and its initial [B, ...] cache.
    bos: [B] int first tokens (fed at index 0).
    max_len: static length of the output (and the most steps taken).
    max_lengths: optional [B] per-row limits <= max_len (EOS forced at the last one).
  """
  batch = bos.shape[0]
  limits = _row_limits(max_lengths, batch, max_len)

  def body(state):
    i, tokens, last, cache, done, total = state
    logprobs, cache = _next_logprobs(step_fn, last, cache, i, eos_id, i + 1 >= limits)
    token = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)
    token_logprob = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    token = jnp.where(done, pad_id, token)
    total = total + jnp.where(done, 0.0, token_logprob)
    tokens = tokens.at[:, i].set(token)
    return i + 1, tokens, token, cache, done | (token == eos_id), total

  def cond(state):
    i, done = state[0], state[4]
    return (i < max_len) & ~jnp.all(done)

  state = (jnp.int32(0), jnp.full((batch, max_len), pad_id, jnp.int32), jnp.asarray(bos, jnp.int32), cache,
           jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.float32))
  _, tokens, _, _, _, total = jax.lax.while_loop(cond, body, state)
  return GreedyResult(tokens, total)


def beam_search(step_fn: StepFn, cache: Any, bos: jax.Array, *, beam_size: int, max_len: int, eos_id: int,
                pad_id: int = 0, alpha: float = 0.6, max_lengths: jax.Array | None = None) -> BeamResult:
  """Beam search with the GNMT length penalty (see the module docstring for the rules).

  Args:
    step_fn: the model's step function; it is called on B * beam_size rows.
    cache: the initial cache for B rows (tiled by beam here).
    bos: [B] int first tokens.
    beam_size: K.
    max_len: static output length; max_lengths: optional [B] per-row limits <= max_len.
    alpha: length-penalty exponent (0: rank by log-probability).
  Returns:
    BeamResult with the K best finished hypotheses per row, best first.
  """
  batch, k = bos.shape[0], beam_size
  limits = _row_limits(max_lengths, batch, max_len)
  rank = jnp.arange(2 * k)[None, :]

  def top(values, count, *arrays):
    """The `count` best along axis 1 of values [B, M], with arrays [B, M, ...] gathered alike."""
    best, index = jax.lax.top_k(values, count)
    gather = lambda a: jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1)
    return (best, *[gather(a) for a in arrays])

  def body(state):
    i, last, live_tokens, live_logprob, cache, fin_tokens, fin_scores, fin_logprob, done = state
    force = jnp.repeat(i + 1 >= limits, k)
    logprobs, cache = _next_logprobs(step_fn, last.reshape(-1), cache, i, eos_id, force)
    vocab = logprobs.shape[-1]
    candidates = (live_logprob[:, :, None] + logprobs.reshape(batch, k, vocab)).reshape(batch, k * vocab)
    cand_logprob, flat = jax.lax.top_k(candidates, 2 * k)
    cand_beam, cand_token = flat // vocab, (flat % vocab).astype(jnp.int32)
    cand_tokens = jnp.take_along_axis(live_tokens, cand_beam[:, :, None], axis=1)
    cand_tokens = cand_tokens.at[:, :, i].set(cand_token)
    is_eos = cand_token == eos_id

    # EOS among the top K expansions finishes a hypothesis (only while its row is not done).
    finishing = is_eos & (rank < k) & jnp.isfinite(cand_logprob) & ~done[:, None]
    cand_scores = jnp.where(finishing, cand_logprob / length_penalty(i + 1.0, alpha), -jnp.inf)
    fin_scores, fin_tokens, fin_logprob = top(
        jnp.concatenate([fin_scores, cand_scores], axis=1), k,
        jnp.concatenate([fin_tokens, cand_tokens], axis=1), jnp.concatenate([fin_logprob, cand_logprob], axis=1))

    # The best K expansions that did not end stay live; the cache follows their parent beams.
    live_logprob, live_tokens, last, parent = top(
        jnp.where(is_eos, -jnp.inf, cand_logprob), k, cand_tokens, cand_token, cand_beam)
    cache = gather_beams(cache, parent, k)
    cannot_improve = fin_scores[:, -1] >= live_logprob[:, 0] / length_penalty(i + 1.0, alpha)
    done = done | cannot_improve | (i + 1 >= limits)
    return i + 1, last, live_tokens, live_logprob, cache, fin_tokens, fin_scores, fin_logprob, done

  def cond(state):
    i, done = state[0], state[-1]
    return (i < max_len) & ~jnp.all(done)

  # Only beam 0 is live at the start, so the first expansions are not K copies of each other.
  live_logprob = jnp.broadcast_to(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (batch, k))
  empty = jnp.full((batch, k, max_len), pad_id, jnp.int32)
  last = jnp.repeat(jnp.asarray(bos, jnp.int32)[:, None], k, axis=1)
  state = (jnp.int32(0), last, empty, live_logprob, tile_beams(cache, k), empty,
           jnp.full((batch, k), -jnp.inf), jnp.full((batch, k), -jnp.inf), jnp.zeros((batch,), bool))
  state = jax.lax.while_loop(cond, body, state)
  fin_tokens, fin_scores, fin_logprob = state[5:8]
  return BeamResult(fin_tokens, fin_scores, fin_logprob)


def strip(tokens: np.ndarray, eos_id: int) -> list[list[int]]:
  """[N, L] output tokens -> per row the ids before the first EOS (host side, for detokenizing)."""
  rows = []
  for row in np.asarray(tokens).tolist():
    rows.append(row[: row.index(eos_id)] if eos_id in row else row)
  return rows
