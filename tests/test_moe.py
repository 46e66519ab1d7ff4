"""Mixture-of-experts GPT (models/moe.py): the grouped-matmul layer against a per-token loop, the
capacity path's drops, the balancing losses and bias by hand, scan/remat/decoding."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import moe
from models.gpt import GPT, GPT2Config, generate
from models.layers import ACTIVATIONS
from numerics import assert_close, assert_trees_close, transformer_terms

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

E, H, N = 8, 6, 4  # width, expert width, experts
# A layer output's reductions: the router and the up (and gate) projections over E, down over H, the k-sum.
LAYER_TERMS = 2 * E + H + 2
GPT_TERMS = transformer_terms(2, 16, 12, 9, vocab=37)


def layer(*, gated=False, activation='gelu_tanh', top_k=2, seed=0, **options):
  return moe.MoEFeedForward(E, H, experts=N, top_k=top_k, gated=gated, activation=activation, rngs=nnx.Rngs(seed),
                            **options)


def inputs(tokens=10, seed=1):
  return jax.random.normal(jax.random.key(seed), (2, tokens // 2, E))


def reference(m: moe.MoEFeedForward, x, capacity: int | None = None):
  """The layer token by token in float64 numpy: softmax router, the k largest, each chosen expert's
  MLP times its weight. With `capacity`, an expert takes slots in priority order (all first choices
  in token order, then all second choices, ...) and ignores the ones past its capacity.
  Returns ([T, E] outputs without the shared experts, [(token, choice)] dropped)."""
  f64 = lambda v: np.asarray(v, np.float64)
  tokens = f64(x).reshape(-1, E)
  router, up, down = f64(m.router.kernel[...]), f64(m.up[...]), f64(m.down[...])
  gate = None if m.gate is None else f64(m.gate[...])
  act = lambda h: np.asarray(ACTIVATIONS[m.activation](jnp.asarray(h)), np.float64)
  logits = tokens @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  chosen = np.argsort(-probs, axis=-1, kind='stable')[:, :m.top_k]
  kept, taken = np.ones(chosen.shape, bool), np.zeros(N, int)
  for j in range(m.top_k):
    for t in range(len(tokens)):
      taken[chosen[t, j]] += 1
      kept[t, j] = capacity is None or taken[chosen[t, j]] <= capacity
  out = np.zeros_like(tokens)
  for t, token in enumerate(tokens):
    weights = probs[t, chosen[t]] / (probs[t, chosen[t]].sum() if m.norm_topk_prob else 1.0)
    for j, n in enumerate(chosen[t]):
      hidden = act(token @ up[n]) if gate is None else act(token @ gate[n]) * (token @ up[n])
      out[t] += kept[t, j] * weights[j] * (hidden @ down[n])
  return out, [(t, j) for t, j in zip(*np.nonzero(~kept))]


@pytest.mark.parametrize('gated, activation, shared', [(False, 'gelu_tanh', 0), (False, 'relu2', 0),
                                                       (True, 'silu', 1)])
def test_grouped_matmul_moe_equals_a_per_token_loop_over_the_chosen_experts(gated, activation, shared):
  m = layer(gated=gated, activation=activation, shared_experts=shared)
  x = inputs()
  out, dropped = reference(m, x)
  expected = out.reshape(x.shape) + (np.asarray(m.shared(x)) if shared else 0.0)
  assert dropped == []
  assert_close(m(x), expected, terms=LAYER_TERMS)
  m.capacity_factor = float(N)  # capacity T * k: no expert can be over it
  assert_close(m(x), expected, terms=LAYER_TERMS)


def test_norm_topk_prob_off_keeps_the_softmax_weights():
  m = layer(norm_topk_prob=False, top_k=3)
  x = inputs()
  assert_close(m(x), reference(m, x)[0].reshape(x.shape), terms=LAYER_TERMS)


def hand_routed_layer():
  """Router = identity on the first N features, so a token 4 e_a + 2 e_b goes to a, then b."""
  m = layer(top_k=2, capacity_factor=1.0)
  m.router.kernel.set_value(jnp.eye(E, N))
  first, second = [0, 0, 0, 0, 1, 1], [1, 2, 3, 1, 0, 2]
  x = np.zeros((1, 6, E), np.float32)
  for t, (a, b) in enumerate(zip(first, second)):
    x[0, t, a], x[0, t, b] = 4.0, 2.0
  return m, jnp.asarray(x)


def test_the_capacity_path_drops_exactly_the_slots_a_hand_count_says():
  m, x = hand_routed_layer()
  # C = ceil(1.0 * 6 tokens * 2 / 4 experts) = 3. First choices, in token order, before second ones:
  # expert 0 takes tokens 0, 1, 2 and drops token 3's first choice and token 4's second; expert 1
  # takes 4, 5 (first) and 0 (second) and drops token 3's second. Token 3 keeps nothing.
  assert moe.expert_capacity(6, 2, 4, 1.0) == 3
  expected_drops = [(3, 0), (3, 1), (4, 1)]
  out, dropped = reference(m, x, capacity=3)
  assert sorted(dropped) == expected_drops
  y, recorded = moe.record_router_statistics(m, m, x)
  assert_close(y[0], out, terms=LAYER_TERMS)
  assert np.all(np.asarray(y)[0, 3] == 0)  # nothing but its residual
  statistics = recorded[0][1]
  assert float(statistics.dropped) == 3
  np.testing.assert_array_equal(statistics.load, [5, 4, 2, 1])  # routed before any drop
  m.capacity_factor = 0.0  # dropless: the same routing, nothing dropped
  assert_close(m(x)[0], reference(m, x)[0], terms=LAYER_TERMS)


def test_load_balancing_loss_is_the_switch_formula_on_a_hand_made_routing():
  # 2 tokens, top-2, 4 experts: slots to experts 0, 0, 0, 1 (f = 3/4, 1/4, 0, 0);
  # mean probabilities P = (0.6, 0.2, 0.1, 0.1): N sum f P = 4 (0.45 + 0.05) = 2.
  probs = jnp.asarray([[0.7, 0.1, 0.1, 0.1], [0.5, 0.3, 0.1, 0.1]])
  load = moe.expert_load(jnp.asarray([[0, 1], [0, 0]]), 4)
  np.testing.assert_array_equal(load, [3, 1, 0, 0])
  assert float(moe.load_balancing_loss(load, probs)) == pytest.approx(2.0)
  even = moe.load_balancing_loss(jnp.ones(4), jnp.full((3, 4), 0.25))
  assert float(even) == pytest.approx(1.0)
  # The layer reports the same formula for its own routing; its gradient reaches the router only through P.
  m, x = layer(), inputs()
  _, [(_, statistics)] = moe.record_router_statistics(m, m, x)
  routing = moe.route(x.reshape(-1, E) @ m.router.kernel[...], 2)
  counts = np.bincount(np.asarray(routing.experts).ravel(), minlength=N)
  expected = N * np.sum(counts / counts.sum() * np.asarray(routing.probs).mean(0))
  assert float(statistics.load_balancing_loss) == pytest.approx(expected, rel=1e-5)


def test_router_z_loss_by_hand():
  # logsumexp of (0, 0) is ln 2, of (ln 3, 0) ln 4: the mean of their squares is 2.5 (ln 2)^2.
  logits = jnp.asarray([[0.0, 0.0], [math.log(3.0), 0.0]])
  assert float(moe.router_z_loss(logits)) == pytest.approx(2.5 * math.log(2.0) ** 2, rel=1e-6)


def test_the_loss_free_bias_moves_a_skewed_routers_load_towards_even():
  logits = jax.random.normal(jax.random.key(0), (512, N)) + jnp.asarray([1.5, 0.5, 0.0, 0.0])  # favours expert 0
  bias, shares = jnp.zeros(N), []
  for _ in range(40):
    load = moe.expert_load(moe.route(logits, 2, load_bias=bias).experts, N)
    shares.append(float(load.max() / load.mean()))
    bias = moe.updated_load_bias(bias, load, 0.01)
  assert shares[0] > 1.5 and shares[-1] < 1.15, shares
  # The update: + rate for the experts under the mean load, - rate over it.
  np.testing.assert_allclose(moe.updated_load_bias(jnp.zeros(3), jnp.asarray([5.0, 1.0, 3.0]), 0.1), [-0.1, 0.1, 0.0])
  # The bias picks experts, the weights stay the probabilities.
  routing = moe.route(jnp.log(jnp.asarray([[0.5, 0.3, 0.2]])), 1, load_bias=jnp.asarray([-1.0, 0.0, 0.0]))
  assert int(routing.experts[0, 0]) == 1 and float(routing.weights[0, 0]) == pytest.approx(1.0)
  routing = moe.route(jnp.log(jnp.asarray([[0.5, 0.3, 0.2]])), 1, norm_topk_prob=False,
                      load_bias=jnp.asarray([-1.0, 0.0, 0.0]))
  assert float(routing.weights[0, 0]) == pytest.approx(0.3)


def dense_formulation(params, x, top_k, gated, activation):
  """The layer written as every expert on every token ([T, N, H]), weighted by a [T, N] routing
  matrix that is zero off the chosen experts: autodiff's reference for the grouped gradients."""
  tokens = x.reshape(-1, E)
  probs = jax.nn.softmax(tokens @ params['router']['kernel'], axis=-1)
  top, chosen = jax.lax.top_k(probs, top_k)
  weights = jnp.sum(jax.nn.one_hot(chosen, N) * (top / top.sum(-1, keepdims=True))[..., None], axis=1)  # [T, N]
  act = ACTIVATIONS[activation]
  up = jnp.einsum('te,neh->tnh', tokens, params['up'])
  hidden = act(jnp.einsum('te,neh->tnh', tokens, params['gate'])) * up if gated else act(up)
  return jnp.einsum('tn,tnh,nhe->te', weights, hidden, params['down']).reshape(x.shape)


