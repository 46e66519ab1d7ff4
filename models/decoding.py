"""The decoding library of every autoregressive model: greedy, sampling and beam search.

A model exposes one step function, used by all three searches:

  step_fn(tokens, cache, index) -> (logits, cache)

  tokens: [N, T] int32 ids at positions index .. index + T - 1 of every row. The first call
          (index 0) feeds the whole prompt, T = P (a GPT prompt, or just BOS for a translation),
          and scores output token 0; the call that scores output token i >= 1 feeds token i - 1
          alone, T = 1, at index P + i - 1.
  cache:  a pytree with what the model carries from call to call: KV caches, the keys' validity
          mask and per-row position offsets of left-padded prompts, encoder keys/values and the
          source mask, RNN states. Beam search tiles it by beam and reorders it along axis 0, so
          every leaf of a cache it is given has the row axis N first. `decode` never looks inside,
          so there the GPT's layer-stacked KV cache of `scan_layers` may lead with [layers, N].
  index:  int32 scalar, the position of tokens[:, 0].
  logits: [N, T, V] next-token scores after each fed token (only the last one is read), any float
          dtype. A model with a padded vocabulary masks the padded ids' scores itself
          (models.layers.mask_padded_logits), so no search here ever emits them.

The model modules build their step functions and call these loops under `jit` with the settings
static: models.gpt.generate, models.rnn_lm.generate (prompt continuation), and
models.transformer.translate, models.seq2seq.translate (greedy or beam search).

Both loops are pure JAX (`jax.lax.while_loop`, static shapes), batched, and stop early once
every row is finished.

Conventions. Outputs hold the generated tokens only (not the prompt): [.., L] arrays, L =
`max_len` steps at most, `pad_id` after a row's EOS. With `max_lengths` ([B] per-row limits, e.g.
`max_lengths_for(source lengths)`) EOS is the only token allowed at a row's last position, so
every row ends with EOS. A sequence's log-probability is the sum of the model's log-softmax over
its tokens, EOS included (unaffected by temperature, top-k or top-p); beam search ranks finished
hypotheses by the GNMT score log p / lp with lp = ((5 + n) / 6) ** alpha and n the generated
length with EOS.

Beam search keeps `beam_size` live hypotheses; of the 2 * beam_size best expansions, those
ending in EOS among the top beam_size are finished, the best beam_size others stay live, and the
best beam_size finished ones are kept. A row is done at its maximum length (`max_len` without
`max_lengths`: beam search always forces EOS there), or once it holds beam_size finished
hypotheses and even the worst of them scores at least as well as the best live one would if it
ended now (the heuristic Hugging Face uses by default). Stopping as soon as beam_size
hypotheses have finished is not enough: with peaked models, poor hypotheses end early and fill
the finished set before the good one ends. With beam_size 1 this is exactly greedy `decode`
given the same `max_lengths`.

Shape legend: B batch rows, P prompt length, L = max_len output length, K beams, V vocabulary,
N = B (decode) or B * K (beam search) rows seen by the step function.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

StepFn = Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


class Decoded(NamedTuple):
  tokens: jax.Array  # [B, L] int32 new tokens, pad_id after a row's EOS
  lengths: jax.Array  # [B] int32 new tokens up to and including EOS
  logprobs: jax.Array  # [B] float32 sum of the model's log-probabilities of those tokens


class BeamResult(NamedTuple):
  tokens: jax.Array  # [B, K, L] int32, best first
  scores: jax.Array  # [B, K] length-penalised scores; -inf for empty slots
  logprobs: jax.Array  # [B, K]


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """[B, V] logits -> [B] token ids. temperature 0 is greedy (argmax)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k and top_k < logits.shape[-1]:
    kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p.
    keep_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def left_pad(prompts: list[list[int]], pad_id: int, length: int | None = None):
  """Token lists -> (tokens [B, P] int32, valid [B, P] bool), right-aligned so every prompt ends at P."""
  length = length or max(len(p) for p in prompts)
  tokens = [[pad_id] * (length - len(p)) + list(p[-length:]) for p in prompts]
  valid = [[False] * (length - len(p)) + [True] * min(len(p), length) for p in prompts]
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool)


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


def _next_logprobs(logits: jax.Array, eos_id: int | None, force_eos: jax.Array | None) -> jax.Array:
  """[N, T, V] step logits -> [N, V] float32 log-probabilities of the next token; rows with
  force_eos [N] may only emit EOS."""
  logprobs = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1)
  if force_eos is None:
    return logprobs
  only_eos = force_eos[:, None] & (jnp.arange(logprobs.shape[-1]) != eos_id)[None, :]
  return jnp.where(only_eos, -jnp.inf, logprobs)


