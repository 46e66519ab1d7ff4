"""Read a Hugging Face GPT-2 directory (config.json, model.safetensors, tokenizer) into `models.gpt.GPT`.

HF GPT-2 stores its linear layers as Conv1D with [in, out] weights, the same layout as
`nnx.Linear.kernel`; the fused `c_attn` [E, 3E] is split into our query, key and value.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.gpt import GPT, GPT2Config


def read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  path = os.path.join(hf_dir, 'model.safetensors')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} not found: save the model with save_pretrained(..., safe_serialization=True).')
  return load_file(path)


def read_hf_tokenizer(hf_dir: str):
  """The directory's tokenizer.json, or vocab.json + merges.txt, as our byte-level BPE tokenizer."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  from data.tokenizers import HFTokenizer
  path = os.path.join(hf_dir, 'tokenizer.json')
  if os.path.exists(path):
    return HFTokenizer(tokenizers.Tokenizer.from_file(path), 'bpe')
  vocab, merges = os.path.join(hf_dir, 'vocab.json'), os.path.join(hf_dir, 'merges.txt')
  if not (os.path.exists(vocab) and os.path.exists(merges)):
    raise FileNotFoundError(f'No tokenizer in {hf_dir}: expected tokenizer.json or vocab.json + merges.txt.')
  tokenizer = tokenizers.Tokenizer(models.BPE.from_file(vocab, merges))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  return HFTokenizer(tokenizer, 'bpe')


def gpt2_config_from_hf(hf_dir: str, dtype: str = 'float32', attention: str = 'xla') -> GPT2Config:
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} not found: --hf_dir must be a Hugging Face GPT-2 directory.')
  with open(path) as f:
    hf = json.load(f)
  if hf.get('model_type') not in (None, 'gpt2'):
    raise ValueError(f"{path} describes a {hf.get('model_type')!r} model, not 'gpt2'; use that family's config.")
  activation = hf.get('activation_function', 'gelu_new')
  if activation not in ('gelu_new', 'gelu_pytorch_tanh'):
    raise ValueError(f'{path}: activation_function={activation!r} is not supported (GPT uses tanh-GELU).')
  return GPT2Config(vocab_size=hf['vocab_size'], max_len=hf['n_positions'], num_layers=hf['n_layer'],
                    num_heads=hf['n_head'], width=hf['n_embd'], mlp_ratio=(hf.get('n_inner') or 4 * hf['n_embd'])
                    // hf['n_embd'], dropout=hf.get('resid_pdrop', 0.1),
                    layer_norm_epsilon=hf.get('layer_norm_epsilon', 1e-5), dtype=dtype, attention=attention)


def load_gpt2_weights(model: GPT, weights: dict[str, np.ndarray]) -> None:
  """Copy HF GPT-2 tensors into `model` in place; every model parameter must be filled."""
  weights = {k.removeprefix('transformer.'): v for k, v in weights.items()}
  used = set()

  def take(name):
    if name not in weights:
      raise ValueError(f'The checkpoint lacks {name!r}; is it a GPT-2 checkpoint of this size?')
    used.add(name)
    return jnp.asarray(weights[name], jnp.float32)

  def assign(variable, value):
    if variable.shape != value.shape:
      raise ValueError(f'Shape mismatch: checkpoint {value.shape} vs model {variable.shape}.')
    variable[...] = value

  assign(model.token_embedding.embedding, take('wte.weight'))
  assign(model.position_embedding.embedding, take('wpe.weight'))
  width = model.config.width
  for i, block in enumerate(model.blocks):
    prefix = f'h.{i}.'
    assign(block.self_attention_norm.scale, take(prefix + 'ln_1.weight'))
    assign(block.self_attention_norm.bias, take(prefix + 'ln_1.bias'))
    qkv_kernel, qkv_bias = take(prefix + 'attn.c_attn.weight'), take(prefix + 'attn.c_attn.bias')
    attention = block.self_attention
    for j, linear in enumerate((attention.query, attention.key, attention.value)):
      assign(linear.kernel, qkv_kernel[:, j * width:(j + 1) * width])
      assign(linear.bias, qkv_bias[j * width:(j + 1) * width])
    assign(attention.out.kernel, take(prefix + 'attn.c_proj.weight'))
    assign(attention.out.bias, take(prefix + 'attn.c_proj.bias'))
    assign(block.mlp_norm.scale, take(prefix + 'ln_2.weight'))
    assign(block.mlp_norm.bias, take(prefix + 'ln_2.bias'))
    assign(block.mlp.up.kernel, take(prefix + 'mlp.c_fc.weight'))
    assign(block.mlp.up.bias, take(prefix + 'mlp.c_fc.bias'))
    assign(block.mlp.down.kernel, take(prefix + 'mlp.c_proj.weight'))
    assign(block.mlp.down.bias, take(prefix + 'mlp.c_proj.bias'))
  assign(model.final_norm.scale, take('ln_f.weight'))
  assign(model.final_norm.bias, take('ln_f.bias'))
  unused = {k for k in weights if k not in used and not k.endswith('attn.bias') and not k.endswith('masked_bias')
            and k != 'lm_head.weight'}
  if unused:
    raise ValueError(f'The checkpoint has tensors this GPT does not use: {sorted(unused)[:5]}...')


def load_hf_gpt2(hf_dir: str, config) -> tuple[GPT, object]:
  """(model, tokenizer) from `hf_dir`; updates `config.model` / `config.data` to the checkpoint's sizes."""
  gpt_config = gpt2_config_from_hf(hf_dir, dtype=config.model.dtype, attention='xla')
  tokenizer = read_hf_tokenizer(hf_dir)
  weights = read_safetensors(hf_dir)
  model = GPT(gpt_config, rngs=nnx.Rngs(params=0, dropout=config.seed))
  load_gpt2_weights(model, weights)
  config.model.dropout = gpt_config.dropout
  config.model.num_layers = gpt_config.num_layers
  config.model.num_heads = gpt_config.num_heads
  config.model.width = gpt_config.width
  config.model.mlp_ratio = gpt_config.mlp_ratio
  config.model.max_len = gpt_config.max_len
  config.model.layer_norm_epsilon = gpt_config.layer_norm_epsilon
  config.model.vocab_size = gpt_config.vocab_size
  config.data.tokenizer = 'bpe'
  config.data.vocab_size = gpt_config.vocab_size
  config.data.seq_len = min(config.data.seq_len, gpt_config.max_len)
  return model, tokenizer
