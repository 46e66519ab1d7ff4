"""PEFT adapters: a LoRA run's adapters (models/lora.py) as the adapter directory that Hugging Face's
`peft` loads onto the base run's export, `peft.PeftModel.from_pretrained(base_model, adapter_dir)`.

The directory holds adapter_config.json (PEFT's LoraConfig, written here as JSON: exporting needs
no `peft`) and adapter_model.safetensors. For each adapted Hugging Face module `M` the weights are
`base_model.model.M.lora_A.weight` [R, in] and `base_model.model.M.lora_B.weight` [out, R], torch
Linear layouts whatever the module's own (GPT-2's Conv1D too: `fan_in_fan_out` only tells PEFT how
to merge), and PEFT adds lora_alpha / R * B(A(x)) to the module's output. Our projections map to HF
modules through the family's tensor table (interop/common.py `TensorName`): where one HF module holds
several of them side by side (GPT-2's `c_attn`: query, key, value), its adapter stacks their A's and
places each B beside its own outputs, zeros elsewhere, so it computes exactly theirs at rank R = k r
and alpha k alpha for k projections adapted (PEFT's `rank_pattern` and `alpha_pattern` for that module).
Modules a LoRA run trains in full beside its adapters (a BERT classifier's new output layer) are PEFT's
`modules_to_save`: written whole, as `base_model.model.M.weight` and `.bias`, and swapped in by PEFT for
the base model's own (a BertForSequenceClassification loaded from the base run's BertForPreTraining
export draws that layer at random).

GPT runs (`export_gpt_adapter`) adapt a GPT2LMHeadModel or LlamaForCausalLM, BERT runs
(`export_bert_adapter`) a BertForPreTraining or BertForSequenceClassification (Hugging Face's module
names: attention.self.query / key / value, attention.output.dense, intermediate.dense, output.dense).

Shape legend: in / out a module's features, r our rank, R the module's adapter rank.
"""
from __future__ import annotations

import re

import numpy as np

from interop import gpt_exporter
from interop.common import (TensorName, hf_tensor, leaf_paths, numpy_params, output_directory, unscanned_params,
                            value_at, write_json, write_safetensors)
from interop.hf_bert import tensor_names as bert_tensor_names
from interop.hf_gpt2 import export_gpt2
from interop.hf_gpt2 import tensor_names as gpt2_tensor_names
from interop.hf_llama import tensor_names as llama_tensor_names

ADAPTER_CONFIG, ADAPTER_WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'  # PEFT's file names


def _adapter_of(params: dict, kernel: tuple) -> dict | None:
  """{'lora_a': [in, r], 'lora_b': [r, out]} of the projection whose kernel is at `kernel`, or None."""
  return value_at(params, kernel[:-1]).get('lora')


