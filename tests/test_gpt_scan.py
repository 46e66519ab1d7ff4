"""GPT `scan_layers` and `remat`: the same function as the plain layer loop, a compiled program
whose size does not grow with depth, cached decoding, and training through the shared trainer."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from models.gpt import GPT, GPT2Config, generate
from numerics import assert_close, assert_trees_close, transformer_terms
from train.losses import lm_loss

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

CONFIG = GPT2Config(vocab_size=61, max_len=32, num_layers=2, num_heads=2, width=16, dropout=0.0)
# Logits, the loss and its gradients over `tokens()`'s 2 x 11 positions.
TERMS = transformer_terms(CONFIG.num_layers, CONFIG.width, CONFIG.mlp_width, 12, vocab=CONFIG.vocab_size, positions=22)


@functools.cache
def twin_models(config=CONFIG):
  """(unscanned, scanned) GPTs holding the same parameters."""
  scanned = GPT(GPT2Config(**{**config.__dict__, 'scan_layers': True}), rngs=nnx.Rngs(params=0, dropout=1))
  plain = GPT(config, rngs=nnx.Rngs(params=1, dropout=1))
  nnx.update(plain, nnx.state(scanned, nnx.Param).filter(lambda path, _: path[0] != 'blocks'))
  stacked = nnx.state(scanned.blocks, nnx.Param)
  for i, block in enumerate(plain.blocks):
    nnx.update(block, jax.tree.map(lambda x: x[i], stacked))
  return plain, scanned


def tokens(batch=2, length=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


def loss_and_grads(model, x):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest):
    logits, _ = nnx.merge(graphdef, params, rest, copy=True)(x[:, :-1], deterministic=False)
    return lm_loss(logits, x[:, 1:])[0]
  return jax.jit(jax.value_and_grad(loss))(params, rest)


@functools.cache
def reference_loss_and_grads():
  return loss_and_grads(twin_models()[0], tokens())


def test_scanned_and_unscanned_give_the_same_logits_and_gradients():
  plain, scanned = twin_models()
  assert nnx.state(scanned.blocks, nnx.Param)['self_attention']['query']['kernel'].shape == (2, 16, 16)
  count = lambda model: sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count(scanned) == count(plain)
  x = tokens()
  forward = nnx.jit(lambda model, x: model(x)[0])
  assert_close(forward(scanned, x), forward(plain, x), terms=TERMS)
  (plain_loss, plain_grads), (scan_loss, scan_grads) = reference_loss_and_grads(), loss_and_grads(scanned, x)
  assert_close(scan_loss, plain_loss, terms=TERMS)
  assert_close(scan_grads['blocks']['mlp']['up']['kernel'][1], plain_grads['blocks'][1]['mlp']['up']['kernel'],
               terms=TERMS)
  assert_close(scan_grads['token_embedding']['embedding'], plain_grads['token_embedding']['embedding'], terms=TERMS)


@pytest.mark.parametrize('remat, scan', [('dots', True), ('full', False)])
def test_remat_changes_memory_not_results(remat, scan):
  reference_loss, reference_grads = reference_loss_and_grads()
  model = twin_models(GPT2Config(**{**CONFIG.__dict__, 'remat': remat}))[int(scan)]
  loss, grads = loss_and_grads(model, tokens())
  assert_close(loss, reference_loss, terms=TERMS)
  if scan:  # compare layer 1 of the stacked gradients with the plain model's block 1
    grads = {**grads, 'blocks': [jax.tree.map(lambda g: g[i], grads['blocks']) for i in range(CONFIG.num_layers)]}
  assert_trees_close(grads, reference_grads, terms=TERMS)


def test_cached_greedy_decoding_matches_between_layouts():
  plain, scanned = twin_models()
  prompt = tokens(batch=2, length=5, seed=3)
  valid = jnp.ones(prompt.shape, bool).at[0, :2].set(False)  # a left-padded row
  outputs = [np.asarray(generate(m, prompt, valid, jax.random.key(0), max_new_tokens=8, temperature=0.0, top_k=0,
                                 top_p=1.0, eos_id=None, pad_id=0)[0]) for m in (plain, scanned)]
  np.testing.assert_array_equal(outputs[0], outputs[1])
  cache = scanned.init_cache(2, 13)
  assert cache['self']['k'].shape == (2, 2, 2, 13, 8)


@pytest.mark.parametrize('remat', ['dots', 'full'])
def test_cached_decoding_of_a_remat_model_equals_the_plain_one(remat):
  """Remat only changes what the backward pass keeps: an unscanned model with it decodes as without it
  (its blocks, created outside the decoding loop, are run without nnx.remat there)."""
  plain = twin_models()[0]
  with_remat = twin_models(GPT2Config(**{**CONFIG.__dict__, 'remat': remat}))[0]
  prompt = tokens(batch=2, length=5, seed=3)
  valid = jnp.ones(prompt.shape, bool)
  outputs = [np.asarray(generate(m, prompt, valid, jax.random.key(0), max_new_tokens=6, temperature=0.0, top_k=0,
                                 top_p=1.0, eos_id=None, pad_id=0)[0]) for m in (plain, with_remat)]
  np.testing.assert_array_equal(outputs[0], outputs[1])


def hlo_size(num_layers: int, scan: bool) -> int:
  config = GPT2Config(**{**CONFIG.__dict__, 'num_layers': num_layers, 'scan_layers': scan})
  model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(params=0, dropout=1)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda params, rest, x: nnx.merge(graphdef, params, rest, copy=True)(x)[0].mean()
  return len(jax.jit(jax.grad(loss)).lower(params, rest, tokens()).as_text().splitlines())


def test_scanned_program_size_does_not_grow_with_depth():
  scanned = hlo_size(2, True), hlo_size(4, True)
  unscanned = hlo_size(2, False), hlo_size(4, False)
  assert scanned[1] <= scanned[0] * 1.02, scanned
  # Lines = the rest + layers x a block's: x1.5 from 2 to 4 layers means a block outweighs half the rest.
  assert unscanned[1] > unscanned[0] * 1.5, unscanned


def test_scanned_remat_gpt_trains_sharded(tmp_path):
  from train.trainer import train_and_evaluate
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=3, lines=40)
  config = support.tiny_gpt_config(corpus, **{'model.scan_layers': True, 'model.remat': 'dots', 'model.dropout': 0.1,
                                              'mesh.data': 4, 'mesh.fsdp': 2, 'train.steps': 8,
                                              'train.eval_every': 8, 'train.checkpoint_every': 8,
                                              'train.log_every': 1})
  results = train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['step'] == 8 and results['eval/loss'] < 3.8
  from train.rundir import load_run
  assert load_run(str(tmp_path / 'run')).model.config.scan_layers
