"""Per-device memory estimate of a training step, printed at start-up to warn before an obvious OOM.

Parameters and optimizer state are counted exactly from the sharded abstract state (each leaf's
shard shape on the chosen mesh), so each `train.optimizer` is counted as it is: AdamW and
schedule-free AdamW two copies of the parameters, Muon one of its matrices and two of the rest,
Lion one, Adafactor its factored rows and columns (tests/test_optimizers.py). Gradients are one more
copy of the parameter shards. (Schedule-free's evaluations and saves make one more, passing, copy:
the averaged parameters.) Activations
saved for the backward pass are estimated per layer and token, for the transformer families
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4,
counted in elements instead of fp16 bytes, without dropout masks):

  attention sub-block   LN in, LN out, Q, K, V, context           6E  +  2 H S  (scores, weights)
  MLP sub-block         LN in, LN out, up out, activation out     2E  +  2F
  residual stream                                                 1E
  -> 9E + 2F + 2HS per token and layer; model.remat='dots' keeps only the projection outputs and
  the block input (6E + F); 'full' keeps only the block input (E) and recomputes one block at a time.
  With model.qk_norm the normalised Q and K are kept too: 2E more without remat ('dots' and 'full'
  recompute them).

plus the float32 logits and their gradient (2V per token). E, H, F, V, the layer count, the
compute dtype and the remat policy come from the resolved model config's `block_shape()`
(models/layers.py BlockShape); S is data.seq_len. B S tokens per device are the global batch over
mesh data x fsdp x expert, divided by gradient-accumulation micro-batches; the F and H terms are split by
mesh.tensor. Models without Transformer blocks (no `block_shape()`: the RNNs, kernel regression)
get parameters and optimizer only.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from train import sharding

MB = 2**20
WARN_FRACTION = 0.9


@dataclasses.dataclass
class MemoryEstimate:
  """Bytes per device."""
  params: int
  optimizer: int
  gradients: int
  activations: int | None
  available: int | None  # device memory (TPU/GPU) or host RAM per local device (CPU)

  @property
  def total(self) -> int:
    return self.params + self.optimizer + self.gradients + (self.activations or 0)

  def as_mb(self) -> dict[str, float | None]:
    sizes = dataclasses.asdict(self)
    sizes['total'] = self.total
    return {k: None if v is None else round(v / MB, 1) for k, v in sizes.items()}

  def too_big(self) -> bool:
    return self.available is not None and self.total > WARN_FRACTION * self.available

  def line(self) -> str:
    mb = self.as_mb()
    activations = 'unknown' if mb['activations'] is None else f'{mb["activations"]:,.0f}'
    available = '' if mb['available'] is None else f' of {mb["available"]:,.0f} MB available'
    return (f'Memory per device (estimate): parameters {mb["params"]:,.0f} MB + optimizer {mb["optimizer"]:,.0f} MB '
            f'+ gradients {mb["gradients"]:,.0f} MB + activations {activations} MB = {mb["total"]:,.0f} MB{available}.')


def sharded_bytes(tree, shardings) -> int:
  """Bytes of one device's shards of a pytree of arrays (or ShapeDtypeStructs) placed by `shardings`."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shape = sharding.shard_shape(leaf.shape) if leaf.shape else ()
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def activation_bytes(config, model_config, mesh) -> int | None:
  """Saved activations of one micro-batch per device (see the module docstring) of the model
  `model_config` describes, trained with `config`'s batch and sequence length; None without
  `model_config.block_shape()`."""
  if not hasattr(model_config, 'block_shape'):
    return None
  shape = model_config.block_shape()
  seq = config.data.seq_len
  split = lambda n: n / mesh.shape['tensor']
  one_block = (11 if shape.qk_norm else 9) * shape.width + split(2 * shape.mlp_width + 2 * shape.heads * seq)
  per_token = {'none': one_block, 'dots': 6 * shape.width + split(shape.mlp_width), 'full': shape.width}[shape.remat]
  recomputed = one_block if shape.remat != 'none' else 0  # one block's, live again during its backward pass
  micro_batch = config.train.batch_size / sharding.batch_shards(mesh) / config.train.grad_accum
  tokens = micro_batch * seq
  saved = tokens * np.dtype(shape.dtype).itemsize * (shape.layers * per_token + recomputed)
  return int(saved + tokens * 4 * split(2 * shape.vocab))


def available_bytes() -> int | None:
  device = jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if device.platform == 'cpu':
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // jax.local_device_count()
  return None


def estimate(config, model_config, abstract_state, state_sharding, mesh,
             available: int | None = None) -> MemoryEstimate:
  """`model_config`: the resolved model config (the task's); `abstract_state`: the trainer's
  TrainState (abstract or concrete) and its shardings; `available`: the memory per device of the
  devices it is for (None: this process's, `available_bytes()`)."""
  trained = sharded_bytes(abstract_state.params, state_sharding.params)  # the frozen ones have no gradient
  params = trained + sharded_bytes(abstract_state.frozen, state_sharding.frozen)
  return MemoryEstimate(params=params, optimizer=sharded_bytes(abstract_state.opt_state, state_sharding.opt_state),
                        gradients=trained, activations=activation_bytes(config, model_config, mesh),
                        available=available_bytes() if available is None else available)


def log_estimate(config, model_config, abstract_state, state_sharding, mesh) -> MemoryEstimate:
  """Print the estimate (process 0), with a warning and the fixes when it nears the device's memory."""
  result = estimate(config, model_config, abstract_state, state_sharding, mesh)
  if jax.process_index() == 0:
    print(result.line(), flush=True)
    if result.too_big():
      print('WARNING: this is more than 90% of the memory per device; expect an out-of-memory error. Lower '
            'train.batch_size, raise train.grad_accum, set model.remat=full (where the model has it), or shard '
            'parameters and optimizer over more devices with mesh.fsdp.', flush=True)
  return result


def xla_sizes_mb(analysis) -> dict[str, float]:
  """XLA's own per-device buffer sizes of a compiled step (`compiled.memory_analysis()`)."""
  fields = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes', 'alias_size_in_bytes')
  return {name.replace('_size_in_bytes', ''): round(getattr(analysis, name) / MB, 1) for name in fields}
