"""Mixtral and Qwen3-MoE and Hugging Face: random MixtralForCausalLM and Qwen3MoeForCausalLM
checkpoints (every parameter random, norms and routers included) imported (the Mixtral through
launch.py without --config) give transformers' logits and its greedy generation token for token; their export
rewrites every tensor byte for byte and loads in AutoModelForCausalLM; a run with experts trained
here (scanned, FSDP-sharded) exports with transformers' logits; a GPT with experts that neither
class computes is refused in one line before anything is written."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from numerics import assert_close, transformer_terms

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

LLAMA_STEPS = dict(positions='rope', norm='rmsnorm', mlp='swiglu', use_bias=False)
# 2 blocks of width 32 over <= 20 tokens; an MoE block's output sums 2 experts' down projections,
# each over its hidden width (<= 48 with the dense blocks').
TERMS = transformer_terms(2, 32, 2 * 48, 20)
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=2, bos_token_id=None,
             eos_token_id=None, pad_token_id=0)
# Mixtral: 4 experts 24 wide in both blocks, untied. Qwen3-MoE: heads 16 wide (4 x 16 != 32), QK-norm,
# experts in block 1 only (decoder_sparse_step=2; block 0 a dense SwiGLU 48 wide), the chosen
# probabilities not renormalised, tied embeddings.
HF_CONFIGS = {
    'mixtral': lambda vocab: transformers.MixtralConfig(
        vocab_size=vocab, intermediate_size=24, num_local_experts=4, tie_word_embeddings=False, **SIZES),
    'qwen3_moe': lambda vocab: transformers.Qwen3MoeConfig(
        vocab_size=vocab, intermediate_size=48, moe_intermediate_size=16, num_experts=4, head_dim=16,
        decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True, **SIZES),
}
FIELDS = {  # what the imported run's config.json says of the model
    'mixtral': dict(moe_experts=4, moe_top_k=2, moe_hidden=24, moe_every=1, moe_norm_topk_prob=True, qk_norm=False,
                    head_dim=0, tie_embeddings=False),
    'qwen3_moe': dict(moe_experts=4, moe_top_k=2, moe_hidden=16, moe_every=2, moe_norm_topk_prob=False, qk_norm=True,
                      head_dim=16, mlp_hidden=48, tie_embeddings=True),
}
ARCHITECTURES = {'mixtral': 'MixtralForCausalLM', 'qwen3_moe': 'Qwen3MoeForCausalLM'}
CONFIG_ATTRIBUTES = {model_type: ['vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                                  'num_attention_heads', 'num_key_value_heads', 'rms_norm_eps',
                                  'rope_parameters', 'tie_word_embeddings', 'max_position_embeddings', 'sliding_window',
                                  'num_local_experts', 'num_experts_per_tok'] + extra
                     for model_type, extra in (('mixtral', []), ('qwen3_moe', [
                         'head_dim', 'moe_intermediate_size', 'decoder_sparse_step', 'mlp_only_layers',
                         'norm_topk_prob']))}


def max_difference(ours, theirs) -> float:
  return float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))))


@pytest.fixture(scope='module', params=sorted(HF_CONFIGS))
def hf_moe(request, tmp_path_factory):
  """(model_type, directory, model): a random transformers model with its tokenizer, saved by transformers."""
  from data.tokenizers import train_bpe
  model_type = request.param
  directory = str(tmp_path_factory.mktemp(model_type))
  bpe = train_bpe(['def foo(x):\n    return x + 1\n' * 20, 'hello world, hello there'], vocab_size=300)
  bpe.tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[model_type](bpe.vocab_size))
  with torch.no_grad():
    for p in model.parameters():  # norms and routers too: a tensor under the wrong name must show
      p.normal_(0.0, 0.2)
  model.eval().save_pretrained(directory)
  return model_type, directory, model


@pytest.fixture(scope='module')
def imported_run(hf_moe, tmp_path_factory):
  """The run imported from `hf_moe`: the Mixtral through launch.py without --config (the config its
  model_type names), the Qwen3-MoE in-process by what launch.py calls with that config (the same
  gpt:moe preset), one launch.py process fewer."""
  from configs import gpt
  from train.trainer import import_hf_run
  model_type, directory, _ = hf_moe
  workdir = str(tmp_path_factory.mktemp(f'imported_{model_type}') / 'run')
  if model_type == 'mixtral':
    result = support.launch(['--mode=import_hf', f'--hf_dir={directory}', f'--workdir={workdir}'])
    assert result.returncode == 0, result.stderr[-2000:]
  else:
    import_hf_run(gpt.get_config(gpt.HF_MODEL_TYPES[model_type]), directory, workdir)
  return workdir


@pytest.fixture(scope='module')
def loaded_run(imported_run):
  """`load_run(imported_run)`, reloaded once for the tests that read it (none changes its model)."""
  from train.rundir import load_run
  return load_run(imported_run)


def test_imported_moe_matches_transformers_logits_and_greedy_generation(hf_moe, loaded_run):
  from models.gpt import generate
  model_type, _, hf_model = hf_moe
  run = loaded_run
  assert run.config.family == 'gpt'
  assert {key: run.config.model[key] for key in FIELDS[model_type]} == FIELDS[model_type]
  vocab = hf_model.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 20))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = support.real_logits(support.compiled_call(run.model, jnp.asarray(tokens))[0], vocab)
  print(f'\n{ARCHITECTURES[model_type]} logits (imported): max |ours - transformers| = '
        f'{max_difference(ours, theirs):.2e}')
  assert_close(ours, theirs, terms=TERMS)
  prompts = tokens[:, :7]
  with torch.no_grad():
    expected = hf_model.generate(torch.tensor(prompts), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False)[:, 7:].numpy()
  out, _ = generate(run.model, jnp.asarray(prompts), jnp.ones(prompts.shape, bool), jax.random.key(0),
                    max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0, eos_id=None, pad_id=0)
  np.testing.assert_array_equal(out, expected)


def test_import_then_export_is_the_identity_and_loads_in_transformers(hf_moe, loaded_run, tmp_path):
  from safetensors import safe_open
  model_type, directory, hf_model = hf_moe
  out = str(tmp_path / 'hf')
  summary = loaded_run.export_hf(out)
  assert summary['architecture'] == ARCHITECTURES[model_type]
  assert summary['parameters'] == sum(p.numel() for p in hf_model.parameters())
  tensors = []
  for source in (directory, out):
    with safe_open(os.path.join(source, 'model.safetensors'), 'np') as f:
      tensors.append({name: f.get_tensor(name) for name in f.keys()})
  assert sorted(tensors[1]) == sorted(tensors[0])
  assert any('.experts.3.' in name for name in tensors[0])  # one tensor per expert, as transformers saves them
  for name, value in tensors[0].items():
    assert tensors[1][name].dtype == value.dtype and tensors[1][name].tobytes() == value.tobytes(), name
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(exported).__name__ == ARCHITECTURES[model_type]
  # transformers' reading of each config.json (Qwen3-MoE's expert count is num_experts in the export,
  # num_local_experts in transformers 5's file: the class reads both).
  assert {k: getattr(exported.config, k) for k in CONFIG_ATTRIBUTES[model_type]} == {
      k: getattr(hf_model.config, k) for k in CONFIG_ATTRIBUTES[model_type]}
  tokens = torch.tensor(np.random.default_rng(1).integers(0, hf_model.config.vocab_size, (2, 16)))
  with torch.no_grad():
    exported_logits, original_logits = exported(tokens).logits.numpy(), hf_model(tokens).logits.numpy()
  print(f'\n{ARCHITECTURES[model_type]} logits (import -> export, AutoModelForCausalLM): max |exported - original| '
        f'= {max_difference(exported_logits, original_logits):.2e}')
  np.testing.assert_array_equal(exported_logits, original_logits)  # the same tensors through the same code


def test_trained_scanned_sharded_moe_exports_to_transformers(tmp_path):
  from test_interop import randomize, shard_over_devices, train
  from train.rundir import load_run
  corpus = support.write_corpus(str(tmp_path / 'corpus'), files=4, lines=30)
  model = {**LLAMA_STEPS, 'num_heads': 4, 'num_kv_heads': 2, 'tie_embeddings': False, 'moe_experts': 4,
           'moe_top_k': 2, 'moe_hidden': 24, 'scan_layers': True}
  workdir = train(support.tiny_gpt_config(corpus), str(tmp_path / 'run'),
                  **{f'model.{k}': v for k, v in model.items()}, **{'mesh.data': 4, 'mesh.fsdp': 2})
  run = load_run(workdir)
  randomize(run.model)
  shard_over_devices(run.model)
  assert not run.model.blocks.mlp.up[...].sharding.is_fully_replicated
  out = str(tmp_path / 'hf')
  summary = run.export_hf(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(model).__name__ == summary['architecture'] == 'MixtralForCausalLM'
  assert summary['parameters'] == sum(p.numel() for p in model.parameters())
  vocab = run.model.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 20))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = support.real_logits(support.compiled_call(run.model, jnp.asarray(tokens))[0], vocab)
  print(f'\nMixtral logits (trained here, scan_layers, FSDP-sharded): max |ours - transformers| = '
        f'{max_difference(ours, theirs):.2e}')
  c = run.model.config
  assert_close(ours, theirs, terms=transformer_terms(c.num_layers, c.width, 2 * c.expert_width, 20, vocab=vocab))


# A GPT with experts that neither class computes: (its options, the one line export_hf gives).
REFUSED = {
    'shared experts': (dict(moe_shared_experts=1), "model.moe_shared_experts=1 has no counterpart in Hugging Face's "
                                                   "MixtralForCausalLM"),
    'router bias': (dict(qk_norm=True, moe_router_bias=True), "model.moe_router_bias=True has no counterpart in "
                                                              "Hugging Face's Qwen3MoeForCausalLM"),
    'dense blocks without QK-norm': (dict(num_layers=2, moe_every=2), "model.moe_every=2 has no counterpart in "
                                                                      "Hugging Face's MixtralForCausalLM"),
    'weights not renormalised without QK-norm': (dict(moe_norm_topk_prob=False), "model.moe_norm_topk_prob=False has "
                                                 "no counterpart in Hugging Face's MixtralForCausalLM"),
    'biases': (dict(use_bias=True), "model.use_bias=True has no counterpart in Hugging Face's MixtralForCausalLM"),
    'soft cap': (dict(qk_norm=True, logit_softcap=30.0), "model.logit_softcap=30.0 has no counterpart in Hugging "
                                                         "Face's Qwen3MoeForCausalLM"),
    'GPT-2 experts': (dict(mlp='gelu'), "A MixtralForCausalLM needs {'positions': 'rope', 'norm': 'rmsnorm', "
                                        "'mlp': 'swiglu'}; this GPT has {'mlp': 'gelu'}."),
}


@pytest.mark.parametrize('case', list(REFUSED))
def test_a_gpt_with_experts_neither_class_computes_is_refused_in_one_line(case, tmp_path):
  from data.tokenizers import CharTokenizer
  from errors import UserError
  from interop import gpt_exporter
  from interop.hf_moe import export_moe
  from models.gpt import GPT, GPT2Config
  options, message = REFUSED[case]
  config = GPT2Config(**{**dict(vocab_size=40, max_len=16, num_layers=1, num_heads=2, width=16, moe_experts=4),
                         **LLAMA_STEPS, **options})
  with pytest.raises(UserError) as error:
    gpt_exporter(config)
  assert str(error.value).startswith(message) and '\n' not in str(error.value)
  # The model built abstractly: the refusal reads its config alone, before any parameter value (a model that got
  # further would fail otherwise, not with the message).
  with pytest.raises(UserError, match='^' + message.replace('(', r'\(').replace('{', r'\{')):
    export_moe(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))), CharTokenizer('abcdefghijklmnopqrstuvwxyz'),
               str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()
