"""The Llama-style decoder: each step against a reference on its own (RoPE against NumPy and
transformers' frequencies, grouped-query attention against repeated K/V heads, multi-head bit for
bit), packing and cached decoding against the plain forward, the presets' parameter counts, and
Hugging Face parity: a random LlamaForCausalLM imported through launch.py (no --config), its logits
and greedy generation, its export (byte-identical tensors) and the export of a run trained here."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import support
from models import attention, decoding, rope
from models.gpt import GPT, GPT2Config, generate
from numerics import assert_close, transformer_terms

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

LLAMA_STEPS = dict(positions='rope', norm='rmsnorm', mlp='swiglu', use_bias=False, tie_embeddings=False)
# Llama 3 scaling with a short original context, so that the head width 8's four frequencies fall in
# all three bands (kept, blended, slowed).
LLAMA3 = dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


# tiny_llama's and the random LlamaForCausalLM's logits: 2 blocks (width 32, SwiGLU 40 or 48 wide), <= 20 tokens.
TINY_TERMS = transformer_terms(2, 32, 40, 20)
HF_TERMS = transformer_terms(2, 32, 48, 20)


# One compilation per model instead of one per op (eager execution).
logits_of = nnx.jit(lambda model, tokens: model(tokens)[0])


def max_difference(ours, theirs) -> float:
  return float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))))


def tiny_llama_config(**overrides) -> GPT2Config:
  return GPT2Config(**{**dict(vocab_size=37, max_len=48, num_layers=2, num_heads=4, num_kv_heads=2, width=32,
                              mlp_hidden=40, dropout=0.0, rope_scaling='llama3', rope_original_max_len=16,
                              rope_theta=500000.0), **LLAMA_STEPS, **overrides})


def tiny_llama(seed=0, **overrides):
  """The tiny Llama-style GPT with any weights (the tests here hold for every value): built abstractly and
  valued by NumPy from `seed`, no random program compiled for each parameter shape."""
  return support.numpy_valued(nnx.eval_shape(lambda: GPT(tiny_llama_config(**overrides), rngs=nnx.Rngs(seed))), seed)


# ------------------------------------------------------------------------------------ each step alone
def test_rope_frequencies_are_transformers_and_the_rotation_matches_numpy():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters=LLAMA3)
  theirs, _ = ROPE_INIT_FUNCTIONS['llama3'](config, 'cpu')
  ours = rope.inverse_frequencies(8, rope.RopeConfig(theta=500000.0, scaling='llama3', original_max_len=16))
  assert_close(ours, theirs.numpy(), terms=1)  # a float32 pow and a blend: torch and NumPy within an ulp or two
  # GPT-2 with only positions=rope: attention of block 0 against NumPy, with each feature pair
  # (x_i, x_{i + D/2}) a complex number turned by e^{i * position * inv_freq_i}.
  # Any weights do (built abstractly, valued by NumPy: no random program compiled for each parameter shape).
  model = support.numpy_valued(nnx.eval_shape(lambda: GPT(GPT2Config(
      vocab_size=37, max_len=48, num_layers=1, num_heads=2, width=16, dropout=0.0, positions='rope'),
      rngs=nnx.Rngs(0))))
  assert not hasattr(model, 'position_embedding')
  layer = model.blocks[0].self_attention
  x = np.random.default_rng(0).normal(size=(1, 7, 16)).astype(np.float32)
  positions = np.array([[0, 1, 2, 3, 0, 1, 2]])  # two packed segments
  segments = np.array([[1, 1, 1, 1, 2, 2, 2]])
  mask = attention.AttentionMask(causal=True, query_segment_ids=jnp.asarray(segments),
                                 key_segment_ids=jnp.asarray(segments))
  out = nnx.jit(lambda layer, *args: layer(args[0], mask=args[1], positions=args[2])[0])(
      layer, jnp.asarray(x), mask, jnp.asarray(positions))

  inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
  def heads(linear):
    return (x @ np.asarray(linear.kernel[...]) + np.asarray(linear.bias[...])).reshape(1, 7, 2, 8)
  def rotate(v):
    turned = (v[..., :4] + 1j * v[..., 4:]) * np.exp(1j * positions[..., None, None] * inv_freq)
    return np.concatenate([turned.real, turned.imag], axis=-1)
  q, k, v = rotate(heads(layer.query)), rotate(heads(layer.key)), heads(layer.value)
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(8)
  allowed = np.tril(np.ones((7, 7), bool)) & (segments[0][:, None] == segments[0][None, :])
  weights = np.exp(np.where(allowed, scores, -np.inf) - scores.max(-1, keepdims=True))
  context = np.einsum('bhqk,bkhd->bqhd', weights / weights.sum(-1, keepdims=True), v).reshape(1, 7, 16)
  expected = context @ np.asarray(layer.out.kernel[...]) + np.asarray(layer.out.bias[...])
  assert_close(out, expected, terms=3 * 16 + 8 + 2 * 7)  # projections over E = 16, a head, 7 keys


def test_grouped_query_attention_equals_attention_over_repeated_heads_on_each_path():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, 9, 2, 8)), jnp.float32) for _ in range(2))
  mask = attention.AttentionMask(causal=True, q_offset=4, key_lengths=jnp.array([9, 7]))
  # Compiled: one program per path, not each op on its own.
  attend = jax.jit(attention.dot_product_attention, static_argnames='implementation')
  repeated, weights = attend(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask)
  for implementation in ('xla', 'jax_nn'):
    out, _ = attend(q, k, v, mask, implementation=implementation)
    assert_close(out, repeated, terms=8 + 2 * 9, err_msg=implementation)  # a head's dot product, 9 keys
  _, grouped_weights = attend(q, k, v, mask)
  assert_close(grouped_weights, weights, terms=8 + 9)  # the einsum path's [B, H, Lq, Lk]


def test_splash_takes_grouped_heads_alone_and_split_over_a_mesh():
  from train import sharding
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(4, 128, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(4, 128, 2, 16)), jnp.float32) for _ in range(2))
  segments = jnp.asarray(np.repeat([1, 2], [50, 78])[None].repeat(4, 0), jnp.int32)

  def attend(implementation, q, k, v):
    mask = attention.AttentionMask(causal=True, query_segment_ids=segments[:len(q)], key_segment_ids=segments[:len(q)])
    return attention.dot_product_attention(q, k, v, mask, implementation=implementation)[0]

  # Jitted (one compilation each, not one per op): the einsum reference, one row through the kernel.
  expected = jax.jit(functools.partial(attend, 'xla'))(q, k, v)
  # One row alone: the outputs, and the multi-query kernel's backward per K/V head.
  terms = 16 + 2 * 128  # a head's dot product over D = 16, the normalizer and the values over 128 keys
  assert_close(jax.jit(functools.partial(attend, 'splash'))(q[:1], k[:1], v[:1]), expected[:1], terms=terms)
  key_grad = lambda implementation: jax.jit(jax.grad(
      lambda k: jnp.sum(jnp.sin(attend(implementation, q[:1], k, v[:1])))))(k[:1])
  assert_close(key_grad('splash'), key_grad('xla'), terms=2 * terms + 2 * 128)  # + the sums over queries and groups
  with sharding.use_mesh(sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})):  # 2 KV heads over tensor=2
    out = jax.jit(functools.partial(attend, 'splash'))(q, k, v)
  assert_close(out, expected, terms=terms)


def test_as_many_kv_heads_as_query_heads_is_multi_head_bit_for_bit():
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (2, 12)))
  forward = nnx.jit(lambda m, t: m(t)[0])
  plain, explicit = (forward(tiny_llama(num_kv_heads=heads), tokens) for heads in (0, 4))
  np.testing.assert_array_equal(plain, explicit)


def test_stacked_projection_gradients_equal_autodiff_of_the_einsum():
  # SwiGLU's gate/up matmul has a hand-written weight gradient (operand order for XLA:CPU): same values.
  from models.layers import stacked_projection
  keys = jax.random.split(jax.random.key(0), 3)
  x, kernels = jax.random.normal(keys[0], (3, 5, 8)), jax.random.normal(keys[1], (8, 2, 6))
  cotangent = jax.random.normal(keys[2], (3, 5, 2, 6))
  loss = lambda project: lambda x, w: jnp.sum(project(x, w) * cotangent)
  ours = jax.jit(jax.grad(loss(stacked_projection), (0, 1)))(x, kernels)  # compiled: one program, not op by op
  autodiff = jax.jit(jax.grad(loss(lambda x, w: jnp.einsum('...e,ecf->...cf', x, w)), (0, 1)))(x, kernels)
  for a, b in zip(ours, autodiff):
    assert_close(a, b, terms=3 * 5)  # the kernels' gradient sums over 3 x 5 positions


def test_cached_greedy_decoding_and_packing_agree_with_the_plain_forward():
  model = tiny_llama()
  assert model.init_cache(3, 20)[0]['self']['k'].shape == (3, 2, 20, 8)  # the cache holds the 2 KV heads
  prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [12, 13, 14]]
  tokens, valid = decoding.left_pad(prompts, pad_id=0)
  out, _ = generate(model, tokens, valid, jax.random.key(0), max_new_tokens=6, temperature=0.0, top_k=0,
                    top_p=1.0, eos_id=None, pad_id=0)
  # Each prompt and its continuation in one uncached forward (right-padded: causal rows ignore the padding).
  sequences = [prompt + row for prompt, row in zip(prompts, np.asarray(out).tolist())]
  padded = jnp.asarray([sequence + [0] * (13 - len(sequence)) for sequence in sequences])
  logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, padded))
  for row, prompt, row_logits in zip(np.asarray(out).tolist(), prompts, logits):
    assert row == row_logits[len(prompt) - 1:len(prompt) + 5].argmax(-1).tolist()
  # Two sequences packed in one row (positions restarting, segment ids) = each on its own.
  first, second = [4, 9, 2, 7, 1], [8, 3, 6]
  rows = {'tokens': [first + second, first + [0] * 3, second + [0] * 5],  # packed, then each alone
          'positions': [[0, 1, 2, 3, 4, 0, 1, 2], list(range(8)), list(range(8))],
          'segment_ids': [[1] * 5 + [2] * 3, [1] * 8, [1] * 8]}
  logits = nnx.jit(lambda m, rows: m(rows['tokens'], positions=rows['positions'], segment_ids=rows['segment_ids'])[0])(
      model, {name: jnp.asarray(value) for name, value in rows.items()})
  assert_close(logits[0], np.concatenate([logits[1, :5], logits[2, :3]]), terms=TINY_TERMS)


def test_presets_have_the_published_parameter_counts():
  from test_gpt import abstract_params
  # Stacked blocks (scan_layers) hold the same parameters and build in one trace instead of one per layer.
  assert abstract_params('smollm-135m', scan_layers=True) == 134_515_008  # HuggingFaceTB/SmolLM-135M
  assert abstract_params('llama-3.2-1b', scan_layers=True) == 1_235_814_400  # meta-llama/Llama-3.2-1B
  # The CPU `llama` preset matches the GPT-2 block of the `default` one in size (BPE vocabulary 2,048);
  # `default`'s QK-norm adds a 64-wide query and key scale per layer: 4 x 2 x 64 = 512.
  assert abstract_params('llama', vocab_size=2048) == 3_746_048
  assert abstract_params('default', vocab_size=2048, qk_norm=False) == 3_749_376
  assert abstract_params('default', vocab_size=2048) == 3_749_376 + 512


@pytest.mark.parametrize('override, message', [
    ({'model.positions': 'alibi'}, "config.model.positions='alibi' is not one of ('learned', 'rope')."),
    ({'model.num_kv_heads': 3}, 'config.model.num_kv_heads=3 does not divide config.model.num_heads=4; use a '
                                'divisor of num_heads (1: multi-query, 0: one per query head).'),
    ({'model.mlp': 'geglu'}, "config.model.mlp='geglu' is not one of ('gelu', 'swiglu', 'relu2')."),
])
def test_bad_llama_options_are_one_line_config_errors(override, message):
  from configs import gpt
  from errors import ConfigError
  from train.validation import validate_config
  with pytest.raises(ConfigError) as error:
    validate_config(support.with_overrides(gpt.get_config('llama'), override))
  assert str(error.value) == message


def test_tensor_parallelism_splits_key_value_projections_by_whole_heads():
  from train import sharding
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 2, 'tensor': 4})
  counts = sharding.kv_head_counts(nnx.eval_shape(lambda: GPT(tiny_llama_config(width=256, num_kv_heads=2),
                                                                 rngs=nnx.Rngs(0))))
  assert counts == {'blocks/0/self_attention': 2, 'blocks/1/self_attention': 2}
  spec = lambda path, heads: sharding.partition_spec(path, (256, 128), mesh, heads)
  assert spec('params/blocks/0/self_attention/key/kernel', counts) == P('fsdp', None)  # 2 heads over 4: whole
  assert spec('params/blocks/0/self_attention/query/kernel', counts) == P('fsdp', 'tensor')
  assert spec('params/blocks/0/self_attention/key/kernel', {'blocks/0/self_attention': 4}) == P('fsdp', 'tensor')
  assert sharding.partition_spec('params/blocks/0/mlp/gate/kernel', (256, 512), mesh) == P('fsdp', 'tensor')


# ------------------------------------------------------------------------------------ Hugging Face
@pytest.fixture(scope='module')
def hf_llama(tmp_path_factory):
  """A random LlamaForCausalLM (GQA 4/2 heads, Llama 3 RoPE, untied) saved by transformers."""
  from data.tokenizers import train_bpe
  directory = str(tmp_path_factory.mktemp('hf_llama'))
  bpe = train_bpe(['def foo(x):\n    return x + 1\n' * 20, 'hello world, hello there'], vocab_size=300)
  bpe.tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  config = transformers.LlamaConfig(
      vocab_size=bpe.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=LLAMA3,
      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():
    for p in model.parameters():  # norms too: a tensor under the wrong name must show
      p.normal_(0.0, 0.2)
  model.eval().save_pretrained(directory)
  return directory, model


@pytest.fixture(scope='module')
def imported_run(hf_llama, tmp_path_factory):
  directory, _ = hf_llama
  workdir = str(tmp_path_factory.mktemp('imported') / 'run')
  result = support.launch(['--mode=import_hf', f'--hf_dir={directory}', f'--workdir={workdir}'])
  assert result.returncode == 0, result.stderr[-2000:]
  return workdir


@pytest.fixture(scope='module')
def loaded_run(imported_run):
  """`load_run(imported_run)`, reloaded once for the tests that read it (none changes its model)."""
  from train.rundir import load_run
  return load_run(imported_run)


def test_import_with_another_family_config_is_a_one_line_error(hf_llama, tmp_path):
  directory, _ = hf_llama
  result = support.launch(['--config=configs/bert.py:tiny', '--mode=import_hf', f'--hf_dir={directory}',
                           f'--workdir={tmp_path / "run"}'])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f"error: {directory} holds a 'llama' model, which configs/gpt.py imports, not the 'bert' config given; drop "
      f"--config (it follows from config.json) or pass --config=configs/gpt.py."]
  assert not os.path.exists(tmp_path / 'run')


def test_imported_llama_matches_transformers_logits_and_greedy_generation(hf_llama, loaded_run):
  _, hf_model = hf_llama
  run = loaded_run
  assert run.config.family == 'gpt' and run.model.config.kv_heads == 2 and not run.model.config.tie_embeddings
  # config.json describes the checkpoint (not the `llama` preset the import started from).
  assert (run.config.model.num_kv_heads, run.config.model.width, run.config.model.rope_scaling) == (2, 32, 'llama3')
  vocab = hf_model.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 20))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = logits_of(run.model, jnp.asarray(tokens))
  difference = max_difference(support.real_logits(ours, vocab), theirs)
  print(f'\nLlama logits (imported via launch.py): max |ours - transformers| = {difference:.2e}')
  assert_close(support.real_logits(ours, vocab), theirs, terms=HF_TERMS)
  prompts = tokens[:, :7]
  with torch.no_grad():
    expected = hf_model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False)[:, 7:].numpy()
  out, _ = generate(run.model, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.key(0),
                    max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
  np.testing.assert_array_equal(out, expected)


def test_import_then_export_is_the_identity_and_loads_in_transformers(hf_llama, loaded_run, tmp_path):
  from safetensors import safe_open
  directory, hf_model = hf_llama
  out = str(tmp_path / 'hf')
  assert loaded_run.export_hf(out)['architecture'] == 'LlamaForCausalLM'
  tensors = []
  for source in (directory, out):
    with safe_open(os.path.join(source, 'model.safetensors'), 'np') as f:
      tensors.append({name: f.get_tensor(name) for name in f.keys()})
  assert sorted(tensors[1]) == sorted(tensors[0])
  for name, value in tensors[0].items():
    assert tensors[1][name].dtype == value.dtype and tensors[1][name].tobytes() == value.tobytes(), name
  with open(os.path.join(directory, 'config.json')) as f, open(os.path.join(out, 'config.json')) as g:
    before, after = json.load(f), json.load(g)
  keys = ['vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
          'num_key_value_heads', 'rms_norm_eps', 'rope_parameters', 'tie_word_embeddings', 'max_position_embeddings']
  assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == 'LlamaForCausalLM'
  tokens = torch.tensor(np.random.default_rng(1).integers(0, hf_model.config.vocab_size, (2, 16)))
  with torch.no_grad():
    exported_logits, original_logits = exported(tokens).logits.numpy(), hf_model(tokens).logits.numpy()
  difference = max_difference(exported_logits, original_logits)
  print(f'\nLlama logits (import -> export, AutoModelForCausalLM): max |exported - original| = {difference:.2e}')
  assert_close(exported_logits, original_logits, terms=HF_TERMS)


def test_trained_scanned_sharded_llama_exports_to_transformers(tmp_path):
  from test_interop import randomize, shard_over_devices, train
  from train.rundir import load_run
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=4, lines=30)
  steps = {f'model.{k}': v for k, v in LLAMA_STEPS.items()}
  workdir = train(support.tiny_gpt_config(corpus), str(tmp_path / 'run'),
                  **steps, **{'model.num_heads': 4, 'model.num_kv_heads': 2, 'model.rope_scaling': 'llama3',
                              'model.scan_layers': True, 'mesh.data': 4, 'mesh.fsdp': 2})
  run = load_run(workdir)
  randomize(run.model)
  shard_over_devices(run.model)
  out = str(tmp_path / 'hf')
  summary = run.export_hf(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert summary['parameters'] == sum(p.numel() for p in model.parameters())
  vocab = run.model.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = support.real_logits(logits_of(run.model, jnp.asarray(tokens)), vocab)
  print(f'\nLlama logits (trained here, scan_layers, FSDP-sharded): max |ours - transformers| = '
        f'{max_difference(ours, theirs):.2e}')
  c = run.model.config
  assert_close(ours, theirs, terms=transformer_terms(c.num_layers, c.width, c.mlp_width, 24, vocab=vocab))


def test_a_gpt_mixing_gpt2_and_llama_steps_has_no_hf_export(tmp_path):
  from interop import gpt_exporter
  from interop.common import HFExportError
  with pytest.raises(HFExportError, match='neither a GPT2LMHeadModel'):
    gpt_exporter(GPT2Config(positions='rope'))
