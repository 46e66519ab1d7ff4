"""Nadaraya-Watson kernel regression seen as attention pooling (D2L ch. 10.2).

The prediction at a query q is an attention-weighted average of the training targets (values)
y_i, with weights from a Gaussian kernel on the distance to the training inputs (keys) x_i:

  f(q) = sum_i softmax_i(-((q - x_i) w)^2 / 2) y_i

Non-parametric: w = 1, nothing is learned. Parametric: the width w is one learned scalar, so a
larger w gives a narrower kernel and sharper attention.

Shape legend: Q queries, K keys; leading batch axes are arbitrary.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import masked_softmax


@dataclasses.dataclass(frozen=True)
class NadarayaWatsonConfig:
  parametric: bool = True
  initial_width: float = 0.0  # the starting w; 0 = drawn from U(0, 1) as in D2L


class NadarayaWatson(nnx.Module):
  """Gaussian-kernel attention pooling.

  Call: queries [..., Q], keys [..., K], values [..., K], key_valid bool broadcastable to
  [..., Q, K] (False: the key is ignored, e.g. a training point predicting itself)
  -> (predictions [..., Q], attention weights [..., Q, K]).
  """

  def __init__(self, parametric: bool = True, *, rngs: nnx.Rngs | None = None, width: float | None = None):
    """`width`: the initial w (parametric) or the fixed one (non-parametric, default 1).

    A parametric model without `width` draws w from U(0, 1) like D2L, which needs `rngs`.
    """
    self.parametric = parametric
    if not parametric:
      self.width = 1.0 if width is None else float(width)
    elif width is not None:
      self.width = nnx.Param(jnp.array([width], jnp.float32))
    elif rngs is None:
      raise ValueError('A parametric NadarayaWatson needs rngs (or an initial width=...).')
    else:
      self.width = nnx.Param(jax.random.uniform(rngs.params(), (1,)))

  def scores(self, queries: jax.Array, keys: jax.Array) -> jax.Array:
    """[..., Q], [..., K] -> Gaussian-kernel logits [..., Q, K]."""
    width = self.width[...] if self.parametric else self.width
    distance = queries[..., :, None] - keys[..., None, :]
    return -jnp.square(distance * width) / 2

  def __call__(self, queries, keys, values, key_valid=None):
    weights = masked_softmax(self.scores(queries, keys), key_valid)
    return jnp.einsum('...qk,...k->...q', weights, values), weights
