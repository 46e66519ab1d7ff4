"""Models built and trained under a trace (models/tracing.py): flax's RNG counter updates never make
JAX describe where a traced value came from (a walk over every equation traced so far, which made
building an L-layer model O(L^2)), and an error in a user's own traced code still says where."""
import types

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.interpreters import partial_eval

from models.gpt import GPT, GPT2Config
from models.tracing import tracer_errors_without_origin
from train import sharding, steps
from train import state as state_lib


def origin_walks(monkeypatch) -> list:
  """The traced values whose origin JAX describes (walking back over the equations), from now on."""
  walks = []
  describe = partial_eval.DynamicJaxprTracer._origin_msg

  def counted(tracer):
    walks.append(tracer)
    return describe(tracer)
  monkeypatch.setattr(partial_eval.DynamicJaxprTracer, '_origin_msg', counted)
  return walks


def test_building_and_training_a_model_never_walks_a_traced_values_origin(monkeypatch):
  config = GPT2Config(vocab_size=64, max_len=16, num_layers=2, num_heads=2, width=32, dropout=0.1)
  build = lambda rngs: GPT(config, rngs=rngs)
  walks = origin_walks(monkeypatch)
  nnx.eval_shape(lambda: build(state_lib.make_rngs(0, 'threefry')))
  assert len(walks) >= 2 * 2 * 4  # without the context: two walks per parameter draw, 4+ draws a block

  walks.clear()
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  tx = optax.adamw(1e-3)
  spec = state_lib.state_spec(build, mesh, 'threefry', tx)
  state = state_lib.init_state(spec, build, tx, seed=0)
  # A train step with dropout: every dropout draw bumps the stream's count under the step's trace.
  task = types.SimpleNamespace(
      loss=lambda model, batch, deterministic: (jnp.mean(model(batch['tokens'], deterministic=deterministic)[0]), {}),
      count_tokens=lambda batch: (None, jnp.int32(batch['tokens'].size)))
  step = jax.jit(steps.make_train_step(task, spec.graphdef, tx, grad_accum=1))
  with sharding.use_mesh(mesh):
    traced = step.trace(state, {'tokens': jax.ShapeDtypeStruct((2, 16), jnp.int32)})
  assert 'random_bits' in str(traced.jaxpr) or 'threefry' in str(traced.jaxpr)  # dropout was traced
  assert walks == []


def test_an_error_in_a_users_traced_code_still_says_where_its_value_came_from():
  with pytest.raises(ValueError, match='inside'):
    with tracer_errors_without_origin():
      raise ValueError('inside')  # leaving by an exception restores JAX's message too
  with pytest.raises(jax.errors.ConcretizationTypeError, match='while tracing the function .* for jit'):
    jax.jit(lambda x: int(x))(1.0)
