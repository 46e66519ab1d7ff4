"""Mixture-of-experts GPT (models/moe.py): the grouped-matmul layer against a per-token loop, the
capacity path's drops, the balancing losses and bias by hand, scan/remat/decoding, a training run
through the trainer with its metrics and picture, the presets' parameter counts, and bad config
values as one-line errors."""
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from configs import gpt as gpt_configs
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


# A layer applied as one compiled program per configuration (its options are static), not op by op.
forward = nnx.jit(lambda m, x: m(x))


@nnx.jit
def forward_recording(m, x):
  """(m(x), its RouterStatistics): `moe.record_router_statistics` of a single layer, compiled."""
  y, [(_, statistics)] = moe.record_router_statistics(m, m, x)
  return y, statistics


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
  expected = out.reshape(x.shape) + (np.asarray(forward(m.shared, x)) if shared else 0.0)
  assert dropped == []
  assert_close(forward(m, x), expected, terms=LAYER_TERMS)
  m.capacity_factor = float(N)  # capacity T * k: no expert can be over it
  assert_close(forward(m, x), expected, terms=LAYER_TERMS)


def test_norm_topk_prob_off_keeps_the_softmax_weights():
  m = layer(norm_topk_prob=False, top_k=3)
  x = inputs()
  assert_close(forward(m, x), reference(m, x)[0].reshape(x.shape), terms=LAYER_TERMS)


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
  y, statistics = forward_recording(m, x)
  assert_close(y[0], out, terms=LAYER_TERMS)
  assert np.all(np.asarray(y)[0, 3] == 0)  # nothing but its residual
  assert float(statistics.dropped) == 3
  np.testing.assert_array_equal(statistics.load, [5, 4, 2, 1])  # routed before any drop
  m.capacity_factor = 0.0  # dropless: the same routing, nothing dropped
  assert_close(forward(m, x)[0], reference(m, x)[0], terms=LAYER_TERMS)


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
  _, statistics = forward_recording(m, x)
  routing = jax.jit(moe.route, static_argnums=1)(x.reshape(-1, E) @ m.router.kernel[...], 2)
  counts = np.bincount(np.asarray(routing.experts).ravel(), minlength=N)
  expected = N * np.sum(counts / counts.sum() * np.asarray(routing.probs).mean(0))
  assert float(statistics.load_balancing_loss) == pytest.approx(expected, rel=1e-5)


def test_router_z_loss_by_hand():
  # logsumexp of (0, 0) is ln 2, of (ln 3, 0) ln 4: the mean of their squares is 2.5 (ln 2)^2.
  logits = jnp.asarray([[0.0, 0.0], [math.log(3.0), 0.0]])
  assert float(moe.router_z_loss(logits)) == pytest.approx(2.5 * math.log(2.0) ** 2, rel=1e-6)


def test_the_loss_free_bias_moves_a_skewed_routers_load_towards_even():
  logits = jax.random.normal(jax.random.key(0), (512, N)) + jnp.asarray([1.5, 0.5, 0.0, 0.0])  # favours expert 0

  @jax.jit  # one program for the 40 steps, not each op compiled on its own
  def step(bias):
    load = moe.expert_load(moe.route(logits, 2, load_bias=bias).experts, N)
    return load.max() / load.mean(), moe.updated_load_bias(bias, load, 0.01)

  bias, shares = jnp.zeros(N), []
  for _ in range(40):
    share, bias = step(bias)
    shares.append(float(share))
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
  grouped_grads = jax.jit(jax.grad(loss(grouped)))(params)  # compiled: one program, not op by op
  dense_grads = jax.jit(jax.grad(loss(dense)))(params)
  for path, grad in jax.tree.leaves_with_path(grouped_grads):
    assert float(jnp.abs(grad).max()) > 0, path
  assert_trees_close(grouped_grads, dense_grads, terms=2 * LAYER_TERMS + 10 + N)  # and the sums over T, N


# ---------------------------------------------------------------------------------------------- GPT
CONFIG = GPT2Config(vocab_size=37, max_len=32, num_layers=2, num_heads=2, width=16, dropout=0.0, moe_experts=4,
                    moe_hidden=12)


