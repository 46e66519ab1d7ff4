"""The decoder options of issue 33 (qk_norm, mlp='relu2', logit_softcap, zero_init_out, train.z_loss),
each against a computation written out here in NumPy or plain jnp: one attention layer with
qk-norm, the ReLU^2 MLP, soft-capped logits and both loss paths' values and gradients (against
jax.grad of a hand-written loss), the z-loss, zero-initialised output projections; cached decoding
with qk-norm and a soft cap against recomputing the prefix; the export refusals; one-line config
errors; and the defaults leaving GPT-2 as it was."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from models import attention, decoding
from models.gpt import GPT, GPT2Config, generate
from models.lm_head import chunked_lm_loss, vocab_logits
from numerics import assert_close, assert_trees_close
from train.losses import lm_loss

TINY = dict(vocab_size=37, max_len=32, num_layers=2, num_heads=2, width=16, dropout=0.0)


def tiny_gpt(seed=0, **options):
  return GPT(GPT2Config(**{**TINY, **options}), rngs=nnx.Rngs(seed))


def params_of(model) -> dict[str, np.ndarray]:
  return {'/'.join(map(str, path)): np.asarray(value) for path, value in
          nnx.to_flat_state(nnx.state(model, nnx.Param))}


def rms_normalise(x, scale, eps):
  return x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + eps) * scale


# ------------------------------------------------------------------------------------ qk-norm
@pytest.mark.numerics
def test_qk_norm_attention_is_the_formula_on_every_path():
  # Rotary, grouped-query (2 query heads per K/V head), random norm scales: the formula is
  # q_h = RoPE(q_h / rms(q_h) * g_q), k_h likewise with g_k, then causal softmax(q k^T / sqrt(D)) v.
  layer = attention.MultiHeadAttention(16, 4, num_kv_heads=2, qk_norm=True, qk_norm_epsilon=1e-5,
                                       rope=tuple(10000.0 ** (-np.arange(0, 4, 2) / 4)), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  layer.query_norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 2.0, 4), jnp.float32))
  layer.key_norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 2.0, 4), jnp.float32))

  def expected(x):  # [B, L, 16] -> [B, L, 16], written out
    batch, length, _ = x.shape
    positions = np.arange(length)
    def heads(linear, count):
      return (x @ np.asarray(linear.kernel[...]) + np.asarray(linear.bias[...])).reshape(batch, length, count, 4)
    def rotate(v):
      inv_freq = 10000.0 ** (-np.arange(0, 4, 2) / 4)
      turned = (v[..., :2] + 1j * v[..., 2:]) * np.exp(1j * positions[:, None, None] * inv_freq)
      return np.concatenate([turned.real, turned.imag], axis=-1)
    q = rotate(rms_normalise(heads(layer.query, 4), np.asarray(layer.query_norm.scale[...]), 1e-5))
    k = rotate(rms_normalise(heads(layer.key, 2), np.asarray(layer.key_norm.scale[...]), 1e-5))
    k, v = np.repeat(k, 2, axis=2), np.repeat(heads(layer.value, 2), 2, axis=2)  # query head h reads K/V head h // 2
    scores = np.einsum('bqhd,bkhd->bhqk', q, k) / 2.0
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    context = np.einsum('bhqk,bkhd->bqhd', weights / weights.sum(-1, keepdims=True), v).reshape(batch, length, 16)
    return context @ np.asarray(layer.out.kernel[...]) + np.asarray(layer.out.bias[...])

  def terms(length):  # the Q/K/V projections (16), a head's RMS and score (4 + 4), softmax over `length` keys
    return 16 + 4 + 4 + 2 * length + 16  # ... and its weighted sum of values, then the output projection (16)

  mask = attention.AttentionMask(causal=True)
  forward = nnx.jit(lambda layer, x: layer(x, mask=mask, positions=jnp.arange(x.shape[1])[None])[0])
  x = rng.normal(size=(2, 6, 16)).astype(np.float32)
  for implementation in ('xla', 'jax_nn'):
    layer.implementation = implementation
    assert_close(forward(layer, jnp.asarray(x)), expected(x), terms=terms(6), err_msg=implementation)
  # The splash kernel (run in Pallas's interpreter here) takes whole blocks of 128 tokens.
  layer.implementation = 'splash'
  x = rng.normal(size=(1, 128, 16)).astype(np.float32)
  assert_close(forward(layer, jnp.asarray(x)), expected(x), terms=terms(128), err_msg='splash')


@pytest.mark.numerics
def test_cached_decoding_with_qk_norm_and_softcap_equals_recomputing_the_prefix():
  options = dict(logit_softcap=0.5, positions='rope', num_kv_heads=1, num_layers=1)
  model, without_qk_norm = tiny_gpt(qk_norm=True, **options), tiny_gpt(**options)
  nnx.update(model, nnx.state(without_qk_norm, nnx.Param))  # the same weights; qk-norm's scales stay 1
  prompts = [[5, 6, 7, 8, 9], [3], [12, 13, 14]]
  tokens, valid = decoding.left_pad(prompts, pad_id=0)
  out, _ = generate(model, tokens, valid, jax.random.key(0), max_new_tokens=6, temperature=0.0, top_k=0,
                    top_p=1.0, eos_id=None, pad_id=0)
  sequences = [prompt + row for prompt, row in zip(prompts, np.asarray(out).tolist())]
  padded = jnp.asarray([sequence + [0] * (11 - len(sequence)) for sequence in sequences])
  logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, padded))
  assert np.all(np.abs(logits[:, :, :37]) < 0.5)  # the uncached logits are capped too
  for row, prompt, row_logits in zip(np.asarray(out).tolist(), prompts, logits):
    assert row == row_logits[len(prompt) - 1:len(prompt) + 5].argmax(-1).tolist()
  # The cache holds normalised keys: with unit scales, each raw key head k (RMS ~0.1) divided by
  # sqrt(mean(k^2) + epsilon). RoPE turns pairs of a head's features by one angle, so it commutes
  # with that division: the cached keys are the model without qk-norm's cached keys, so divided.
  prefill = nnx.jit(lambda m, t: m(t, cache=m.init_cache(1, 4), cache_index=0)[1][0]['self']['k'])  # [B, K, L, D]
  keys = np.asarray(prefill(model, padded[:1, :4]))
  raw = np.asarray(prefill(without_qk_norm, padded[:1, :4]), np.float64)
  epsilon = model.config.layer_norm_epsilon
  assert_close(keys, raw / np.sqrt(np.mean(np.square(raw), -1, keepdims=True) + epsilon), terms=16 + 4)


# ------------------------------------------------------------------------------------ relu2
@pytest.mark.numerics
def test_relu2_mlp_is_down_of_relu_squared():
  model = tiny_gpt(mlp='relu2')
  mlp = model.blocks[0].mlp
  assert not hasattr(mlp, 'gate')  # a plain two-matrix MLP
  x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)
  up = x @ np.asarray(mlp.up.kernel[...]) + np.asarray(mlp.up.bias[...])
  expected = np.maximum(up, 0) ** 2 @ np.asarray(mlp.down.kernel[...]) + np.asarray(mlp.down.bias[...])
  assert_close(nnx.jit(lambda m, x: m(x))(mlp, jnp.asarray(x)), expected, terms=16 + 64)  # up, then down over 4 x 16


# ------------------------------------------------------------------------------------ soft cap and z-loss
VOCAB, PADDED = 11, 16  # the table has 5 padded rows: their masked logits must give no NaN and no gradient


def hand_loss(hidden, table, targets, weights, softcap, z_loss):
  """(mean of cross-entropy + z-loss, cross-entropy sum, z-loss sum) over the real ids, written out."""
  logits = hidden @ table[:VOCAB].T
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  log_z = jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, VOCAB), -1)
  cross_entropy = jnp.sum((log_z - target_logit) * weights)
  z = jnp.sum(z_loss * log_z ** 2 * weights)
  return (cross_entropy + z) / jnp.sum(weights), cross_entropy, z


@pytest.mark.numerics
@pytest.mark.parametrize('softcap, z_loss', [(2.0, 0.0), (0.0, 0.05), (2.0, 0.05)])
def test_softcap_and_z_loss_values_and_gradients_on_both_loss_paths(softcap, z_loss):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
  table = jnp.asarray(2 * rng.normal(size=(PADDED, 8)), jnp.float32)  # logits of several units: the cap bites
  targets = jnp.asarray(rng.integers(0, VOCAB, (3, 5)))
  weights = jnp.asarray(rng.uniform(size=(3, 5)) > 0.3, jnp.float32)
  plain = lambda h, w: lm_loss(vocab_logits(h, w.T, VOCAB, softcap=softcap), targets, weights, vocab_size=VOCAB,
                               z_loss=z_loss)
  chunked = lambda h, w: chunked_lm_loss(h, w, targets, weights, vocab_size=VOCAB, chunk_tokens=4, softcap=softcap,
                                         z_loss=z_loss)
  hand = lambda h, w: hand_loss(h, w, targets, weights, softcap, z_loss)
  (expected, (cross_entropy, z)), expected_grads = jax.jit(jax.value_and_grad(
      lambda h, w: (hand(h, w)[0], hand(h, w)[1:]), (0, 1), has_aux=True))(hidden, table)
  terms = 8 + VOCAB + 15  # a logit (8 wide), the normaliser over the real ids, the sum over 3 x 5 positions
  for name, loss_fn in (('plain', plain), ('chunked', chunked)):
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, (0, 1), has_aux=True))(hidden, table)
    assert_close(loss, expected, terms=terms, err_msg=name)
    assert_close(metrics['loss'][0], cross_entropy, terms=terms, err_msg=name)  # 'loss': the CE alone
    assert ('z_loss' in metrics) == bool(z_loss), name
    if z_loss:
      assert_close(metrics['z_loss'][0], z, terms=terms, err_msg=name)
    assert_trees_close(grads, expected_grads, terms=terms, err_msg=name)
    assert not np.any(grads[1][VOCAB:]), name  # the padded rows learn nothing


@pytest.mark.numerics
def test_softcapped_logits_are_the_formula_and_the_padded_ids_stay_masked():
  model = tiny_gpt(logit_softcap=3.0, vocab_multiple=8)  # 37 ids in 40 rows
  hidden = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4, 16)), jnp.float32)
  table = np.asarray(model.token_embedding.embedding[...])
  raw = np.asarray(hidden) @ table.T * 20  # scaled so that some logits saturate
  logits = np.asarray(nnx.jit(lambda m, h: m.logits(h * 20))(model, hidden))
  assert_close(logits[..., :37], 3.0 * np.tanh(raw[..., :37] / 3.0), terms=16)  # a logit: 16 wide
  assert np.all(logits[..., 37:] == np.finfo(np.float32).min)


# Whether each registered family's loss ends in a softmax over a vocabulary (train.z_loss adds its log(Z)^2) or not
# (train.z_loss is a config error). A family missing here runs in the first test below, which fails naming it.
VOCABULARY_SOFTMAX = {'gpt': True, 'transformer': True, 'bert': True, 'rnn_lm': True, 'seq2seq': True,
                      'classifier': False, 'attention_pooling': False}


@pytest.mark.parametrize('family, overrides', [
    *[(family, {}) for family in support.registered_families() if VOCABULARY_SOFTMAX.get(family, True)],
    ('gpt', {'train.loss_chunk_tokens': 0})])  # GPT's unchunked loss path
def test_every_family_with_a_vocabulary_softmax_passes_train_z_loss_to_its_loss(family, overrides):
  # Traced only (abstract model and batch): the loss functions' values are checked above.
  from data.tokenizers import train_tokenizer
  from train.task import task_without_data
  support.family_entry(VOCABULARY_SOFTMAX, family, 'VOCABULARY_SOFTMAX in tests/test_decoder_options.py')
  for z_loss in (0.0, 1e-4):
    config = support.smallest_config(family, {**overrides, 'train.z_loss': z_loss})
    task = task_without_data(config, train_tokenizer(config.data.tokenizer, [' '.join(support.WORDS)] * 2, 100))
    model = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(0)))
    batch = task.example_batch(config.train.batch_size)  # the RNN LM carries a state of that many rows
    _, metrics = nnx.eval_shape(lambda m, b: task.loss(m, b, deterministic=False), model, batch)
    assert ('z_loss' in metrics) == bool(z_loss), (family, z_loss)


# ------------------------------------------------------------------------------------ zero-init
@pytest.mark.numerics
def test_zero_init_out_zeroes_the_output_projections_and_each_block_starts_as_the_identity():
  plain, zeroed = tiny_gpt(), tiny_gpt(zero_init_out=True)
  before, after = params_of(plain), params_of(zeroed)
  assert before.keys() == after.keys()
  outputs = [name for name in after if 'self_attention/out/' in name or '/mlp/down/' in name]
  assert len(outputs) == 8  # 2 blocks x (attention out, MLP down) x (kernel, bias)
  for name, value in after.items():
    if name in outputs:
      assert not np.any(value), name
    else:
      np.testing.assert_array_equal(value, before[name], err_msg=name)  # the same draws as without the option
  # Every residual branch adds zero: the logits are final LayerNorm(token + position embedding) @ embedding^T.
  tokens = np.array([[3, 1, 4, 1, 5, 9]])
  x = after['token_embedding/embedding'][tokens] + after['position_embedding/embedding'][:6]
  normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
  normed = normed * after['final_norm/scale'] + after['final_norm/bias']
  expected = normed @ after['token_embedding/embedding'].T
  # The norm's mean and variance (2 x 16), then a logit (16 wide).
  assert_close(nnx.jit(lambda m, t: m(t)[0])(zeroed, jnp.asarray(tokens)), expected, terms=2 * 16 + 16)


def test_zero_init_out_and_qk_norm_reach_the_other_families():
  from models.bert import BertConfig, build_bert
  from models.classifier import ClassifierConfig, TransformerClassifier
  from models.transformer import Transformer, TransformerConfig
  options = dict(qk_norm=True, zero_init_out=True)
  models = {
      'transformer': Transformer(TransformerConfig(vocab_size=20, width=16, num_heads=2, encoder_layers=1,
                                                   decoder_layers=1, mlp_dim=32, **options), rngs=nnx.Rngs(0)),
      'bert': build_bert(BertConfig(vocab_size=20, max_len=16, num_layers=1, num_heads=2, width=16, mlp_dim=32,
                                    heads='pretraining', **options), rngs=nnx.Rngs(0)),
      'classifier': TransformerClassifier(ClassifierConfig(vocab_size=20, num_layers=1, num_heads=2, width=16,
                                                           mlp_dim=32, **options), rngs=nnx.Rngs(0)),
  }
  for family, model in models.items():
    params = params_of(model)
    outputs = [name for name in params if '_attention/out/' in name or '/mlp/down/' in name]
    norms = [name for name in params if name.endswith(('query_norm/scale', 'key_norm/scale'))]
    attentions = {'transformer': 3, 'bert': 1, 'classifier': 1}[family]  # encoder self, decoder self and cross
    assert len(outputs) == 2 * (attentions + {'transformer': 2, 'bert': 1, 'classifier': 1}[family]), family
    assert len(norms) == 2 * attentions, family
    assert not any(np.any(params[name]) for name in outputs), family


# ------------------------------------------------------------------------------------ export, config, defaults
@pytest.mark.parametrize('option, shown', [({'qk_norm': True}, 'model.qk_norm=True'),
                                           ({'mlp': 'relu2'}, "model.mlp='relu2'"),
                                           ({'logit_softcap': 30.0}, 'model.logit_softcap=30.0')])
def test_exporting_an_option_hugging_face_lacks_is_refused_in_one_line(option, shown, tmp_path):
  from data.tokenizers import CharTokenizer
  from errors import UserError
  from interop import gpt_exporter
  from interop.hf_gpt2 import export_gpt2
  from interop.hf_llama import export_llama
  llama = dict(positions='rope', norm='rmsnorm', mlp='swiglu', use_bias=False)
  tokenizer = CharTokenizer('abcdefghijklmnopqrstuvwxyz0123456789')
  for architecture, steps, exporter in (('GPT2LMHeadModel', {}, export_gpt2),
                                        ('LlamaForCausalLM', llama, export_llama)):
    config = GPT2Config(**{**TINY, **steps, **option})
    with pytest.raises(UserError) as error:
      gpt_exporter(config)
    assert str(error.value).startswith(f"{shown} has no counterpart in Hugging Face's GPT2LMHeadModel or "
                                       f'LlamaForCausalLM') and '\n' not in str(error.value)
    out = tmp_path / architecture
    with pytest.raises(UserError, match=f"^{shown} has no counterpart in Hugging Face's {architecture}, so"):
      exporter(GPT(config, rngs=nnx.Rngs(0)), tokenizer, str(out))
    assert not out.exists()


def test_bert_options_hugging_face_lacks_are_refused_and_zero_init_out_exports(tmp_path):
  from data.tokenizers import CharTokenizer
  from errors import UserError
  from interop.hf_bert import export_bert
  from interop.hf_gpt2 import export_gpt2
  from models.bert import BertConfig, build_bert
  bert = build_bert(BertConfig(vocab_size=20, max_len=16, num_layers=1, num_heads=2, width=16, mlp_dim=32,
                               qk_norm=True), rngs=nnx.Rngs(0))
  with pytest.raises(UserError, match="^model.qk_norm=True has no counterpart in Hugging Face's BertModel"):
    export_bert(bert, None, str(tmp_path / 'bert'))
  relu2 = nnx.eval_shape(lambda: build_bert(BertConfig(vocab_size=20, max_len=16, num_layers=1, num_heads=2, width=16,
                                                       mlp_dim=32, activation='relu2'), rngs=nnx.Rngs(0)))
  with pytest.raises(UserError, match="^model.activation='relu2' has no counterpart in Hugging Face's BertModel"):
    export_bert(relu2, None, str(tmp_path / 'bert'))
  assert not (tmp_path / 'bert').exists()
  # zero_init_out changes only the initialisation: the model is a GPT-2 and exports.
  summary = export_gpt2(tiny_gpt(zero_init_out=True), CharTokenizer('abcdefghijklmnopqrstuvwxyz0123456789'),
                        str(tmp_path / 'gpt2'))
  assert summary['architecture'] == 'GPT2LMHeadModel'
  assert json.loads((tmp_path / 'gpt2' / 'config.json').read_text())['model_type'] == 'gpt2'


@pytest.mark.parametrize('override, message', [
    ({'model.mlp': 'relu3'}, "config.model.mlp='relu3' is not one of ('gelu', 'swiglu', 'relu2')."),
    ({'model.logit_softcap': -1.0}, 'config.model.logit_softcap=-1.0 must be >= 0 (0: no cap; the NanoGPT speedrun '
                                    'uses 15 to 30).'),
    ({'train.z_loss': -1e-4}, 'config.train.z_loss=-0.0001 must be >= 0.'),
])
def test_bad_option_values_are_one_line_config_errors(override, message):
  from configs import gpt
  from errors import ConfigError
  from train.validation import validate_config
  with pytest.raises(ConfigError) as error:
    validate_config(support.with_overrides(gpt.get_config('tiny'), override), num_devices=1)
  assert str(error.value) == message


@pytest.mark.parametrize('family, overrides', [
    *[(family, {}) for family in support.registered_families() if VOCABULARY_SOFTMAX.get(family) is False],
    ('bert', {'task': 'classify'})])  # BERT fine-tuned to classify: its classification head, no MLM
def test_z_loss_where_the_loss_has_no_vocabulary_softmax_is_a_config_error(family, overrides):
  from errors import ConfigError
  from train.validation import validate_config
  config = support.smallest_config(family, {**overrides, 'train.z_loss': 1e-4})
  with pytest.raises(ConfigError, match=r'^config.train.z_loss=0.0001: .* leave train.z_loss at 0.$'):
    validate_config(config, num_devices=1)


def test_the_defaults_are_gpt2_as_saved_before_the_options_existed(tmp_path):
  # A model.json written before these fields existed loads with every option off, and builds the
  # GPT-2 it was: the same parameters (exactly GPT-2's tensors, nothing more) and logits bit for bit.
  from interop.hf_gpt2 import tensor_names
  from train.rundir import MODEL_SCHEMA, read_model_config
  old_fields = {**GPT2Config().__dict__, **TINY}
  for option in ('qk_norm', 'logit_softcap', 'zero_init_out'):
    del old_fields[option]
  with open(tmp_path / 'model.json', 'w') as f:
    json.dump({'schema': MODEL_SCHEMA, 'class': 'GPT2Config', 'fields': old_fields, 'rng_impl': 'threefry'}, f)
  loaded = read_model_config(str(tmp_path), GPT2Config)
  assert (loaded.qk_norm, loaded.mlp, loaded.logit_softcap, loaded.zero_init_out) == (False, 'gelu', 0.0, False)
  model = GPT(loaded, rngs=nnx.Rngs(0))
  hf_paths = {'/'.join(map(str, path)) for name in tensor_names(loaded) for path in name.ours}
  assert set(params_of(model)) == hf_paths
  explicit = tiny_gpt(qk_norm=False, mlp='gelu', logit_softcap=0.0, zero_init_out=False)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (2, 9)))
  forward = nnx.jit(lambda m, t: m(t)[0])
  np.testing.assert_array_equal(forward(model, tokens), forward(explicit, tokens))


def test_the_memory_estimate_counts_the_normalised_queries_and_keys():
  import dataclasses
  from configs import gpt
  from train import memory
  from train.task import task_class
  mesh = jax.make_mesh((1, 8, 1), ('data', 'fsdp', 'tensor'))
  config = support.with_overrides(gpt.get_config('bench'), {'mesh.data': 1, 'mesh.fsdp': 8})  # 1 row per device
  model_config = task_class('gpt').resolve_model_config(config, None, vocab_size=8192)
  added = (memory.activation_bytes(config, dataclasses.replace(model_config, qk_norm=True), mesh)
           - memory.activation_bytes(config, model_config, mesh))
  assert added == 256 * 6 * 2 * 384 * 4  # 256 tokens x 6 layers x (normalised Q and K, E each) x float32
