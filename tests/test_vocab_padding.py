"""Padded vocabularies (models/layers.py): the embedding has a multiple of 128 rows, the padded ids
are never emitted by any search even when their weights would win, and losses and gradients
equal those of the unpadded model with the same real weights."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import decoding
from models.bert import BertConfig, BertForPretraining
from models.gpt import GPT, GPT2Config, generate
from models.layers import padded_vocab_size
from numerics import assert_close, assert_trees_close, transformer_terms
from train.losses import lm_loss
from train.tasks.bert import pretraining_loss

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

VOCAB = 37
# One block: the padding lives in the embedding, the output layer and the loss, none in the blocks (fewer layers
# compile faster).
GPT_CONFIG = GPT2Config(vocab_size=VOCAB, vocab_multiple=128, max_len=48, num_layers=1, num_heads=2, width=16,
                        dropout=0.0)
# Tiny models run compiled: op-by-op eager execution costs seconds per call.
forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))
BERT_CONFIG = BertConfig(vocab_size=VOCAB, vocab_multiple=128, max_len=16, num_layers=1, num_heads=2, width=8,
                         mlp_dim=16, dropout=0.0, attention_dropout=0.0, heads='pretraining')


def test_padded_sizes_are_multiples_of_128():
  assert [padded_vocab_size(v, 128) for v in (37, 128, 129, 30522, 50257)] == [128, 128, 256, 30592, 50304]
  assert padded_vocab_size(50257, 1) == 50257
  gpt = nnx.eval_shape(lambda: GPT(dataclasses.replace(GPT_CONFIG, vocab_size=300), rngs=nnx.Rngs(0)))
  assert gpt.token_embedding.embedding.shape == (384, 16)
  bert = nnx.eval_shape(lambda: BertForPretraining(BERT_CONFIG, rngs=nnx.Rngs(0)))
  assert bert.encoder.embeddings.token.embedding.shape == (128, 8) and bert.mlm.bias.shape == (128,)


def test_padded_rows_start_at_zero_and_real_rows_do_not():
  embedding = np.asarray(GPT(GPT_CONFIG, rngs=nnx.Rngs(0)).token_embedding.embedding[...])
  assert np.all(embedding[VOCAB:] == 0) and np.all(np.abs(embedding[:VOCAB]).sum(-1) > 0)


def tempting_gpt():
  """A padded GPT whose padded output rows beat every real one at every position, unless masked."""
  model = GPT(GPT_CONFIG, rngs=nnx.Rngs(0))
  model.final_norm.scale[...] = jnp.zeros_like(model.final_norm.scale[...])  # every hidden state = the bias
  bias = jax.random.normal(jax.random.key(1), (16,))
  model.final_norm.bias[...] = bias
  embedding = model.token_embedding.embedding[...]
  model.token_embedding.embedding[...] = embedding.at[VOCAB:].set(10 * bias / jnp.linalg.norm(bias))
  return model


def test_padded_ids_would_win_unmasked_and_are_never_emitted():
  model = tempting_gpt()
  tokens, valid = decoding.left_pad([[5, 6, 7], [3]], pad_id=0)
  hidden, _ = nnx.jit(lambda m, t: m(t, return_hidden=True))(model, tokens)
  unmasked = hidden @ model.token_embedding.embedding[...].T
  assert np.all(np.asarray(jnp.argmax(unmasked, -1)) >= VOCAB)  # the test would catch a missing mask
  logits, _ = forward(model, tokens)
  assert np.all(np.asarray(logits[..., VOCAB:]) == np.finfo(np.float32).min)
  for settings in (dict(temperature=0.0, top_k=0, top_p=1.0), dict(temperature=2.0, top_k=0, top_p=1.0),
                   dict(temperature=1.0, top_k=200, top_p=1.0), dict(temperature=1.0, top_k=0, top_p=0.999)):
    for seed in range(2):
      out, _ = generate(model, tokens, valid, jax.random.key(seed), max_new_tokens=12, eos_id=None, pad_id=0,
                        **settings)
      assert np.all(np.asarray(out) < VOCAB), settings
  # Beam search over a step function that recomputes the whole prefix (the cache is the token buffer).
  length = 14

  def step_fn(step_tokens, buffer, index):
    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, step_tokens, index, axis=1)
    logits, _ = model(buffer)
    return jax.lax.dynamic_slice_in_dim(logits, index + step_tokens.shape[1] - 1, 1, axis=1), buffer

  prompt = jnp.asarray([[5, 6], [3, 4]], jnp.int32)
  beams = jax.jit(lambda p: decoding.beam_search(step_fn, jnp.zeros((2, length), jnp.int32), p, beam_size=4,
                                                 max_len=length - 2, eos_id=2))(prompt)
  assert np.all(np.asarray(beams.tokens) < VOCAB) and np.all(np.isfinite(np.asarray(beams.scores)))


def test_logits_stay_in_the_compute_dtype():
  model = GPT(dataclasses.replace(GPT_CONFIG, dtype='bfloat16'), rngs=nnx.Rngs(0))
  logits, _ = forward(model, jnp.ones((1, 4), jnp.int32))
  assert logits.dtype == jnp.bfloat16
  assert np.all(np.asarray(logits[..., VOCAB:], np.float32) == float(jnp.finfo(jnp.bfloat16).min))
  bert = BertForPretraining(dataclasses.replace(BERT_CONFIG, dtype='bfloat16'), rngs=nnx.Rngs(0))
  assert forward(bert, jnp.ones((1, 4), jnp.int32)).mlm_logits.dtype == jnp.bfloat16


def copy_real_weights(padded, unpadded):
  """`padded` with the parameters of `unpadded`; its padded rows get large random values (masked, so they must not
  matter)."""
  source = nnx.to_pure_dict(nnx.state(unpadded, nnx.Param))
  state = nnx.state(padded, nnx.Param)
  target = nnx.to_pure_dict(state)

  def merge(path, ours, theirs):
    if ours.shape == theirs.shape:
      return theirs
    noise = 50.0 * jax.random.normal(jax.random.key(len(path)), ours.shape, ours.dtype)
    return noise.at[:theirs.shape[0]].set(theirs)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(merge, target, source))
  nnx.update(padded, state)


def assert_same_loss_and_gradients(loss_fn, padded, unpadded, terms: int):
  """`terms`: the reductions behind the loss and its gradients (tests/numerics.py)."""
  value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))
  (loss, metrics), grads = value_and_grad(padded)
  (loss_u, metrics_u), grads_u = value_and_grad(unpadded)
  assert_close(loss, loss_u, terms=terms)
  for name in metrics:
    assert_close(metrics[name], metrics_u[name], terms=terms, err_msg=name)
  grads, grads_u = nnx.to_pure_dict(grads), nnx.to_pure_dict(grads_u)
  real_rows = jax.tree.map(lambda g, g_u: np.asarray(g)[:np.shape(g_u)[0]], grads, grads_u)
  assert_trees_close(real_rows, grads_u, terms=terms)

  def no_gradient_on_padded_rows(path, g, g_u):
    assert np.all(np.asarray(g)[np.shape(g_u)[0]:] == 0), jax.tree_util.keystr(path)

  jax.tree_util.tree_map_with_path(no_gradient_on_padded_rows, grads, grads_u)


@pytest.mark.parametrize('loss', ['plain', 'smoothed', 'chunked', 'chunked_smoothed'])
def test_gpt_loss_and_gradients_equal_the_unpadded_model(loss):
  unpadded = GPT(dataclasses.replace(GPT_CONFIG, vocab_multiple=1), rngs=nnx.Rngs(0))
  padded = GPT(GPT_CONFIG, rngs=nnx.Rngs(1))
  copy_real_weights(padded, unpadded)
  tokens = jax.random.randint(jax.random.key(2), (3, 17), 0, VOCAB)
  smoothing = 0.1 if 'smoothed' in loss else 0.0

  def loss_fn(model):
    if loss.startswith('chunked'):
      hidden, _ = model(tokens[:, :-1], return_hidden=True)
      return model.chunked_loss(hidden, tokens[:, 1:], label_smoothing=smoothing, chunk_tokens=20)
    return lm_loss(model(tokens[:, :-1])[0], tokens[:, 1:], label_smoothing=smoothing, vocab_size=VOCAB)

  assert_same_loss_and_gradients(loss_fn, padded, unpadded, terms=transformer_terms(
      GPT_CONFIG.num_layers, GPT_CONFIG.width, GPT_CONFIG.mlp_width, 16, vocab=VOCAB, positions=3 * 16))


def test_bert_pretraining_loss_and_gradients_equal_the_unpadded_model():
  unpadded = BertForPretraining(dataclasses.replace(BERT_CONFIG, vocab_multiple=1), rngs=nnx.Rngs(0))
  padded = BertForPretraining(BERT_CONFIG, rngs=nnx.Rngs(1))
  copy_real_weights(padded, unpadded)
  rng = np.random.default_rng(0)
  batch = {'tokens': rng.integers(5, VOCAB, (2, 10)), 'segments': np.zeros((2, 10), np.int32),
           'valid': np.ones((2, 10), bool), 'next_sentence': np.array([0, 1]),
           'masked_positions': np.array([[1, 4, 0], [2, 3, 7]]), 'masked_labels': rng.integers(5, VOCAB, (2, 3)),
           'masked_weights': np.array([[1, 1, 0], [1, 1, 1]], np.float32)}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  assert_same_loss_and_gradients(lambda m: pretraining_loss(m, batch, deterministic=True), padded, unpadded,
                                 terms=transformer_terms(1, 8, 16, 10, vocab=VOCAB, positions=2 * 10) + 2 * 8)
