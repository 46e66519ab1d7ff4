"""Expert parallelism (models/moe_parallel.py) on 8 CPU devices: a mixture-of-experts GPT trained on a
(data 2, expert 4) mesh takes the steps a 1-device run takes, its compiled step moves tokens with
all-to-all and never gathers the experts' weights, its checkpoints resume on another mesh, and bad
meshes stop in one line before any workdir."""
import json
import os

import jax
import numpy as np
import optax
import pytest

import support
from numerics import assert_close, assert_trees_close, transformer_terms
from train import bench, hlo, sharding
from train import state as state_lib
from train.optim import make_optimizer
from train.steps import jit_train_step
from train.trainer import train_and_evaluate

pytestmark = pytest.mark.numerics  # parity: .ci/run reruns them with AVX2 only

WIDTH, EXPERT_WIDTH, EXPERTS, TOP_K = 32, 80, 8, 2  # [N, E, H] experts large enough to shard (MIN_SHARDED_SIZE)
# With the loss-free bias, as the `moe` preset balances (a rate that moves the choice within the steps).
MOE = {'model.moe_experts': EXPERTS, 'model.moe_top_k': TOP_K, 'model.moe_hidden': EXPERT_WIDTH,
       'model.mlp': 'swiglu', 'model.dropout': 0.0, 'model.moe_router_bias': True, 'train.moe_bias_rate': 0.01}
EXPERT_PARALLEL = {'mesh.data': 2, 'mesh.expert': 4}
# fsdp and tensor beside the expert axis: the experts' matrices gathered over fsdp into the exchange, the
# tokens' copies on the tensor axis computing alike.
BESIDE_FSDP_AND_TENSOR = {'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.expert': 2, 'mesh.tensor': 2}
ONE_DEVICE = {'mesh.data': 1}
STEPS = 3
# The character vocabulary of `corpus` (4 specials, 20 letters, space, '.', newline), and STEPS steps in
# the schedule: the trainer's runs on it below then compile the programs `train_steps` compiled for the
# same mesh (the persistent compilation cache has them).
VOCAB = 27
# One step of the tiny GPT (2 blocks of width 32, 32 positions, batch 8), the MLP's reduction being
# an expert's down projection over its 80 hidden units plus the router's over the width.
STEP_TERMS = transformer_terms(2, WIDTH, EXPERT_WIDTH + WIDTH, 32, vocab=VOCAB, positions=8 * 32)
EXPERT_MATRICES = {(WIDTH, EXPERT_WIDTH), (EXPERT_WIDTH, WIDTH)}  # the trailing [E, H], [H, E] of every expert's


def moe_config(mesh: dict, **overrides):
  config = support.with_overrides(support.tiny_gpt_config(''), {**MOE, **mesh, 'train.steps': STEPS, **overrides})
  config.data.vocab_size = VOCAB
  return config


