"""Hugging Face export: GPT and BERT runs written by --mode=export_hf load in transformers with no
custom code and compute what our models compute (scanned, FSDP-sharded and classifier runs
included); import -> export is the identity on every tensor; a bad target stops with one message
and leaves nothing behind."""
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import numerics
import support

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

HF_FILES = ['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
# Each comparison's max |ours - transformers|, printed at the end of the module (pytest -s).
DIFFERENCES = {}


@pytest.fixture(scope='module', autouse=True)
def report_differences():
  yield
  for name, difference in DIFFERENCES.items():
    print(f'\n{name}: max |ours - transformers| = {difference:.2e}', end='')


# The tiny GPT (2 blocks of width 32 over <= 24 tokens) and the tiny BERT (2 blocks of width 32,
# MLP 64, over <= 12 tokens; a head adds two projections): the reductions behind their outputs.
GPT_TERMS = numerics.transformer_terms(2, 32, 128, 24)
BERT_TERMS = numerics.transformer_terms(2, 32, 64, 12) + 2 * 32


def assert_close(name, ours, theirs, terms):
  """tests/numerics.py's comparison, the largest difference kept for the report above."""
  DIFFERENCES[name] = float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))))
  numerics.assert_close(ours, theirs, terms=terms, err_msg=name)


def train(config, workdir, **overrides):
  """A 2-step run of `config` (a tiny preset) in `workdir`."""
  from train.trainer import train_and_evaluate
  support.with_overrides(config, {'train.steps': 2, 'train.eval_every': 2, 'train.eval_steps': 1,
                                  'train.checkpoint_every': 2, 'train.log_every': 1, **overrides})
  train_and_evaluate(config, workdir)
  return workdir


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')), files=6, lines=40)


@pytest.fixture(scope='module')
def gpt_run(corpus, tmp_path_factory):
  """Byte-level BPE, data parallel over the 8 devices."""
  return train(support.tiny_gpt_config(corpus), str(tmp_path_factory.mktemp('gpt') / 'run'),
               **{'data.tokenizer': 'bpe', 'data.vocab_size': 300})


@pytest.fixture(scope='module')
def bert_run(corpus, tmp_path_factory):
  from configs import bert
  directory = tmp_path_factory.mktemp('bert')
  held_out = support.write_corpus(str(directory / 'held_out'), files=2, lines=40, seed=1)
  return train(bert.get_config('tiny'), str(directory / 'run'),
               **{'data.source': corpus, 'data.eval_source': held_out, 'mesh.data': 4, 'mesh.fsdp': 2})


