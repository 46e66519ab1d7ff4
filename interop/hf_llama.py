"""Llama and Hugging Face: read a `LlamaForCausalLM` directory (Llama, SmolLM, TinyLlama, ...) into
`models.gpt.GPT` with the Llama steps, and write such a GPT as one that
`transformers.AutoModelForCausalLM` loads.

HF Llama stores torch `nn.Linear` weights, [out, in]: the transpose of `nnx.Linear.kernel`. Its
rotary embedding pairs the two halves of each head (`rotate_half`), the layout of models/rope.py,
so the query and key projections load with no permutation. The output layer `lm_head.weight`
[V, E] is stored unless `tie_word_embeddings`; like `embed_tokens` it holds the tokenizer's
`vocab_size` rows and our padded rows (`vocab_multiple`) are zeros on import and left out on
export. Scanned models ([num_layers, ...] block parameters) export one `layers.<i>` per layer.

The same layout (embeddings, attention, norms, head) is Mixtral's and Qwen3-MoE's, whose blocks
hold experts instead of one MLP: interop/hf_moe.py builds on `decoder_tensor_names`,
`decoder_fields_from_hf`, `import_decoder` and `export_decoder`, giving each its MLP names and
config entries. `head_dim` (Qwen3's heads are wider than hidden_size / num_attention_heads) is
read and written.

config.json: transformers 5 writes the rotary settings as `rope_parameters` {'rope_type',
'rope_theta', ...}; older files carry `rope_theta` and `rope_scaling`. Both are read; exports write
both, so transformers 4 and 5 load the same angles.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from flax import nnx

from data.tokenizers import HFTokenizer
from interop.common import (HFExportError, HFImportError, ParamPath, TensorName, built_without_parameters,
                            fields_from_hf, fields_to_hf, linear_names, load_tensors, output_directory,
                            read_hf_config, read_tensors, refuse_options_without_counterpart, reject_unused,
                            to_hf_tensors, unscanned_params, write_json, write_safetensors, write_tokenizer)
from interop.hf_gpt2 import OPTIONS_WITHOUT_HF, read_hf_tokenizer
from models.gpt import GPT, GPT2Config

# (config.json key, GPT2Config field, value when the key is missing: None = required).
CONFIG_KEYS = (
    ('vocab_size', 'vocab_size', None), ('max_position_embeddings', 'max_len', None),
    ('num_hidden_layers', 'num_layers', None), ('num_attention_heads', 'num_heads', None),
    ('hidden_size', 'width', None), ('intermediate_size', 'mlp_hidden', None),
    ('rms_norm_eps', 'layer_norm_epsilon', 1e-6), ('tie_word_embeddings', 'tie_embeddings', False))
# Llama 3's rope_scaling entries: (HF key, GPT2Config field).
LLAMA3_KEYS = (('factor', 'rope_factor'), ('low_freq_factor', 'rope_low_freq_factor'),
               ('high_freq_factor', 'rope_high_freq_factor'),
               ('original_max_position_embeddings', 'rope_original_max_len'))
# What a GPT needs to be a LlamaForCausalLM (the other steps are options of both).
LLAMA_STEPS = {'positions': 'rope', 'norm': 'rmsnorm', 'mlp': 'swiglu'}
PROJECTIONS = (('q_proj', 'query'), ('k_proj', 'key'), ('v_proj', 'value'), ('o_proj', 'out'))
MLP_PROJECTIONS = (('gate_proj', 'gate'), ('up_proj', 'up'), ('down_proj', 'down'))


class ImportedDecoder(NamedTuple):
  model: GPT
  tokenizer: HFTokenizer | None
  config: GPT2Config


# (block index, the block's HF prefix 'model.layers.<i>.', our block path) -> the names of its MLP.
MLPNames = Callable[[int, str, ParamPath], list[TensorName]]


def decoder_tensor_names(config: GPT2Config, mlp_names: MLPNames) -> list[TensorName]:
  """Every parameter of an unscanned Llama-style GPT with its HF name, in the layout
  LlamaForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM share; `mlp_names` names each
  block's MLP. Shapes (E width, H*D query and K*D key/value widths): embed_tokens and lm_head
  [V, E], q_proj [H*D, E], o_proj [E, H*D], k_proj and v_proj [K*D, E], q_norm and k_norm [D]
  (qk_norm), the other norms [E]."""
  names = [TensorName('model.embed_tokens.weight', (('token_embedding', 'embedding'),), rows=config.vocab_size)]
  for i in range(config.num_layers):
    hf, block = f'model.layers.{i}.', ('blocks', i)
    attention = block + ('self_attention',)
    names.append(TensorName(hf + 'input_layernorm.weight', (block + ('self_attention_norm', 'scale'),)))
    for hf_name, ours in PROJECTIONS:
      names += linears(config, f'{hf}self_attn.{hf_name}', attention + (ours,))
    if config.qk_norm:
      names += [TensorName(f'{hf}self_attn.{hf_name}.weight', (attention + (ours, 'scale'),))
                for hf_name, ours in (('q_norm', 'query_norm'), ('k_norm', 'key_norm'))]
    names.append(TensorName(hf + 'post_attention_layernorm.weight', (block + ('mlp_norm', 'scale'),)))
    names += mlp_names(i, hf, block)
  names.append(TensorName('model.norm.weight', (('final_norm', 'scale'),)))
  if not config.tie_embeddings:
    names.append(TensorName('lm_head.weight', (('lm_head', 'embedding'),), rows=config.vocab_size))
  return names


def linears(config: GPT2Config, hf: str, ours: ParamPath) -> list[TensorName]:
  """An nnx.Linear's kernel as HF's [out, in] weight, and its bias when the GPT has biases."""
  names = linear_names(hf, ours, transpose=True)
  return names if config.use_bias else names[:1]


def dense_mlp_names(config: GPT2Config, hf: str, ours: ParamPath) -> list[TensorName]:
  """A SwiGLU MLP `ours` (GatedFeedForward) as HF's `hf`gate_proj, up_proj [F, E] and down_proj [E, F]."""
  return [name for hf_name, part in MLP_PROJECTIONS for name in linears(config, hf + hf_name, ours + (part,))]


