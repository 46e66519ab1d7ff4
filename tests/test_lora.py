"""LoRA fine-tuning (train/lora.py, models/lora.py, interop/peft.py): an adapted projection is its base
plus (alpha / r) x A B by hand; a LoRA run of a tiny GPT trains its adapters alone (the base weights
bit-equal to its base run's, no optimizer state and no checkpoint bytes for them), resumes bit for
bit and is scored alike by --mode=eval; its PEFT adapter, loaded by `peft` onto the base run's Hugging
Face export, and its merged export compute its logits (GPT-2, and a scanned Llama-style GPT with
adapters on every projection); a BERT classifier trains its adapters and new head, and its PEFT adapter
(the head as PEFT's modules_to_save) and merged export compute its logits, as a BERT pretraining model's
adapter on every projection does its MLM and NSP logits; each bad LoRA input is one ConfigError before
anything is left on disk."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import support
from errors import ConfigError
from models import lora
from test_bert import hf_outputs
from test_bert_task import hf_bert_dir  # noqa: F401 (a fixture)
from test_bert_task import tiny_config as bert_config
from train import checkpoint as ckpt

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')

pytestmark = pytest.mark.numerics  # parity with transformers + peft: .ci/run reruns them with AVX2 only

# The tiny GPT's training, as tests/test_interop.py's: a byte-level BPE of 300 ids over 32-token windows.
BASE = {'data.tokenizer': 'bpe', 'data.vocab_size': 300, 'train.steps': 2, 'train.eval_every': 2,
        'train.eval_steps': 1, 'train.checkpoint_every': 2, 'train.log_every': 1}
# The LoRA run: rank 4 on q, v (GPT-2's fused c_attn) and the MLP's down projection, with dropout, over
# an FSDP mesh; 4 steps with a checkpoint at 2 (where the resume starts).
LORA = {**BASE, 'train.steps': 4, 'train.lora_rank': 4, 'train.lora_alpha': 8.0, 'train.lora_dropout': 0.1,
        'train.lora_targets': 'q,v,down', 'train.optimizer': 'adamw', 'mesh.data': 4, 'mesh.fsdp': 2}


def saved(workdir, step):
  """The checkpoint of `step` as written: {'model', 'optimizer', 'data'}."""
  manager = ckpt.Checkpointer(workdir, read_only=True).manager
  return manager.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(), optimizer=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))


def paths(tree) -> list[str]:
  """'blocks/0/self_attention/query/kernel' for each leaf of `tree` (a checkpoint's leaves end in '/value')."""
  return ['/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path).removesuffix('/value')
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def randomize_adapters(model, seed=1, scale=0.3):
  """Adapters far from their start (B = 0), so that a misplaced A or B changes the logits."""
  state = nnx.state(model, nnx.LoRAParam)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)  # NumPy's draws: no random program compiled for each adapter shape
  nnx.update(model, jax.tree.unflatten(treedef, [
      support.placed_like(x, (scale * rng.standard_normal(x.shape)).astype(x.dtype)) for x in leaves]))


def peft_logits(base_dir, adapter_dir, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
  model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def within_1e4(name, theirs, ours) -> bool:
  """Whether float32 logits agree within 1e-4; the difference is printed (pytest -s)."""
  difference = float(np.abs(np.asarray(theirs, np.float64) - np.asarray(ours, np.float64)).max())
  print(f'\n{name}: max |ours - transformers| = {difference:.2e}')
  return difference <= 1e-4


def hf_logits(directory, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


# ------------------------------------------------------------------------------------ the layer
def test_an_adapted_projection_is_its_base_plus_scaled_low_rank_update_by_hand():
  base = nnx.Linear(5, 7, rngs=nnx.Rngs(0))
  base.bias.set_value(jnp.arange(7, dtype=jnp.float32) / 7)
  layer = lora.LoRALinear(base, rank=3, alpha=6.0, dropout=0.0, rngs=nnx.Rngs(1))
  assert layer.kernel is base.kernel and layer.lora.lora_a.shape == (5, 3) and layer.lora.lora_b.shape == (3, 7)
  assert isinstance(layer.lora.lora_a, nnx.LoRAParam) and not np.any(layer.lora.lora_b[...])  # B starts at zero
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(3, 7)).astype(np.float32)
  layer.lora.lora_a.set_value(jnp.asarray(a))
  layer.lora.lora_b.set_value(jnp.asarray(b))
  x = rng.normal(size=(4, 5)).astype(np.float32)
  w, bias = np.asarray(base.kernel[...]), np.asarray(base.bias[...])
  expected = x @ w + bias + (6.0 / 3) * x @ a @ b
  np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)
  # Merged into a plain nnx.Linear: the same map, x (W + (alpha / r) A B) + b.
  holder = nnx.List([layer])
  lora.merge_adapters(holder)
  assert type(holder[0]) is nnx.Linear
  np.testing.assert_allclose(np.asarray(holder[0](jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_acts_in_training_mode_only():
  base = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
  layer = lora.LoRALinear(base, rank=2, alpha=2.0, dropout=0.5, rngs=nnx.Rngs(params=1, dropout=2))
  layer.lora.lora_b.set_value(jnp.ones((2, 8)))
  x = jnp.ones((3, 64))
  evaluated = layer(x)  # built for evaluation: nothing dropped
  undropped = x @ base.kernel[...] + base.bias[...] + x @ layer.lora.lora_a[...] @ jnp.ones((2, 8))
  np.testing.assert_allclose(evaluated, undropped, rtol=1e-5, atol=1e-5)
  layer.train()  # as the train step sets every model
  assert not np.allclose(layer(x), evaluated)


# ------------------------------------------------------------------------------------ a LoRA run
@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')), files=6, lines=40)


@pytest.fixture(scope='module')
def base_run(corpus, tmp_path_factory):
  from train.trainer import train_and_evaluate
  workdir = str(tmp_path_factory.mktemp('base') / 'run')
  train_and_evaluate(support.tiny_gpt_config(corpus, **BASE), workdir)
  return workdir


def lora_config(corpus, base_run, **overrides):
  return support.tiny_gpt_config(corpus, **{**LORA, 'init_from': base_run, **overrides})


# The states the LoRA run's training initialised (state.init_state's results), recorded by `lora_run`.
LORA_RUN_INITIALISED = []


@pytest.fixture(scope='module')
def lora_run(corpus, base_run, tmp_path_factory):
  from train import state
  from train.trainer import train_and_evaluate
  workdir = str(tmp_path_factory.mktemp('lora') / 'run')
  init_state = state.init_state
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(state, 'init_state', lambda *args, **kwargs: LORA_RUN_INITIALISED.append(
        init_state(*args, **kwargs)) or LORA_RUN_INITIALISED[-1])
    train_and_evaluate(lora_config(corpus, base_run), workdir)
  return workdir


@pytest.fixture(scope='module')
def loaded_base(base_run):
  """`load_run(base_run)`, reloaded once for the tests that read it (none changes it)."""
  from train.rundir import load_run
  return load_run(base_run)


@pytest.fixture(scope='module')
def loaded_lora(lora_run):
  """`load_run(lora_run)` (its base weights copied from the base run), reloaded once;
  a test that changes its model changes a clone (`nnx.clone`)."""
  from train.rundir import load_run
  return load_run(lora_run)


def test_gpt_fine_tuning_starts_from_its_base_run_model_tokenizer_and_weights(corpus, base_run, loaded_base, tmp_path):
  from train import state as state_lib
  from train.trainer import fresh_state, setup_run
  # Full fine-tuning (no lora_rank) asking for another width: the base run's model is what it gets.
  config = support.tiny_gpt_config(corpus, **{**BASE, 'init_from': base_run, 'model.width': 64})
  setup = setup_run(config, str(tmp_path / 'run'))
  base = loaded_base
  assert setup.task.model_config == base.model_config and setup.task.tokenizer.vocab_size == 300
  with open(os.path.join(base_run, 'tokenizer.json')) as f, open(tmp_path / 'run' / 'tokenizer.json') as g:
    assert f.read() == g.read()
  model = state_lib.model_of(setup.spec, fresh_state(setup))
  for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(base.model, nnx.Param)),
                  strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_the_base_weights_stay_bit_equal_while_the_adapters_train(base_run, lora_run, loaded_base, loaded_lora):
  model, base = loaded_lora.model, loaded_base.model
  frozen, original = nnx.state(model, lora.BASE), nnx.state(base, nnx.Param)
  assert paths(frozen) == paths(original)
  for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(original), strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  adapted = sorted(lora.adapted(model))
  assert adapted == [f'blocks/{i}/{name}' for i in (0, 1)
                     for name in ('mlp/down', 'self_attention/query', 'self_attention/value')]
  assert all(np.abs(np.asarray(layer.lora.lora_b[...])).max() > 0 for layer in lora.adapted(model).values())
  with open(os.path.join(lora_run, 'model.json')) as f:
    assert json.load(f)['base'] == {'workdir': os.path.abspath(base_run), 'step': 2}


def test_a_reload_copies_the_base_weights_without_drawing_them(lora_run, loaded_base, monkeypatch):
  """Every frozen weight of a LoRA GPT is its base run's: its training's initialiser drew none of them
  (only the adapters), and reloading it runs no initialiser (which would draw, hold and throw away a second
  copy of the model) and gives them bit for bit."""
  [initialised] = LORA_RUN_INITIALISED
  assert jax.tree.leaves(initialised.frozen) == []
  assert paths(initialised.params) and all('/lora/' in path for path in paths(initialised.params))
  from train import state
  from train.rundir import load_run

  def initialiser(*args, **kwargs):
    raise AssertionError('the LoRA run was reloaded through an initialiser')
  monkeypatch.setattr(state, 'init_state', initialiser)
  frozen = nnx.state(load_run(lora_run).model, lora.BASE)
  for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(nnx.state(loaded_base.model, nnx.Param)), strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_the_checkpoint_and_optimizer_state_hold_the_adapters_alone(base_run, lora_run):
  last = saved(lora_run, 4)
  params = last['model']['params']
  assert paths(params) and all('/lora/lora_' in path for path in paths(params))
  adapter_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  base_shapes = {np.shape(x) for x in jax.tree.leaves(saved(base_run, 2)['model']['params'])}
  optimizer = [np.asarray(x) for x in jax.tree.leaves(last['optimizer'])]
  # AdamW's two moments of each adapter, and scalars (the step counts): no leaf of a base weight's size.
  assert sum(x.nbytes for x in optimizer if x.ndim) == 2 * adapter_bytes
  assert not {x.shape for x in optimizer if x.ndim} & base_shapes
  assert sum(x.nbytes for x in optimizer if not x.ndim) <= 64


def test_the_training_state_line_counts_what_the_checkpoints_hold(corpus, base_run, lora_run, tmp_path):
  """The start-up line's sizes: the adapters trained, the base frozen, the optimizer's moments and
  counts, as the saved arrays count them."""
  from train import state as state_lib
  from train.trainer import setup_run
  last, base = saved(lora_run, 4), saved(base_run, 2)
  size = lambda tree: (sum(np.asarray(x).size for x in jax.tree.leaves(tree)),
                       sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))
  (trained, trained_bytes), (frozen, frozen_bytes) = size(last['model']['params']), size(base['model']['params'])
  values, value_bytes = size(last['optimizer'])
  line = state_lib.describe_sizes(setup_run(lora_config(corpus, base_run), str(tmp_path / 'run')).spec)
  assert line == (f'Training state: {trained:,} trained parameters ({trained_bytes / 2**20:,.2f} MiB), {frozen:,} frozen '
                  f'({frozen_bytes / 2**20:,.2f} MiB), optimizer state {values:,} values ({value_bytes / 2**20:,.2f} MiB).')
  assert 2 * trained < values < 2 * trained + 8  # AdamW: two moments of each adapter, and its step counts


def test_a_resumed_lora_run_equals_the_uninterrupted_one_and_eval_mode_scores_it_alike(corpus, base_run, lora_run,
                                                                                          tmp_path):
  from train.trainer import evaluate_run, train_and_evaluate
  resumed = support.copy_run_back_to(lora_run, 2, str(tmp_path / 'resumed'))
  results = train_and_evaluate(lora_config(corpus, base_run), resumed)
  # --mode=eval rebuilds the model from the base run and the adapters: the final evaluation's loss again.
  assert evaluate_run(resumed)['eval/loss'] == pytest.approx(results['eval/loss'], abs=1e-6)
  straight, again = saved(lora_run, 4), saved(resumed, 4)
  for part in ('model', 'optimizer'):
    for x, y in zip(jax.tree.leaves(straight[part]), jax.tree.leaves(again[part]), strict=True):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x, y = jax.random.key_data(x), jax.random.key_data(y)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_adapters_are_replicated_until_large_then_split_over_fsdp_like_their_projection():
  from jax.sharding import PartitionSpec as P

  from train import sharding
  mesh = sharding.make_mesh({'data': 4, 'fsdp': 2, 'tensor': 1})
  spec = lambda name, shape: sharding.partition_spec(f'params/blocks/0/self_attention/query/lora/{name}', shape, mesh)
  assert spec('lora_a', (768, 8)) == P() and spec('lora_b', (8, 768)) == P()  # 6,144 values: replicated
  assert spec('lora_a', (4096, 8)) == P('fsdp', None) and spec('lora_b', (8, 4096)) == P(None, 'fsdp')
  assert spec('lora_a', (12, 4096, 8)) == P(None, 'fsdp', None)  # a scanned stack of them


@pytest.fixture(scope='module')
def bert_base(hf_bert_dir, tmp_path_factory):
  """(workdir, HF directory, run): a BERT pretraining run imported from `hf_bert_dir`, the base of the BERT LoRA
  runs, its export (a BertForPreTraining) and the run reloaded (once: a test that changes its model changes a
  clone)."""
  from train.rundir import load_run
  from train.trainer import import_hf_run
  root = tmp_path_factory.mktemp('bert')
  workdir, hf_dir = str(root / 'imported'), str(root / 'hf')
  import_hf_run(bert_config(task='pretrain'), hf_bert_dir[0], workdir)
  run = load_run(workdir)
  run.export_hf(hf_dir)
  return workdir, hf_dir, run


def bert_classifier_config(source, tmp_path, **overrides):
  """A LoRA fine-tuning of `source` into a two-class classifier, rank 2 on q and v, 2 steps."""
  data = tmp_path / 'reviews.tsv'
  data.write_text(''.join(f'{w} film {i}\t{"pos" if w == "good" else "neg"}\n'
                          for i, w in enumerate(['good', 'bad'] * 20)))
  return bert_config(task='classify', init_from=source, **{
      'data.source': f'tsv:{data}', 'train.lora_rank': 2, 'train.steps': 2, 'train.eval_every': 2,
      'train.eval_steps': 1, 'train.checkpoint_every': 2, **overrides})


def peft_classifier_logits(base_dir, adapter_dir, tokens, segments, valid):
  """Logits of the BertForSequenceClassification built on the base run's export, `adapter_dir` loaded by PEFT."""
  model = transformers.BertForSequenceClassification.from_pretrained(base_dir, num_labels=2, dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model.eval(), adapter_dir).eval()
  return hf_outputs(model, tokens, segments, valid).logits.numpy()


def test_a_bert_classifier_trains_adapters_and_its_new_head_and_exports_both_ways(bert_base, tmp_path):
  from train.rundir import load_run
  from train.trainer import train_and_evaluate
  (source, base_dir, base), workdir = bert_base, str(tmp_path / 'lora')
  train_and_evaluate(bert_classifier_config(source, tmp_path), workdir)
  params = paths(saved(workdir, 2)['model']['params'])
  assert {p for p in params if '/lora/' not in p} == {'classifier/kernel', 'classifier/bias'}
  assert len(params) == 2 + 2 * 2 * 3  # the head, and A and B of q and v in each of the 3 blocks
  run = load_run(workdir)
  encoder, original = run.model.encoder, base.model.encoder
  for x, y in zip(jax.tree.leaves(nnx.state(encoder, lora.BASE)), jax.tree.leaves(nnx.state(original, nnx.Param)),
                  strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  assert all(np.abs(np.asarray(layer.lora.lora_b[...])).max() > 0 for layer in lora.adapted(run.model).values())
  tokens = np.random.default_rng(0).integers(104, run.model_config.vocab_size, (2, 12))  # words, no specials
  segments, valid = np.zeros_like(tokens), np.ones(tokens.shape, bool)
  logits = lambda: np.asarray(support.compiled_call(run.model, jnp.asarray(tokens), jnp.asarray(segments),
                                                     jnp.asarray(valid)))
  # Adapters far from their start, so that a misplaced A or B shows; the head stays as trained.
  trained = logits()
  randomize_adapters(run.model)
  ours = logits()
  assert np.abs(ours - trained).max() > 1e-2
  # The adapters and the head as a PEFT adapter of the BertForSequenceClassification on the base export.
  summary = run.export_hf(str(tmp_path / 'adapter'), adapter=True)
  assert summary['architecture'] == 'PEFT LoRA adapter of a BertForSequenceClassification'
  with open(tmp_path / 'adapter' / 'adapter_config.json') as f:
    config = json.load(f)
  assert config['target_modules'] == [f'bert.encoder.layer.{i}.attention.self.{m}' for i in range(3)
                                      for m in ('query', 'value')]
  assert (config['task_type'], config['modules_to_save'], config['r'], config['lora_alpha']) == (
      'SEQ_CLS', ['classifier'], 2, 16.0)
  assert within_1e4('BERT classifier LoRA run, PEFT adapter on the base export',
                    peft_classifier_logits(base_dir, str(tmp_path / 'adapter'), tokens, segments, valid), ours)
  # Merged into the base weights, the export is a BertForSequenceClassification computing the run's logits.
  run.export_hf(str(tmp_path / 'hf'))
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / 'hf'), dtype=torch.float32)
  assert within_1e4('BERT classifier LoRA run, merged export',
                    hf_outputs(hf.eval(), tokens, segments, valid).logits.numpy(), ours)


def test_a_bert_pretraining_model_with_adapters_on_every_projection_loads_in_peft(bert_base, tmp_path):
  from interop.peft import export_bert_adapter
  _, base_dir, base = bert_base
  model = nnx.clone(base.model)
  assert lora.add_adapters(model, ('q', 'k', 'v', 'o', 'up', 'down'), rank=2, alpha=3.0, dropout=0.0,
                           rngs=nnx.Rngs(1)) == sorted(f'encoder/blocks/{i}/{name}' for i in range(3) for name in (
                               'mlp/down', 'mlp/up', 'self_attention/key', 'self_attention/out',
                               'self_attention/query', 'self_attention/value'))
  randomize_adapters(model)
  adapter_dir = str(tmp_path / 'adapter')
  export_bert_adapter(model, adapter_dir, rank=2, alpha=3.0, dropout=0.0)
  with open(os.path.join(adapter_dir, 'adapter_config.json')) as f:
    config = json.load(f)
  assert [m for m in config['target_modules'] if '.layer.0.' in m] == [
      f'bert.encoder.layer.0.{m}' for m in ('attention.output.dense', 'attention.self.key', 'attention.self.query',
                                            'attention.self.value', 'intermediate.dense', 'output.dense')]
  assert (config['task_type'], config['modules_to_save'], len(config['target_modules'])) == (None, None, 18)
  hf = transformers.BertForPreTraining.from_pretrained(base_dir, dtype=torch.float32).eval()
  rng = np.random.default_rng(0)
  tokens = rng.integers(104, hf.config.vocab_size, (2, 12))
  segments, valid = (np.arange(12) >= 6).astype(np.int64)[None].repeat(2, 0), np.ones(tokens.shape, bool)
  out = support.compiled_call(model, jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(valid))
  ours = np.concatenate([support.real_logits(out.mlm_logits, hf.config.vocab_size).reshape(2, -1),
                         np.asarray(out.nsp_logits)], axis=-1)

  def both_heads(hf_model):
    result = hf_outputs(hf_model, tokens, segments, valid)
    return np.concatenate([result.prediction_logits.numpy().reshape(2, -1), result.seq_relationship_logits.numpy()],
                          axis=-1)

  assert np.abs(both_heads(hf) - ours).max() > 1e-2  # the adapters matter
  assert within_1e4('BERT pretraining heads, PEFT adapter on the base export',
                    both_heads(peft.PeftModel.from_pretrained(hf, adapter_dir).eval()), ours)


def test_a_lora_target_on_the_head_a_classifier_trains_in_full_stops_before_anything_is_left(bert_base, tmp_path):
  from train.trainer import train_and_evaluate
  workdir = str(tmp_path / 'run')
  with pytest.raises(ConfigError) as error:
    train_and_evaluate(bert_classifier_config(bert_base[0], tmp_path, **{'train.lora_targets': 'q,classifier'}),
                       workdir)
  assert str(error.value) == ("config.train.lora_targets='q,classifier' adapts classifier, which a LoRA run trains in "
                              "full; leave it out of the targets.")
  assert not os.path.exists(workdir)


# ------------------------------------------------------------------------------------ Hugging Face and PEFT
def test_a_gpt2_lora_run_exports_a_peft_adapter_and_a_merged_model_with_its_logits(loaded_base, loaded_lora, tmp_path):
  import dataclasses
  base_dir, adapter_dir, merged_dir = (str(tmp_path / name) for name in ('base', 'adapter', 'merged'))
  loaded_base.export_hf(base_dir)
  run = dataclasses.replace(loaded_lora, model=nnx.clone(loaded_lora.model))  # the fixture's model left as reloaded
  randomize_adapters(run.model)
  summary = run.export_hf(adapter_dir, adapter=True)
  assert sorted(os.listdir(adapter_dir)) == ['adapter_config.json', 'adapter_model.safetensors']
  with open(os.path.join(adapter_dir, 'adapter_config.json')) as f:
    config = json.load(f)
  # q and v share GPT-2's c_attn: one adapter of rank 2 x 4 there (alpha 2 x 8), rank 4 on mlp.c_proj.
  assert config['target_modules'] == [f'transformer.h.{i}.{m}' for i in (0, 1) for m in ('attn.c_attn', 'mlp.c_proj')]
  assert set(config['rank_pattern'].values()) == {8} and set(config['alpha_pattern'].values()) == {16.0}
  assert summary['modules'] == 4
  run.export_hf(merged_dir)
  tokens = np.random.default_rng(0).integers(0, 300, (2, 24))
  ours = support.real_logits(support.compiled_call(run.model, jnp.asarray(tokens))[0], 300)
  base_logits = hf_logits(base_dir, tokens)
  assert np.abs(base_logits - ours).max() > 1e-2  # the adapters matter
  assert within_1e4('GPT-2 LoRA run, PEFT adapter on the base export', peft_logits(base_dir, adapter_dir, tokens), ours)
  assert within_1e4('GPT-2 LoRA run, merged export', hf_logits(merged_dir, tokens), ours)


def test_a_scanned_llama_with_adapters_on_every_projection_loads_in_peft(tmp_path):
  from data.tokenizers import train_bpe
  from interop.hf_llama import export_llama
  from interop.peft import export_gpt_adapter
  from models.gpt import GPT, GPT2Config
  bpe = train_bpe(['def foo(x):\n    return x + 1\n' * 20, 'hello world, hello there'], vocab_size=300)
  config = GPT2Config(vocab_size=bpe.vocab_size, max_len=48, num_layers=2, num_heads=4, num_kv_heads=2, width=32,
                      mlp_hidden=40, dropout=0.0, positions='rope', norm='rmsnorm', mlp='swiglu', use_bias=False,
                      tie_embeddings=False, scan_layers=True)
  # Any base weights do (built abstractly, valued by NumPy: no random program compiled for each parameter shape).
  model = support.numpy_valued(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
  base_dir, adapter_dir = str(tmp_path / 'base'), str(tmp_path / 'adapter')
  export_llama(model, bpe, base_dir)
  tokens = np.random.default_rng(0).integers(0, bpe.vocab_size, (2, 20))
  before = support.real_logits(support.compiled_call(model, jnp.asarray(tokens))[0], bpe.vocab_size)
  assert lora.add_adapters(model, tuple(lora.ALIASES), rank=2, alpha=3.0, dropout=0.0, rngs=nnx.Rngs(1)) == [
      f'blocks/{name}' for name in ('mlp/down', 'mlp/gate', 'mlp/up', 'self_attention/key', 'self_attention/out',
                                    'self_attention/query', 'self_attention/value')]
  assert model.blocks.mlp.gate.lora.lora_a.shape == (2, 32, 2)  # one adapter per layer, stacked
  np.testing.assert_array_equal(support.real_logits(support.compiled_call(model, jnp.asarray(tokens))[0],
                                                    bpe.vocab_size), before)
  randomize_adapters(model)
  export_gpt_adapter(model, adapter_dir, rank=2, alpha=3.0, dropout=0.0)
  ours = support.real_logits(support.compiled_call(model, jnp.asarray(tokens))[0], bpe.vocab_size)
  assert np.abs(hf_logits(base_dir, tokens) - ours).max() > 1e-2
  assert within_1e4('scanned Llama-style GPT, PEFT adapter on the base export',
                    peft_logits(base_dir, adapter_dir, tokens), ours)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize('overrides, message', [
    ({'train.lora_rank': -1}, 'lora_rank=-1: LoRA needs a rank > 0'),
    ({'train.lora_alpha': 4.0}, "lora_rank=0: LoRA needs a rank > 0 (0 = full fine-tuning, where "
                                "train.lora_alpha=4.0 does nothing)"),
    ({'train.lora_targets': 'q,k', 'train.lora_rank': 0}, "where train.lora_targets='q,k' does nothing"),
    ({'train.lora_rank': 4, 'init_from': ''}, 'LoRA fine-tunes a trained run; name it with --config.init_from'),
    ({'train.lora_rank': 4, 'train.lora_alpha': 0.0}, 'lora_alpha=0.0 must be positive'),
    ({'train.lora_rank': 4, 'train.lora_dropout': 1.0}, 'lora_dropout=1.0 must be in [0, 1)'),
    ({'train.lora_rank': 4, 'train.lora_dropout': -0.1}, 'lora_dropout=-0.1 must be in [0, 1)'),
    ({'train.lora_rank': 4, 'train.lora_targets': ' , '}, 'names no projection'),
    ({'train.lora_rank': 4, 'train.lora_targets': 'q,blocks/(1'}, "'blocks/(1' is not a regular expression"),
    ({'train.lora_rank': 4, 'train.optimizer': 'muon'}, 'use --config.train.optimizer=adamw'),
])
def test_bad_lora_settings_are_config_errors(overrides, message):
  from train.validation import validate_config
  config = support.tiny_gpt_config('text:unused', **{'init_from': 'runs/base', **overrides})
  with pytest.raises(ConfigError) as error:
    validate_config(config)
  assert message in str(error.value) and '\n' not in str(error.value)


def test_lora_on_a_family_without_init_from_is_a_config_error():
  from train.validation import validate_config
  config = support.smallest_config('rnn_lm', {'train.lora_rank': 4, 'init_from': 'runs/base'})
  with pytest.raises(ConfigError, match="the 'rnn_lm' family does not"):
    validate_config(config)


def test_a_target_matching_no_projection_or_a_lora_base_stops_before_anything_is_left(corpus, base_run, lora_run,
                                                                                      tmp_path):
  from train.trainer import train_and_evaluate
  for overrides, message in [({'train.lora_targets': 'q,gate'}, "'gate' matches no projection of this model"),
                             ({'init_from': lora_run}, 'is itself a LoRA run; start from its base run')]:
    workdir = str(tmp_path / 'run')
    with pytest.raises(ConfigError) as error:
      train_and_evaluate(lora_config(corpus, base_run, **overrides), workdir)
    assert message in str(error.value) and '\n' not in str(error.value)
    assert not os.path.exists(workdir)


def test_resuming_with_another_base_run_is_refused_and_leaves_the_run_as_it_was(corpus, base_run, lora_run, tmp_path):
  from train.rundir import RunDirError
  from train.trainer import train_and_evaluate
  copy = support.copy_run_back_to(lora_run, 2, str(tmp_path / 'copy'))
  with open(os.path.join(copy, 'model.json')) as f:
    before = f.read()
  with pytest.raises(RunDirError) as error:
    train_and_evaluate(lora_config(corpus, base_run, init_from=str(tmp_path / 'elsewhere')), copy)
  assert f'(config.init_from={base_run}) but the config asks for config.init_from={tmp_path}/elsewhere' in str(
      error.value)
  with open(os.path.join(copy, 'model.json')) as f:
    assert f.read() == before
  assert sorted(os.listdir(os.path.join(copy, 'checkpoints'))) == ['2']


def test_launch_refuses_lora_without_a_base_run_and_an_adapter_export_of_a_full_run(base_run, tmp_path):
  from train.trainer import train_and_evaluate
  # The trainer's ConfigError, which launch.py prints as its one line (as it does the export's below).
  with pytest.raises(ConfigError) as error:
    train_and_evaluate(support.tiny_gpt_config('text:unused', **{'train.lora_rank': 8}), str(tmp_path / 'run'))
  assert str(error.value) == ('config.train.lora_rank: LoRA fine-tunes a trained run; name it with '
                              '--config.init_from=<its workdir>.')
  assert not os.path.exists(tmp_path / 'run')
  result = support.launch(['--mode=export_hf', f'--workdir={base_run}', f'--hf_dir={tmp_path / "hf"}', '--hf_adapter'])
  assert result.returncode == 1 and not os.path.exists(tmp_path / 'hf')
  assert 'this run has none; export it without --hf_adapter' in result.stderr.strip().splitlines()[-1]
