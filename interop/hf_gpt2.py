"""GPT-2 and Hugging Face: read a GPT-2 directory (config.json, weights, tokenizer) into
`models.gpt.GPT`, and write a GPT as one that `transformers.AutoModelForCausalLM` loads.

HF GPT-2 stores its linear layers as Conv1D with [in, out] weights, the layout of
`nnx.Linear.kernel`; the fused `c_attn` [E, 3E] holds our query, key and value kernels side by
side. The output layer is tied to `wte` and not stored. A GPT with `scan_layers` stacks its block
parameters on a leading [num_layers] axis; the export writes one `h.<i>` per layer all the same.
`wte` holds the tokenizer's `vocab_size` rows; our token embedding's padded rows
(`vocab_multiple`) are zeros on import and left out on export.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import tokenizers
from flax import nnx
from tokenizers import decoders, pre_tokenizers

from data.tokenizers import HFTokenizer
from interop.common import (HFImportError, TensorName, built_without_parameters, fields_from_hf, fields_to_hf,
                            layer_norm_names, linear_names, load_tensors, output_directory, read_hf_config,
                            read_tensors, reading_tokenizer, refuse_options_without_counterpart, reject_unused,
                            to_hf_tensors, unscanned_params, write_json, write_safetensors, write_tokenizer)
from models.gpt import GPT, GPT2Config

# (config.json key, GPT2Config field, value when the key is missing: None = required).
CONFIG_KEYS = (
    ('vocab_size', 'vocab_size', None), ('n_positions', 'max_len', None), ('n_layer', 'num_layers', None),
    ('n_head', 'num_heads', None), ('n_embd', 'width', None), ('resid_pdrop', 'dropout', 0.1),
    ('layer_norm_epsilon', 'layer_norm_epsilon', 1e-5))
# Tensors some GPT-2 checkpoints carry that are no parameters here: causal-mask buffers, the output matrix tied to wte.
_IGNORED = ('lm_head.weight',)
_IGNORED_SUFFIXES = ('.attn.bias', '.attn.masked_bias')
QKV = ('query', 'key', 'value')  # their order in c_attn
# What a GPT needs to be a GPT2LMHeadModel (besides one key/value head per query head).
GPT2_STEPS = {'positions': 'learned', 'norm': 'layernorm', 'mlp': 'gelu', 'use_bias': True, 'tie_embeddings': True}
# The decoder options neither GPT2LMHeadModel nor LlamaForCausalLM has (models/gpt.py), each with the
# test of its being on (experts: interop/hf_moe.py). zero_init_out changes only the initialisation: such models export.
OPTIONS_WITHOUT_HF = {'qk_norm': bool, 'mlp': lambda mlp: mlp == 'relu2', 'logit_softcap': bool, 'moe_experts': bool}


class ImportedGPT2(NamedTuple):
  model: GPT
  tokenizer: HFTokenizer | None
  config: GPT2Config


def tensor_names(config: GPT2Config, prefix: str = '') -> list[TensorName]:
  """Every parameter of an unscanned GPT with its HF name; prefix 'transformer.' for
  GPT2LMHeadModel files, '' for GPT2Model ones. Shapes (E width, F = mlp_ratio * E): wte [V, E],
  wpe [max_len, E], c_attn [E, 3E] and [3E], attn.c_proj [E, E], c_fc [E, F], mlp.c_proj [F, E]."""
  names = [TensorName(prefix + 'wte.weight', (('token_embedding', 'embedding'),), rows=config.vocab_size),
           TensorName(prefix + 'wpe.weight', (('position_embedding', 'embedding'),))]
  for i in range(config.num_layers):
    hf, block = f'{prefix}h.{i}.', ('blocks', i)
    attention = block + ('self_attention',)
    names += layer_norm_names(hf + 'ln_1', block + ('self_attention_norm',))
    names += [TensorName(f'{hf}attn.c_attn.{hf_leaf}', tuple(attention + (part, leaf) for part in QKV))
              for hf_leaf, leaf in (('weight', 'kernel'), ('bias', 'bias'))]
    names += linear_names(hf + 'attn.c_proj', attention + ('out',), transpose=False)
    names += layer_norm_names(hf + 'ln_2', block + ('mlp_norm',))
    names += linear_names(hf + 'mlp.c_fc', block + ('mlp', 'up'), transpose=False)
    names += linear_names(hf + 'mlp.c_proj', block + ('mlp', 'down'), transpose=False)
  return names + layer_norm_names(prefix + 'ln_f', ('final_norm',))


# ---------------------------------------------------------------------------------------- import
def read_hf_tokenizer(hf_dir: str) -> HFTokenizer:
  """The directory's tokenizer.json, or vocab.json + merges.txt, as our byte-level BPE tokenizer."""
  path = os.path.join(hf_dir, 'tokenizer.json')
  if os.path.exists(path):
    with reading_tokenizer(path):
      return HFTokenizer(tokenizers.Tokenizer.from_file(path), 'bpe')
  vocab, merges = os.path.join(hf_dir, 'vocab.json'), os.path.join(hf_dir, 'merges.txt')
  if not (os.path.exists(vocab) and os.path.exists(merges)):
    raise HFImportError(f'No tokenizer in {hf_dir}: expected tokenizer.json or vocab.json + merges.txt.')
  with reading_tokenizer(f'{vocab} with {merges}'):
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab, merges))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  return HFTokenizer(tokenizer, 'bpe')