@pytest.mark.parametrize('gated, capacity_factor', [(True, 0.0), (False, 0.0), (True, 8.0)])
def test_gradients_reach_the_router_and_every_expert_as_in_the_dense_formulation(gated, capacity_factor):
  m = layer(gated=gated, activation='silu', capacity_factor=capacity_factor)
  x, target = inputs(seed=1), inputs(seed=2)
  graphdef, state, rest = nnx.split(m, nnx.Param, ...)
  params = nnx.to_pure_dict(state)  # {'router': {'kernel'}, 'gate', 'up', 'down'}

  def grouped(params):
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state, rest)(x)

  dense = lambda params: dense_formulation(params, x, 2, gated, 'silu')
  loss = lambda forward: lambda params: jnp.sum((forward(params) - target) ** 2)
  grouped_grads = jax.grad(loss(grouped))(params)
  dense_grads = jax.grad(loss(dense))(params)
  for path, grad in jax.tree.leaves_with_path(grouped_grads):
    assert float(jnp.abs(grad).max()) > 0, path
  assert_trees_close(grouped_grads, dense_grads, terms=2 * LAYER_TERMS + 10 + N)  # and the sums over T, N


# ---------------------------------------------------------------------------------------------- GPT
CONFIG = GPT2Config(vocab_size=37, max_len=32, num_layers=2, num_heads=2, width=16, dropout=0.0, moe_experts=4,
                    moe_hidden=12)