def tensor_names(config: GPT2Config) -> list[TensorName]:
  """Every parameter of an unscanned Llama-style GPT with its LlamaForCausalLM name (F mlp_hidden:
  gate_proj and up_proj [F, E], down_proj [E, F]; the rest `decoder_tensor_names`)."""
  return decoder_tensor_names(config, lambda i, hf, block: dense_mlp_names(config, hf + 'mlp.', block + ('mlp',)))


# ---------------------------------------------------------------------------------------- import
def rope_fields_from_hf(hf: dict, where: str) -> dict:
  """{'rope_theta', 'rope_scaling', ...} GPT2Config fields from `rope_parameters` (transformers 5)
  or `rope_theta` + `rope_scaling` (earlier files)."""
  rope = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  kind = rope.get('rope_type', rope.get('type', 'default'))
  fields = {'rope_theta': float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))}
  if kind == 'default':
    return {**fields, 'rope_scaling': 'none'}
  if kind != 'llama3':
    raise HFImportError(f"{where}: rope type {kind!r} is not supported (only the default RoPE and 'llama3').")
  scaling = {field: (int if field == 'rope_original_max_len' else float)(rope[key]) for key, field in LLAMA3_KEYS}
  return {**fields, 'rope_scaling': 'llama3', **scaling}


def decoder_fields_from_hf(hf: dict, where: str) -> dict:
  """The GPT2Config fields every Llama-style config.json (`hf`, read from `where`) gives the same
  way: sizes, heads, RoPE, the Llama steps; no dropout."""
  fields = fields_from_hf(hf, CONFIG_KEYS, where)
  if hf.get('hidden_act', 'silu') != 'silu':
    raise HFImportError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (SwiGLU uses 'silu').")
  head_dim = hf.get('head_dim') or fields['width'] // fields['num_heads']
  # head_dim 0 (width / num_heads) unless the file sets another, so a round trip keeps the config as it was.
  return {**fields, **LLAMA_STEPS, **rope_fields_from_hf(hf, where), 'dropout': 0.0,
          'num_kv_heads': hf.get('num_key_value_heads') or fields['num_heads'],
          'head_dim': 0 if head_dim * fields['num_heads'] == fields['width'] else head_dim}


def llama_config_from_hf(hf_dir: str, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128
                         ) -> GPT2Config:
  """GPT2Config with the Llama steps from `hf_dir/config.json`; dtype, attention and the
  vocabulary padding are not stored by HF."""
  hf = read_hf_config(hf_dir, 'llama')
  where = f'{hf_dir}/config.json'
  bias = bool(hf.get('attention_bias', False))
  if bool(hf.get('mlp_bias', False)) != bias:
    raise HFImportError(f'{where}: attention_bias and mlp_bias differ; this GPT has one use_bias for both.')
  return GPT2Config(**decoder_fields_from_hf(hf, where), use_bias=bias, dtype=dtype, attention=attention,
                    vocab_multiple=vocab_multiple)