def tokens(batch=2, length=9, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


def twin_moe_models(**overrides):
  """(unscanned, scanned) MoE GPTs holding the same parameters."""
  return _twin_moe_models(GPT2Config(**{**CONFIG.__dict__, **overrides}))


@functools.cache  # by the config: twin_moe_models(mlp='gelu') is twin_moe_models()
def _twin_moe_models(config: GPT2Config):
  scanned = GPT(GPT2Config(**{**config.__dict__, 'scan_layers': True}), rngs=nnx.Rngs(0))
  # The unscanned model built abstractly (no second initialisation), then given the scanned one's
  # variables: block i's are layer i of the stacked ones, the others the same.
  graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
  stacked = nnx.to_pure_dict(nnx.state(scanned))
  layers = jax.jit(lambda blocks: [jax.tree.map(lambda v: v[i], blocks) for i in range(config.num_layers)])(
      stacked['blocks'])
  values = {**stacked, 'blocks': dict(enumerate(layers))}
  nnx.replace_by_pure_dict(shapes, values)
  return nnx.merge(graphdef, shapes), scanned


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
  generated = list(np.asarray(out)[0])
  # Without a cache: the argmax loop, in one causal pass over the prompt and the generated tokens (one
  # program instead of one per length): position P - 1 + i sees exactly the prefix the loop's step i
  # would run again, so the cached tokens are greedy iff each equals the argmax before it. (A capacity
  # is per forward pass: 2.0 x the even share of a 4-expert top-2 layer is all tokens, so nothing is
  # dropped in either pass.)
  logits = full_forward(model, jnp.asarray([prompt + generated[:-1]]))[0]
  assert list(np.asarray(jnp.argmax(logits[len(prompt) - 1:], axis=-1))) == generated


def test_a_tiny_moe_gpt_trains_through_the_trainer_and_logs_its_routing(tmp_path):
  from train.rundir import load_run
  from train.trainer import evaluate_run, train_and_evaluate
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=3, lines=30)
  config = support.tiny_gpt_config(corpus, **{
      'model.moe_experts': 4, 'model.moe_every': 2, 'model.moe_shared_experts': 1, 'model.moe_router_bias': True,
      'model.mlp': 'swiglu', 'train.moe_bias_rate': 0.01, 'train.steps': 3, 'train.log_every': 1,
      'train.eval_every': 3, 'train.checkpoint_every': 3, 'decode.prompts': ''})
  workdir = str(tmp_path / 'run')
  results = train_and_evaluate(config, workdir)
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  train_rows = [row for row in rows if 'train/loss' in row]
  assert [row['step'] for row in train_rows] == [1, 2, 3]
  for row in train_rows:  # block 1 alone holds experts (moe_every=2)
    assert 1.0 <= row['train/moe/block_1/max_load'] <= 4.0 and 0.0 <= row['train/moe/block_1/min_load'] <= 1.0
    assert 'train/moe/block_0/max_load' not in row
    assert row['train/moe/dropped_fraction'] == 0.0
    assert row['train/moe/load_balancing_loss'] > 0 and row['train/moe/z_loss'] > 0
  assert os.path.isfile(results['images']['moe/expert_load'])
  run = load_run(workdir)
  # The load bias moved once per step, by +-rate (or stayed for an expert at the mean load).
  bias = np.asarray(run.model.blocks[1].mlp.load_bias[...])
  assert np.any(bias != 0) and np.allclose(np.round(bias / 0.01), bias / 0.01, atol=1e-4)
  assert np.abs(bias).max() <= 3 * 0.01 + 1e-6
  assert not isinstance(run.model.blocks[0].mlp, moe.MoEFeedForward)
  evaluated = evaluate_run(workdir)
  assert evaluated['eval/loss'] == pytest.approx(results['eval/loss'], rel=1e-6)


def test_the_balancing_losses_join_the_minimised_loss_with_their_coefficients():
  from train.tasks import gpt as gpt_task
  config = support.smallest_config('gpt', {'model.moe_experts': 4, 'train.moe_aux_loss': 0.5,
                                           'train.moe_z_loss': 0.25, 'train.loss_chunk_tokens': 0})
  from train.task import Prepared
  model_config = gpt_task.Task.resolve_model_config(config, 'cpu', vocab_size=37)
  task = gpt_task.Task(config, Prepared(None, model_config))
  # Any weights do (the identity holds for all): built abstractly and valued by NumPy, no initialiser compiled.
  model = support.numpy_valued(nnx.eval_shape(lambda: task.build_model(nnx.Rngs(0))))
  batch = {'tokens': np.asarray(tokens(batch=2, length=10))}
  compiled_loss = nnx.jit(task.loss, static_argnames='deterministic')  # one program each, not op by op
  loss, metrics = compiled_loss(model, batch, deterministic=False)
  cross_entropy = metrics['loss'][0] / metrics['loss'][1]
  balancing = metrics['moe/load_balancing_loss'][0]
  z_loss = metrics['moe/z_loss'][0]
  assert float(loss) == pytest.approx(float(cross_entropy + 0.5 * balancing + 0.25 * z_loss), rel=1e-6)
  eval_loss, eval_metrics = compiled_loss(model, batch, deterministic=True)
  assert float(eval_loss) == pytest.approx(float(cross_entropy), rel=1e-6) and 'moe/z_loss' not in eval_metrics


