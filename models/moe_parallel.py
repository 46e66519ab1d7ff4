"""Expert parallelism: a mixture of experts' experts split between devices, each token sent to the
devices of its experts and its results sent back (GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021), never every expert's weights gathered on every device.

models/moe.py's MoEFeedForward calls `expert_parallel` when the active mesh splits its experts
(the logical 'expert' axis, `splits_experts`). No mesh axis is named here: as models/splash.py does,
the logical names 'batch' and 'expert' resolve to mesh axes through the active rules
(models/partitioning.py; train/sharding.py maps 'expert' to the mesh's expert axis and 'batch' to
data x fsdp x expert). Under `jax.shard_map` each device then holds T_l of the T tokens with their
routing, and the N_l = N / D experts of its place on the expert axis (D devices along it):

  1. its T_l * k token-slots sorted by expert (models/moe.py `sort_by_expert`), so that each
     destination device's slots are contiguous;
  2. one all-to-all over the expert axis sends device d's slots to d, with each source's count per
     local expert: a [D, C, E] buffer per device, C = T_l * min(k, N_l) rows per destination (a
     token's k experts are distinct, so at most min(k, N_l) of its slots go to one device: no slot is
     ever dropped; rows past a source's count are zeros);
  3. the received rows sorted by local expert and computed with the grouped matmuls of the one-device
     path (`grouped_expert_mlp`; rows past the counts belong to no group and come out zero);
  4. the reverse all-to-all returns each slot's output to the device its token lives on, where the
     k outputs are weighted and summed as on one device (`unsort_and_combine`).

Static shapes throughout (the buffer is the dropless worst case, D x C rows), so nothing recompiles
as the routing changes. `jax.lax.ragged_all_to_all` would send only the occupied rows but XLA:CPU
does not implement it (UNIMPLEMENTED: ragged-all-to-all, JAX 0.10), and the tests run on CPU devices.
Inside an MoE block the tensor axis holds copies: each expert's [E, H] matrices are whole on the
devices of its expert-axis place (gathered over fsdp and tensor, as FSDP gathers every weight).

Shape legend: T tokens, E width, N experts, k experts per token, D devices on the expert axis,
N_l = N / D local experts, M = T_l * k slots of one device's tokens, C rows per destination.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.partitioning import manual_spec


def splits_experts(num_experts: int) -> bool:
  """Whether the active mesh and rules split `num_experts` experts between devices."""
  spec = manual_spec((num_experts,), ('expert',))
  return spec is not None and spec[0] is not None


def expert_parallel(local_moe: Callable[..., jax.Array], grouped_mlp: Callable[..., jax.Array], tokens: jax.Array,
                    routing: Any, weights: Any) -> jax.Array:
  """[T, E] tokens -> [T, E], each token-slot computed on the device that holds its expert.

  Args:
    local_moe: the one-device computation, `local_moe(tokens, routing, weights, grouped_mlp=...)`
      -> [T, E] (models/moe.py `dropless_moe`), run on each device's tokens with the `grouped_mlp`
      given here wrapped in the exchange between devices.
    grouped_mlp: `grouped_mlp(sorted_slots [M', E], group_sizes [N'], weights, activation)` -> [M', E],
      the experts' grouped matmuls (models/moe.py `grouped_expert_mlp`), run on the received slots.
    tokens: [T, E].
    routing: a pytree of [T, ...] arrays whose `experts` are the [T, k] chosen experts.
    weights: a pytree of [N, ...] arrays, the experts' matrices.
  Where the tokens cannot be split over the expert axis (a decoding batch it does not divide),
  `local_moe` runs once over the whole mesh, XLA's partitioner moving weights or activations.
  """
  num_experts = jax.tree.leaves(weights)[0].shape[0]
  token_axes = manual_spec(tokens.shape, ('batch', None))[0]
  expert_axis = manual_spec((num_experts,), ('expert',))[0]
  if token_axes is None or expert_axis not in (token_axes if isinstance(token_axes, tuple) else (token_axes,)):
    return local_moe(tokens, routing, weights, grouped_mlp=grouped_mlp)
  mesh = jax.sharding.get_abstract_mesh()
  shards = _size(mesh, expert_axis)
  top_k = routing.experts.shape[-1]
  exchanged = _exchanged(grouped_mlp, expert_axis, shards, capacity=tokens.shape[0] // _size(mesh, token_axes)
                         * min(top_k, num_experts // shards))
  per_device = lambda x, r, w: local_moe(x, r, w, grouped_mlp=exchanged)
  batch = jax.P(token_axes)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(batch, batch, jax.P(expert_axis)), out_specs=batch)(
      tokens, routing, weights)


def _size(mesh, axes) -> int:
  """Devices along the mesh axes `axes` (a name or a tuple of names) together."""
  return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def _exchanged(grouped_mlp: Callable[..., jax.Array], axis: str, shards: int, capacity: int) -> Callable[..., jax.Array]:
  """`grouped_mlp` with the same contract run across the expert axis: called on one device's sorted
  slots [M, E] with their group sizes over all N experts and this device's N_l experts' weights, it
  sends each slot to its expert's device, computes it there and brings its output back: [M, E]."""

  def run(sorted_slots: jax.Array, group_sizes: jax.Array, weights: Any, activation: str) -> jax.Array:
    slots, width = sorted_slots.shape
    counts = group_sizes.reshape(shards, -1)  # [D, N_l]: slots for each device's local experts
    sent = jnp.sum(counts, axis=1)  # [D]
    starts = jnp.cumsum(sent) - sent  # where each destination's slots begin among the sorted ones
    row = jnp.arange(capacity, dtype=jnp.int32)
    source = jnp.where(row < sent[:, None], starts[:, None] + row, slots)  # [D, C]; `slots`: a zero row
    buffer = jnp.take(sorted_slots, source, axis=0, mode='fill', fill_value=0)  # [D, C, E]
    received = jax.lax.all_to_all(buffer, axis, 0, 0)  # [D, C, E]: row block s from device s
    received_counts = jax.lax.all_to_all(counts, axis, 0, 0)  # [D, N_l]: what device s sent, per local expert
    # Each received row's local expert (N_l past a source's count), and the rows sorted by it.
    ends = jnp.cumsum(received_counts, axis=1)  # [D, N_l]
    expert_of_row = jnp.sum(row[None, None, :] >= ends[:, :, None], axis=1).reshape(-1)  # [D * C]
    order = jnp.argsort(expert_of_row, stable=True)
    outputs = grouped_mlp(jnp.take(received.reshape(-1, width), order, axis=0), jnp.sum(received_counts, axis=0),
                          weights, activation)
    outputs = jnp.zeros_like(outputs).at[order].set(outputs, unique_indices=True).reshape(shards, capacity, width)
    returned = jax.lax.all_to_all(outputs, axis, 0, 0).reshape(-1, width)  # [D * C, E], as `buffer` was sent
    destination = jnp.repeat(jnp.arange(shards, dtype=jnp.int32), sent, total_repeat_length=slots)  # [M]
    position = destination * capacity + jnp.arange(slots, dtype=jnp.int32) - starts[destination]
    return jnp.take(returned, position, axis=0)

  return run
