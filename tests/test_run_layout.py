"""One-way data flow: `Task.prepare` never writes into the config, runs save what was built
(model.json) beside what was asked (config.json), and runs saved in older layouts (before
model.json existed, or in its older schemas) still reload, evaluate and predict."""
import contextlib
import json
import os
import shutil

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import support
from numerics import assert_close, transformer_terms
from train.rundir import MODEL_SCHEMA, RunDirError, load_run, model_record
from train.task import task_class
from train.sharding import use_mesh
from train.evaluation import evaluate_loss
from train.trainer import evaluate_run, fresh_state, restored_setup

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'legacy_runs')


def family_config(spec, directory):
  """The spec's config; BERT and the classifier read the small corpora `small_data` writes into `directory`."""
  family, overrides = spec
  config = support.smallest_config(family, overrides)
  return support.with_overrides(config, small_data(config, str(directory)))


def small_data(config, directory: str) -> dict:
  """Overrides that put a few hundred lines in place of bbc_news (BERT and the classifier: every one of
  its ~2,200 articles is tokenized and trained a vocabulary on, whatever data.max_examples keeps):
  a text corpus with its held-out files for pretraining, else 120 labelled lines (distinct, as copies of
  one text share their split) of 3 classes. {} for the other families."""
  if config.family not in ('bert', 'classifier'):
    return {}
  if config.family == 'bert' and config.task == 'pretrain':
    return {'data.source': support.write_corpus(os.path.join(directory, 'corpus'), files=6, lines=40),
            'data.eval_source': support.write_corpus(os.path.join(directory, 'held_out'), files=2, lines=40, seed=1)}
  path = os.path.join(directory, 'reviews.tsv')
  with open(path, 'w') as f:
    f.write(''.join(f'a {word} film, take {i}\t{label}\n'
                    for word, label in (('good', 'pos'), ('bad', 'neg'), ('fine', 'meh')) for i in range(40)))
  return {'data.source': f'tsv:{path}'}


# Every registered family at its smallest preset (support.smallest_preset), BERT and the classifier on
# small corpora (small_data); and the variants a family's config can switch to (`task`).
FAMILIES = [(family, {}) for family in support.registered_families()] + [('bert', {'task': 'classify'})]


def spec_id(spec):
  return spec[0] + ''.join(f'-{value}' for value in spec[1].values())


@pytest.mark.parametrize('spec', FAMILIES, ids=spec_id)
def test_prepare_never_writes_into_the_config(spec, tmp_path):
  config = family_config(spec, tmp_path)
  before = json.dumps(config.to_dict(), sort_keys=True)
  family = task_class(config.family)
  prepared = family.prepare(config, str(tmp_path / 'run'))
  assert json.dumps(config.to_dict(), sort_keys=True) == before
  assert type(prepared.model_config) is family.model_config_class
  assert prepared.model_config.__dataclass_params__.frozen


@contextlib.contextmanager
def restores_recorded():
  """A list that gets what each `restored_setup` that evaluate_run (--mode=eval) calls returns: (setup, state,
  step). A test checks the setup and state it evaluated instead of restoring the run a second time."""
  from train import trainer
  real, restores = trainer.restored_setup, []

  def recorded(*args, **kwargs):
    restores.append(real(*args, **kwargs))
    return restores[-1]
  trainer.restored_setup = recorded
  try:
    yield restores
  finally:
    trainer.restored_setup = real


def legacy_copy(name, tmp_path):
  workdir = str(tmp_path / name)
  shutil.copytree(os.path.join(FIXTURES, name), workdir)
  assert not os.path.exists(os.path.join(workdir, 'model.json'))
  return workdir