# ------------------------------------------------------------------------------------------- presets
def expert_matrices(config: GPT2Config) -> int:
  """Parameters of one expert: two or three matrices E x H."""
  return (3 if config.mlp == 'swiglu' else 2) * config.width * config.expert_width


def preset_model_config(preset: str, **overrides) -> GPT2Config:
  config = gpt_configs.get_config(preset)
  return GPT2Config(**{**config.model.to_dict(), 'vocab_size': config.data.vocab_size, 'attention': 'xla',
                       'dtype': 'float32', **overrides})


def counts(preset: str) -> tuple[int, int]:
  """(parameters, parameters active per token) of a preset's model, built abstractly (scanned: flat
  in depth); active = all but the N - k experts each MoE block leaves out."""
  config = preset_model_config(preset, scan_layers=True)
  total = support.abstract_parameter_count(config, lambda c: GPT(c, rngs=nnx.Rngs(0)))
  idle = len(config.moe_blocks()) * (config.moe_experts - config.moe_top_k) * expert_matrices(config)
  return total, total - idle


def llama_style_count(vocab, layers, width, heads, kv_heads, head_dim, experts, expert_width, qk_norm):
  """By hand: untied embedding and head 2 V E; per block query and output 2 E H D, key and value
  2 E K D, two RMSNorms 2E, QK-norm 2D, the router E N and N experts of three E x H' matrices; the
  final RMSNorm E."""
  block = (2 * width * heads * head_dim + 2 * width * kv_heads * head_dim + 2 * width + qk_norm * 2 * head_dim
           + width * experts + experts * 3 * width * expert_width)
  return 2 * vocab * width + layers * block + width


@pytest.mark.parametrize('preset, published, by_hand', [
    # Mixtral 8x7B (Jiang et al. 2024; HF MixtralForCausalLM): 46.7B parameters, 12.9B active.
    ('mixtral-8x7b', (46.7e9, 12.9e9), (46_702_792_704, 12_879_925_248)),
    # Qwen3-30B-A3B (Qwen3 technical report 2025; HF Qwen3MoeForCausalLM): 30.5B, 3.3B active
    # (29.9B without the embedding and output layer, 2 x 151,936 x 2,048).
    ('qwen3-30b-a3b', (30.5e9, 3.3e9), (30_532_122_624, 3_353_032_704)),
    # OLMoE-1B-7B (Muennighoff et al. 2024): 6.9B, 1.3B active; its QK-norm scales the whole
    # projections (2 x 2,048 per block), ours each head's (2 x 128): 16 x 3,840 = 61,440 fewer.
    ('olmoe-1b-7b', (6.9e9, 1.3e9), (6_919_161_856 - 61_440, 1_282_017_280 - 61_440)),
])
def test_the_published_moe_shapes_have_their_published_parameter_counts(preset, published, by_hand):
  config = preset_model_config(preset)
  hand_total = llama_style_count(config.vocab_size, config.num_layers, config.width, config.num_heads,
                                 config.kv_heads, config.head_width, config.moe_experts, config.expert_width,
                                 config.qk_norm)
  hand_active = hand_total - config.num_layers * (config.moe_experts - config.moe_top_k) * expert_matrices(config)
  assert (hand_total, hand_active) == by_hand
  assert counts(preset) == by_hand
  # Published to a tenth of a billion (Qwen3's 3.353B active is given as 3.3B).
  assert all(abs(count - value) < 0.06e9 for count, value in zip(by_hand, published))


def test_the_moe_preset_has_the_dense_defaults_active_parameters():
  # default: embeddings (2,048 + 256 positions) x 256; per block attention 4 x 256^2 + 4 x 256 biases,
  # QK-norm 2 x 64, two LayerNorms 4 x 256, MLP 2 x 256 x 1,024 + 1,024 + 256 biases; final LayerNorm 512.
  embeddings, attention, norms = (2048 + 256) * 256, 4 * 256**2 + 4 * 256 + 2 * 64, 4 * 256
  dense = embeddings + 4 * (attention + norms + 2 * 256 * 1024 + 1024 + 256) + 512
  # moe: the MLP is the 256 x 8 router and 8 experts of 2 x 256 x 510, 2 of them active per token.
  total = embeddings + 4 * (attention + norms + 256 * 8 + 8 * 2 * 256 * 510) + 512
  active = embeddings + 4 * (attention + norms + 256 * 8 + 2 * 2 * 256 * 510) + 512
  assert (dense, total, active) == (3_749_888, 10_011_648, 3_744_768)
  assert 256 * 8 + 2 * 2 * 256 * 510 == 2 * 256 * 1024  # the MLP weights a token passes through
  assert counts('moe') == (total, active)
  assert counts('default')[0] == dense


