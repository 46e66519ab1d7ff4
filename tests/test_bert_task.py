"""The BERT family end to end: HF import as a run, features and fill-mask predictions against
transformers, fine-tuning initialised from another run, the pretraining loss by hand."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from errors import ConfigError
from numerics import assert_close, transformer_terms
from support import with_overrides
from train import task as task_lib
from train.rundir import load_run

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

WORDS = 'the a cat sat on mat dog ran park hello world good bad film was movie , . !'.split()


@pytest.fixture(scope='module')
def hf_bert_dir(tmp_path_factory):
  """A small random BertForPreTraining with its tokenizer, saved the Hugging Face way."""
  directory = tmp_path_factory.mktemp('hf_bert')
  vocab = ['[PAD]'] + [f'[unused{i}]' for i in range(99)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS
  (directory / 'vocab.txt').write_text('\n'.join(vocab) + '\n')
  tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))
  torch.manual_seed(0)
  config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64)
  model = transformers.BertForPreTraining(config)
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.2)
  model.eval().save_pretrained(str(directory))
  tokenizer.save_pretrained(str(directory))
  return str(directory), model, tokenizer


def tiny_config(**overrides):
  from configs import bert
  return with_overrides(bert.get_config('tiny'), overrides)


def test_imported_run_features_and_fill_mask_match_transformers(hf_bert_dir, tmp_path):
  from train.rundir import load_run
  from train.trainer import import_hf_run
  directory, hf_model, hf_tokenizer = hf_bert_dir
  workdir = str(tmp_path / 'imported')
  import_hf_run(tiny_config(task='pretrain'), directory, workdir)
  with open(os.path.join(workdir, 'model.json')) as f:
    saved = json.load(f)['fields']
  assert (saved['width'], saved['num_layers'], saved['heads']) == (32, 3, 'pretraining')

  lines = ['the cat sat on the mat.', 'hello world!\tthe dog ran']
  run = load_run(workdir, config_overrides={'task': 'features', 'features.mean_last': 2,
                                            'features.output_dir': str(tmp_path / 'features')})
  outputs = run.predict(lines)
  for line, output in zip(lines, outputs):
    encoded = hf_tokenizer(*line.split('\t'), return_tensors='pt')
    with torch.no_grad():
      hidden = hf_model(**encoded, output_hidden_states=True).hidden_states
    expected = ((hidden[-1] + hidden[-2]) / 2)[0].numpy()
    assert output['tokens'] == hf_tokenizer.convert_ids_to_tokens(encoded['input_ids'][0])
    assert_close(np.load(output['file']), expected, terms=transformer_terms(3, 32, 48, 16))

  masked = 'the [MASK] sat on the mat.'
  fills = load_run(workdir).predict([masked])[0]['masks']
  encoded = hf_tokenizer(masked, return_tensors='pt')
  with torch.no_grad():
    logits = hf_model(**encoded).prediction_logits[0, 2].numpy()
  assert fills == [hf_tokenizer.convert_ids_to_tokens(np.argsort(-logits)[:5].tolist())]


def test_finetuning_takes_the_encoder_tokenizer_and_sizes_of_init_from(hf_bert_dir, tmp_path):
  from train.task import prepare_task
  from train.trainer import import_hf_run
  directory, hf_model, hf_tokenizer = hf_bert_dir
  source = str(tmp_path / 'imported')
  import_hf_run(tiny_config(task='features'), directory, source)
  data = tmp_path / 'reviews.tsv'
  # Distinct texts: the split hashes each text, and copies of one text share its split.
  data.write_text(''.join(f'{w} film {i}\t{"pos" if w == "good" else "neg"}\n'
                          for i, w in enumerate(['good', 'bad'] * 20)))
  config = tiny_config(task='classify', init_from=source, **{'data.source': f'tsv:{data}'})
  before = config.to_dict()
  task = prepare_task(config, str(tmp_path / 'finetune'))
  model_config = task.model_config
  assert config.to_dict() == before  # the sizes were adopted into the model config, not written into config
  assert (model_config.width, model_config.num_layers, model_config.num_classes) == (32, 3, 2)
  assert model_config.labels == ('neg', 'pos') and model_config.heads == 'classifier'
  assert task.tokenizer.encode('good film') == hf_tokenizer('good film', add_special_tokens=False)['input_ids']
  model = task.build_model(nnx.Rngs(0))
  task.init_from(model, load_run(source).model)
  query = model.encoder.blocks[2].self_attention.query.kernel[...]
  expected = hf_model.bert.encoder.layer[2].attention.self.query.weight.detach().numpy().T
  np.testing.assert_array_equal(np.asarray(query), expected)  # copied, not computed
  # More positions than the source (64): its vectors fill the first rows, the rest are new.
  longer = tiny_config(task='classify', init_from=source, **{'data.source': f'tsv:{data}', 'model.max_len': 96})
  long_task = prepare_task(longer, str(tmp_path / 'finetune-long'))
  long_config = long_task.model_config
  assert (long_config.max_len, long_config.width) == (96, 32)
  long_model = long_task.build_model(nnx.Rngs(0))
  long_task.init_from(long_model, load_run(source).model)
  positions = np.asarray(long_model.encoder.embeddings.position.embedding[...])
  hf_positions = hf_model.bert.embeddings.position_embeddings.weight.detach().numpy()
  assert positions.shape == (96, 32)
  np.testing.assert_array_equal(positions[:64], hf_positions)
  assert not np.allclose(positions[64:], 0.0)
  np.testing.assert_array_equal(np.asarray(long_model.encoder.blocks[2].self_attention.query.kernel[...]), expected)
  mismatched = tiny_config(task='classify', **{'model.width': 16})
  other = type(task)(mismatched, task_lib.Prepared(task.tokenizer, dataclasses.replace(model_config, width=16)))
  with pytest.raises(ConfigError, match='different sizes'):
    other.init_from(other.build_model(nnx.Rngs(0)), load_run(source).model)


def test_pretraining_loss_by_hand():
  from models.bert import BertConfig, BertForPretraining
  from train.tasks.bert import pretraining_loss
  config = BertConfig(vocab_size=30, max_len=16, num_layers=1, num_heads=2, width=8, mlp_dim=16)
  model = BertForPretraining(config, rngs=nnx.Rngs(0))  # eagerly: one compilation per parameter shape
  rng = np.random.default_rng(0)
  batch = {'tokens': rng.integers(5, 30, (2, 10)), 'segments': np.zeros((2, 10), np.int32),
           'valid': np.ones((2, 10), bool), 'next_sentence': np.array([0, 1]),
           'masked_positions': np.array([[1, 4, 0], [2, 3, 7]]), 'masked_labels': np.array([[6, 7, 0], [8, 9, 10]]),
           'masked_weights': np.array([[1, 1, 0], [1, 1, 1]], np.float32)}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  # The loss and the model's outputs as one compiled program.
  (loss, metrics), full = nnx.jit(lambda m, b: (pretraining_loss(m, b, deterministic=True),
                                                m(b['tokens'], b['segments'], b['valid'])))(model, batch)
  mlm = np.asarray(jax.nn.log_softmax(full.mlm_logits))
  nsp = np.asarray(jax.nn.log_softmax(full.nsp_logits))
  chosen = [(0, 1, 6), (0, 4, 7), (1, 2, 8), (1, 3, 9), (1, 7, 10)]  # the weight-1 slots: (row, position, label)
  expected = -np.mean([mlm[b, p, label] for b, p, label in chosen]) - (nsp[0, 0] + nsp[1, 1]) / 2
  assert_close(loss, expected, terms=transformer_terms(1, 8, 16, 10, vocab=30, positions=5))
  assert float(metrics['mlm_loss'][1]) == 5 and float(metrics['nsp_accuracy'][1]) == 2


def test_pretraining_draws_new_masks_every_epoch_and_fine_tuning_reads_examples_as_they_are():
  from data import batching
  from train.task import Prepared
  from train.tasks.bert import Task
  masker = object()  # what prepare puts there: the MLM masker of the run's tokenizer
  pretraining = Task(tiny_config(task='pretrain'), Prepared(None, None, family_data=masker))
  assert pretraining.batch_plan() == batching.Shuffled(draw=masker, draw_seed_offset=3)
  assert Task(tiny_config(task='classify'), Prepared(None, None)).batch_plan() == batching.Shuffled()


def test_launch_predict_applies_config_overrides_to_a_trained_run(tmp_path):
  """`--mode=predict --config.task=features` on a pretraining run writes vectors; unknown keys
  are still rejected with one message (checked against the run's own config.json)."""
  import support
  source = support.write_corpus(str(tmp_path / 'corpus'), files=6, lines=40)
  held_out = support.write_corpus(str(tmp_path / 'held_out'), files=2, lines=40, seed=1)
  workdir = str(tmp_path / 'pretrain')
  # One block without dropout: what is checked here is the run's files and predictions, and the tiny
  # preset's two blocks with dropout take nearly twice as long to compile.
  trained = support.launch(['--config=configs/bert.py:tiny', f'--config.data.source={source}',
                            f'--config.data.eval_source={held_out}', '--config.train.steps=4',
                            '--config.train.eval_every=4', '--config.train.checkpoint_every=4',
                            '--config.model.num_layers=1', '--config.model.dropout=0.0',
                            '--config.model.attention_dropout=0.0', f'--workdir={workdir}'])
  assert trained.returncode == 0, trained.stderr[-2000:]
  # One value per metric name and step: the final evaluation adds no second eval/loss at step 4.
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    keyed = [(m['step'], key) for m in map(json.loads, f) for key in m if key != 'step']
  assert len(keyed) == len(set(keyed)) and (4, 'eval/loss') in keyed
  assert {'eval/loss', 'eval/mlm_loss', 'eval/nsp_accuracy'} <= set(support.last_json(trained.stdout))
  lines = tmp_path / 'lines.txt'
  lines.write_text('alpha beta gamma.\ndelta epsilon\tzeta eta theta.\n')
  output_dir = tmp_path / 'vectors'
  with open(lines) as stdin:  # the lines piped in, as docs/families/bert.md shows it (--input=-)
    process = support.launch(['--mode=predict', f'--workdir={workdir}', '--input=-', '--config.task=features',
                              '--config.features.pooling=mean', f'--config.features.output_dir={output_dir}'],
                             background=True, stdin=stdin)
    stdout, stderr = process.communicate(timeout=300)
  assert process.returncode == 0, stderr[-2000:]
  outputs = support.last_json(stdout)['outputs']
  assert [o['shape'] for o in outputs] == [[32], [32]]  # tiny: width 32, mean over real tokens
  for output in outputs:
    assert os.path.dirname(output['file']) == str(output_dir)
    assert np.load(output['file']).shape == (32,)
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['task'] == 'pretrain'  # the overrides change this prediction, not the run

  unknown = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={lines}',
                            '--config.features.poolng=mean'])
  assert unknown.returncode == 1
  assert "Unknown config key 'features.poolng'. Did you mean 'features.pooling'?" in unknown.stderr
  assert 'Traceback' not in unknown.stderr
  bad_value = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={lines}', '--config.task=features',
                              '--config.features.pooling=max'])
  assert bad_value.returncode == 1 and 'features.pooling' in bad_value.stderr and 'Traceback' not in bad_value.stderr
