"""Mixtral, Qwen3-MoE and Hugging Face: read a `MixtralForCausalLM` or `Qwen3MoeForCausalLM`
directory into `models.gpt.GPT` with the Llama steps and experts (models/moe.py), and write such a
GPT as one that `transformers.AutoModelForCausalLM` loads.

Both are Llama-style decoders (interop/hf_llama.py: embeddings, attention, norms and head are
named and configured as there) whose blocks route each token to k of N SwiGLU experts:
softmax over the router's logits, the k most probable experts, their probabilities as weights
(renormalised to sum to 1: always in Mixtral, with `norm_topk_prob` in Qwen3-MoE), as
`MoEFeedForward` computes. Files hold one [out, in] tensor per expert and matrix
(`experts.<n>.w1/w3/w2` in Mixtral's `block_sparse_moe`, `experts.<n>.gate_proj/up_proj/down_proj`
in Qwen3-MoE's `mlp`; transformers 5 fuses them in memory, not on disk) and the router as
`gate.weight` [N, E]; ours stack the experts on a leading [N] axis: gate and up [N, E, H], down
[N, H, E], router kernel [E, N].

Qwen3-MoE adds RMSNorm of each query and key head (`qk_norm`, a [D] scale each, its heads
`head_dim` wide), `norm_topk_prob`, and dense SwiGLU blocks `intermediate_size` wide between the
MoE ones: every `decoder_sparse_step`-th block holds experts (`moe_every`); `mlp_only_layers`
making other blocks dense has no counterpart here. A sliding window shorter than
`max_position_embeddings` is refused (this GPT attends to every earlier token), as are attention
biases (no released Qwen3-MoE has them). Training settings (`router_aux_loss_coef`,
`router_jitter_noise`, `output_router_logits`) do not change the model and are not read; exports
write transformers' defaults. The export's class follows `qk_norm`: Qwen3-MoE with it, Mixtral
without; shared experts and the auxiliary-loss-free router bias have no counterpart in either.
A capacity factor exports: transformers computes every token, as `moe_capacity_factor=0` does here.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from flax import nnx

from interop.common import HFImportError, ParamPath, TensorName, read_hf_config, refuse_options_without_counterpart
from interop.hf_llama import (MLP_PROJECTIONS, ImportedDecoder, check_llama_steps, decoder_fields_from_hf,
                              decoder_tensor_names, dense_mlp_names, export_decoder, import_decoder)
from models.gpt import GPT, GPT2Config


def experts_and_top_k(hf: dict, where: str) -> dict:
  """moe_experts and moe_top_k from config.json (`hf`, read from `where`); transformers 5 writes the
  expert count as num_local_experts for both classes, Qwen3-MoE's own files as num_experts."""
  experts, top_k = hf.get('num_local_experts', hf.get('num_experts')), hf.get('num_experts_per_tok')
  if not experts or not top_k:
    raise HFImportError(f'{where} lacks num_local_experts (or num_experts) or num_experts_per_tok: the experts of '
                        f'a mixture of experts. A complete Hugging Face config.json has them; download it again.')
  if not 1 <= top_k <= experts:
    raise HFImportError(f'{where}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts; the '
                        f'config.json is damaged: download it again.')
  return {'moe_experts': experts, 'moe_top_k': top_k}


def refuse_sliding_window(window: int | None, max_len: int, where: str) -> None:
  """HFImportError when a sliding `window` would cut attention within `max_len` tokens."""
  if window is not None and window < max_len:
    raise HFImportError(f'{where}: sliding_window={window} is shorter than max_position_embeddings={max_len}, and '
                        f'this GPT attends to every earlier token; to import it for sequences of at most {window} '
                        f'tokens (where the window cuts nothing), set max_position_embeddings to {window}.')


def mixtral_fields(hf: dict, decoder: dict, where: str) -> dict:
  """The MoE fields of a MixtralForCausalLM config.json: experts `intermediate_size` wide in every block."""
  refuse_sliding_window(hf.get('sliding_window'), decoder['max_len'], where)
  return {**experts_and_top_k(hf, where), 'moe_hidden': decoder['mlp_hidden'], 'moe_norm_topk_prob': True,
          'use_bias': False}


