"""What several processes of one run decide together."""
from __future__ import annotations

import jax
import numpy as np


def agreed(flag: bool) -> bool:
  """Process 0's `flag`, on every process (a no-op with one process)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # only multi-process runs need it
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))