def randomize(model, seed=0, scale=0.1):
  """Move every parameter by N(0, scale) noise: two training steps leave LayerNorms and biases
  near their init, where a tensor written under the wrong name could go unnoticed."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.default_rng(seed)  # NumPy's draws: no random program compiled for each parameter shape
  nnx.update(model, jax.tree.unflatten(treedef, [
      support.placed_like(x, np.asarray(x) + (scale * rng.standard_normal(x.shape)).astype(x.dtype)) for x in leaves]))


def shard_over_devices(model):
  """Split every parameter over all devices along its first axis the device count divides (the
  tiny models are below the size the trainer's FSDP rules shard)."""
  count = jax.device_count()
  mesh = jax.make_mesh((count,), ('fsdp',), axis_types=(jax.sharding.AxisType.Auto,))

  def put(x):
    axis = next((i for i, size in enumerate(x.shape) if size % count == 0), None)
    return jax.device_put(x, NamedSharding(mesh, P() if axis is None else P(*(None,) * axis, 'fsdp')))
  nnx.update(model, jax.tree.map(put, nnx.state(model, nnx.Param)))


def test_launch_export_gpt2_loads_in_transformers_with_the_same_logits(gpt_run, tmp_path):
  from train.rundir import load_run
  out = str(tmp_path / 'hf' / 'gpt')  # the parent is created too
  result = support.launch(['--mode=export_hf', f'--workdir={gpt_run}', f'--hf_dir={out}'])
  assert result.returncode == 0, result.stderr[-2000:]
  assert support.last_json(result.stdout)['architecture'] == 'GPT2LMHeadModel'
  assert sorted(os.listdir(out)) == HF_FILES
  assert os.listdir(tmp_path / 'hf') == ['gpt']  # no staging directory left
  run = load_run(gpt_run)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  texts = ['alpha beta gamma. delta', 'omega psi chi phi']
  for text in texts:
    assert tokenizer(text)['input_ids'] == run.tokenizer.encode(text)
  encoded = tokenizer(texts[0], return_tensors='pt')
  assert set(encoded) == {'input_ids', 'attention_mask'}  # GPT-2 would embed token_type_ids
  with torch.no_grad():
    theirs = model(**encoded).logits.numpy()
  ours, _ = support.compiled_call(run.model, jnp.asarray(encoded['input_ids'].numpy()))
  assert run.model.token_embedding.embedding.shape[0] == 384  # 300 ids padded to a multiple of 128
  assert_close('GPT-2 logits (trained run, via launch.py)', support.real_logits(ours, 300), theirs, GPT_TERMS)
  assert model.config.n_positions == run.model.config.max_len and model.config.n_layer == 2


def test_scanned_sharded_gpt_exports_one_layer_per_block(corpus, tmp_path):
  """A run trained with scan_layers and FSDP: stacked [num_layers, ...] parameters become h.<i>."""
  from train.rundir import load_run
  workdir = train(support.tiny_gpt_config(corpus), str(tmp_path / 'run'),
                  **{'model.scan_layers': True, 'mesh.data': 4, 'mesh.fsdp': 2})
  run = load_run(workdir)
  assert run.model.config.scan_layers and run.tokenizer.kind == 'char'
  randomize(run.model)
  shard_over_devices(run.model)
  assert not run.model.blocks.mlp.up.kernel[...].sharding.is_fully_replicated
  out = tmp_path / 'hf'
  out.mkdir()  # an existing empty directory is a fine target
  summary = run.export_hf(str(out))
  padding = (run.model.token_embedding.embedding.shape[0] - run.model.config.vocab_size) * run.model.config.width
  assert padding > 0
  assert summary['parameters'] == sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param))) - padding
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert summary['parameters'] == sum(p.numel() for p in model.parameters())
  tokens = np.random.default_rng(0).integers(0, run.model.config.vocab_size, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = support.compiled_call(run.model, jnp.asarray(tokens))[0]
  assert_close('GPT-2 logits (scan_layers, FSDP-sharded)', support.real_logits(ours, run.model.config.vocab_size), theirs,
               GPT_TERMS)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  text = 'alpha beta.\n  gamma?'  # '?' is not in the corpus: <unk>
  ids = run.tokenizer.encode(text)
  assert tokenizer(text)['input_ids'] == ids and ids.count(run.tokenizer.unk_id) == 1
  assert tokenizer.decode(ids, skip_special_tokens=True) == run.tokenizer.decode(ids) == text[:-1]


def bert_inputs(tokenizer, pairs):
  """transformers' padded encoding of sentence pairs, and ours as [B, L] arrays."""
  encoded = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors='pt')
  arrays = (jnp.asarray(encoded['input_ids'].numpy()), jnp.asarray(encoded['token_type_ids'].numpy()),
            jnp.asarray(encoded['attention_mask'].numpy().astype(bool)))
  return encoded, arrays


PAIRS = [('alpha beta gamma.', 'delta epsilon.'), ('omega', 'psi chi phi upsilon tau sigma rho.')]


