"""Device mesh and the partitioning rules of every parameter, in one place.

Mesh axes: 'data' (pure data parallel), 'fsdp' (data parallel whose parameters and optimizer
state are sharded too), 'expert' (expert parallel: a mixture of experts' experts split between
devices, each token sent to its experts' devices and back, models/moe_parallel.py; outside the
experts it is one more data-parallel axis) and 'tensor' (Megatron-style model parallel over heads
and MLP width). The batch is split over ('data', 'fsdp', 'expert').

Models carry no parameter annotations. A parameter's sharding follows from its path, by the first
matching rule in `PARTITION_RULES`, the names being the ones the shared modules use
(MultiHeadAttention: query/key/value/out; FeedForward: up/down; GatedFeedForward: gate/up/down;
MoEFeedForward: router, gate/up/down experts, shared; Embed: embedding). Any other array is
FSDP-sharded over its largest dimension, a fallback that `explicit_rule` makes visible:
tests/test_sharding_rules.py fails when a large array of any preset lands on it. Grouped-query
attention's key and value projections hold K*D columns for K < H heads: 'tensor' splits them only
when it divides K (`kv_head_counts`), so no head is cut in two. An axis that does not divide a
dimension is dropped for that dimension (that dimension is replicated), so every model shards on
any mesh.
Optimizer moments live at the same paths (below `mu/`, `nu/`), so they shard like their parameters.

Activations: models name logical axes at a few points (models/partitioning.py) and
ACTIVATION_RULES maps them to mesh axes while a step is traced inside `use_mesh`. Without them
XLA's partitioner kept FSDP kernels split on their contraction dimension and moved the activations
instead: several times the temporaries per device, and all-reduces of hidden states and logits
every step where weight gathers and gradient reductions suffice (GPT-2 124M with fsdp=8:
measurements/code_comments.csv; docs/accelerators.md, Sharding). Chosen over JAX's explicit sharding mode
(AxisType.Explicit), which fails at trace time at the first embedding lookup of these models and
would need an output sharding at every lookup and a reshard of every FSDP-split kernel before its
matmul (replacing nnx.Linear), where logical names take one call at each of a dozen points.
"""
from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import partitioning

# 'expert' before 'tensor': with expert = 1 every mesh places its devices as before the axis existed.
MESH_AXES = ('data', 'fsdp', 'expert', 'tensor')
BATCH_AXES = ('data', 'fsdp', 'expert')

# (regex searched in the 'a/b/c' path of an array, axis name per dimension); the first rule whose
# pattern matches and whose rank is the array's wins. A rule also covers a stack of such arrays (one
# more, leading, dimension: the layers of `nnx.scan`, e.g. GPT's scan_layers), never split.
PARTITION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r'(query|key|value)/kernel$', ('fsdp', 'tensor')),  # [E, H*D]: split by heads
    (r'(query|key|value)/bias$', ('tensor',)),
    (r'attention/out/kernel$', ('tensor', 'fsdp')),  # [H*D, E]
    (r'(mlp|shared)/(up|gate)/kernel$', ('fsdp', 'tensor')),  # [E, F]: split the hidden width
    (r'(mlp|shared)/(up|gate)/bias$', ('tensor',)),
    (r'(mlp|shared)/down/kernel$', ('tensor', 'fsdp')),  # [F, E]; `shared`: an MoE block's shared experts
    # An MoE block's experts (models/moe.py), [N, E, H] and [N, H, E]: split between devices over 'expert'
    # (models/moe_parallel.py), each expert like a dense MLP.
    (r'mlp/(up|gate)$', ('expert', 'fsdp', 'tensor')),
    (r'mlp/down$', ('expert', 'tensor', 'fsdp')),
    (r'mlp/router/kernel$', ('fsdp', None)),  # [E, N]
    (r'embedding$', ('tensor', 'fsdp')),  # [V, E]: vocabulary split for the tied output layer
    # FSDP alone, over the dimension the largest-dimension fallback picked for every preset:
    (r'(norm/(scale|bias)|(attention/out|mlp/down|shared/down)/bias)$', ('fsdp',)),  # [E]: large only when stacked
    (r'(pooler|mlm/dense)/kernel$', ('fsdp', None)),  # BERT's [E, E] pooler and MLM transform
    (r'mlm/bias$', ('fsdp',)),  # BERT's MLM output bias [V']
    (r'output/kernel$', (None, 'fsdp')),  # untied output layers [E, V]: the vocabulary
    (r'(input|recurrent)_kernel$', (None, 'fsdp')),  # RNN cells (models/rnn.py) [in, gates * hidden]
    # LoRA adapters (models/lora.py), A [in, r] and B [r, out]: FSDP over the projection's side, the rank
    # whole (replicated while under MIN_SHARDED_SIZE, as the adapters of most models are).
    (r'lora/lora_a$', ('fsdp', None)),
    (r'lora/lora_b$', (None, 'fsdp')),
)
# Logical activation axes (models/partitioning.py) -> mesh axes. The batch is split like the input
# batch; heads, MLP width and vocabulary over 'tensor' (Megatron: column-parallel up/query/key/value,
# row-parallel down/out, one reduction per row-parallel output); width, length and the recurrent state
# stay whole, so the contraction dimension of every weight is gathered rather than the activations.
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    'batch': BATCH_AXES, 'heads': ('tensor',), 'mlp': ('tensor',), 'vocab': ('tensor',), 'expert': ('expert',),
    'length': (), 'embed': (), 'hidden': (),
}
# Arrays smaller than this stay replicated: sharding them costs more communication than memory.
MIN_SHARDED_SIZE = 2**14


def mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Resolve -1 entries of `config.mesh` ({'data','fsdp','expert','tensor'}) to use all devices; an
  axis `mesh_config` lacks (a config saved before the axis existed) is 1."""
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  free = [axis for axis, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f'mesh: only one axis may be -1, got {free}; set the others explicitly.')
  if free:
    if num_devices % fixed:
      raise ValueError(f'mesh: {num_devices} devices are not divisible by the fixed axes '
                       f'(product {fixed}); change mesh.* so they divide the device count.')
    sizes[free[0]] = num_devices // fixed
  if int(np.prod(list(sizes.values()))) != num_devices:
    raise ValueError(f'mesh {sizes} uses {int(np.prod(list(sizes.values())))} devices but '
                     f'{num_devices} are available; make the product of mesh.* equal the device count '
                     f'or set one axis to -1.')
  return sizes


def make_mesh(mesh_config, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  sizes = mesh_shape(mesh_config, len(devices))
  # Auto axes: XLA's partitioner propagates the parameter and batch shardings through the model.
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """`jax.set_mesh(mesh)` with the activation rules active: every step traced inside keeps its
  activations split as ACTIVATION_RULES says. Enter it wherever a step is traced for `mesh`."""
  with jax.set_mesh(mesh), partitioning.axis_rules(ACTIVATION_RULES):
    yield


def path_to_string(path) -> str:
  """'params/blocks/0/self_attention/value/kernel' for a pytree key path: an nnx Variable's own
  `.value` attribute is left out, a module named 'value' (the value projection) is not."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name == 'value':
      continue
    for attribute in ('key', 'name', 'idx'):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


def kv_head_counts(model) -> dict[str, int]:
  """{'blocks/0/self_attention': K} for every grouped-query attention (K < H) of `model` (abstract
  is fine): the head counts `partition_spec` splits their key/value projections by."""
  from models.attention import MultiHeadAttention
  return {'/'.join(map(str, path)): module.num_kv_heads for path, module in nnx.iter_modules(model)
          if isinstance(module, MultiHeadAttention) and module.num_kv_heads < module.num_heads}


def partition_spec(path: str, shape: tuple[int, ...], mesh: Mesh, kv_heads: dict[str, int] | None = None) -> P:
  """The PartitionSpec of one array from the rules, dropping axes that do not divide (the tensor
  axis of a grouped-query key/value projection: when it does not divide its `kv_heads` count)."""
  if re.search(r'(^|/)carried(/|$)', path) and shape:  # recurrent state carried between batches: [B, ...]
    return P(_batch_axes_dividing(shape[0], mesh), *[None] * (len(shape) - 1))
  if int(np.prod(shape, dtype=np.int64)) < MIN_SHARDED_SIZE or not shape:
    return P()
  rule = explicit_rule(path, shape)
  if rule is None:  # FSDP over the largest dimension
    axes = [None] * len(shape)
    axes[int(np.argmax(shape))] = 'fsdp'
  else:
    axes = list(rule)
  heads = next((count for prefix, count in (kv_heads or {}).items()
                if re.search(f'(^|/){re.escape(prefix)}/(key|value)/', path)), None)
  for i, axis in enumerate(axes):
    if axis is not None and (mesh.shape.get(axis, 1) == 1 or shape[i] % mesh.shape[axis]):
      axes[i] = None
    if axis == 'tensor' and heads is not None and heads % mesh.shape[axis]:
      axes[i] = None
  return P(*axes)


def explicit_rule(path: str, shape: tuple[int, ...]) -> tuple[str | None, ...] | None:
  """The axes of the first rule of PARTITION_RULES matching the array at `path` of `shape`, or None
  when none does (`partition_spec` then falls back to FSDP over the largest dimension)."""
  for pattern, rule in PARTITION_RULES:
    if re.search(pattern, path):
      if len(rule) == len(shape):
        return rule
      if len(rule) + 1 == len(shape):
        return (None, *rule)
  return None


def _batch_axes_dividing(size: int, mesh: Mesh) -> tuple[str, ...] | None:
  """The batch axes (BATCH_AXES, in order) whose product divides `size`: how a [B, ...] array
  holding one row per example of the batch is split."""
  axes, product = [], 1
  for axis in BATCH_AXES:
    if mesh.shape.get(axis, 1) > 1 and size % (product * mesh.shape[axis]) == 0:
      axes.append(axis)
      product *= mesh.shape[axis]
  return tuple(axes) or None


def state_shardings(abstract_state, mesh: Mesh, kv_heads: dict[str, int] | None = None):
  """NamedShardings for a pytree of arrays (model and optimizer state), by the rules above;
  kv_heads: the model's `kv_head_counts`."""
  def sharding(path, leaf):
    shape = getattr(leaf, 'shape', ())
    return NamedSharding(mesh, partition_spec(path_to_string(path), tuple(shape), mesh, kv_heads))
  return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def batch_shards(mesh: Mesh) -> int:
  """Into how many pieces the batch is split: the product of the BATCH_AXES `mesh` has."""
  return int(np.prod([mesh.shape.get(axis, 1) for axis in BATCH_AXES]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assemble the global batch from each process's slice (multi-host ready; one process = whole)."""
  sharding = batch_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
          for name, value in local_batch.items()}
