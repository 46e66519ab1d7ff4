"""The training state, created once for every caller: the trainer, the benchmark and `load_run`.

`state_spec` gives the shapes and shardings without allocating anything (XLA's memory estimate,
checkpoint restore targets); `init_state` creates the state on the mesh, each array born with its
sharding (parameters never exist whole on one device).

The model's random streams (parameter init, dropout) use the PRNG implementation `rng_impl`
(`config.rng_impl`, resolved by `resolve_rng_impl` and saved in the run's model.json, because the
dropout keys in every checkpoint have its shape). 'threefry' is bit-identical under any sharding;
'rbg' and 'unsafe_rbg' (XLA's RngBitGenerator) are much cheaper to compile and run on GPU and TPU:
XLA:GPU compiles GPT-2's threefry initialiser for minutes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from errors import ConfigError
from models.tracing import tracer_errors_without_origin
from train import sharding

RNG_IMPLS = {'threefry': 'threefry2x32', 'rbg': 'rbg', 'unsafe_rbg': 'unsafe_rbg'}  # config name -> JAX's


@dataclasses.dataclass
class TrainState:
  """Everything a step reads and writes; a pytree of (sharded) arrays."""
  params: nnx.State  # the parameters training changes (`StateSpec.trainable`)
  extra: nnx.State  # non-parameter model variables: dropout RNG streams, carried RNN state
  opt_state: Any  # None where no optimizer is needed (reloading for inference)
  step: jax.Array
  # Parameters training leaves as they are, with no gradient or optimizer state: a LoRA run's base
  # weights (train/lora.py), which its checkpoints do not hold; empty for every other run.
  frozen: nnx.State = dataclasses.field(default_factory=lambda: nnx.State({}))


jax.tree_util.register_dataclass(TrainState, data_fields=['params', 'extra', 'opt_state', 'step', 'frozen'],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StateSpec:
  graphdef: nnx.GraphDef  # the model's structure; nnx.merge(graphdef, params, frozen, extra) rebuilds it
  abstract: TrainState  # jax.ShapeDtypeStruct leaves
  shardings: TrainState  # NamedSharding leaves on `mesh`
  mesh: jax.sharding.Mesh
  rng_impl: str
  trainable: Any = nnx.Param  # the nnx filter of the parameters in `TrainState.params`; the others are frozen


def resolve_rng_impl(name: str, platform: str | None = None) -> str:
  """'auto': 'rbg' on GPU and TPU, 'threefry' on CPU (sharding-invariant, as the CPU tests compare
  sharded with single-device runs); otherwise `name`. `platform` ('cpu' | 'gpu' | 'tpu') is the
  one the state is compiled for (None: this process's default backend)."""
  if name == 'auto':
    return 'threefry' if (platform or jax.default_backend()) == 'cpu' else 'rbg'
  if name not in RNG_IMPLS:
    raise ConfigError(f"config.rng_impl={name!r} is not one of {('auto', *RNG_IMPLS)}.")
  return name


def _build_traced(build_model, rngs: nnx.Rngs) -> nnx.Module:
  """`build_model(rngs)` under a trace, in time linear in the model's size (`tracer_errors_without_origin`)."""
  with tracer_errors_without_origin():
    return build_model(rngs)


def make_rngs(seed: int, rng_impl: str) -> nnx.Rngs:
  """Parameter stream from `seed`, dropout stream from seed + 1."""
  impl = RNG_IMPLS[rng_impl]
  return nnx.Rngs(params=jax.random.key(seed, impl=impl), dropout=jax.random.key(seed + 1, impl=impl))


def split_model(model: nnx.Module, trainable=nnx.Param) -> tuple[nnx.State, nnx.State, nnx.State]:
  """(the parameters `trainable` selects, the other parameters, every other variable) of `model`."""
  _, params, frozen, extra = nnx.split(model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
  return params, frozen, extra


def _init_fn(build_model, tx: optax.GradientTransformation | None, seed: int, rng_impl: str, trainable,
             frozen: bool = True):
  def init() -> TrainState:
    model = _build_traced(build_model, make_rngs(seed, rng_impl))
    params, frozen_params, extra = split_model(model, trainable)
    return TrainState(params=params, extra=extra, opt_state=None if tx is None else tx.init(params),
                      step=jnp.zeros((), jnp.int32), frozen=frozen_params if frozen else nnx.State({}))
  return init


def state_spec(build_model, mesh, rng_impl: str, tx: optax.GradientTransformation | None = None,
               trainable=nnx.Param) -> StateSpec:
  """Shapes and shardings of the state of `build_model(rngs)` (optimizer state too when `tx` is
  given) that trains the parameters the nnx filter `trainable` selects."""
  abstract_model = nnx.eval_shape(lambda: _build_traced(build_model, make_rngs(0, rng_impl)))
  # The state's shapes from that one trace of the model (tracing a model's construction costs more
  # than its tiny programs take to run): what `_init_fn` returns, abstractly.
  params, frozen, extra = split_model(abstract_model, trainable)
  abstract = TrainState(params=params, extra=extra, opt_state=None if tx is None else jax.eval_shape(tx.init, params),
                        step=jax.ShapeDtypeStruct((), jnp.int32), frozen=frozen)
  shardings = sharding.state_shardings(abstract, mesh, sharding.kv_head_counts(abstract_model))
  return StateSpec(nnx.graphdef(abstract_model), abstract, shardings, mesh, rng_impl, trainable)


def _size(tree) -> tuple[int, int]:
  """(elements, bytes) of the arrays (or abstract arrays) of `tree`, whole (not per device)."""
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, 'shape')]
  return (sum(int(np.prod(x.shape)) for x in leaves),
          sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves))