def test_bench_flops_count_the_chosen_and_shared_experts_not_all_of_them():
  from train import bench
  config = gpt_configs.get_config('moe')
  task = bench.bench_task(config, 'cpu')
  # 6 x (per block 4 x 256^2 attention + the router 256 x 8 + 2 chosen experts x 2 x 256 x 510,
  # the 2,048 x 256 output layer) + 12 x 4 blocks x 128 positions x 256.
  per_block = 4 * 256**2 + 256 * 8 + 2 * 2 * 256 * 510
  assert task.flops_per_token() == 6 * (4 * per_block + 2048 * 256) + 12 * 4 * 128 * 256
  shared = bench.bench_task(support.with_overrides(gpt_configs.get_config('moe'), {
      'model.moe_shared_experts': 1, 'model.moe_every': 2}), 'cpu')
  dense_block = 4 * 256**2 + 2 * 256 * 1024
  moe_block = 4 * 256**2 + 256 * 8 + 3 * 2 * 256 * 510
  assert shared.flops_per_token() == 6 * (2 * dense_block + 2 * moe_block + 2048 * 256) + 12 * 4 * 128 * 256


# --------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize('override, message', [
    ({'model.moe_experts': 4, 'model.moe_top_k': 5},
     'config.model.moe_top_k=5 must be between 1 and model.moe_experts=4.'),
    ({'model.moe_experts': 4, 'model.moe_top_k': 0},
     'config.model.moe_top_k=0 must be between 1 and model.moe_experts=4.'),
    ({'model.moe_top_k': 4}, 'config.model.moe_top_k=4 is set on a dense model (model.moe_experts=0); set '
                             'model.moe_experts to the number of experts, or drop it.'),
    ({'model.moe_capacity_factor': 1.25}, 'config.model.moe_capacity_factor=1.25 is set on a dense model '
                                          '(model.moe_experts=0); set model.moe_experts to the number of experts, '
                                          'or drop it.'),
    ({'model.moe_experts': -2}, 'config.model.moe_experts=-2 must be >= 0 (0: a dense model).'),
    ({'model.moe_experts': 4, 'model.moe_capacity_factor': -1.0},
     'config.model.moe_capacity_factor=-1.0 must be >= 0 (0: dropless; 1.25 is a common capacity).'),
    ({'model.moe_experts': 4, 'model.moe_every': 0},
     'config.model.moe_every=0 must be >= 1 (1: every block holds experts).'),
    ({'model.moe_experts': 4, 'model.moe_every': 3},
     'config.model.moe_every=3 exceeds model.num_layers=2: no block would hold experts; lower it.'),
    ({'model.moe_experts': 4, 'model.moe_every': 2, 'model.scan_layers': True},
     'config.model.moe_every=2 with model.scan_layers=True: scanned blocks are identical, so set moe_every=1 or '
     'scan_layers=False.'),
    ({'model.moe_experts': 4, 'model.moe_hidden': -8},
     'config.model.moe_hidden=-8 must be >= 0 (0: the dense MLP width).'),
    ({'model.moe_experts': 4, 'model.moe_shared_experts': -1}, 'config.model.moe_shared_experts=-1 must be >= 0.'),
    ({'model.moe_experts': 4, 'train.moe_aux_loss': -0.01}, 'config.train.moe_aux_loss=-0.01 must be >= 0 (0: off).'),
    ({'model.head_dim': -1}, 'config.model.head_dim=-1 must be >= 0 (0: width // num_heads).'),
])
def test_bad_moe_values_are_one_line_config_errors(override, message):
  from errors import ConfigError
  from train.validation import validate_config
  with pytest.raises(ConfigError) as error:
    validate_config(support.with_overrides(gpt_configs.get_config('tiny'), override), num_devices=1)
  assert str(error.value) == message


def test_a_bad_moe_value_stops_launch_in_one_line_before_any_workdir(tmp_path):
  result = support.launch(['--config=configs/gpt.py:tiny', '--config.model.moe_experts=2',
                           '--config.model.moe_top_k=3', f'--workdir={tmp_path}/run'])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      'error: config.model.moe_top_k=3 must be between 1 and model.moe_experts=2.'], result.stderr
  assert not os.path.exists(tmp_path / 'run')


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