def test_a_gpt_run_saved_before_model_json_reloads_evaluates_and_predicts(tmp_path):
  workdir = legacy_copy('gpt_tiny', tmp_path)
  run = load_run(workdir)
  assert (run.model_config.vocab_size, run.model_config.width, run.step) == (222, 32, 2)
  assert run.model_config.vocab_size == run.tokenizer.vocab_size
  # Saved before vocabulary padding: unpadded, as its checkpoint is.
  assert run.model_config.vocab_multiple == 1 and run.model.token_embedding.embedding.shape == (222, 32)
  assert len(run.predict(['def '])) == 1
  # That run logged eval/loss 5.3244 on the windows its split held then; held-out splits have since been
  # carved by another rule (data/sources.py `hold_out_documents`), so today's windows are others. The
  # restored weights must still be the trained ones: on today's windows they score clearly below the
  # same model freshly initialised (5.381), which a restore that lost them would not.
  setup, state, step = restored_setup(workdir)
  with use_mesh(setup.mesh):
    logged_batches = evaluate_loss(setup, state, setup.config.train.eval_steps)
    untrained = evaluate_loss(setup, fresh_state(setup), setup.config.train.eval_steps)
  assert logged_batches['eval/loss'] < untrained['eval/loss'] - 0.02, (logged_batches, untrained)
  # And the loss these windows gave when the split rule changed (issue 62; the run's own 5.3244 on the
  # old windows), so that a later change to restoring or evaluating old runs shows.
  assert_close(logged_batches['eval/loss'], 5.350829601287842,
               terms=transformer_terms(2, 32, 128, 32, vocab=222, positions=2 * 8 * 32))
  # --mode=eval scores every window of the validation split, not the train.eval_steps batches that
  # training's evaluations did. The stdlib's split is ~100k windows (~15 s here): a small held-out
  # corpus in its place, `--mode=eval --config.data.eval_source=...` (at least 3 batches of 8 windows).
  held_out = {'data.eval_source': support.write_corpus(str(tmp_path / 'eval'), files=1, lines=40)}
  with restores_recorded() as restores:  # the setup and state --mode=eval restored: restored once, not twice
    results = evaluate_run(workdir, held_out)
  [(held_out_setup, held_out_state, _)] = restores
  with use_mesh(held_out_setup.mesh):
    two_batches = evaluate_loss(held_out_setup, held_out_state, held_out_setup.config.train.eval_steps)
    every_window = evaluate_loss(held_out_setup, held_out_state)
  assert step == results['step'] == 2 and np.isfinite(results['eval/loss'])
  assert results['eval/loss'] == every_window['eval/loss'] != two_batches['eval/loss']


def test_a_classify_run_saved_before_model_json_keeps_its_labels(tmp_path):
  workdir = legacy_copy('bert_classify_tiny', tmp_path)
  run = load_run(workdir)
  assert run.model_config.labels == ('business', 'entertainment', 'politics', 'sports', 'tech')
  assert run.model_config.heads == 'classifier' and run.model_config.num_classes == 5
  assert run.model_config.vocab_multiple == 1
  assert run.model.encoder.embeddings.token.embedding.shape[0] == run.model_config.vocab_size
  prediction = run.predict(['shares fell on the stock market'])[0]
  assert prediction['label'] in run.model_config.labels and set(prediction['probabilities']) == set(
      run.model_config.labels)
  results = evaluate_run(workdir)
  # The accuracies that run reported after training (valid_accuracy / test_accuracy then).
  assert results['eval/accuracy'] == 43 / 222 and results['test/accuracy'] == 47 / 223  # counts of examples: exact


def test_a_classifier_run_saved_before_its_model_options_grew_reloads_and_scores_as_reported(tmp_path):
  """A run written at d8ec8bb, before `model.token_dropout` (and any later classifier option): a new
  option must default to the old model, adding neither parameters nor RNG state to its checkpoint
  (a token dropout built even at rate 0 made every such run fail to restore)."""
  workdir = str(tmp_path / 'classifier_tiny')
  shutil.copytree(os.path.join(FIXTURES, 'classifier_tiny'), workdir)
  run = load_run(workdir)
  assert run.step == 2 and run.model_config.labels == ('business', 'entertainment', 'politics', 'sports', 'tech')
  assert set(run.predict(['shares fell on the stock market'])[0]['probabilities']) == set(run.model_config.labels)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    reported = json.loads(f.read().splitlines()[-1])  # that run's final evaluation
  results = evaluate_run(workdir)
  assert (reported['eval/accuracy'], reported['test/accuracy']) == (50 / 222, 37 / 223)
  assert {k: results[k] for k in reported if k != 'step'} == {k: v for k, v in reported.items() if k != 'step'}