def _row_limits(max_lengths: jax.Array, max_len: int) -> jax.Array:
  return jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_len)


def decode(step_fn: StepFn, cache: Any, prompt: jax.Array, rng: jax.Array | None = None, *, max_len: int,
           eos_id: int | None = None, pad_id: int = 0, max_lengths: jax.Array | None = None,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Decoded:
  """Greedy decoding (temperature 0) or sampling (temperature, top-k, top-p) of B continuations.

  The prompt is fed in one call, then one token per step until `max_len` new tokens or until
  every row has emitted EOS.

  Args:
    step_fn, cache: the model's step function and its initial cache for B rows, with room for
      P + max_len - 1 positions.
    prompt: [B, P] int token ids (left-padded prompts: the cache marks the padding).
    rng: key for sampling (unused, and may be None, when greedy).
    max_len: static number of steps and output length L.
    eos_id: ends a row (None: rows run to max_len).
    max_lengths: optional [B] per-row limits <= max_len, with EOS forced at the last one (needs
      eos_id). Without them no EOS is forced.
  Returns:
    Decoded(tokens [B, L], lengths [B], logprobs [B]).
  """
  rng = _checked_rng(rng, temperature, max_lengths is not None and eos_id is None)
  batch, prompt_len = prompt.shape
  limits = None if max_lengths is None else _row_limits(max_lengths, max_len)
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)

  def emit(i, logits, state):
    """Choose output token i from the step's logits [B, T, V]; finished rows get pad_id."""
    tokens, cache, done, lengths, total, rng = state
    logprobs = _next_logprobs(logits, eos_id, None if limits is None else i + 1 >= limits)
    rng, step_rng = jax.random.split(rng)
    # Sampling from log-probabilities (logits shifted per row) draws from the same distribution,
    # and greedy then picks exactly what beam search ranks first.
    token = sample(logprobs, step_rng)
    token_logprob = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    tokens = tokens.at[:, i].set(jnp.where(done, pad_id, token))
    total = total + jnp.where(done, 0.0, token_logprob)
    lengths = lengths + (~done).astype(jnp.int32)
    if eos_id is not None:
      done = done | (token == eos_id)
    return tokens, cache, done, lengths, total, rng

  def cond(carry):
    i, (_, _, done, *_) = carry
    return (i < max_len) & ~jnp.all(done)

  def body(carry):
    i, state = carry
    tokens, cache = state[:2]
    logits, cache = step_fn(jax.lax.dynamic_index_in_dim(tokens, i - 1, axis=1), cache, prompt_len + i - 1)
    return i + 1, emit(i, logits, (tokens, cache, *state[2:]))

  logits, cache = step_fn(jnp.asarray(prompt, jnp.int32), cache, jnp.int32(0))
  state = (jnp.full((batch, max_len), pad_id, jnp.int32), cache, jnp.zeros((batch,), bool),
           jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32), rng)
  _, (tokens, _, _, lengths, total, _) = jax.lax.while_loop(cond, body, (jnp.int32(1), emit(0, logits, state)))
  return Decoded(tokens, lengths, total)


def _checked_rng(rng: jax.Array | None, temperature: float, limits_without_eos: bool) -> jax.Array:
  """decode's rng (a fixed key when greedy decoding is given none), or a ValueError for arguments
  that contradict each other."""
  if limits_without_eos:
    raise ValueError('max_lengths forces EOS at each row\'s limit, so it needs an eos_id.')
  if rng is None:
    if temperature != 0.0:
      raise ValueError('Sampling (temperature > 0) needs an rng key.')
    rng = jax.random.key(0)  # split along but never read by argmax
  return rng


