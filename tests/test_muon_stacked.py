"""Muon's stacked orthogonalisation (train/optim.py `stacked_muon`): the matrices of each shape go
through Optax's Newton-Schulz as one batch, and the updates equal Optax's per-matrix muon over the
parameter tree (tests/numerics.py tolerance) step after step, in the optimizer state layout that
checkpoints hold; a stack unstacked in the wrong order is caught; bfloat16 Newton-Schulz rounds
exactly the iterations' matmuls."""
import dataclasses

import jax
import jax.extend
import numpy as np
import optax
import pytest
from flax import nnx

from configs import gpt
from models.gpt import GPT, GPT2Config
from numerics import assert_trees_close
from train import optim

STEPS = 3
WIDTH, HIDDEN = 16, 64  # the 2-layer GPT's matrices: [16, 16] x 4, [16, 64], [64, 16] per layer
NS_STEPS = 5  # Optax's default, which train/optim.py keeps
# One Newton-Schulz chain of an [in, out] matrix, its smaller side m: the Frobenius norm (in * out
# terms), then per iteration X X^T (max(in, out) terms) and two products over m; the gradient clip's
# global norm over every parameter comes first.
NS_TERMS = WIDTH * HIDDEN + NS_STEPS * (HIDDEN + 2 * WIDTH)


def train_config(**values):
  config = gpt.get_config('tiny').train
  config.update({'optimizer': 'muon', 'warmup_steps': 0, 'schedule': 'constant', 'grad_clip': 0.5, 'lr': 0.01,
                 'adam_lr': 0.002, 'weight_decay': 0.1, 'muon_momentum': 0.9, 'muon_rms_scale': 0.2, **values})
  return config


def per_matrix_muon(t):
  """Optax's muon over the parameter tree, one Newton-Schulz chain per leaf, as train/optim.py built it
  before the stacks."""
  return optax.chain(optax.clip_by_global_norm(t.grad_clip), optax.contrib.muon(
      optim.learning_rate_schedule(t), beta=t.muon_momentum, eps=t.eps, weight_decay=t.weight_decay, adam_b1=t.b1,
      adam_b2=t.b2, adam_learning_rate=optim.learning_rate_schedule(t, peak=t.adam_lr),
      muon_weight_dimension_numbers=optim.muon_dimension_numbers, consistent_rms=t.muon_rms_scale or None))


def gpt_params(scan_layers):
  """A 2-layer GPT's parameters (nnx.State), random; scan_layers stacks each kernel as [layers, in, out]."""
  config = GPT2Config(vocab_size=11, max_len=8, num_layers=2, num_heads=2, width=WIDTH, scan_layers=scan_layers)
  abstract = nnx.state(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))), nnx.Param)
  return random_like(abstract, 0, 0.1)


def random_like(tree, seed, scale):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (scale * rng.standard_normal(x.shape)).astype(np.float32), tree)


def run_steps(tx, params):
  """[the updates of each of STEPS steps], the final state: `tx` on the same random gradients. The steps
  are a scan over one compiled update (unrolled, each step would be compiled again)."""
  grads = [random_like(params, seed, 1.0) for seed in range(1, STEPS + 1)]

  @jax.jit
  def run(params, grads):
    def step(carry, g):
      params, state = carry
      update, state = tx.update(g, state, params)
      return (optax.apply_updates(params, update), state), update

    (_, state), updates = jax.lax.scan(step, (params, tx.init(params)), grads)
    return updates, state

  updates, state = run(params, jax.tree.map(lambda *g: np.stack(g), *grads))
  return [jax.tree.map(lambda x, i=i: x[i], updates) for i in range(STEPS)], state


_REFERENCE_STEPS = {}


def reference_steps(scan_layers, **values):
  """run_steps of Optax's per-matrix muon on gpt_params(scan_layers), computed once per configuration
  (several tests compare against the same one)."""
  key = (scan_layers, tuple(sorted(values.items())))
  if key not in _REFERENCE_STEPS:
    _REFERENCE_STEPS[key] = run_steps(per_matrix_muon(train_config(**values)), gpt_params(scan_layers))
  return _REFERENCE_STEPS[key]


def terms(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) + STEPS * NS_TERMS


def ns_dots(tx, params):
  """The dot_general equations in one update of `tx`: a Newton-Schulz chain's 3 (its iterations are a
  scan over one body), no other part of Muon multiplies matrices."""
  return list(dot_equations(jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr))


def dot_equations(jaxpr):
  for equation in jaxpr.eqns:
    if equation.primitive.name == 'dot_general':
      yield equation
    for value in equation.params.values():
      for inner in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(inner, 'jaxpr', inner)  # a ClosedJaxpr's Jaxpr
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from dot_equations(inner)


@pytest.mark.numerics
@pytest.mark.parametrize('scan_layers', [False, True], ids=['layers', 'scanned'])
@pytest.mark.parametrize('rms_scale', [0.2, 0.0], ids=['consistent_rms', 'width_scaling'])
def test_the_stacks_give_optaxs_per_matrix_updates(scan_layers, rms_scale):
  params, config = gpt_params(scan_layers), train_config(muon_rms_scale=rms_scale)
  tx, _ = optim.make_optimizer(config)
  ours, our_state = run_steps(tx, params)
  theirs, their_state = reference_steps(scan_layers, muon_rms_scale=rms_scale)
  for step in range(STEPS):
    assert_trees_close(ours[step], theirs[step], terms=terms(params), err_msg=f'step {step + 1}: ')
  # The state checkpoints hold: Optax's per-parameter layout, the same momentum.
  assert jax.tree.structure(our_state) == jax.tree.structure(their_state)
  assert_trees_close(our_state, their_state, terms=terms(params))


