"""Hugging Face interop: import HF checkpoints as our models, export our models as HF directories.

  from interop.hf_gpt2 import import_gpt2, export_gpt2
  from interop.hf_llama import import_llama, export_llama
  from interop.hf_bert import import_bert, export_bert
  from interop import export_run
  export_run(train.rundir.load_run('runs/gpt-...'), 'hf/my-gpt')   # = --mode=export_hf

This package reads and writes files and tokenizers around `models/` (which take arrays only) and
`data/`; it never imports `train/` or `configs/`, and never writes a run config.
"""
from __future__ import annotations

from interop.common import HFExportError, check_target
from interop.hf_bert import export_bert
from interop.hf_gpt2 import GPT2_STEPS, export_gpt2
from interop.hf_llama import LLAMA_STEPS, export_llama

# Families with a Hugging Face counterpart.
EXPORTABLE = ('gpt', 'bert')


def check_export(family: str, out_dir: str) -> None:
  """Raise HFExportError unless a run of `family` can be exported into `out_dir`; cheap, so that
  `--mode=export_hf` calls it before loading the checkpoint."""
  if family not in EXPORTABLE:
    raise HFExportError(f'A {family!r} run has no Hugging Face counterpart: export_hf writes runs of the families '
                        f'{EXPORTABLE}; pass the --workdir of one of those.')
  check_target(out_dir)


def export_run(run, out_dir: str) -> dict:
  """Export a reloaded run (anything with `.model`, `.tokenizer`, `.config` holding `family` and
  `.model_config`, whose `labels` name a BERT classifier's classes) into `out_dir`.

  GPT runs become GPT2LMHeadModel directories, or LlamaForCausalLM ones with the Llama steps (rope
  positions, RMSNorm, SwiGLU); BERT runs BertForPreTraining (pretrain), BertForSequenceClassification
  (classify) or BertModel (features) ones. Returns the exporter's summary.
  """
  check_export(run.config.family, out_dir)
  if run.config.family == 'gpt':
    return gpt_exporter(run.model.config)(run.model, run.tokenizer, out_dir)
  return export_bert(run.model, run.tokenizer, out_dir, labels=list(getattr(run.model_config, 'labels', ())))


def gpt_exporter(config):
  """export_gpt2 or export_llama, whichever architecture the GPT's config is; a GPT mixing the two
  (rope with LayerNorm, say) has no Hugging Face class: HFExportError."""
  if all(getattr(config, name) == value for name, value in LLAMA_STEPS.items()):
    return export_llama
  if all(getattr(config, name) == value for name, value in GPT2_STEPS.items()) and config.kv_heads == config.num_heads:
    return export_gpt2
  has = {name: getattr(config, name) for name in GPT2_STEPS | LLAMA_STEPS} | {'num_kv_heads': config.num_kv_heads}
  raise HFExportError(f'This GPT ({has}) is neither a GPT2LMHeadModel ({GPT2_STEPS}, num_kv_heads=0) nor a '
                      f'LlamaForCausalLM ({LLAMA_STEPS}): export_hf writes one of those two.')