def describe_sizes(spec: StateSpec) -> str:
  """One line: the trained parameters, the frozen ones (a LoRA run's base weights) and the optimizer
  state, each in elements and MiB, whole (a sharded array counted once, not per device)."""
  mib = lambda size: f'{size[1] / 2**20:,.2f} MiB'
  trained, frozen, optimizer = _size(spec.abstract.params), _size(spec.abstract.frozen), _size(spec.abstract.opt_state)
  return (f'Training state: {trained[0]:,} trained parameters ({mib(trained)}), {frozen[0]:,} frozen '
          f'({mib(frozen)}), optimizer state {optimizer[0]:,} values ({mib(optimizer)}).')


def jit_initialiser(spec: StateSpec, build_model, tx: optax.GradientTransformation | None, seed: int,
                    frozen: bool = True):
  """() -> TrainState: the jitted initialiser that `init_state` calls, each array born with its sharding."""
  shardings = spec.shardings if frozen else dataclasses.replace(spec.shardings, frozen=nnx.State({}))
  return jax.jit(_init_fn(build_model, tx, seed, spec.rng_impl, spec.trainable, frozen), out_shardings=shardings)


def init_state(spec: StateSpec, build_model, tx: optax.GradientTransformation | None, seed: int,
               frozen: bool = True) -> TrainState:
  """A freshly initialised state, created sharded on `spec.mesh` (parameters from `seed`, dropout from
  seed + 1). `frozen` False: without the frozen parameters (an empty `frozen`), which are then never
  drawn (a LoRA run copies its base run's: train/rundir.py `base_weights`); the others are as with them."""
  with jax.set_mesh(spec.mesh):
    return jit_initialiser(spec, build_model, tx, seed, frozen)()


def step_array(spec: StateSpec, step: int) -> jax.Array:
  """The step counter placed as the train step places it: an uncommitted scalar would compile the step twice."""
  return jax.make_array_from_callback((), spec.shardings.step, lambda _: np.asarray(step, np.int32))


def with_shardings(abstract, shardings):
  """Abstract arrays that carry their target shardings (restore targets for Orbax)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def model_of(spec: StateSpec, state: TrainState) -> nnx.Module:
  return nnx.merge(spec.graphdef, state.params, state.frozen, state.extra)


def copied_from(spec: StateSpec, state: TrainState, copy) -> TrainState:
  """`state` after `copy(model)` changed its model in place (a fine-tuning run's `Task.init_from`),
  split again by `spec.trainable` and placed by `spec`'s shardings; the optimizer state is `state`'s."""
  model = model_of(spec, state)
  copy(model)
  params, frozen, extra = jax.device_put(split_model(model, spec.trainable),
                                         (spec.shardings.params, spec.shardings.frozen, spec.shardings.extra))
  return dataclasses.replace(state, params=params, frozen=frozen, extra=extra)
