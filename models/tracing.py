"""Building models under a trace (`jax.eval_shape`, a jitted initialiser) in time linear in their size."""
import contextlib

from jax.interpreters import partial_eval


@contextlib.contextmanager
def tracer_errors_without_origin():
  """Within: errors about traced values skip the sentence naming where the value came from.

  Models are built under a trace (train/state.py's eval_shape and jitted initialiser) and run
  dropout under one (the train step). Each draw from an `nnx.Rngs` stream bumps its counter through flax 0.12.8's `Variable.set_value`, which compares
  `getattr(value, 'sharding', None)`; on a traced value JAX raises an AttributeError whose message
  (`DynamicJaxprTracer._origin_msg`) walks every equation traced so far, and getattr throws it
  away. Building an L-layer model that way costs O(L^2) in its depth (docs/benchmarks.md has the
  times of GPT-2 at 12 and 48 layers, with and without the messages). Keep it
  around tracing alone (inside a jitted function's body, which runs only while tracing): an error a
  user must read, such as a ConcretizationTypeError in their own code, keeps its full message
  everywhere else.
  """
  tracer = partial_eval.DynamicJaxprTracer
  original = tracer.__dict__.get('_origin_msg')
  if original is None:  # another JAX: nothing to skip
    yield
    return
  tracer._origin_msg = lambda self: ''  # no public switch for it in JAX 0.10
  try:
    yield
  finally:
    tracer._origin_msg = original
