"""Autoregressive sampling with a key/value cache, shared by every decoder-only model.

`generate` prefills the cache with the whole (left-padded) prompt in one call, then runs a
compiled `lax.while_loop` producing one token per step until `max_new_tokens` or until every row
has emitted EOS. Greedy, temperature, top-k and top-p (nucleus) sampling. Beam search for
encoder-decoders lives beside it in models/beam_search.py.

Shape legend: B batch, P prompt length (padded), N new tokens, V vocabulary, L_max = P + N.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

# step_fn(tokens [B, T], positions [B, T], key_valid [B, L_max], cache, cache_index)
#   -> (logits [B, T, V], cache)
StepFn = Callable


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


def generate(step_fn: StepFn, cache, prompt: jax.Array, prompt_valid: jax.Array, rng: jax.Array, *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, pad_id: int = 0) -> tuple[jax.Array, jax.Array]:
  """Sample continuations of left-padded prompts (call under jit with the settings static).

  Args:
    step_fn: the model's cached forward (see StepFn); `cache` is sized for L_max = P + N.
    prompt: [B, P] left-padded token ids; prompt_valid: [B, P] bool, False on the padding.
  Returns:
    (tokens [B, N]: new tokens, `pad_id` after a row's EOS; lengths [B]: new tokens up to and
    including EOS).
  """
  batch, prompt_len = prompt.shape
  key_valid = jnp.concatenate([prompt_valid, jnp.ones((batch, max_new_tokens), bool)], axis=1)
  positions = jnp.maximum(jnp.cumsum(prompt_valid, axis=1) - 1, 0)
  logits, cache = step_fn(prompt, positions, key_valid, cache, 0)
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  rng, first_rng = jax.random.split(rng)
  first = sample(logits[:, -1], first_rng)
  next_position = positions[:, -1] + 1
  out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.zeros((batch,), bool) if eos_id is None else first == eos_id
  lengths = jnp.ones((batch,), jnp.int32)

  def cond(carry):
    i, _, _, done, *_ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, out, cache, done, lengths, rng = carry
    previous = out[:, i - 1]
    position = (next_position + i - 1)[:, None]
    logits, cache = step_fn(previous[:, None], position, key_valid, cache, prompt_len + i - 1)
    rng, step_rng = jax.random.split(rng)
    token = jnp.where(done, pad_id, sample(logits[:, -1], step_rng))
    out = out.at[:, i].set(token)
    lengths = lengths + (~done).astype(jnp.int32)
    if eos_id is not None:
      done = done | (token == eos_id)
    return i + 1, out, cache, done, lengths, rng

  _, out, _, _, lengths, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, cache, done, lengths, rng))
  return out, lengths