def tokens(batch=2, length=9, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


@functools.cache
def twin_moe_models(**overrides):
  """(unscanned, scanned) MoE GPTs holding the same parameters."""
  config = GPT2Config(**{**CONFIG.__dict__, **overrides})
  scanned = GPT(GPT2Config(**{**config.__dict__, 'scan_layers': True}), rngs=nnx.Rngs(0))
  plain = GPT(config, rngs=nnx.Rngs(1))
  nnx.update(plain, nnx.filter_state(nnx.state(scanned, nnx.Param), lambda path, _: path[0] != 'blocks'))
  for i, block in enumerate(plain.blocks):
    nnx.update(block, jax.tree.map(lambda v: v[i], nnx.state(scanned.blocks, nnx.Param)))
  return plain, scanned


def logits_and_statistics(model, x, remat=None):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state):
    m = nnx.merge(graphdef, state)
    (logits, _), recorded = moe.record_router_statistics(m, m, x, deterministic=False)
    return logits, m.router_statistics(recorded)
  return run(state)


def with_remat(model: GPT) -> GPT:
  """`model` (a copy) recomputing every block in the backward pass."""
  copy = nnx.clone(model)
  copy.config = GPT2Config(**{**model.config.__dict__, 'remat': 'full'})
  return copy


@pytest.mark.parametrize('mlp', ['gelu', 'swiglu'])
def test_scanned_and_remat_moe_gpts_give_the_plain_models_logits_and_router_statistics(mlp):
  llama = {'positions': 'rope', 'norm': 'rmsnorm', 'use_bias': False} if mlp == 'swiglu' else {}
  plain, scanned = twin_moe_models(mlp=mlp, **llama)
  x = tokens()
  reference_logits, reference_statistics = logits_and_statistics(plain, x)
  np.testing.assert_array_equal(np.asarray(reference_statistics.load).sum(1), [2 * 9 * 2] * 2)  # T * k per block
  for model in (scanned, with_remat(plain), with_remat(scanned)):
    logits, statistics = logits_and_statistics(model, x)
    assert_close(logits, reference_logits, terms=GPT_TERMS)
    np.testing.assert_array_equal(statistics.load, reference_statistics.load)
    assert_trees_close(statistics, reference_statistics, terms=GPT_TERMS)


