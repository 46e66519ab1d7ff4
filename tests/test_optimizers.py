"""The optimizers and schedules of train/optim.py against Optax's own, by hand: one step of each
optimizer equals the same Optax transformation built here, Muon's split is the stated one, wsd
matches a hand computation and moves its cooldown without recompiling, the memory estimate counts
each optimizer's state, the target clock records the right evaluation, each bad value is one line
before anything compiles, and sharded steps (FSDP, tensor parallelism) gather weights, not
activations: Muon's Newton-Schulz gathers its momentum matrices."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import support
from configs import gpt
from errors import ConfigError
from numerics import assert_trees_close
from models.gpt import GPT, GPT2Config
from test_fsdp_activations import FAST_COMPILE, MESHES, batch_carrying, tiny_config
from train import compilation, hlo, loop, memory, optim, sharding
from train import state as state_lib
from train.bench import compile_train_step
from train.validation import validate_config

D = optax.contrib.MuonDimensionNumbers


def train_config(**values):
  config = gpt.get_config('tiny').train
  config.update({'warmup_steps': 0, 'schedule': 'constant', 'grad_clip': 0.5, 'lr': 0.01, 'weight_decay': 0.1,
                 **values})
  return config


@functools.cache
def gpt_params(scan_layers=False, width=8, num_layers=2):
  """A GPT's parameters (an nnx.State), random, made without running JAX."""
  config = GPT2Config(vocab_size=11, max_len=8, num_layers=num_layers, num_heads=2, width=width,
                      scan_layers=scan_layers)
  abstract = nnx.state(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))), nnx.Param)
  return random_like(abstract, 0)


def random_like(tree, seed, scale=0.1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (scale * rng.standard_normal(x.shape)).astype(np.float32), tree)


