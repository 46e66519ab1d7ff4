"""Greedy and beam search (models/decoding.py) on a synthetic model with a reference in NumPy.

The toy model's next-token logits depend on the previous token, the position and a running
count kept in the cache, so a beam search that reordered its cache wrongly would report
log-probabilities that a replay of its own outputs does not reproduce.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decoding
from numerics import assert_close, tolerance

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

VOCAB, BOS, EOS, PAD, COUNTED = 7, 2, 1, 0, 3
MAX_LEN = 8
# A hypothesis's log-probability: each step's normalizer over the vocabulary, summed over <= 8 steps.
TERMS = MAX_LEN * (VOCAB + 1)


def toy_model(seed=0, vocab=VOCAB, max_len=MAX_LEN):
  """(parameters for `toy_step`, the same model's logits in NumPy)."""
  rng = np.random.default_rng(seed)
  params = {'table': rng.normal(size=(vocab, vocab)).astype(np.float32) * 2.0,
            'drift': rng.normal(size=(max_len, vocab)).astype(np.float32),
            'bonus': rng.normal(size=(vocab,)).astype(np.float32)}

  def logits_np(last, index, count):
    return params['table'][last] + params['drift'][index] + count * params['bonus']

  return params, logits_np


def toy_step(params):
  def step_fn(tokens, cache, index):
    last = tokens[:, 0]
    count = cache['count'] + (last == COUNTED)
    logits = params['table'][last] + params['drift'][index] + count[:, None] * params['bonus']
    return logits[:, None, :], {'count': count}
  return step_fn


def log_softmax(x):
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def replay_logprob(logits_np, sequence, limit):
  """Log-probability of `sequence` (ending with EOS) under the toy model, EOS forced at `limit`."""
  total, last, count = 0.0, BOS, 0
  for index, token in enumerate(sequence):
    count += last == COUNTED
    logprobs = log_softmax(logits_np(last, index, count))
    if index + 1 >= limit:
      logprobs = np.where(np.arange(len(logprobs)) == EOS, logprobs, -np.inf)
    total += logprobs[token]
    last = token
  return total


def hypothesis(row):
  row = list(np.asarray(row))
  assert EOS in row, row
  end = row.index(EOS) + 1
  assert all(t == PAD for t in row[end:]), row
  return row[:end]


def gnmt(logprob, length, alpha):
  return logprob / ((5.0 + length) / 6.0) ** alpha


@functools.partial(jax.jit, static_argnames=('beam_size', 'alpha'))
def run_both(params, limits, beam_size, alpha):
  """(greedy, beam) results for len(limits) rows; compiled once per shape, beam size and alpha."""
  step_fn, batch = toy_step(params), limits.shape[0]
  cache = {'count': jnp.zeros((batch,), jnp.int32)}
  bos = jnp.full((batch, 1), BOS, jnp.int32)
  greedy = decoding.decode(step_fn, cache, bos, max_len=MAX_LEN, eos_id=EOS, max_lengths=limits)
  beam = decoding.beam_search(step_fn, cache, bos, beam_size=beam_size, max_len=MAX_LEN, eos_id=EOS,
                              alpha=alpha, max_lengths=limits)
  return greedy, beam


def test_greedy_matches_numpy_argmax():
  # Rows differ through their per-row limits.
  limits = np.array([1, 3, 5, 8])
  params, logits_np = toy_model(1)
  greedy, _ = run_both(params, jnp.asarray(limits), 1, 0.0)
  for row, limit in zip(np.asarray(greedy.tokens), limits):
    expected, last, count = [], BOS, 0
    while not expected or expected[-1] != EOS:
      count += last == COUNTED
      logprobs = log_softmax(logits_np(last, len(expected), count))
      if len(expected) + 1 >= limit:
        logprobs[np.arange(VOCAB) != EOS] = -np.inf
      last = int(np.argmax(logprobs))
      expected.append(last)
    assert hypothesis(row) == expected
    assert len(expected) <= limit


@pytest.mark.parametrize('alpha', [0.0, 0.6])
def test_beam_size_one_is_greedy(alpha):
  for seed in range(4):
    params, _ = toy_model(seed)
    greedy, beam = run_both(params, jnp.asarray([3, 5, 8, 8]), 1, alpha)
    np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
    assert_close(beam.logprobs[:, 0], greedy.logprobs, terms=TERMS)


@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.0])
def test_beam_scores_are_replayable_and_beat_greedy(alpha):
  params, logits_np = toy_model(2)
  limits = np.array([2, 4, 6, 8, 8, 8])
  greedy, beam = run_both(params, jnp.asarray(limits), 4, alpha)
  for b, limit in enumerate(limits):
    greedy_tokens = hypothesis(greedy.tokens[b])
    greedy_score = gnmt(replay_logprob(logits_np, greedy_tokens, limit), len(greedy_tokens), alpha)
    scores = np.asarray(beam.scores[b])
    slack = tolerance(terms=TERMS + 2, scale=abs(greedy_score))  # a tie may round either way
    assert np.all(np.diff(scores[np.isfinite(scores)]) <= slack), 'hypotheses must be sorted best first'
    assert scores[0] >= greedy_score - slack
    for k in range(4):
      if not np.isfinite(scores[k]):
        continue
      tokens = hypothesis(beam.tokens[b, k])
      assert len(tokens) <= limit
      logprob = replay_logprob(logits_np, tokens, limit)
      assert_close(beam.logprobs[b, k], logprob, terms=TERMS)
      assert_close(scores[k], gnmt(logprob, len(tokens), alpha), terms=TERMS + 2)  # + the length penalty