def mixtral_to_hf(config: GPT2Config) -> dict:
  return {'intermediate_size': config.expert_width, 'num_local_experts': config.moe_experts,
          'num_experts_per_tok': config.moe_top_k, 'sliding_window': None, 'router_jitter_noise': 0.0}


def qwen3_moe_fields(hf: dict, decoder: dict, where: str) -> dict:
  """The MoE fields of a Qwen3MoeForCausalLM config.json: experts `moe_intermediate_size` wide in
  every `decoder_sparse_step`-th block, QK-norm."""
  refuse_sliding_window(hf.get('sliding_window') if hf.get('use_sliding_window') else None, decoder['max_len'], where)
  if hf.get('attention_bias'):
    raise HFImportError(f'{where}: attention_bias=true is not supported for Qwen3-MoE (its MLPs have no biases, and '
                        f'this GPT has one use_bias for both).')
  if hf.get('moe_intermediate_size') is None:
    raise HFImportError(f"{where} lacks moe_intermediate_size: the experts' width. A complete Hugging Face "
                        f'config.json has it; download it again.')
  step = hf.get('decoder_sparse_step', 1)
  if not 1 <= step <= decoder['num_layers']:
    raise HFImportError(f"{where}: decoder_sparse_step={step} must be between 1 and num_hidden_layers="
                        f"{decoder['num_layers']} (every decoder_sparse_step-th block holds experts).")
  dense = sorted(i for i in hf.get('mlp_only_layers') or [] if (i + 1) % step == 0)
  if dense:
    raise HFImportError(f'{where}: mlp_only_layers={hf["mlp_only_layers"]} makes blocks {dense} dense, which '
                        f'decoder_sparse_step={step} gives experts; this GPT places experts only every moe_every-th '
                        f'block (decoder_sparse_step), so such a model cannot be imported.')
  return {**experts_and_top_k(hf, where), 'moe_hidden': hf['moe_intermediate_size'], 'moe_every': step,
          'moe_norm_topk_prob': bool(hf.get('norm_topk_prob', False)), 'qk_norm': True, 'use_bias': False}


def qwen3_moe_to_hf(config: GPT2Config) -> dict:
  return {'moe_intermediate_size': config.expert_width, 'num_experts': config.moe_experts,
          'num_experts_per_tok': config.moe_top_k, 'norm_topk_prob': config.moe_norm_topk_prob,
          'decoder_sparse_step': config.moe_every, 'mlp_only_layers': [], 'attention_bias': False,
          'use_sliding_window': False, 'sliding_window': None}


class MoEArchitecture(NamedTuple):
  """One transformers mixture-of-experts class and how its files differ from the other's."""
  name: str  # the transformers class
  model_type: str
  layer: str  # the MoE layer's name in an HF block
  experts: tuple[tuple[str, str], ...]  # (HF name, our parameter) of each expert's matrices
  options_without_hf: dict  # for refuse_options_without_counterpart
  fields_from_hf: Callable[[dict, dict, str], dict]  # (config.json, decoder_fields_from_hf, where) -> MoE fields
  fields_to_hf: Callable[[GPT2Config], dict]  # its config.json entries besides the Llama-style ones


# The options neither class has (the Llama steps are checked apart: check_llama_steps).
WITHOUT_HF = {'logit_softcap': bool, 'use_bias': bool, 'moe_shared_experts': bool, 'moe_router_bias': bool}
MIXTRAL = MoEArchitecture(
    'MixtralForCausalLM', 'mixtral', 'block_sparse_moe.', (('w1', 'gate'), ('w3', 'up'), ('w2', 'down')),
    {**WITHOUT_HF, 'moe_every': lambda every: every != 1, 'moe_norm_topk_prob': lambda norm: not norm},
    mixtral_fields, mixtral_to_hf)
