"""How close two floating-point computations of the same value must be: one rule for every test.

Two programs that compute the same mathematical value rarely agree to the last bit: XLA:CPU picks
its vector width, loop blocking and fusion by the CPU it runs on (AVX-512 or AVX2 or SSE), and so
sums the terms of every reduction (a matmul's dot products, a softmax's normalizer, a gradient's
sum over the batch) in another order. PyTorch, NumPy and a scanned or chunked version of a model
reorder them again. Each addition rounds by at most half an ulp, eps / 2 relative; a reduction of
n terms in any order is within about eps * sqrt(n) * (the sum of the terms' magnitudes) of the
exact sum when the rounding errors are independent (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., sections 4.2 and 3.1); the worst-case bound is n instead of sqrt(n). A value
that passes through several reductions (layers, a loss, its gradient) carries all of theirs.

So `tolerance` is

    atol = SAFETY * eps(dtype) * sqrt(terms) * scale

  dtype   the precision of the arithmetic (float32: eps = 1.19e-7; bfloat16: 7.8e-3).
  terms   the length of the reductions behind the compared values, added up along the chain of
          computations they pass through (a dot product over E = 64 in each of 2 layers, then a
          sum over 15 batch positions: 2 * 64 + 15). Count each reduction once, not its repeats.
  scale   the size of the values: the largest magnitude among the desired values (the default),
          or the size of the summed terms where a reduction cancels. A tree of gradients is compared
          at its largest value (`assert_trees_close`): a leaf that cancels to nothing in exact
          arithmetic (a key bias's gradient: softmax ignores a shift of all its scores) still
          carries rounding of the size of the terms it summed.
  SAFETY  8: the sqrt(n) estimate is a typical error, not a bound, and the slack costs nothing a
          real defect would hide behind (below).

A real defect moves a value by far more. A gradient scaled by (1 + 1e-3), a missing scale, a wrong
sign or a dropped term of a loss changes the largest values by 1e-3 of their size or more, while
the tolerance is 8 * 1.19e-7 * sqrt(terms) of it: below 1e-3 for any reduction shorter than
a million terms (tests/test_numerics.py shows both sides: reordered sums pass, such defects fail).

Bit-equality (`np.testing.assert_array_equal`) stays where it is the point: the same compiled
program run twice, a resume against an uninterrupted run, a cache read back, integer outputs.
"""
from __future__ import annotations

import jax
import numpy as np

SAFETY = 8.0


def tolerance(*, terms: int, scale: float, dtype=np.float32) -> float:
  """The absolute tolerance for two computations, in `dtype`, of values of size `scale` that come
  from reductions of `terms` terms in all (the module docstring's rule)."""
  if terms < 1 or not np.isfinite(scale):
    raise ValueError(f'terms={terms} must be >= 1 and scale={scale} finite.')
  return SAFETY * float(np.finfo(np.dtype(dtype)).eps) * float(np.sqrt(terms)) * float(scale)


def assert_close(actual, desired, *, terms: int, scale: float | None = None, dtype=None, err_msg: str = '') -> None:
  """Assert that `actual` equals `desired` up to summation order: |actual - desired| <= `tolerance`
  elementwise, with `scale` (default: max |desired|) and the precision of `dtype` (default:
  `least_precise` of the two)."""
  dtype = dtype or least_precise(actual, desired)
  actual, desired = (np.asarray(x).astype(np.float64) for x in (actual, desired))
  if scale is None:
    scale = float(np.max(np.abs(desired))) if desired.size else 0.0
  atol = tolerance(terms=terms, scale=scale, dtype=dtype)
  np.testing.assert_allclose(actual, desired, rtol=0, atol=atol,
                             err_msg=f'{err_msg} (tolerance {atol:.3g}: terms={terms}, scale={scale:.3g}, {dtype})')


def assert_trees_close(actual, desired, *, terms: int, err_msg: str = '') -> None:
  """`assert_close` leaf by leaf for two pytrees of the same structure (gradients, parameters), every
  leaf at the scale of the largest magnitude in `desired`."""
  leaves = jax.tree.leaves_with_path(desired)
  actual_leaves = jax.tree.leaves(actual)
  assert len(actual_leaves) == len(leaves), (len(actual_leaves), len(leaves))
  scale = max((float(np.max(np.abs(np.asarray(x)))) for _, x in leaves if np.size(x)), default=0.0)
  for (path, want), got in zip(leaves, actual_leaves):
    assert_close(got, want, terms=terms, scale=scale, err_msg=f'{err_msg}{jax.tree_util.keystr(path)}')


def least_precise(*arrays):
  """The floating dtype of largest epsilon among `arrays`, and never finer than float32: the
  models compute in float32 at best, so a value read back as a Python float or compared with a
  float64 NumPy reference still carries float32 rounding."""
  floats = [np.asarray(a).dtype for a in arrays]
  floats = [d for d in floats if np.issubdtype(d, np.floating) or d.name == 'bfloat16'] + [np.dtype(np.float32)]
  return max(floats, key=lambda d: np.finfo(d).eps)


def transformer_terms(layers: int, width: int, mlp_width: int, length: int, vocab: int = 0, positions: int = 0) -> int:
  """`terms` for the outputs of `layers` Transformer blocks: per block the projections, attention's
  head dot products and the norms' statistics (8 x width in all), the MLP's down projection
  (mlp_width) and attention's two sums over at most `length` keys; then the output layer (width),
  the softmax normalizer over `vocab` ids for a loss, and for a parameter's gradient the sum over
  the batch's `positions`."""
  return layers * (8 * width + mlp_width + 2 * length) + width + vocab + positions
