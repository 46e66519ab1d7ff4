"""Rotary position embeddings (RoPE; Su et al. 2021), as Llama and `transformers` define them.

Instead of adding a position vector to the token embedding, attention rotates every query and key
by an angle proportional to its position: the pair of features (x_i, x_{i + D/2}) of a head is
turned by position * inv_freq[i]. A query at position m and a key at position n then score
q_m . k_n = f(q, k, m - n): attention sees relative positions only, so a token's rotation depends
on its own position alone (packed segments restart at 0, a cached key keeps the rotation it was
written with).

The feature pairs are the two halves of the head ("rotate_half", the layout of Hugging Face's
Llama checkpoints), not adjacent features (the original paper's interleaving): checkpoints then
load with no permutation of the query/key projections.

inv_freq[i] = theta^(-2i / D), i < D/2. Llama 3 stretches the long wavelengths for long contexts
(`llama3_inv_freq`): wavelengths beyond original_max_len / low_freq_factor are divided by
`factor`, those below original_max_len / high_freq_factor kept, those between interpolated.

Shape legend: B batch, L length, H heads, D head width.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """theta: the base wavelength; scaling: 'none' | 'llama3' (the other fields are Llama 3's)."""
  theta: float = 10000.0
  scaling: str = 'none'
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192


ROPE_SCALINGS = ('none', 'llama3')


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
  """[D/2] float32 angular speed of each feature pair, Llama-3-scaled when rope.scaling says so."""
  if head_dim % 2:
    raise ValueError(f'Rotary embeddings need an even head width, got {head_dim}.')
  if rope.scaling not in ROPE_SCALINGS:
    raise ValueError(f'rope scaling {rope.scaling!r} is not one of {ROPE_SCALINGS}.')
  # float32 as transformers computes them, so imported checkpoints see the very same angles.
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv_freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
  return llama3_inv_freq(inv_freq, rope) if rope.scaling == 'llama3' else inv_freq


def llama3_inv_freq(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
  """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, the band
  between blended linearly in original_max_len / wavelength."""
  wavelength = 2 * np.pi / inv_freq
  long_wavelength = rope.original_max_len / rope.low_freq_factor
  short_wavelength = rope.original_max_len / rope.high_freq_factor
  slowed = np.where(wavelength > long_wavelength, inv_freq / rope.factor, inv_freq)
  blend = (rope.original_max_len / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
  blended = (1 - blend) * slowed / rope.factor + blend * slowed
  in_between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
  return np.where(in_between, blended, slowed).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: Sequence[float]) -> jax.Array:
  """Rotate x [B, L, H, D] by its positions [B, L] (int): each half-pair (x1, x2) becomes
  (x1 cos - x2 sin, x2 cos + x1 sin) at angle position * inv_freq ([D/2]). The angles are
  computed in float32 whatever x's dtype."""
  angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [B, L, D/2]
  cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)  # [B, L, 1, D/2]: every head alike
  sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