def test_short_poor_hypotheses_do_not_end_the_search():
  # A peaked model: the good path is 6 tokens long; any deviation makes EOS almost certain next.
  # Poor hypotheses then finish early and fill all beam slots long before the good one ends.
  good = jnp.array([4, 5, 3, 6, 4, EOS])

  def step_fn(tokens, cache, index):
    deviated = cache['deviated'] | ((index > 0) & (tokens[:, 0] != good[jnp.maximum(index - 1, 0)]))
    target = jnp.where(deviated, EOS, good[jnp.minimum(index, 5)])
    return 10.0 * jax.nn.one_hot(target, VOCAB)[:, None], {'deviated': deviated}

  cache = {'deviated': jnp.zeros((2,), bool)}
  bos = jnp.full((2, 1), BOS, jnp.int32)
  # Jitted: one compilation each, not one per op of the search.
  greedy = jax.jit(lambda: decoding.decode(step_fn, cache, bos, max_len=MAX_LEN, eos_id=EOS))()
  assert hypothesis(greedy.tokens[0]) == good.tolist()
  for alpha in (0.0, 0.6):
    beam = jax.jit(lambda: decoding.beam_search(step_fn, cache, bos, beam_size=3, max_len=MAX_LEN, eos_id=EOS,
                                                alpha=alpha))()
    np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)


def test_wide_beam_finds_the_exhaustive_optimum():
  # 4 tokens, at most 4 steps: 64 beams never prune, so the best hypothesis is the true optimum.
  vocab, limit, alpha = 4, 4, 0.6
  params, logits_np = toy_model(3, vocab=vocab)
  _, beam = run_both(params, jnp.asarray([limit]), 64, alpha)
  best = -np.inf
  for length in range(1, limit + 1):
    for prefix in itertools.product([t for t in range(vocab) if t != EOS], repeat=length - 1):
      sequence = list(prefix) + [EOS]
      best = max(best, gnmt(replay_logprob(logits_np, sequence, limit), length, alpha))
  assert_close(beam.scores[0, 0], best, terms=TERMS + 2)


def test_max_lengths_for_source_lengths():
  limits = decoding.max_lengths_for(jnp.array([0, 4, 100]), 1.5, 2, 20)
  np.testing.assert_array_equal(limits, [2, 8, 20])


def test_gather_beams_reorders_rows():
  tree = {'x': jnp.arange(6)[:, None] * jnp.ones((6, 2))}  # B=2, K=3
  reordered = decoding.gather_beams(tree, jnp.array([[2, 2, 0], [1, 0, 0]]), 3)
  np.testing.assert_array_equal(reordered['x'][:, 0], [2, 2, 0, 4, 3, 3])


def test_strip_cuts_at_eos():
  assert decoding.strip(np.array([[5, 6, EOS, 0], [4, 4, 4, 4]]), EOS) == [[5, 6], [4, 4, 4, 4]]