def gpt2_config_from_hf(hf_dir: str, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128
                        ) -> GPT2Config:
  """GPT2Config from `hf_dir/config.json`; dtype, attention and the vocabulary padding are not stored by HF."""
  hf = read_hf_config(hf_dir, 'gpt2')
  where = os.path.join(hf_dir, 'config.json')
  activation = hf.get('activation_function', 'gelu_new')
  if activation not in ('gelu_new', 'gelu_pytorch_tanh'):
    raise HFImportError(f'{where}: activation_function={activation!r} is not supported (GPT uses tanh-GELU).')
  fields = fields_from_hf(hf, CONFIG_KEYS, where)
  return GPT2Config(**fields, mlp_ratio=(hf.get('n_inner') or 4 * fields['width']) // fields['width'], dtype=dtype,
                    attention=attention, vocab_multiple=vocab_multiple)


def import_gpt2(hf_dir: str, *, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128,
                rngs: nnx.Rngs | None = None, tokenizer: bool = True) -> ImportedGPT2:
  """(model, tokenizer or None, config) read from a Hugging Face GPT-2 directory.

  `rngs` seeds the dropout stream (the parameters all come from the checkpoint). Every parameter
  is filled; a tensor the model has no place for is an error. `vocab_multiple` pads the token
  embedding (as run configs do, see models/layers.py).
  """
  config = gpt2_config_from_hf(hf_dir, dtype, attention, vocab_multiple)
  tensors = {k.removeprefix('transformer.'): v for k, v in read_tensors(hf_dir).items()}
  model = built_without_parameters(lambda rngs: GPT(config, rngs=rngs), rngs or nnx.Rngs(0))
  used = load_tensors(model, tensors, tensor_names(config), hf_dir)
  reject_unused(sorted(k for k in tensors if k not in used and k not in _IGNORED and not k.endswith(_IGNORED_SUFFIXES)),
                hf_dir)
  return ImportedGPT2(model, read_hf_tokenizer(hf_dir) if tokenizer else None, config)


# ---------------------------------------------------------------------------------------- export
def export_gpt2(model: GPT, tokenizer, out_dir: str) -> dict:
  """Write `model` and `tokenizer` as a GPT2LMHeadModel directory: config.json, model.safetensors
  (float32, [in, out] Conv1D weights, `c_attn` [E, 3E]) and tokenizer.json + tokenizer_config.json.

  `out_dir` must not exist or be empty; it appears complete or not at all. Returns
  {'architecture', 'tensors', 'parameters'}.
  """
  config = model.config
  refuse_options_without_counterpart(config, OPTIONS_WITHOUT_HF, 'GPT2LMHeadModel')
  with output_directory(out_dir) as staging:
    tensors = to_hf_tensors(unscanned_params(model), tensor_names(config, 'transformer.'))
    write_json(staging, 'config.json', {
        'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', **fields_to_hf(config, CONFIG_KEYS),
        # One dropout rate serves embeddings, attention weights and residual branches here.
        'embd_pdrop': config.dropout, 'attn_pdrop': config.dropout, 'n_inner': config.mlp_ratio * config.width,
        'activation_function': 'gelu_new', 'tie_word_embeddings': True,
        'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id,
        'dtype': str(tensors['transformer.wte.weight'].dtype)})
    write_safetensors(staging, tensors)
    # GPT2Model adds wte(token_type_ids) when given them: the tokenizer must not produce any.
    write_tokenizer(staging, tokenizer, max_len=config.max_len, model_input_names=['input_ids', 'attention_mask'],
                    special_tokens={'bos_token': tokenizer.bos_id, 'eos_token': tokenizer.eos_id,
                                    'pad_token': tokenizer.pad_id, 'unk_token': tokenizer.unk_id})
  return {'architecture': 'GPT2LMHeadModel', 'tensors': len(tensors),
          'parameters': int(sum(t.size for t in tensors.values()))}