def batches(config, count: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  shape = (config.train.batch_size, config.data.seq_len + 1)
  return [{'tokens': rng.integers(0, config.data.vocab_size, shape, dtype=np.int32)} for _ in range(count)]


def train_steps(config, devices) -> tuple[dict, list[dict[str, float]]]:
  """The trainer's compiled step run on `batches` over `config.mesh` on `devices`, from the seed's
  initialisation: (the gradients the first step computed, as numpy; each step's loss and gradient norm)."""
  task = bench.bench_task(config)
  mesh = sharding.make_mesh(config.mesh, devices)
  tx, _ = make_optimizer(config.train)
  spec = state_lib.state_spec(task.build_model, mesh, state_lib.resolve_rng_impl(config.rng_impl), tx)
  state = state_lib.init_state(spec, task.build_model, tx, config.seed)
  scalars = []
  with sharding.use_mesh(mesh):
    step = jit_train_step(task, spec, tx, config.train.grad_accum)
    for batch in batches(config, STEPS):
      state, (values, _) = step(state, sharding.global_batch(batch, mesh))
      scalars.append({name: float(values[name]) for name in ('loss', 'grad_norm')})
      if len(scalars) == 1:  # read before the next step, which is given (donated) this state
        gradients = first_gradients(state.opt_state, config.train, scalars[0]['grad_norm'])
  return gradients, scalars


def first_gradients(opt_state, train_config, grad_norm: float) -> dict:
  """The gradients of the first step, read from AdamW's first moment after it (no program of their own):
  mu = (1 - b1) g, of g clipped to norm train.grad_clip (optax.clip_by_global_norm divides by the norm)."""
  adam, = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
  unclipped = max(1.0, grad_norm / train_config.grad_clip) if train_config.grad_clip else 1.0
  return jax.tree.map(lambda mu: np.asarray(mu, np.float64) / (1 - train_config.b1) * unclipped, jax.device_get(adam.mu))


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


@pytest.fixture(scope='module')
def one_device():
  return train_steps(moe_config(ONE_DEVICE), jax.devices()[:1])


@pytest.mark.parametrize('mesh', [EXPERT_PARALLEL, BESIDE_FSDP_AND_TENSOR],
                         ids=['data=2,expert=4', 'fsdp=2,expert=2,tensor=2'])
def test_three_steps_on_an_expert_parallel_mesh_equal_one_device(one_device, mesh):
  # The experts' outputs start small beside the residual stream (GPT-2's initialisation), so the
  # losses hardly see them; their gradients do.
  single_gradients, single = one_device
  gradients, parallel = train_steps(moe_config(mesh), jax.devices())
  assert_trees_close(gradients, single_gradients, terms=STEP_TERMS)
  for step, (mine, want) in enumerate(zip(parallel, single), start=1):
    for name in want:
      assert_close(mine[name], want[name], terms=step * STEP_TERMS, err_msg=f'{name} of step {step}')


def test_the_compiled_step_moves_tokens_with_all_to_all_and_never_gathers_expert_weights():
  # The program test_three_steps_on_an_expert_parallel_mesh_equal_one_device[data=2,expert=4] ran, compiled
  # with the same options: after it, read from the persistent compilation cache, not compiled again.
  compiled = bench.compile_train_step(moe_config(EXPERT_PARALLEL))
  found = hlo.collectives(compiled.as_text())
  # Per device a [4, C, E] buffer (or its four [1, C, E] pieces), C = 1 row x 32 positions x min(k, 2
  # local experts) slots: 2 MoE blocks x (slots out, outputs back), forward and backward.
  exchanges = [c for c in found if c.kind == 'all-to-all' and c.shape[-2:] == (32 * TOP_K, WIDTH)]
  assert len(exchanges) >= 2 * 2 * 2, [(c.kind, c.arrays) for c in found]
  gathered = [c for c in found if c.kind == 'all-gather'
              and any(shape[-2:] in EXPERT_MATRICES for _, shape in c.arrays)]
  assert not gathered, [(c.name, c.arrays) for c in gathered]
  # Nor do the tokens travel any other way: no gather or reduction of the global batch's [T, ...] tokens or
  # [T k, ...] slots (without the exchange XLA all-reduces the global [T k, H] hidden slots).
  tokens = 8 * 32
  global_batch = [c for c in found if c.kind != 'all-to-all' and any(shape[:1] in ((tokens,), (tokens * TOP_K,))
                                                                     for _, shape in c.arrays)]
  assert not global_batch, [(c.kind, c.arrays) for c in global_batch]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')), files=3, lines=30)


def run_config(corpus: str, mesh: dict):
  return support.tiny_gpt_config(corpus, **MOE, **mesh, **{
      'train.steps': 3, 'train.checkpoint_every': 2, 'train.eval_every': 3, 'train.log_every': 1,
      'decode.prompts': ''})


def train_losses(workdir: str) -> dict[int, float]:
  """{step: train/loss}, the last logged for each step (a resumed run logs its steps again)."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  return {row['step']: row['train/loss'] for row in rows if 'train/loss' in row}


def test_a_run_saved_on_data_2_expert_4_resumes_on_another_mesh(corpus, tmp_path, capsys):
  straight = str(tmp_path / 'straight')
  train_and_evaluate(run_config(corpus, EXPERT_PARALLEL), straight)
  # fsdp=2 x expert=2 x tensor=2: each device holds another half of the experts, each expert's matrices
  # split in two as well. The mesh of test_three_steps_on_an_expert_parallel_mesh_equal_one_device's
  # second case: its programs come from the persistent compilation cache.
  resumed = support.copy_run_back_to(straight, 2, str(tmp_path / 'resumed'))
  capsys.readouterr()
  results = train_and_evaluate(run_config(corpus, BESIDE_FSDP_AND_TENSOR), resumed)
  assert 'Resumed from the checkpoint at step 2' in capsys.readouterr().out
  assert results['step'] == 3
  assert_close(train_losses(resumed)[3], train_losses(straight)[3], terms=3 * STEP_TERMS)


@pytest.mark.parametrize('overrides, message', [
    ({'mesh.data': 2, 'mesh.expert': 4, 'model.moe_experts': 6},
     'config.model.moe_experts=6 is not divisible by mesh.expert=4: each device holds an equal share of the experts; '
     'choose an expert axis that divides 6.'),
    ({'mesh.data': 4, 'mesh.expert': 2, 'model.moe_experts': 0},
     'config.mesh.expert=2 splits experts, but this model has none (model.moe_experts=0); set mesh.expert=1, or '
     'model.moe_experts.'),
    ({'mesh.data': 2, 'mesh.expert': 4, 'train.batch_size': 12},
     'config.train.batch_size=12 is not divisible by mesh data x fsdp x expert x train.grad_accum = 2 x 1 x 4 x 1; '
     'use a multiple of 8.'),
    ({'mesh.data': 2, 'mesh.expert': 4, 'model.moe_capacity_factor': 1.25},
     'config.model.moe_capacity_factor=1.25 with mesh.expert=4: expert parallelism runs the dropless experts only; '
     'set model.moe_capacity_factor=0, or mesh.expert=1.'),
])
def test_bad_expert_meshes_are_one_line_config_errors_before_any_workdir(overrides, message, tmp_path):
  from errors import ConfigError
  from train.validation import validate_config
  config = support.with_overrides(support.tiny_gpt_config(''), {**MOE, **overrides})
  with pytest.raises(ConfigError) as error:
    validate_config(config, num_devices=8)
  assert str(error.value) == message  # launch.py prints a ConfigError as this one line and exits 1
  with pytest.raises(ConfigError):
    train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')