def module_adapters(params: dict, names: list[TensorName]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{HF module: (A [R, in], B [out, R])} of every adapter in `params` (an `unscanned_params` dict of
  an adapted model) by the tensor table `names`."""
  modules, mapped = {}, 0
  for name in names:
    if not name.hf.endswith('.weight') or any(path[-1] != 'kernel' for path in name.ours):
      continue
    adapters = [(i, _adapter_of(params, path)) for i, path in enumerate(name.ours)]
    adapters = [(i, adapter) for i, adapter in adapters if adapter is not None]
    if not adapters:
      continue
    widths = [value_at(params, path).shape[-1] for path in name.ours]
    starts = np.cumsum([0] + widths)
    rank = adapters[0][1]['lora_a'].shape[-1]
    a = np.concatenate([np.asarray(adapter['lora_a']).T for _, adapter in adapters])  # [R, in]
    b = np.zeros((starts[-1], a.shape[0]), np.float32)  # [out, R]
    for j, (i, adapter) in enumerate(adapters):
      b[starts[i]:starts[i + 1], j * rank:(j + 1) * rank] = np.asarray(adapter['lora_b']).T
    # safetensors writes an array's buffer as is: the concatenated transposes must be made C-ordered.
    modules[name.hf.removesuffix('.weight')] = (np.ascontiguousarray(a, np.float32), b)
    mapped += len(adapters)
  adapted = sum(1 for path in leaf_paths(params) if path[-2:] == ('lora', 'lora_a'))
  if mapped != adapted:
    raise ValueError(f'The HF tensor table places {mapped} of the model\'s {adapted} adapters.')
  return modules


def adapter_config(modules: dict[str, tuple[np.ndarray, np.ndarray]], *, rank: int, alpha: float, dropout: float,
                   fan_in_fan_out: bool, task_type: str | None, modules_to_save: list[str]) -> dict:
  """PEFT's LoraConfig for `modules` (`module_adapters`), as adapter_config.json holds it: `rank` and
  `alpha`, and for each module holding k > 1 adapters rank k r and alpha k alpha (PEFT matches those
  patterns as regular expressions, so the module names are escaped); `modules_to_save` the HF modules
  stored whole."""
  patterns = {re.escape(module): a.shape[0] // rank for module, (a, _) in modules.items() if a.shape[0] != rank}
  return {'peft_type': 'LORA', 'task_type': task_type, 'r': rank, 'lora_alpha': alpha, 'lora_dropout': dropout,
          'target_modules': sorted(modules), 'rank_pattern': {k: n * rank for k, n in patterns.items()},
          'alpha_pattern': {k: n * alpha for k, n in patterns.items()}, 'fan_in_fan_out': fan_in_fan_out,
          'bias': 'none', 'use_rslora': False, 'modules_to_save': modules_to_save or None, 'init_lora_weights': True,
          'inference_mode': True, 'base_model_name_or_path': None}


def write_adapter(params: dict, names: list[TensorName], out_dir: str, *, architecture: str, rank: int, alpha: float,
                  dropout: float, fan_in_fan_out: bool = False, task_type: str | None,
                  trained_in_full: tuple[str, ...] = ()) -> dict:
  """Write the adapters in `params` (an `unscanned_params` dict) as a PEFT adapter of the HF
  `architecture` whose tensors `names` names; the modules of `trained_in_full` (our module names, as
  `Task.lora_heads`) whole, as PEFT's `modules_to_save`. `out_dir` appears complete or not at all.
  Returns {'architecture', 'modules', 'parameters'}."""
  modules = module_adapters(params, names)
  tensors = {f'base_model.model.{module}.lora_{part}.weight': array
             for module, pair in modules.items() for part, array in zip('AB', pair)}
  saved = [name for name in names if any(part in path for path in name.ours for part in trained_in_full)]
  tensors |= {f'base_model.model.{name.hf}': hf_tensor(params, name) for name in saved}
  to_save = sorted({name.hf.rsplit('.', 1)[0] for name in saved})
  with output_directory(out_dir) as staging:
    write_json(staging, ADAPTER_CONFIG, adapter_config(modules, rank=rank, alpha=alpha, dropout=dropout,
                                                       fan_in_fan_out=fan_in_fan_out, task_type=task_type,
                                                       modules_to_save=to_save))
    write_safetensors(staging, tensors, ADAPTER_WEIGHTS)
  return {'architecture': f'PEFT LoRA adapter of a {architecture}', 'modules': len(modules),
          'parameters': int(sum(t.size for t in tensors.values()))}


def export_gpt_adapter(model, out_dir: str, *, rank: int, alpha: float, dropout: float) -> dict:
  """Write the adapters of `model` (an adapted GPT) as a PEFT adapter of the GPT2LMHeadModel or
  LlamaForCausalLM its base run exports to (`write_adapter`)."""
  config = model.config
  gpt2 = gpt_exporter(config) is export_gpt2  # refuses models without a Hugging Face class
  names = gpt2_tensor_names(config, 'transformer.') if gpt2 else llama_tensor_names(config)
  return write_adapter(unscanned_params(model), names, out_dir, rank=rank, alpha=alpha, dropout=dropout,
                       architecture='GPT2LMHeadModel' if gpt2 else 'LlamaForCausalLM', fan_in_fan_out=gpt2,
                       task_type='CAUSAL_LM')


def export_bert_adapter(model, out_dir: str, *, rank: int, alpha: float, dropout: float,
                        trained_in_full: tuple[str, ...] = ()) -> dict:
  """Write the adapters of `model` (an adapted BertForPretraining or BertClassifier) as a PEFT adapter of
  the BertForPreTraining or BertForSequenceClassification it exports as, its modules `trained_in_full`
  (a classifier's 'classifier') saved whole (`write_adapter`). A classifier's base loads from the base
  run's export: `BertForSequenceClassification.from_pretrained(base_dir, num_labels=<its classes>)`."""
  architecture, names = bert_tensor_names(model)
  # BertForPreTraining's two heads match none of PEFT's task types: None is PEFT's plain PeftModel.
  task_type = 'SEQ_CLS' if architecture == 'BertForSequenceClassification' else None
  return write_adapter(numpy_params(model), names, out_dir, architecture=architecture, rank=rank, alpha=alpha,
                       dropout=dropout, task_type=task_type, trained_in_full=trained_in_full)
