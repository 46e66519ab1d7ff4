"""Hugging Face interop: import HF checkpoints as our models, export our models as HF directories.

  from interop.hf_gpt2 import import_gpt2, export_gpt2
  from interop.hf_bert import import_bert, export_bert
  from interop import export_run
  export_run(train.checkpoint.load_run('runs/gpt-...'), 'hf/my-gpt')   # = --mode=export_hf

This package reads and writes files and tokenizers around `models/` (which take arrays only) and
`data/`; it never imports `train/` or `configs/`, and never writes a run config.
"""
from __future__ import annotations

from interop.common import HFExportError, check_target
from interop.hf_bert import export_bert
from interop.hf_gpt2 import export_gpt2

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

  GPT runs become GPT2LMHeadModel directories; BERT runs BertForPreTraining (pretrain),
  BertForSequenceClassification (classify) or BertModel (features) ones. Returns the exporter's
  summary.
  """
  check_export(run.config.family, out_dir)
  if run.config.family == 'gpt':
    return export_gpt2(run.model, run.tokenizer, out_dir)
  return export_bert(run.model, run.tokenizer, out_dir, labels=list(getattr(run.model_config, 'labels', ())))
