"""Evaluation batches that score every example.

Training batches are endless and full; evaluation must see each example exactly once, so the
last batch of a split that does not divide into batches is filled up. The fillers are copies of
the split's first example (any real example keeps every computation finite: an all-padding row
can make a masked softmax NaN, and NaN x 0 is NaN) with `example_weight` 0; every family's loss
multiplies its per-token or per-example weights by `example_weight` (train/losses.py), so a
filler counts for nothing.
"""
from __future__ import annotations

import grain
import numpy as np

EXAMPLE_WEIGHT = 'example_weight'  # float32 [B]: 1 for a real example, 0 for a filler


def padded_batches(examples: grain.MapDataset, batch_size: int, num_batches: int | None = None) -> grain.MapDataset:
  """`examples` in `num_batches` batches of `batch_size` rows (default: as few as hold them all),
  each row carrying `EXAMPLE_WEIGHT`; rows past the last example are weight-0 fillers.

  Several processes pass their own slice of a split and the same `num_batches` (from the global
  count), so every process runs the same number of eval steps."""
  count = len(examples)
  if count == 0:
    raise ValueError('padded_batches needs at least one example.')
  num_batches = -(-count // batch_size) if num_batches is None else num_batches
  if num_batches * batch_size < count:
    raise ValueError(f'{num_batches} batches of {batch_size} cannot hold {count} examples.')

  def row(i: int) -> dict[str, np.ndarray]:
    real = i < count
    example = examples[i if real else 0]
    return {**example, EXAMPLE_WEIGHT: np.float32(real)}

  return grain.MapDataset.range(num_batches * batch_size).map(row).batch(batch_size)
