"""GPT-2: parameter counts, cached decoding, sampling filters, Hugging Face import parity."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from numerics import assert_close, transformer_terms
from configs import gpt as gpt_configs
from models import decoding
from models.gpt import GPT, GPT2Config, generate

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only


def abstract_params(preset, **overrides):
  config = gpt_configs.get_config(preset)
  gpt_config = GPT2Config(**{**{k: v for k, v in config.model.items() if k in GPT2Config.__dataclass_fields__},
                             'vocab_size': config.data.vocab_size, 'attention': 'xla', 'dtype': 'float32',
                             **overrides})
  return support.abstract_parameter_count(gpt_config, lambda c: GPT(c, rngs=nnx.Rngs(0)))


def gpt2_count_by_hand(vocab, positions, layers, width):
  """Embeddings (V + positions) E; per block two LayerNorms 4E, attention 4E^2 + 4E and MLP
  8E^2 + 5E; the final LayerNorm 2E (the output layer is tied)."""
  return (vocab + positions) * width + layers * (12 * width**2 + 13 * width) + 2 * width


def test_gpt2_presets_have_the_published_parameter_counts():
  assert gpt2_count_by_hand(50257, 1024, 12, 768) == 124_439_808  # HF GPT2LMHeadModel's counts
  assert gpt2_count_by_hand(50257, 1024, 24, 1024) == 354_823_168
  assert abstract_params('gpt2', vocab_multiple=1) == 124_439_808
  # The presets pad the 50,257 ids to 50,304 embedding rows: 47 more rows of zeros, never used.
  assert abstract_params('gpt2') == gpt2_count_by_hand(50304, 1024, 12, 768) == 124_439_808 + 47 * 768
  assert abstract_params('gpt2-medium') == gpt2_count_by_hand(50304, 1024, 24, 1024) == 354_823_168 + 47 * 1024


def small_gpt(seed=0, vocab=37):
  return GPT(GPT2Config(vocab_size=vocab, max_len=48, num_layers=2, num_heads=2, width=16, dropout=0.0),
             rngs=nnx.Rngs(seed))


@nnx.jit
def full_forward(model, tokens):
  return model(tokens)[0]


def greedy_without_cache(model, prompt, new_tokens, length=24):
  """Recompute the whole prefix for every token (right padding cannot affect causal positions)."""
  tokens = list(prompt)
  for _ in range(new_tokens):
    logits = full_forward(model, jnp.asarray([tokens + [0] * (length - len(tokens))]))
    tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
  return tokens[len(prompt):]


def test_cached_batched_decoding_equals_recomputing_the_prefix():
  model = small_gpt()
  prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [12, 13, 14]]
  tokens, valid = decoding.left_pad(prompts, pad_id=0)
  out, lengths = generate(model, tokens, valid, jax.random.key(0), max_new_tokens=10, temperature=0.0,
                          top_k=0, top_p=1.0, eos_id=None, pad_id=0)
  for row, prompt in zip(np.asarray(out), prompts):
    assert list(row) == greedy_without_cache(model, prompt, 10)
  assert list(np.asarray(lengths)) == [10, 10, 10]


def test_eos_stops_a_row_and_pads_after_it():
  model = small_gpt()
  prompt = [[5, 6, 7]]
  free = greedy_without_cache(model, prompt[0], 6)
  eos = free[2]
  tokens, valid = decoding.left_pad(prompt, pad_id=0)
  out, lengths = generate(model, tokens, valid, jax.random.key(0), max_new_tokens=6, temperature=0.0,
                          top_k=0, top_p=1.0, eos_id=eos, pad_id=0)
  first_eos = free.index(eos)
  assert list(np.asarray(out)[0][:first_eos + 1]) == free[:first_eos + 1]
  assert np.all(np.asarray(out)[0][first_eos + 1:] == 0)
  assert int(lengths[0]) == first_eos + 1


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
  logits = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = lambda keys, **kw: jax.vmap(lambda k: decoding.sample_logits(logits, k, **kw)[0])(keys)

  @jax.jit  # the four samplers as one program: eagerly, each op of each compiles on its own
  def draws(keys):
    return draw(keys[:400], top_k=2), draw(keys[:400], top_p=0.8), draw(keys[:400], temperature=0.0), draw(keys)

  top_k, top_p, greedy, samples = (np.asarray(x) for x in draws(keys))
  assert set(top_k) == {1, 3}
  # Nucleus 0.8: 0.4 + 0.3 = 0.7 < 0.8, so the next token (0.15) completes it.
  assert set(top_p) == {1, 3, 4}
  assert set(greedy) == {1}
  # Sampling noise, not rounding: 2,000 draws put each frequency within ~4 standard errors
  # (sqrt(p (1 - p) / 2000) <= 0.011) of its probability.
  np.testing.assert_allclose(np.bincount(samples, minlength=5) / len(keys), [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.04)


@pytest.fixture(scope='module')
def hf_gpt2_dir(tmp_path_factory):
  transformers = pytest.importorskip('transformers')
  import tokenizers
  torch = pytest.importorskip('torch')
  from data.tokenizers import train_bpe
  directory = str(tmp_path_factory.mktemp('hf_gpt2'))
  bpe = train_bpe(['def foo(x):\n    return x + 1\n' * 20, 'hello world, hello there'], vocab_size=300)
  bpe.tokenizer.add_special_tokens(['<|endoftext|>'])
  bpe.tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4)
  model = transformers.GPT2LMHeadModel(config).eval()
  model.save_pretrained(directory, safe_serialization=True)
  return directory, model


def test_hf_gpt2_import_matches_transformers_logits(hf_gpt2_dir, tmp_path):
  import torch
  from configs import gpt as gpt_configs
  from train.rundir import load_run
  from train.trainer import import_hf_run
  directory, hf_model = hf_gpt2_dir
  config = gpt_configs.get_config('tiny')
  workdir = str(tmp_path / 'imported')
  import_hf_run(config, directory, workdir)
  run = load_run(workdir)
  tokens = np.random.default_rng(0).integers(0, hf_model.config.vocab_size, (2, 20))
  with torch.no_grad():
    expected = hf_model(torch.tensor(tokens)).logits.numpy()
  logits, _ = support.compiled_call(run.model, jnp.asarray(tokens))
  assert_close(support.real_logits(logits, hf_model.config.vocab_size), expected, terms=transformer_terms(2, 32, 128, 20))
  from transformers import PreTrainedTokenizerFast
  hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, 'tokenizer.json'))
  text = 'def foo(x):\n    return hello'
  assert run.tokenizer.encode(text) == hf_tokenizer(text)['input_ids']
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['width'] == 32


def test_the_end_of_a_run_prints_decode_num_samples_continuations_of_the_prompts_in_turn(tmp_path, capsys):
  import ml_collections

  from configs.base import decode_defaults
  from data.tokenizers import CharTokenizer
  from errors import ConfigError
  from train import sampling
  from train.validation import check_decode

  tokenizer = CharTokenizer('abcdefghijklmnopqrstuvwxyz ')
  model = small_gpt(vocab=tokenizer.vocab_size)
  decode = decode_defaults()
  decode.update({'prompts': 'ab|cd', 'num_samples': 5, 'max_new_tokens': 12, 'temperature': 1.0})
  (tmp_path / 'five').mkdir()
  (tmp_path / 'none').mkdir()
  samples = sampling.sample_prompts(generate, model, tokenizer, decode, str(tmp_path / 'five'), seed=0, max_len=48)
  with open(tmp_path / 'five' / 'samples.json') as f:
    written = json.load(f)
  assert [w['prompt'] for w in written] == ['ab', 'cd', 'ab', 'cd', 'ab']
  assert [w['continuation'] for w in written] == samples
  assert capsys.readouterr().out.count('--- prompt: ') == 5
  assert len({samples[0], samples[2], samples[4]}) == 3  # one prompt, three draws of their own
  decode.num_samples = 0  # what sweeps and scripts set for no sampling
  assert sampling.sample_prompts(generate, model, tokenizer, decode, str(tmp_path / 'none'), seed=0, max_len=48) == []
  assert not (tmp_path / 'none' / 'samples.json').exists() and capsys.readouterr().out == ''
  decode.num_samples = -1
  with pytest.raises(ConfigError, match=r'config.decode.num_samples=-1 must be >= 0'):
    check_decode(ml_collections.ConfigDict({'decode': decode}))