@pytest.mark.parametrize('spec', FAMILIES, ids=spec_id)
def test_a_restored_run_evaluates_to_the_last_digit_as_after_training(spec, tmp_path):
  """--mode=eval builds the task as training did (`Task.prepare`, then `Task(config, prepared)`):
  every number of the final evaluation is the same, and the task is a value nothing reassigns."""
  from train.trainer import train_and_evaluate
  config = family_config(spec, tmp_path)
  # One block (GPT's and BERT's smallest presets have two): the numbers a restore must give again come from
  # every kind of parameter a block holds, and each training compiles its model afresh.
  for depth in ('num_layers', 'encoder_layers', 'decoder_layers'):
    if depth in config.model:
      config.model[depth] = 1
  # The final evaluation scores (and translation decodes) a few examples: each number still sums over several.
  config.train.update(steps=2, eval_every=2, checkpoint_every=2, eval_steps=1, final_eval_examples=24,
                      final_decode_examples=8)
  config.train.batch_size -= config.train.batch_size % 8  # attention_pooling's 50 points: 48 per step on 8 devices
  if 'pictures' in config:  # the Transformer's attention pictures are no number (tests/test_transformer.py draws them)
    config.pictures.count = 0
  if config.family == 'gpt':  # a small corpus: the standard library's held-out split takes ~20 s to score twice
    config.data.update(source=support.write_corpus(str(tmp_path / 'corpus'), files=2, lines=40),
                       eval_source=support.write_corpus(str(tmp_path / 'eval'), files=1))
  workdir = str(tmp_path / 'run')
  trained = train_and_evaluate(config, workdir)
  with restores_recorded() as restores:
    restored = evaluate_run(workdir)
  [(setup, _, _)] = restores  # the task --mode=eval built
  with pytest.raises(AttributeError, match='is a value'):
    setup.task.prepared = None
  numbers = lambda results: {k: v for k, v in results.items()
                             if isinstance(v, float) and k.startswith(('eval/', 'test/'))}
  assert numbers(trained) and numbers(restored) == numbers(trained)
  assert restored['step'] == trained['final_eval_step']
def test_a_model_json_without_schema_or_rng_impl_reloads_as_threefry(tmp_path):
  workdir = legacy_copy('gpt_tiny', tmp_path)
  before = load_run(workdir)
  with open(os.path.join(workdir, 'model.json'), 'w') as f:  # schema 1: the layout before config.rng_impl
    json.dump({'class': type(before.model_config).__name__, 'fields': dataclasses.asdict(before.model_config)}, f)
  assert model_record(workdir)['schema'] == MODEL_SCHEMA and model_record(workdir)['rng_impl'] == 'threefry'
  after = load_run(workdir)
  assert after.model_config == before.model_config
  params = lambda run: jax.tree.leaves(nnx.state(run.model, nnx.Param))
  for a, b in zip(params(before), params(after), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_model_json_of_a_newer_schema_is_one_clear_error(tmp_path):
  workdir = legacy_copy('gpt_tiny', tmp_path)
  with open(os.path.join(workdir, 'model.json'), 'w') as f:
    json.dump({'schema': MODEL_SCHEMA + 1, 'class': 'GPT2Config', 'fields': {}, 'rng_impl': 'threefry'}, f)
  newer = f'has schema {MODEL_SCHEMA + 1}, newer than the {MODEL_SCHEMA} this code reads'
  with pytest.raises(RunDirError, match=newer):
    load_run(workdir)