def beam_search(step_fn: StepFn, cache: Any, prompt: jax.Array, *, beam_size: int, max_len: int, eos_id: int,
                pad_id: int = 0, alpha: float = 0.6, max_lengths: jax.Array | None = None) -> BeamResult:
  """Beam search with the GNMT length penalty (see the module docstring for the rules).

  Args:
    step_fn: the model's step function; the prompt is fed on B rows, every later step on B * K.
    cache: the initial cache for B rows (tiled by beam after the prompt).
    prompt: [B, P] int token ids, e.g. [B, 1] BOS.
    beam_size: K.
    max_len: static output length L; max_lengths: optional [B] per-row limits <= max_len.
    alpha: length-penalty exponent (0: rank by log-probability).
  Returns:
    BeamResult with the K best finished hypotheses per row, best first.
  """
  (batch, prompt_len), k = prompt.shape, beam_size
  limits = _row_limits(jnp.full((batch,), max_len) if max_lengths is None else max_lengths, max_len)
  expand = functools.partial(_expand_beams, eos_id=eos_id, limits=limits, alpha=alpha)

  def cond(carry):
    i, _, _, state = carry
    return (i < max_len) & ~jnp.all(state[-1])

  def body(carry):
    i, last, cache, state = carry
    logits, cache = step_fn(last.reshape(-1, 1), cache, prompt_len + i - 1)
    state, last, parent = expand(i, logits, state)
    return i + 1, last, gather_beams(cache, parent, k), state  # the cache follows the parent beams

  logits, cache = step_fn(jnp.asarray(prompt, jnp.int32), cache, jnp.int32(0))
  # Only beam 0 is live at the start, so the first expansions are not K copies of each other.
  live_logprob = jnp.broadcast_to(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (batch, k))
  empty = jnp.full((batch, k, max_len), pad_id, jnp.int32)
  state = (empty, live_logprob, empty, jnp.full((batch, k), -jnp.inf), jnp.full((batch, k), -jnp.inf),
           jnp.zeros((batch,), bool))
  # The K copies of a row's cache are identical, so the first expansion needs no reordering.
  state, last, _ = expand(0, tile_beams(logits[:, -1:], k), state)
  *_, state = jax.lax.while_loop(cond, body, (jnp.int32(1), last, tile_beams(cache, k), state))
  fin_tokens, fin_scores, fin_logprob = state[2:5]
  return BeamResult(fin_tokens, fin_scores, fin_logprob)


def _top(values: jax.Array, count: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The `count` best along axis 1 of values [B, M], with arrays [B, M, ...] gathered alike."""
  best, index = jax.lax.top_k(values, count)
  gather = lambda a: jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1)
  return (best, *[gather(a) for a in arrays])


def _expand_beams(i, logits: jax.Array, state: tuple, *, eos_id: int, limits: jax.Array, alpha: float):
  """Extend beam_search's live hypotheses by output token i from the step's logits [B * K, T, V].

  state: (live tokens [B, K, L], live log-probabilities [B, K], finished tokens [B, K, L], their
  scores and log-probabilities [B, K], done rows [B]). Returns the new state, and the last token
  [B, K] and parent beam [B, K] of every live hypothesis.
  """
  live_tokens, live_logprob, fin_tokens, fin_scores, fin_logprob, done = state
  batch, k = live_logprob.shape
  logprobs = _next_logprobs(logits, eos_id, jnp.repeat(i + 1 >= limits, k))
  vocab = logprobs.shape[-1]
  candidates = (live_logprob[:, :, None] + logprobs.reshape(batch, k, vocab)).reshape(batch, k * vocab)
  cand_logprob, flat = jax.lax.top_k(candidates, 2 * k)
  cand_beam, cand_token = flat // vocab, (flat % vocab).astype(jnp.int32)
  cand_tokens = jnp.take_along_axis(live_tokens, cand_beam[:, :, None], axis=1)
  cand_tokens = cand_tokens.at[:, :, i].set(cand_token)
  is_eos = cand_token == eos_id

  # EOS among the top K expansions finishes a hypothesis (only while its row is not done).
  finishing = is_eos & (jnp.arange(2 * k)[None, :] < k) & jnp.isfinite(cand_logprob) & ~done[:, None]
  cand_scores = jnp.where(finishing, cand_logprob / length_penalty(i + 1.0, alpha), -jnp.inf)
  fin_scores, fin_tokens, fin_logprob = _top(
      jnp.concatenate([fin_scores, cand_scores], axis=1), k,
      jnp.concatenate([fin_tokens, cand_tokens], axis=1), jnp.concatenate([fin_logprob, cand_logprob], axis=1))

  # The best K expansions that did not end stay live.
  live_logprob, live_tokens, last, parent = _top(
      jnp.where(is_eos, -jnp.inf, cand_logprob), k, cand_tokens, cand_token, cand_beam)
  cannot_improve = fin_scores[:, -1] >= live_logprob[:, 0] / length_penalty(i + 1.0, alpha)
  done = done | cannot_improve | (i + 1 >= limits)
  return (live_tokens, live_logprob, fin_tokens, fin_scores, fin_logprob, done), last, parent


def strip(tokens: np.ndarray, eos_id: int) -> list[list[int]]:
  """[N, L] output tokens -> per row the ids before the first EOS (host side, for detokenizing)."""
  rows = []
  for row in np.asarray(tokens).tolist():
    rows.append(row[: row.index(eos_id)] if eos_id in row else row)
  return rows