@nnx.jit
def full_forward(model, x):
  return model(x)[0]


@pytest.mark.parametrize('scan, overrides', [
    (False, {}), (True, {}), (False, {'moe_capacity_factor': 2.0}),
    # Llama-style, heads wider than width / heads (Qwen3's head_dim): the cache holds [.., 12] heads.
    (True, {'head_dim': 12, 'positions': 'rope', 'norm': 'rmsnorm', 'mlp': 'swiglu', 'moe_shared_experts': 1})])
def test_cached_greedy_decoding_of_an_moe_gpt_equals_an_argmax_loop_without_cache(scan, overrides):
  plain, scanned = twin_moe_models(**overrides)
  model = scanned if scan else plain
  if 'head_dim' in overrides:
    assert model.blocks.self_attention.query.kernel.shape == (2, 16, 2 * 12)
    assert model.init_cache(1, 10)['self']['k'].shape == (2, 1, 2, 10, 12)
  prompt, new = [5, 6, 7, 8], 6
  out, _ = generate(model, jnp.asarray([prompt]), jnp.ones((1, 4), bool), jax.random.key(0), max_new_tokens=new,
                    temperature=0.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
  # Without a cache the whole prefix runs again for every token. (A capacity is per forward pass: the
  # prefix's tokens compete for it as they do in the cached prompt pass, and 2.0 x the even share of
  # a 4-expert top-2 layer is all tokens, so nothing is dropped either way.)
  sequence = list(prompt)
  for _ in range(new):
    sequence.append(int(jnp.argmax(full_forward(model, jnp.asarray([sequence]))[0, -1])))
  assert list(np.asarray(out)[0]) == sequence[len(prompt):]


def test_muon_takes_each_experts_matrices_and_adamw_the_router():
  from train import optim
  model = nnx.eval_shape(lambda: GPT(GPT2Config(**{**CONFIG.__dict__, 'scan_layers': True, 'mlp': 'swiglu'}),
                                     rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  split = {side: dict(entries) for side, entries in optim.muon_split(params).items()}
  assert split['muon']['blocks/mlp/gate'] == (2, 4, 16, 12) and split['muon']['blocks/mlp/down'] == (2, 4, 12, 16)
  assert split['adamw']['blocks/mlp/router/kernel'] == (2, 16, 4)
  decayed = {optim.path_to_string(path): bool(flag)
             for path, flag in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params))}
  assert decayed['blocks/mlp/up'] and decayed['blocks/mlp/down'] and decayed['blocks/mlp/router/kernel']
  assert not decayed['blocks/mlp_norm/bias']