def import_decoder(hf_dir: str, config: GPT2Config, names: list[TensorName], *, rngs: nnx.Rngs | None,
                   tokenizer: bool) -> ImportedDecoder:
  """A GPT of `config` whose every parameter is read from `hf_dir` by the table `names`, with the
  directory's tokenizer (or None); a tensor the model has no place for is an error (rotary
  inverse-frequency buffers some old checkpoints store are recomputed, not read)."""
  tensors = read_tensors(hf_dir)
  model = built_without_parameters(lambda rngs: GPT(config, rngs=rngs), rngs or nnx.Rngs(0))
  used = load_tensors(model, tensors, names, hf_dir)
  ignored = ('.rotary_emb.inv_freq',) + (('lm_head.weight',) if config.tie_embeddings else ())
  reject_unused(sorted(k for k in tensors if k not in used and not k.endswith(ignored)), hf_dir)
  return ImportedDecoder(model, read_hf_tokenizer(hf_dir) if tokenizer else None, config)


def import_llama(hf_dir: str, *, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128,
                 rngs: nnx.Rngs | None = None, tokenizer: bool = True) -> ImportedDecoder:
  """(model, tokenizer or None, config) read from a Hugging Face LlamaForCausalLM directory."""
  config = llama_config_from_hf(hf_dir, dtype, attention, vocab_multiple)
  return import_decoder(hf_dir, config, tensor_names(config), rngs=rngs, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------- export
def rope_parameters(config: GPT2Config) -> dict:
  """transformers 5's `rope_parameters` for config.json."""
  if config.rope_scaling == 'none':
    return {'rope_type': 'default', 'rope_theta': config.rope_theta}
  return {'rope_type': 'llama3', 'rope_theta': config.rope_theta,
          **{key: getattr(config, field) for key, field in LLAMA3_KEYS}}


def check_llama_steps(config: GPT2Config, architecture: str) -> None:
  """HFExportError unless `config` has the Llama steps every Llama-style HF class computes."""
  mismatched = {k: getattr(config, k) for k, v in LLAMA_STEPS.items() if getattr(config, k) != v}
  if mismatched:
    raise HFExportError(f'A {architecture} needs {LLAMA_STEPS}; this GPT has {mismatched}.')


def export_decoder(model: GPT, tokenizer, out_dir: str, names: list[TensorName], hf_config: dict) -> dict:
  """Write `model` (a Llama-style GPT) by the table `names` and `tokenizer` as an HF directory:
  config.json (the entries every Llama-style class shares, then `hf_config`: 'architectures',
  'model_type' and the class's own), model.safetensors (float32, [out, in] weights) and
  tokenizer.json + tokenizer_config.json.

  `out_dir` must not exist or be empty; it appears complete or not at all. Returns
  {'architecture', 'tensors', 'parameters'}.
  """
  config = model.config
  with output_directory(out_dir) as staging:
    tensors = to_hf_tensors(unscanned_params(model), names)
    rope = rope_parameters(config)
    write_json(staging, 'config.json', {
        **fields_to_hf(config, CONFIG_KEYS), 'intermediate_size': config.mlp_width,
        'num_key_value_heads': config.kv_heads, 'head_dim': config.head_width, 'hidden_act': 'silu',
        'attention_dropout': config.dropout,
        'rope_parameters': rope, 'rope_theta': config.rope_theta,  # transformers 5; 4 reads these two:
        'rope_scaling': None if config.rope_scaling == 'none' else rope,
        'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id,
        'dtype': str(tensors['model.embed_tokens.weight'].dtype), **hf_config})
    write_safetensors(staging, tensors)
    write_tokenizer(staging, tokenizer, max_len=config.max_len, model_input_names=['input_ids', 'attention_mask'],
                    special_tokens={'bos_token': tokenizer.bos_id, 'eos_token': tokenizer.eos_id,
                                    'pad_token': tokenizer.pad_id, 'unk_token': tokenizer.unk_id})
  return {'architecture': hf_config['architectures'][0], 'tensors': len(tensors),
          'parameters': int(sum(t.size for t in tensors.values()))}


def export_llama(model: GPT, tokenizer, out_dir: str) -> dict:
  """Write `model` (a GPT with the Llama steps, LLAMA_STEPS) and `tokenizer` as a LlamaForCausalLM
  directory (`export_decoder`)."""
  config = model.config
  refuse_options_without_counterpart(config, OPTIONS_WITHOUT_HF, 'LlamaForCausalLM')
  check_llama_steps(config, 'LlamaForCausalLM')
  return export_decoder(model, tokenizer, out_dir, tensor_names(config), {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'attention_bias': config.use_bias,
      'mlp_bias': config.use_bias})
