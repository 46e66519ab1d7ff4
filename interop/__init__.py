"""Hugging Face interop: import HF checkpoints as our models, export our models as HF directories.

  from interop.hf_gpt2 import import_gpt2, export_gpt2
  from interop.hf_llama import import_llama, export_llama
  from interop.hf_moe import import_moe, export_moe      # Mixtral, Qwen3-MoE
  from interop.hf_bert import import_bert, export_bert
  train.rundir.load_run('runs/gpt-...').export_hf('hf/my-gpt')   # = --mode=export_hf (the family's Task.export_hf)

This package reads and writes files and tokenizers around `models/` (which take arrays only) and
`data/`; it never imports `train/` or `configs/`, and never writes a run config.
"""
from __future__ import annotations

from interop.common import HFExportError, refuse_options_without_counterpart
from interop.hf_gpt2 import GPT2_STEPS, OPTIONS_WITHOUT_HF, export_gpt2, import_gpt2
from interop.hf_llama import LLAMA_STEPS, export_llama, import_llama
from interop.hf_moe import ARCHITECTURES, export_moe, import_moe, moe_architecture

# A GPT-family config.json's model_type -> its importer (a file naming none is read as GPT-2).
GPT_IMPORTERS = {'gpt2': import_gpt2, 'llama': import_llama, **{model_type: import_moe for model_type in ARCHITECTURES}}


def gpt_exporter(config):
  """export_gpt2, export_llama or (a GPT with experts) export_moe, whichever architecture the GPT's
  config is; a GPT mixing GPT-2 and Llama steps (rope with LayerNorm, say), or using an option its
  class lacks (qk_norm without experts, mlp='relu2', logit_softcap, shared experts, ...), has no
  Hugging Face class: HFExportError."""
  if config.moe_experts:
    moe_architecture(config)  # its HFExportError now, before any file is written
    return export_moe
  refuse_options_without_counterpart(config, OPTIONS_WITHOUT_HF, 'GPT2LMHeadModel or LlamaForCausalLM')
  if all(getattr(config, name) == value for name, value in LLAMA_STEPS.items()):
    return export_llama
  if all(getattr(config, name) == value for name, value in GPT2_STEPS.items()) and config.kv_heads == config.num_heads:
    return export_gpt2
  has = {name: getattr(config, name) for name in GPT2_STEPS | LLAMA_STEPS} | {'num_kv_heads': config.num_kv_heads}
  raise HFExportError(f'This GPT ({has}) is neither a GPT2LMHeadModel ({GPT2_STEPS}, num_kv_heads=0) nor a '
                      f'LlamaForCausalLM ({LLAMA_STEPS}): export_hf writes one of those two.')