def test_one_chain_per_shape_not_per_matrix():
  """The 2-layer GPT has 12 matrices of 3 shapes: 3 batched Newton-Schulz chains instead of 12."""
  params = gpt_params(scan_layers=False)
  tx, _ = optim.make_optimizer(train_config())
  stacks = optim.MatrixStacks.of(params)
  assert {key: len(members) for key, members in stacks.stacks} == {'16x16': 8, '16x64': 2, '64x16': 2}
  assert len(ns_dots(per_matrix_muon(train_config()), params)) == 12 * 3
  dots = ns_dots(tx, params)
  assert len(dots) == 3 * 3
  assert {equation.invars[0].aval.shape[0] for equation in dots} == {8, 2}  # batches of 8 and 2 matrices


@pytest.mark.numerics
def test_a_stack_unstacked_in_the_wrong_order_fails(monkeypatch):
  """Swapping two matrices of the [16, 16] stack when unstacking (a query's update given to a key)
  moves the updates far past the tolerance."""
  params, config = gpt_params(scan_layers=False), train_config()
  theirs, _ = reference_steps(False, muon_rms_scale=0.2)
  unstacked_values = optim.MatrixStacks._unstacked_values

  def swapped(self, stacked):
    stacks = tuple((key, (members[1], members[0], *members[2:]) if key == '16x16' else members)
                   for key, members in self.stacks)
    return unstacked_values(dataclasses.replace(self, stacks=stacks), stacked)

  monkeypatch.setattr(optim.MatrixStacks, '_unstacked_values', swapped)
  ours, _ = run_steps(optim.make_optimizer(config)[0], params)
  with pytest.raises(AssertionError, match=r"\['self_attention'\]\['key'\]"):  # the stack's first two: key, out
    assert_trees_close(ours[0], theirs[0], terms=terms(params))


@pytest.mark.parametrize('schedule', ['constant', 'wsd'])
def test_the_state_layout_is_optaxs_per_parameter_one(schedule):
  """What a checkpoint of a Muon run holds is unchanged (runs saved before the stacks restore):
  the same paths, shapes and dtypes as Optax's muon over the parameter tree."""
  params = gpt_params(scan_layers=True)
  config = train_config(schedule=schedule)
  tx, _ = optim.make_optimizer(config)
  reference = per_matrix_muon(config)
  if schedule == 'wsd':
    reference = optax.inject_hyperparams(lambda cooldown_start, cooldown_steps: per_matrix_muon(config))(
        cooldown_start=np.asarray(0, np.int32), cooldown_steps=np.asarray(1, np.int32))
  describe = lambda state: [(jax.tree_util.keystr(path), x.shape, x.dtype)
                            for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  ours = jax.eval_shape(tx.init, params)
  assert describe(ours) == describe(jax.eval_shape(reference.init, params))
  after = jax.eval_shape(lambda s: tx.update(params, s, params)[1], ours)
  assert describe(after) == describe(ours)


def test_bfloat16_newton_schulz_rounds_its_matmuls_only():
  """muon_ns_dtype: 'auto' is float32 on this CPU; 'bfloat16' gives every Newton-Schulz matmul
  bfloat16 operands with float32 sums, and the momentum stays float32."""
  params = gpt_params(scan_layers=False)
  assert optim.resolve_ns_dtype('auto') == 'float32' and optim.resolve_ns_dtype('auto', 'gpu') == 'bfloat16'
  precisions = lambda tx: [str(equation.params['precision']) for equation in ns_dots(tx, params)]
  assert set(precisions(optim.make_optimizer(train_config())[0])) == {'None'}
  tx, _ = optim.make_optimizer(train_config(muon_ns_dtype='bfloat16'))
  assert precisions(tx) == ['BF16_BF16_F32'] * (3 * 3)
  state = jax.eval_shape(lambda: tx.update(params, tx.init(params), params)[1])
  assert {x.dtype for x in jax.tree.leaves(state) if x.ndim >= 2} == {np.dtype(np.float32)}
  # 'auto' for a GPU: the same bfloat16 matmuls, whatever this host is.
  assert precisions(optim.make_optimizer(train_config(), platform='gpu')[0]) == ['BF16_BF16_F32'] * (3 * 3)


@pytest.mark.numerics
def test_bfloat16_newton_schulz_gives_optaxs_per_matrix_updates_at_that_precision():
  """The stacks in bfloat16 update as Optax's muon over the unstacked leaves does with its matmuls at
  the same precision, step after step (XLA:CPU computes BF16_BF16_F32 dots in float32: here the two
  agree with the float32 updates too; an accelerator rounds both alike)."""
  params, config = gpt_params(scan_layers=False), train_config(muon_ns_dtype='bfloat16')
  ours, our_state = run_steps(optim.make_optimizer(config)[0], params)
  with jax.default_matmul_precision(optim.BF16_MATMULS):
    theirs, their_state = run_steps(per_matrix_muon(config), params)
  for step in range(STEPS):
    assert_trees_close(ours[step], theirs[step], terms=terms(params), err_msg=f'step {step + 1}: ')
  assert_trees_close(our_state, their_state, terms=terms(params))
