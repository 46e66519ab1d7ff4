"""Per-device memory estimate of a training step, printed at start-up to warn before an obvious OOM.

Parameters and optimizer state are counted exactly from the sharded abstract state (each leaf's
shard shape on the chosen mesh). Gradients are one more copy of the parameter shards. Activations
saved for the backward pass are estimated per layer and token, for the transformer families
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4,
counted in elements instead of fp16 bytes, without dropout masks):

  attention sub-block   LN in, LN out, Q, K, V, context           6E  +  2 H S  (scores, weights)
  MLP sub-block         LN in, LN out, up out, activation out     2E  +  2F
  residual stream                                                 1E
  -> 9E + 2F + 2HS per token and layer; model.remat='dots' keeps only the projection outputs and
  the block input (6E + F); 'full' keeps only the block input (E) and recomputes one block at a time.

plus the float32 logits and their gradient (2V per token). B S tokens per device are the global
batch over mesh data x fsdp, divided by gradient-accumulation micro-batches; the F and H terms
are split by mesh.tensor. Families without width / heads (RNNs) get parameters and optimizer only.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

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


def activation_bytes(config, mesh) -> int | None:
  """Saved activations of one micro-batch per device (see the module docstring), or None."""
  m = config.model
  width, heads = m.get('width'), m.get('num_heads')
  layers = m.get('num_layers') or (m.get('encoder_layers', 0) + m.get('decoder_layers', 0))
  if not (width and heads and layers):
    return None
  hidden = m.get('mlp_dim') or m.get('mlp_ratio', 4) * width
  seq = config.data.seq_len
  tensor = mesh.shape['tensor']
  split = lambda n: n / tensor
  per_token = {'none': 9 * width + split(2 * hidden + 2 * heads * seq),
               'dots': 6 * width + split(hidden),
               'full': width}[m.get('remat', 'none')]
  one_block = 9 * width + split(2 * hidden + 2 * heads * seq)  # recomputed during the backward pass
  vocab = m.get('vocab_size') or config.data.vocab_size
  micro_batch = config.train.batch_size / (mesh.shape['data'] * mesh.shape['fsdp']) / config.train.grad_accum
  tokens = micro_batch * seq
  itemsize = np.dtype(m.get('dtype', 'float32')).itemsize
  saved = tokens * itemsize * (layers * per_token + (one_block if m.get('remat', 'none') != 'none' else 0))
  return int(saved + tokens * 4 * split(2 * vocab))


def available_bytes() -> int | None:
  device = jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  if device.platform == 'cpu':
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // jax.local_device_count()
  return None


def estimate(config, abstract_state, state_sharding, mesh, available: int | None = None) -> MemoryEstimate:
  """`abstract_state`: the trainer's TrainState (abstract or concrete) and its shardings; `available`:
  the memory per device of the devices it is for (None: this process's, `available_bytes()`)."""
  params = sharded_bytes(abstract_state.params, state_sharding.params)
  return MemoryEstimate(params=params, optimizer=sharded_bytes(abstract_state.opt_state, state_sharding.opt_state),
                        gradients=params, activations=activation_bytes(config, mesh),
                        available=available_bytes() if available is None else available)


def log_estimate(config, abstract_state, state_sharding, mesh) -> MemoryEstimate:
  """Print the estimate (process 0), with a warning and the fixes when it nears the device's memory."""
  result = estimate(config, abstract_state, state_sharding, mesh)
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