def test_bert_pretraining_run_exports_to_automodel_and_bert_for_pretraining(bert_run, tmp_path):
  from train.rundir import load_run
  run = load_run(bert_run)
  randomize(run.model, seed=1)
  shard_over_devices(run.model)
  out = str(tmp_path / 'hf')
  assert run.export_hf(out)['architecture'] == 'BertForPreTraining'
  assert sorted(os.listdir(out)) == HF_FILES
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer.mask_token == '[MASK]' and tokenizer.pad_token_id == run.tokenizer.pad_id
  for a, b in PAIRS:
    encoded = tokenizer(a, b)
    assert (encoded['input_ids'], encoded['token_type_ids']) == run.tokenizer.encode_pair(a, b)
  encoded, (tokens, segments, valid) = bert_inputs(tokenizer, PAIRS)
  assert not bool(valid.all())  # padding is part of what is compared
  ours = support.compiled_call(run.model, tokens, segments, valid)
  with torch.no_grad():
    encoder = transformers.AutoModel.from_pretrained(out).eval()(**encoded)
    pretraining = transformers.BertForPreTraining.from_pretrained(out).eval()(**encoded)
  assert_close('BERT last hidden state (AutoModel)', ours.encoder.sequence, encoder.last_hidden_state.numpy(),
               BERT_TERMS)
  assert_close('BERT pooled output (AutoModel)', ours.encoder.pooled, encoder.pooler_output.numpy(), BERT_TERMS)
  assert_close('BERT MLM logits (BertForPreTraining)', support.real_logits(ours.mlm_logits, run.model.config.vocab_size),
               pretraining.prediction_logits.numpy(), BERT_TERMS)
  assert_close('BERT NSP logits (BertForPreTraining)', ours.nsp_logits, pretraining.seq_relationship_logits.numpy(),
               BERT_TERMS)


def test_bert_classifier_run_exports_with_label_names(tmp_path):
  from configs import bert
  from train.rundir import load_run
  data = tmp_path / 'reviews.tsv'
  words = {'good': 'pos', 'bad': 'neg', 'fine': 'meh'}
  # Distinct lines: copies of one line share their split (data/sources.py), so 3 texts would leave a split empty.
  data.write_text(''.join(f'a {w} film, take {i}\t{label}\n' for w, label in words.items() for i in range(40)))
  workdir = train(bert.get_config('tiny'), str(tmp_path / 'run'), task='classify', **{'data.source': f'tsv:{data}'})
  run = load_run(workdir)
  labels = list(run.model_config.labels)
  assert sorted(labels) == ['meh', 'neg', 'pos']
  randomize(run.model, seed=2)
  out = str(tmp_path / 'hf')
  assert run.export_hf(out)['architecture'] == 'BertForSequenceClassification'
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
  assert type(model).__name__ == 'BertForSequenceClassification'
  assert model.config.id2label == dict(enumerate(labels))
  encoded, (tokens, segments, valid) = bert_inputs(tokenizer, PAIRS)
  with torch.no_grad():
    theirs = model(**encoded).logits.numpy()
  assert_close('BERT classifier logits (BertForSequenceClassification)',
               support.compiled_call(run.model, tokens, segments, valid), theirs, BERT_TERMS)


def random_hf(cls, config, seed=0):
  """A transformers model whose every parameter (LayerNorms and biases too) is random."""
  torch.manual_seed(seed)
  model = cls(config)
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.2)
  return model.eval()


def write_hf_gpt2(directory):
  from data.tokenizers import train_bpe
  bpe = train_bpe(['def foo(x):\n    return x + 1\n' * 20, 'hello world, hello there'], vocab_size=300)
  bpe.tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  config = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4)
  random_hf(transformers.GPT2LMHeadModel, config).save_pretrained(directory)


def write_hf_bert(directory, cls):
  vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + support.WORDS
  with open(os.path.join(directory, 'vocab.txt'), 'w') as f:
    f.write('\n'.join(vocab) + '\n')
  config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=40)
  random_hf(cls, config).save_pretrained(directory)


