"""The training state, created once for every caller: the trainer, the benchmark and `load_run`.

`state_spec` gives the shapes and shardings without allocating anything (XLA's memory estimate,
checkpoint restore targets); `init_state` creates the state on the mesh, each array born with its
sharding (parameters never exist whole on one device).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from train import sharding


@dataclasses.dataclass
class TrainState:
  """Everything a step reads and writes; a pytree of (sharded) arrays."""
  params: nnx.State
  extra: nnx.State  # non-parameter model variables: dropout RNG streams, carried RNN state
  opt_state: Any  # None where no optimizer is needed (reloading for inference)
  step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=['params', 'extra', 'opt_state', 'step'], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StateSpec:
  graphdef: nnx.GraphDef  # the model's structure; nnx.merge(graphdef, params, extra) rebuilds it
  abstract: TrainState  # jax.ShapeDtypeStruct leaves
  shardings: TrainState  # NamedSharding leaves on `mesh`
  mesh: jax.sharding.Mesh


def _init_fn(build_model, tx: optax.GradientTransformation | None, seed: int):
  def init() -> TrainState:
    model = build_model(nnx.Rngs(params=seed, dropout=seed + 1))
    _, params, extra = nnx.split(model, nnx.Param, ...)
    return TrainState(params=params, extra=extra, opt_state=None if tx is None else tx.init(params),
                      step=jnp.zeros((), jnp.int32))
  return init


def state_spec(build_model, mesh, tx: optax.GradientTransformation | None = None) -> StateSpec:
  """Shapes and shardings of the state of `build_model(rngs)` (optimizer state too when `tx` is given)."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0, dropout=0))))
  abstract = jax.eval_shape(_init_fn(build_model, tx, 0))
  return StateSpec(graphdef, abstract, sharding.state_shardings(abstract, mesh), mesh)


def init_state(spec: StateSpec, build_model, tx: optax.GradientTransformation | None, seed: int) -> TrainState:
  """A freshly initialised state, created sharded on `spec.mesh` (parameters from `seed`, dropout from seed + 1)."""
  with jax.set_mesh(spec.mesh):
    return jax.jit(_init_fn(build_model, tx, seed), out_shardings=spec.shardings)()


def with_shardings(abstract, shardings):
  """Abstract arrays that carry their target shardings (restore targets for Orbax)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def model_of(spec: StateSpec, state: TrainState) -> nnx.Module:
  return nnx.merge(spec.graphdef, state.params, state.extra)