QWEN3_MOE = MoEArchitecture('Qwen3MoeForCausalLM', 'qwen3_moe', 'mlp.', MLP_PROJECTIONS, WITHOUT_HF, qwen3_moe_fields,
                            qwen3_moe_to_hf)
ARCHITECTURES = {architecture.model_type: architecture for architecture in (MIXTRAL, QWEN3_MOE)}


def tensor_names(config: GPT2Config, architecture: MoEArchitecture) -> list[TensorName]:
  """Every parameter of an unscanned Llama-style GPT with experts with its HF name in
  `architecture`: per MoE block the router gate.weight [N, E] and N experts' gate and up [H, E] and
  down [E, H] (H the experts' width); dense blocks as in LlamaForCausalLM."""
  def mlp_names(index: int, hf: str, block: ParamPath) -> list[TensorName]:
    mlp = block + ('mlp',)
    if not config.is_moe_block(index):
      return dense_mlp_names(config, hf + 'mlp.', mlp)
    hf += architecture.layer
    return [TensorName(hf + 'gate.weight', (mlp + ('router', 'kernel'),), transpose=True)] + [
        TensorName(f'{hf}experts.{n}.{hf_name}.weight', (mlp + (ours,),), transpose=True, expert=n)
        for n in range(config.moe_experts) for hf_name, ours in architecture.experts]
  return decoder_tensor_names(config, mlp_names)


# ---------------------------------------------------------------------------------------- import
def moe_config_from_hf(hf_dir: str, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128
                       ) -> tuple[GPT2Config, MoEArchitecture]:
  """GPT2Config with the Llama steps and experts from `hf_dir/config.json` (Mixtral or Qwen3-MoE, by
  its model_type), and that architecture; dtype, attention and the vocabulary padding are not stored by HF."""
  hf = read_hf_config(hf_dir)
  where = f'{hf_dir}/config.json'
  architecture = ARCHITECTURES.get(hf.get('model_type'))
  if architecture is None:
    raise HFImportError(f"{where} describes a {hf.get('model_type')!r} model, not one of {sorted(ARCHITECTURES)}.")
  decoder = decoder_fields_from_hf(hf, where)
  config = GPT2Config(**{**decoder, **architecture.fields_from_hf(hf, decoder, where)}, dtype=dtype,
                      attention=attention, vocab_multiple=vocab_multiple)
  return config, architecture


def import_moe(hf_dir: str, *, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128,
               rngs: nnx.Rngs | None = None, tokenizer: bool = True) -> ImportedDecoder:
  """(model, tokenizer or None, config) read from a Hugging Face MixtralForCausalLM or
  Qwen3MoeForCausalLM directory; every parameter is filled from the checkpoint, and a tensor the
  model has no place for is an error."""
  config, architecture = moe_config_from_hf(hf_dir, dtype, attention, vocab_multiple)
  return import_decoder(hf_dir, config, tensor_names(config, architecture), rngs=rngs, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------- export
def moe_architecture(config: GPT2Config) -> MoEArchitecture:
  """The class a GPT with experts exports as: Qwen3MoeForCausalLM with qk_norm, MixtralForCausalLM
  without. HFExportError naming the first option that class lacks."""
  architecture = QWEN3_MOE if config.qk_norm else MIXTRAL
  check_llama_steps(config, architecture.name)
  refuse_options_without_counterpart(config, architecture.options_without_hf, architecture.name)
  return architecture


def export_moe(model: GPT, tokenizer, out_dir: str) -> dict:
  """Write `model` (a GPT with the Llama steps and experts) and `tokenizer` as a MixtralForCausalLM
  or Qwen3MoeForCausalLM directory (`moe_architecture`; the files as interop/hf_llama.py's
  `export_decoder` writes them). Returns {'architecture', 'tensors', 'parameters'}."""
  config = model.config
  architecture = moe_architecture(config)
  return export_decoder(model, tokenizer, out_dir, tensor_names(config, architecture), {
      'architectures': [architecture.name], 'model_type': architecture.model_type,
      **architecture.fields_to_hf(config)})
