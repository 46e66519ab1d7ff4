"""Expert parallelism (models/moe_parallel.py) on 8 CPU devices."""
import jax
import numpy as np

from train import hlo, sharding

EXPERTS, TOP_K = 8, 2


def test_routing_splits_by_batch_and_chooses_as_top_k():
  """Each device routes its own tokens: no collective in a data-parallel `route` (XLA's TopK custom
  call, which jax.lax.top_k lowers to, was run on the all-gathered [T, N] scores), and the choice is
  top_k's, ties to the lower index."""
  from models.moe import route
  logits = jax.random.normal(jax.random.key(0), (64, EXPERTS))
  logits = logits.at[0].set(0.0).at[1, 2:6].set(5.0)  # all tied; four tied for first
  _, want = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
  np.testing.assert_array_equal(route(logits, TOP_K).experts, want)
  assert route(logits, TOP_K).experts[:2].tolist() == [[0, 1], [2, 3]]
  mesh = sharding.make_mesh({'data': 8})
  split = jax.sharding.NamedSharding(mesh, jax.P('data'))
  compiled = jax.jit(lambda x: route(x, TOP_K), in_shardings=split, out_shardings=split).lower(logits).compile()
  assert hlo.collectives(compiled.as_text()) == []
