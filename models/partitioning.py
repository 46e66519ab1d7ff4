"""Logical axis names for activations: how models say which array dimension is which, never
how it is split.

A model marks a few arrays (a block's input and output, the MLP's hidden layer, the attention
heads, the logits) with one logical name per dimension:

  x = constrain(x, ('batch', 'length', 'embed'))

and the trainer decides what each name means on its device mesh by entering `axis_rules` (the
table is train/sharding.py's ACTIVATION_RULES: 'batch' -> the data-parallel mesh axes, 'heads' /
'mlp' / 'vocab' -> the tensor-parallel axis, the rest replicated). `constrain` then pins the
array's sharding with `jax.lax.with_sharding_constraint`, so that XLA's partitioner moves the
(sharded) weights to the activations instead of the activations to the weights.

A kernel opaque to the partitioner runs under `jax.shard_map` split the same way: `manual_spec`
resolves its inputs' logical names through the same rules (models/splash.py).

Without rules, or without a mesh of more than one device (single-device training, decoding and
tests outside a mesh), `constrain` returns its argument unchanged: numerics are bit-identical.

Names: 'batch', 'length' (sequence or time), 'embed' (model width), 'heads', 'mlp'
(feed-forward width), 'vocab', 'hidden' (recurrent state width); None: no name.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

# The (batch, length, width) of the residual stream between Transformer blocks.
TOKENS = ('batch', 'length', 'embed')

_RULES: contextvars.ContextVar[Mapping[str, tuple[str, ...]] | None] = contextvars.ContextVar(
    'logical_axis_rules', default=None)


@contextlib.contextmanager
def axis_rules(rules: Mapping[str, tuple[str, ...]]):
  """Within the block, `constrain` maps logical name -> these mesh axes (of the current mesh,
  `jax.set_mesh`). A name absent from `rules`, or mapped to (), is replicated."""
  token = _RULES.set(dict(rules))
  try:
    yield
  finally:
    _RULES.reset(token)


def partition_spec(shape: Sequence[int], names: Sequence[str | None], rules: Mapping[str, tuple[str, ...]],
                   mesh) -> P:
  """The PartitionSpec of an array of `shape` whose dimensions have logical `names`.

  Each dimension gets the mesh axes its name maps to that are in `mesh`, larger than 1, not used
  by an earlier dimension and whose product divides it (greedily, in order). A named dimension no
  axis can split is left to XLA (P.UNCONSTRAINED: e.g. a decoding batch of 1); one whose name maps
  to nothing is replicated.
  """
  if len(names) != len(shape):
    raise ValueError(f'{len(names)} logical axis names {tuple(names)} for an array of shape {tuple(shape)}.')
  used, spec = set(), []
  for size, name in zip(shape, names):
    wanted = rules.get(name, ()) if name is not None else ()
    chosen, product = [], 1
    for axis in wanted:
      usable = axis in mesh.axis_names and axis not in used and mesh.shape[axis] > 1
      if usable and size % (product * mesh.shape[axis]) == 0:
        chosen.append(axis)
        product *= mesh.shape[axis]
    used.update(chosen)
    if chosen:
      spec.append(tuple(chosen) if len(chosen) > 1 else chosen[0])
    else:
      spec.append(P.UNCONSTRAINED if any(axis in mesh.axis_names and mesh.shape[axis] > 1 for axis in wanted)
                  else None)
  return P(*spec)


def _active():
  """(rules, mesh) when constraints apply, else None."""
  rules = _RULES.get()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty or mesh.size == 1:
    return None
  return rules, mesh


def shard_count(name: str, size: int) -> int:
  """Into how many pieces the active rules split a dimension of `size` named `name` (1 where no
  rules or no multi-device mesh are active)."""
  active = _active()
  if active is None:
    return 1
  rules, mesh = active
  axes = partition_spec((size,), (name,), rules, mesh)[0]
  if axes is None or axes is P.UNCONSTRAINED:
    return 1
  return math.prod(mesh.shape[axis] for axis in (axes if isinstance(axes, tuple) else (axes,)))


def manual_spec(shape: Sequence[int], names: Sequence[str | None]) -> P | None:
  """The PartitionSpec a `jax.shard_map` over the current mesh splits an array of `shape` with:
  the mesh axes the active rules give its logical `names`, as `constrain` pins them, but a
  dimension no axis can split whole (shard_map takes no P.UNCONSTRAINED). None where no rules or
  no multi-device mesh are active: run the function unsplit."""
  active = _active()
  if active is None:
    return None
  return P(*(None if axes is P.UNCONSTRAINED else axes for axes in partition_spec(shape, names, *active)))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`x` with its sharding pinned to what the active rules make of the logical `names` (one per
  dimension of x); `x` itself where no rules or no multi-device mesh are active."""
  active = _active()
  if active is None:
    return x
  return jax.lax.with_sharding_constraint(x, partition_spec(x.shape, names, *active))