@pytest.mark.parametrize('kind', ['GPT2LMHeadModel', 'BertForPreTraining', 'BertModel'])
def test_import_then_export_is_the_identity_on_every_tensor(tmp_path, kind):
  from safetensors import safe_open

  from interop import hf_bert, hf_gpt2
  source, out = tmp_path / 'source', str(tmp_path / 'out')
  source.mkdir()
  if kind == 'GPT2LMHeadModel':
    write_hf_gpt2(str(source))
    imported = hf_gpt2.import_gpt2(str(source))
    hf_gpt2.export_gpt2(imported.model, imported.tokenizer, out)
    config_keys = [key for key, _, _ in hf_gpt2.CONFIG_KEYS] + ['activation_function']
  else:
    write_hf_bert(str(source), getattr(transformers, kind))
    imported = hf_bert.import_bert(str(source))
    assert imported.heads_loaded == (kind == 'BertForPreTraining')
    hf_bert.export_bert(imported.model if imported.heads_loaded else imported.model.encoder, imported.tokenizer, out)
    config_keys = [key for key, _, _ in hf_bert.CONFIG_KEYS] + ['hidden_act']
  tensors = []
  for directory in (source, out):
    with safe_open(os.path.join(directory, 'model.safetensors'), 'np') as f:
      tensors.append({name: f.get_tensor(name) for name in f.keys()})
  original, exported = tensors
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    assert (exported[name].dtype, exported[name].shape) == (value.dtype, value.shape), name
    assert exported[name].tobytes() == value.tobytes(), name
  with open(source / 'config.json') as f, open(os.path.join(out, 'config.json')) as g:
    before, after = json.load(f), json.load(g)
  assert after['architectures'] == [kind]
  assert {k: after[k] for k in config_keys} == {k: before[k] for k in config_keys}


def test_a_failed_export_leaves_nothing_behind(tmp_path):
  from interop.common import HFExportError
  from interop.hf_gpt2 import export_gpt2
  from models.gpt import GPT, GPT2Config
  # Any weights do (built abstractly, valued by NumPy: no random program compiled for each parameter shape).
  model = support.numpy_valued(nnx.eval_shape(lambda: GPT(GPT2Config(vocab_size=10, max_len=8, num_layers=1,
                                                                     num_heads=2, width=8), rngs=nnx.Rngs(0))))
  # Fails at the tokenizer files, after config.json and model.safetensors were written.
  unknown_tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2, pad_id=0, unk_id=3)
  with pytest.raises(HFExportError, match='no Hugging Face form'):
    export_gpt2(model, unknown_tokenizer, str(tmp_path / 'out'))
  assert os.listdir(tmp_path) == []


def test_export_errors_through_launch_are_one_line(gpt_run, tmp_path):
  from configs import rnn_lm
  from errors import UserError
  from train.rundir import check_hf_export, read_config, save_config
  taken = tmp_path / 'taken'
  taken.mkdir()
  (taken / 'notes.txt').write_text('keep me')
  result = support.launch(['--mode=export_hf', f'--workdir={gpt_run}', f'--hf_dir={taken}'])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [f'error: The export target {taken} already exists and is not empty; '
                                                f'pass a new --hf_dir (or delete that directory first).']
  assert os.listdir(taken) == ['notes.txt'] and sorted(os.listdir(tmp_path)) == ['taken']

  # The family is checked from the run's config.json, before its checkpoint would load: what launch.py's
  # export_hf runs first, in this process (its UserError is launch.py's `error:` line, as above).
  rnn_run = tmp_path / 'rnn'
  rnn_run.mkdir()
  save_config(rnn_lm.get_config('tiny'), str(rnn_run))
  with pytest.raises(UserError) as error:
    check_hf_export(read_config(str(rnn_run)).family, str(tmp_path / 'out'))
  assert str(error.value) == ("A 'rnn_lm' run has no Hugging Face counterpart: export_hf writes runs of the families "
                              "('bert', 'gpt'); pass the --workdir of one of those.")
  assert not os.path.exists(tmp_path / 'out')