def paths(tree) -> dict[str, jax.Array]:
  return {sharding.path_to_string(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def one_step(transformations, params, steps=1):
  """[(the parameters, the state) after `steps` updates of each of `transformations`] with the same
  random gradients, compiled together (op by op, Muon takes a minute)."""
  grads = [random_like(params, seed, 1.0) for seed in range(1, steps + 1)]

  @jax.jit
  def run(params, grads):
    results = []
    for tx in transformations:
      p, state = params, tx.init(params)
      for g in grads:
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
      results.append((p, state))
    return results

  return run(params, grads)


def assert_same(a, b):
  for (name, x), y in zip(paths(a).items(), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


# Muon's matrices in the 2-layer GPT, written out: every other parameter goes to its AdamW.
MUON_MATRICES = {f'blocks/{i}/{name}/kernel' for i in (0, 1) for name in
                 ('self_attention/query', 'self_attention/key', 'self_attention/value', 'self_attention/out',
                  'mlp/up', 'mlp/down')}


def test_muon_takes_the_hidden_matrices_and_one_step_is_optaxs_own():
  params = gpt_params()
  split = optim.muon_split(params)
  assert {name for name, _ in split['muon']} == MUON_MATRICES
  assert {name for name, _ in split['adamw']} == set(paths(params)) - MUON_MATRICES  # embeddings, norms, biases
  config = train_config(optimizer='muon', adam_lr=0.002, muon_momentum=0.9, muon_rms_scale=0.2)
  tx, _ = optim.make_optimizer(config)
  numbers = jax.tree_util.tree_map_with_path(
      lambda path, _: D(0, 1) if sharding.path_to_string(path) in MUON_MATRICES else None, params)
  by_hand = optax.chain(optax.clip_by_global_norm(0.5), optax.contrib.muon(
      0.01, beta=0.9, eps=1e-8, weight_decay=0.1, adam_b1=0.9, adam_b2=0.95, adam_learning_rate=0.002,
      muon_weight_dimension_numbers=numbers, consistent_rms=0.2))
  (ours, _), (theirs, _) = one_step([tx, by_hand], params)
  # Rounding apart: train/optim.py runs Newton-Schulz on stacks of same-shape matrices (tests/test_muon_stacked.py).
  assert_trees_close(ours, theirs, terms=8 * 32 + 5 * (32 + 2 * 8))
  line = optim.describe_split(config, params)
  assert line.startswith('Muon takes 12 matrices, 1,536 parameters (blocks/*/mlp/down, blocks/*/mlp/up, '
                         'blocks/*/self_attention/key, ')
  assert 'in embeddings (position_embedding, token_embedding)' in line


def test_muon_orthogonalises_each_layer_of_a_scanned_stack_alone():
  """scan_layers=True stacks each kernel as [layers, in, out]: its update is the per-layer one."""
  layered, stacked = gpt_params(), gpt_params(scan_layers=True)
  assert {name: shape for name, shape in optim.muon_split(stacked)['muon']} == {
      f'blocks/{name}/kernel': shape for name, shape in
      [('self_attention/query', (2, 8, 8)), ('self_attention/key', (2, 8, 8)), ('self_attention/value', (2, 8, 8)),
       ('self_attention/out', (2, 8, 8)), ('mlp/up', (2, 8, 32)), ('mlp/down', (2, 32, 8))]}
  tx, _ = optim.make_optimizer(train_config(optimizer='muon', grad_clip=0.0, weight_decay=0.0))
  grads = random_like(layered, 3, 1.0)
  stack = lambda tree: {name.replace('/0/', '/'): np.stack([leaf, paths(tree)[name.replace('/0/', '/1/')]])
                        for name, leaf in paths(tree).items() if '/0/' in name}
  as_stacked = lambda tree: jax.tree.unflatten(jax.tree.structure(stacked), [
      stack(tree).get(name, paths(tree).get(name)) for name in paths(stacked)])
  update = jax.jit(lambda grads, params: tx.update(grads, tx.init(params), params)[0])
  by_layer = paths(update(grads, layered))
  updates = paths(update(as_stacked(grads), as_stacked(layered)))
  for name in MUON_MATRICES:
    layer = int(name.split('/')[1])
    np.testing.assert_allclose(updates[name.replace(f'/{layer}/', '/')][layer], by_layer[name], rtol=1e-5, atol=1e-7)


def test_a_model_without_a_matrix_gives_muon_nothing():
  params = {'width': jnp.ones((1,)), 'embedding': {'embedding': jnp.ones((10, 4))},
            'head': {'kernel': jnp.ones((4, 3))}}
  assert optim.muon_split(params)['muon'] == []
  with pytest.raises(ConfigError, match='no hidden weight matrix for Muon') as error:
    optim.describe_split(train_config(optimizer='muon'), params)
  assert '\n' not in str(error.value)


# {family: (some parameters Muon takes, some AdamW takes)} at the family's smallest preset.
MUON_SPLITS = {
    'gpt': ({'blocks/0/self_attention/query/kernel', 'blocks/1/mlp/down/kernel'},
            {'token_embedding/embedding', 'position_embedding/embedding', 'blocks/0/mlp_norm/scale'}),
    'transformer': ({'encoder_blocks/0/self_attention/query/kernel', 'decoder_blocks/0/cross_attention/out/kernel',
                     'decoder_blocks/0/mlp/down/kernel'}, {'source_embedding/embedding'}),
    'rnn_lm': ({'rnn/cells/0/input_kernel', 'rnn/cells/0/recurrent_kernel'}, {'output/kernel', 'embedding/embedding'}),
    'seq2seq': ({'encoder/cells/0/recurrent_kernel', 'attention/score/w_q/kernel'},
                {'attention/score/w_v/kernel', 'output/kernel'}),
    'bert': ({'encoder/pooler/kernel', 'mlm/dense/kernel'}, {'nsp/kernel', 'mlm/bias'}),
    'classifier': ({'blocks/0/mlp/up/kernel'}, {'head/kernel'}),
    'attention_pooling': (set(), {'width'}),  # one kernel width: no matrix for Muon
}


@pytest.mark.parametrize('family', support.registered_families())
def test_the_split_in_every_family(family):
  from data.tokenizers import train_tokenizer
  from train.task import task_without_data
  muon, adamw = support.family_entry(MUON_SPLITS, family, 'MUON_SPLITS in tests/test_optimizers.py')
  config = support.smallest_config(family)
  tokenizer = train_tokenizer(config.data.tokenizer, ['alpha beta gamma delta'] * 20, 300, True)
  task = task_without_data(config, tokenizer)
  params = nnx.state(nnx.eval_shape(lambda: task.build_model(state_lib.make_rngs(0, 'threefry'))), nnx.Param)
  split = {side: {name for name, _ in entries} for side, entries in optim.muon_split(params).items()}
  assert muon <= split['muon'] and adamw <= split['adamw'] and bool(split['muon']) == bool(muon), split
  assert all(name.endswith('kernel') for name in split['muon'])


def test_schedule_free_is_optaxs_with_adamws_decay_mask():
  params = gpt_params(num_layers=1)  # each kind of parameter once: decayed kernels, undecayed biases and norms
  config = train_config(optimizer='schedule_free_adamw', warmup_steps=2, grad_clip=0.0)
  tx, logged_lr = optim.make_optimizer(config)
  decayed = optax.contrib.schedule_free_adamw(0.01, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  undecayed = optax.contrib.schedule_free_adamw(0.01, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
  mask = paths(optim.decay_mask(params))
  # Two steps: after the first, the average x equals the trained y.
  (ours, state), (with_decay, _), (without_decay, _) = one_step([tx, decayed, undecayed], params, steps=2)
  with_decay, without_decay = paths(with_decay), paths(without_decay)
  assert any(mask.values()) and not all(mask.values())
  for name, leaf in paths(ours).items():
    np.testing.assert_array_equal(leaf, (with_decay if mask[name] else without_decay)[name], err_msg=name)
  # What is evaluated and saved: Optax's average, not the trained parameters.
  averaged, optaxs = jax.jit(lambda s, p: (optim.eval_params(s, p), optax.contrib.schedule_free_eval_params(s, p)))(
      state, ours)
  assert_same(averaged, optaxs)
  assert not np.allclose(paths(averaged)['blocks/0/mlp/up/kernel'], paths(ours)['blocks/0/mlp/up/kernel'])
  assert optim.eval_params(optax.adam(0.1).init(params), ours) is ours
  assert logged_lr(0) == pytest.approx(0.005) and logged_lr(1) == pytest.approx(0.01)  # its count starts at 1


def test_one_step_of_adamw_adam_lion_and_adafactor_is_optaxs_own():
  # Adafactor factors the dimensions of 128 or more; one block holds each kind of parameter (the updates are per leaf).
  params = gpt_params(width=128, num_layers=1)
  by_hand = {
      'adamw': optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=optim.decay_mask),
      'adam': optax.adam(0.01, b1=0.9, b2=0.95, eps=1e-8),
      'lion': optax.lion(0.01, b1=0.9, b2=0.95, weight_decay=0.1, mask=optim.decay_mask),
      'adafactor': optax.adafactor(0.01, multiply_by_parameter_scale=False, weight_decay_rate=lambda _: 0.001,
                                   weight_decay_mask=optim.decay_mask)}
  ours = [optim.make_optimizer(train_config(optimizer=name))[0] for name in by_hand]
  theirs = [optax.chain(optax.clip_by_global_norm(0.5), tx) for tx in by_hand.values()]
  results = one_step(ours + theirs, params)
  for name, (mine, _), (optaxs, _) in zip(by_hand, results[:len(ours)], results[len(ours):]):
    assert_same(mine, optaxs)
    assert not np.array_equal(paths(mine)['blocks/0/mlp/up/kernel'], paths(params)['blocks/0/mlp/up/kernel']), name


def test_wsd_against_a_hand_computation():
  for shape, cooldown in (('linear', lambda p: 1 - 0.9 * p), ('1-sqrt', lambda p: 1 - 0.9 * np.sqrt(p))):
    schedule = optim.learning_rate_schedule(train_config(schedule='wsd', lr=1.0, warmup_steps=10, steps=100,
                                                         decay_fraction=0.2, decay_shape=shape, end_lr_fraction=0.1))
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 80: 1.0, 85: cooldown(0.25), 90: cooldown(0.5), 95: cooldown(0.75),
                100: 0.1, 120: 0.1}
    for count, value in expected.items():
      assert float(schedule(count)) == pytest.approx(value, abs=1e-6), (shape, count)
  assert optim.step_cooldown(train_config(steps=100, decay_fraction=0.2)) == (80, 20)


def test_wsd_applies_its_cooldown_and_moves_it_without_recompiling():
  """Lion without weight decay moves every parameter by exactly the learning rate: the lr each
  update used, read from the updates, is wsd's; a cooldown moved in the state (as the wall clock
  moves it) changes it with the same compiled update."""
  params = {'w': jnp.ones((3, 4))}
  config = train_config(optimizer='lion', schedule='wsd', lr=1.0, warmup_steps=2, steps=10, decay_fraction=0.4,
                        decay_shape='linear', end_lr_fraction=0.0, weight_decay=0.0, grad_clip=0.0)
  tx, schedule = optim.make_optimizer(config)
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  shardings = sharding.state_shardings(jax.eval_shape(tx.init, params), mesh)
  state = jax.device_put(tx.init(params), shardings)
  update = jax.jit(tx.update, out_shardings=(None, shardings))
  used = []
  for count in range(10):
    if count == 3:  # the cooldown starts now, for 4 steps (instead of at 6)
      state = optim.with_cooldown(state, (3, 4), shardings)
    updates, state = update({'w': jnp.full((3, 4), 0.5)}, state, params)
    used.append(float(jnp.abs(updates['w']).max()))
  hand = [0.0, 0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
  np.testing.assert_allclose(used, hand, atol=1e-6)
  assert update._cache_size() == 1
  assert [float(schedule(c)) for c in (5, 6, 8)] == pytest.approx([1.0, 1.0, 0.5])  # the plan train.steps gives


def test_memory_estimate_counts_each_optimizers_state():
  config = gpt.get_config('tiny')
  model_config = GPT2Config(vocab_size=256, max_len=16, num_layers=1, num_heads=2, width=128)
  build = lambda rngs: GPT(model_config, rngs=rngs)
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  params = nnx.state(nnx.eval_shape(lambda: build(nnx.Rngs(0))), nnx.Param)
  sizes = {name: int(np.prod(leaf.shape)) for name, leaf in paths(params).items()}
  total = sum(sizes.values())
  muon = sum(sizes[name] for name, _ in optim.muon_split(params)['muon'])
  factored = sum(sum(shape) if min(shape) >= 128 else int(np.prod(shape))
                 for shape in (leaf.shape for leaf in paths(params).values()))
  expected = {'adamw': 2 * total, 'adam': 2 * total, 'schedule_free_adamw': 2 * total, 'lion': total,
              'muon': muon + 2 * (total - muon), 'adafactor': factored}
  for name, floats in expected.items():
    config.train.optimizer = name
    config.train.schedule = 'constant' if name == 'schedule_free_adamw' else 'cosine'
    tx, _ = optim.make_optimizer(config.train)
    spec = state_lib.state_spec(build, mesh, 'threefry', tx)
    estimate = memory.estimate(config, model_config, spec.abstract, spec.shardings, mesh, available=2**40)
    assert estimate.params == 4 * total
    assert 4 * floats <= estimate.optimizer < 4 * floats + 1024, name  # + step counts and Adafactor's placeholders


def test_the_state_spec_describes_the_state_the_initialiser_returns():
  """state_spec takes the state's shapes from one abstract trace of the model; the jitted initialiser
  returns exactly that tree (every leaf's path, shape and dtype: parameters, dropout keys, each
  optimizer's state), so checkpoints restore into it. What the initialiser returns is read from its
  trace (jax.eval_shape: the tree and avals its compiled program returns), not run: four initialisers
  compiled for this would cost ~1 s each."""
  model_config = GPT2Config(vocab_size=64, max_len=16, num_layers=1, num_heads=2, width=32, dropout=0.1)
  build = lambda rngs: GPT(model_config, rngs=rngs)
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
  for name in ('adamw', 'muon', 'adafactor', None):
    tx = optim.make_optimizer(train_config(optimizer=name))[0] if name else None
    spec = state_lib.state_spec(build, mesh, 'threefry', tx)
    with jax.set_mesh(spec.mesh):  # as state_lib.init_state calls it
      state = jax.eval_shape(state_lib.jit_initialiser(spec, build, tx, seed=0))
    described = jax.tree_util.tree_flatten_with_path(spec.abstract)
    built = jax.tree_util.tree_flatten_with_path(state)
    assert described[1] == built[1], name
    assert [(p, x.shape, x.dtype) for p, x in described[0]] == [(p, x.shape, x.dtype) for p, x in built[0]], name


def test_the_target_clock_records_the_first_evaluation_that_meets_it():
  target = loop.parse_target(' eval/loss <= 3.28 ')
  assert (target.metric, target.relation, target.value, str(target)) == ('eval/loss', '<=', 3.28, 'eval/loss<=3.28')
  progress, written = loop.Progress(), []

  class Writer:
    def write(self, step, scalars):
      written.append((step, scalars))

    def log(self, message):
      pass

  losses = {10: 5.0, 20: float('nan'), 30: 3.3, 40: 3.28, 50: 3.1, 60: 3.5}
  met = []
  for step, loss in losses.items():
    progress.tokens = 1000 * step
    met.append(loop.record_target(target, step, {'eval/loss': loss}, progress, seconds=2.0 * step,
                                  compile_seconds=7.0, writer=Writer()))
  assert met == [False, False, False, True, False, False]
  assert progress.target == {'step': 40, 'tokens': 40000, 'seconds': 80.0, 'seconds_excluding_compile': 73.0,
                             'value': 3.28}
  assert written == [(40, {'target/step': 40, 'target/tokens': 40000, 'target/seconds': 80.0,
                           'target/seconds_excluding_compile': 73.0})]
  assert loop.target_results(target, progress)['target/step'] == 40
  assert loop.target_results(target, loop.Progress()) == {'target': 'eval/loss<=3.28', 'target/met': False}
  accuracy = loop.parse_target('eval/accuracy>=0.9')
  assert [accuracy.met_by({'eval/accuracy': a}) for a in (0.89, 0.9, 0.95)] == [False, True, True]


@pytest.mark.parametrize('overrides, message', [
    ({'train.optimizer': 'sgd'}, r"^config.train.optimizer='sgd' is not one of \('adamw', 'adam', 'muon', "),
    ({'train.target': 'eval/loss<3'}, r"^config.train.target='eval/loss<3' is not '<metric><=<value>'"),
    ({'train.target': 'eval/loss<=low'}, r"is not '<metric><=<value>' or '<metric>>=<value>'"),
    ({'train.target': '<=3.2'}, r"is not '<metric><=<value>'"),
    ({'train.stop_at_target': True}, 'stop_at_target=True needs a train.target'),
    ({'train.optimizer': 'schedule_free_adamw'}, "schedule_free_adamw replaces the schedule"),
    ({'train.schedule': 'wsd', 'train.decay_shape': 'cosine'}, 'train.decay_shape'),
    ({'train.decay_fraction': 1.5}, 'decay_fraction=1.5 must be in'),
])
def test_bad_values_are_one_line(overrides, message):
  config = support.with_overrides(gpt.get_config('tiny'), overrides)
  with pytest.raises(ConfigError, match=message) as error:
    validate_config(config, num_devices=1)
  assert '\n' not in str(error.value)


def test_muon_without_a_matrix_and_an_unlogged_target_stop_before_any_compile(tmp_path):
  from configs import attention_pooling
  from train.trainer import train_and_evaluate
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=3, lines=20)
  cases = [(support.with_overrides(attention_pooling.get_config(), {'train.optimizer': 'muon', 'train.batch_size': 48}),
            'train.optimizer=muon: this model has no hidden weight matrix for Muon'),
           (support.tiny_gpt_config(corpus, **{'train.target': 'eval/bleu>=30'}),
            r"names 'eval/bleu', which no evaluation logs; this run's evaluations log eval/accuracy, eval/loss, "
            r'eval/perplexity\.$')]
  for config, message in cases:
    compiled = compilation.compiled_total()
    with pytest.raises(ConfigError, match=message) as error:
      train_and_evaluate(config, str(tmp_path / 'run'))
    assert '\n' not in str(error.value) and compilation.compiled_total() == compiled
    assert not (tmp_path / 'run').exists()


def test_a_sharded_muon_step_gathers_the_momentum_matrices_not_activations():
  """The compiled step on fsdp=8 (and data=2 x fsdp=2 x tensor=2) moves no activation of the batch
  (tests/test_fsdp_activations.py's check); Newton-Schulz gathers each sharded momentum matrix whole
  ([1, in, out]: Optax's batch of one matrix), here several times per step (docs/accelerators.md, Muon under FSDP)."""
  for name, mesh in MESHES.items():
    config = sharded_config('muon', mesh)
    found = hlo.collectives(compile_train_step(config, compiler_options=FAST_COMPILE).as_text())
    assert not batch_carrying(found, config), name
    if name == 'fsdp=8':
      gathered = {shape for c in found if c.kind == 'all-gather' for _, shape in c.arrays if len(shape) == 3}
      width, hidden = config.model.width, 4 * config.model.width
      assert gathered == {(1, width, width), (1, width, hidden), (1, hidden, width)}, gathered


@pytest.mark.parametrize('optimizer', ['schedule_free_adamw', 'lion', 'adafactor'])
def test_the_other_optimizers_shard_without_moving_activations(optimizer):
  config = sharded_config(optimizer, MESHES['data=2,fsdp=2,tensor=2'])
  found = hlo.collectives(compile_train_step(config, compiler_options=FAST_COMPILE).as_text())
  assert any(c.kind == 'all-gather' for c in found) and not batch_carrying(found, config)


def sharded_config(optimizer, mesh):
  """tests/test_fsdp_activations.py's GPT (width 64, batch 16 x 32), one layer, trained by `optimizer`."""
  config = tiny_config('gpt', mesh)
  config.train.optimizer, config.model.num_layers = optimizer, 1
  config.train.schedule = 'constant' if optimizer == 'schedule_free_adamw' else config.train.schedule
  return config
