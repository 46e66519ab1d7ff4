"""The run on disk: a workdir's run files, and `load_run` to reload a run anywhere.

A workdir holds, beside its checkpoints (train/checkpoint.py) and tokenizer files:
  config.json  the config the user asked for, plus `data_history` (the data each span of steps read)
  model.json   the model config that was built: {'schema': MODEL_SCHEMA, 'class': the family's
               dataclass name, 'fields': its values, resolved from the data, 'rng_impl': the PRNG
               of its random streams (the shape of the dropout keys the checkpoints hold)}, and for
               a LoRA run (train/lora.py) 'base': {'workdir', 'step'}, the run and checkpoint whose
               frozen weights its adapters apply to (its checkpoints hold the adapters alone)
so a run reloads without its config file or data:

    from train.rundir import load_run
    run = load_run('runs/gpt-default-...')
    run.predict(['def fibonacci(n):'])

Runs saved by earlier code hold older model.json layouts (or none); `migrate` is the one place
that knows them and turns each into the current layout when it is read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import ml_collections
from flax import nnx

import storage
from data import tokenizers
from errors import UserError
from interop.common import check_target
from models import lora as lora_model
from models.attention import resolve_compute_dtype
from train import lora, sharding, state
from train.checkpoint import Checkpointer, CheckpointError, restore_target
from train.task import RUNTIME_FIELDS, Prepared, Task, no_hf_counterpart, task_class
from train.validation import flatten, reference_config, validate_config

CONFIG_FILE = 'config.json'
MODEL_FILE = 'model.json'
DATA_KEYS = ('source', 'eval_source', 'test_source')  # config.data keys that name what a run reads
DATA_HISTORY = 'data_history'  # config.json: [{'step': the step it started at, 'source': ..., ...}], oldest first
# model.json's layout. Files without a 'schema' key are read by their keys: none (0: the model's
# values lived in config.json), {'class', 'fields'} (1), {'class', 'fields', 'rng_impl'} (2).
MODEL_SCHEMA = 2
BASE_KEY = 'base'  # model.json of a LoRA run: {'workdir': its base run, 'step': that run's checkpoint}


class RunDirError(UserError):
  """A workdir that holds no run, another family's run or a newer layout, or an override its run cannot take."""


# ============================================================================ config.json
def save_config(config, workdir: str, data_history: list[dict] | None = None) -> None:
  """`config.json`: the config, and the run's `data_history` when given (see `data_history`)."""
  record = json.loads(config.to_json())
  if data_history:
    record[DATA_HISTORY] = data_history
  storage.write_atomically(os.path.join(workdir, CONFIG_FILE), json.dumps(record, indent=2))


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's config.json as saved (keys the current schema no longer has included)."""
  path = storage.path(workdir) / CONFIG_FILE
  if not path.exists():
    raise RunDirError(f'{path} not found: {workdir} is not a run directory '
                      f'(expected config.json, tokenizer and checkpoints/).')
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def data_history(workdir: str) -> list[dict]:
  """[{'step', 'source', 'eval_source', 'test_source'}]: the data a run in `workdir` has read, each
  entry from the step it started at (a config.json without the history, as an import writes: its
  one source, from step 0); [] when the workdir holds no config.json."""
  if not (storage.path(workdir) / CONFIG_FILE).exists():
    return []
  saved = json.loads((storage.path(workdir) / CONFIG_FILE).read_text())
  if DATA_HISTORY in saved:
    return list(saved[DATA_HISTORY])
  return [{'step': 0, **{key: saved.get('data', {}).get(key, '') for key in DATA_KEYS}}]


def data_since(workdir: str) -> int:
  """The step at which the run's current data started (0 unless `train.allow_data_change` was used)."""
  history = data_history(workdir)
  return history[-1]['step'] if history else 0


# ============================================================================ model.json
def save_model_config(model_config, rng_impl: str, workdir: str, base: dict | None = None) -> None:
  """`model.json` in the current layout (see the module docstring); `base`: a LoRA run's base run."""
  storage.write_atomically(os.path.join(workdir, MODEL_FILE), json.dumps(
      {'schema': MODEL_SCHEMA, 'class': type(model_config).__name__, 'fields': dataclasses.asdict(model_config),
       'rng_impl': rng_impl, **({BASE_KEY: base} if base else {})}, indent=2))


def model_record(workdir: str) -> dict | None:
  """model.json of the run in `workdir` in the current layout, whatever layout it was saved in;
  None when the workdir holds no run (neither model.json nor config.json)."""
  path = storage.path(workdir) / MODEL_FILE
  if path.exists():
    return migrate(json.loads(path.read_text()), workdir)
  if (storage.path(workdir) / CONFIG_FILE).exists():
    return migrate(None, workdir)
  return None


def lora_base(config, workdir: str) -> dict:
  """{'workdir', 'step'}: the base run of the LoRA run `config` trains (or evaluates) in `workdir`, as
  its model.json recorded it, or for a new run `config.init_from` (made absolute) at the checkpoint
  `load_run` reloads. A ConfigError when that is a LoRA run itself; a RunDirError when the config
  names another base than the one the workdir's run started from."""
  recorded = (model_record(workdir) or {}).get(BASE_KEY)
  if recorded is not None:
    started = read_config(workdir).get('init_from')
    if config.init_from != started:
      raise RunDirError(f'{workdir} fine-tunes {recorded["workdir"]} (config.init_from={started}) but the config '
                        f'asks for config.init_from={config.init_from}; resume with the run\'s own base or use a '
                        f'fresh --workdir.')
    return recorded
  source = config.init_from if storage.is_remote(config.init_from) else os.path.abspath(config.init_from)
  lora.check_base(read_config(source), config.init_from)
  return {'workdir': source, 'step': reloaded_step(source)}


def reloaded_step(workdir: str) -> int:
  """The checkpoint `load_run(workdir)` reloads: the best by `train.best_metric` with
  `train.final_eval_from='best'` (the default), else the newest."""
  config = run_config(workdir)[0]
  checkpointer = Checkpointer(workdir, config.train, read_only=True, data_since=data_since(workdir))
  best = checkpointer.best_step() if config.train.final_eval_from == 'best' else None
  step = best[0] if best else checkpointer.latest_step()
  checkpointer.close()
  if step is None:
    raise CheckpointError(f'No checkpoint in {checkpointer.directory}; train that run first.')
  return step


def read_rng_impl(workdir: str) -> str | None:
  """The PRNG a run's model was built with (None: no run in `workdir`)."""
  record = model_record(workdir)
  return None if record is None else record['rng_impl']


def read_model_config(workdir: str, model_config_class: type):
  """The model config of the run in `workdir` (None: no run there)."""
  record = model_record(workdir)
  if record is None:
    return None
  if record['class'] != model_config_class.__name__:
    raise RunDirError(f'{os.path.join(workdir, MODEL_FILE)} holds a {record["class"]}, not the '
                      f'{model_config_class.__name__} of this family; the run directory belongs to another '
                      f'model family.')
  names = {f.name for f in dataclasses.fields(model_config_class)}
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record['fields'].items() if k in names}
  return model_config_class(**fields)


# ============================================================================ older layouts
def migrate(record: dict | None, workdir: str) -> dict:
  """`record` (model.json as read; None: the run has none) in the current layout, one step per
  older layout: 0 -> 1 the model config resolved from config.json, 1 -> 2 the PRNG, which was
  threefry before `config.rng_impl` existed. A newer layout than this code reads is an error."""
  version = _schema_of(record)
  if version > MODEL_SCHEMA:
    raise RunDirError(f'{os.path.join(workdir, MODEL_FILE)} has schema {version}, newer than the {MODEL_SCHEMA} this '
                      f'code reads; reload the run with the code that saved it, or update this checkout.')
  if version == 0:
    model_config = _model_config_before_model_json(workdir)
    record = {'class': type(model_config).__name__, 'fields': dataclasses.asdict(model_config)}
  if version <= 1:
    record = {**record, 'rng_impl': 'threefry'}
  return {**record, 'schema': MODEL_SCHEMA}


def _schema_of(record: dict | None) -> int:
  """The layout of `record` (see MODEL_SCHEMA): its 'schema', else told by its keys."""
  if record is None:
    return 0
  if 'schema' in record:
    return record['schema']
  return 2 if 'rng_impl' in record else 1


def _labels_v0(saved) -> tuple[str, ...]:
  """Schema 0 classification runs kept their class names, as a JSON list, in `data.labels`."""
  return tuple(json.loads(saved.data.labels)) if saved.data.get('labels') else ()


_BERT_HEADS_V0 = {'pretrain': 'pretraining', 'classify': 'classifier', 'features': 'none'}  # config.task -> heads


def _bert_v0(saved) -> dict:
  heads = saved.model.get('heads') or _BERT_HEADS_V0[saved.task]
  return {'heads': heads, 'num_classes': saved.model.get('num_classes', 0), 'labels': _labels_v0(saved)}


def _classifier_v0(saved) -> dict:
  labels = _labels_v0(saved)
  return {'num_classes': len(labels), 'labels': labels}


# Model-config values a schema 0 run kept in its config.json (beside the `model` keys the family
# reads as in training), by family; the other families resolve everything as in training.
_SAVED_IN_CONFIG_V0 = {'bert': _bert_v0, 'classifier': _classifier_v0}


def _model_config_before_model_json(workdir: str):
  """The model config of a schema 0 run: resolved as in training from its config.json's `model`
  keys and its tokenizer, with what the family kept elsewhere in config.json on top. Keys added
  to `model` since take the dataclass defaults (`vocab_multiple` 1: unpadded, as its checkpoints are)."""
  saved = read_config(workdir)
  family = task_class(saved.family)
  saved = _model_fields_only(saved, family.model_config_class)
  resolved = family.resolved_from_tokenizer(saved, run_tokenizer(workdir))
  family_values = _SAVED_IN_CONFIG_V0.get(saved.family)
  if family_values:
    resolved.update(family_values(saved))
  return family.resolve_model_config(saved, **resolved)


def _model_fields_only(saved, model_config_class: type):
  """A copy of a saved config without the `model.*` keys that are not fields of `model_config_class`
  (keys an older schema had, e.g. `model.attention` of families without attention)."""
  config = saved.copy_and_resolve_references()
  fields = {f.name for f in dataclasses.fields(model_config_class)}
  with config.unlocked():
    for key in [k for k in config.model if k not in fields]:
      del config.model[key]
  return config


# ============================================================================ the run's config
def run_config(workdir: str, overrides: dict | None = None):
  """(the run's config, its resolved model config): `config.json` in the current config schema
  with `overrides` applied and checked, and `model.json`."""
  config = read_config(workdir)
  model_config = read_model_config(workdir, task_class(config.family).model_config_class)
  config = _in_current_schema(config)
  for key, value in (overrides or {}).items():
    _set(config, key, value, workdir)
    model_config = _with_model_override(model_config, key, value, workdir)
  config = _on_these_devices(config)
  validate_config(config)
  return config, model_config


def _with_model_override(model_config, key: str, value, workdir: str):
  """A `model.<field>` override of a reloaded run: runtime fields (attention, dtype, ...) change its
  model config; fields that fix what the checkpoint holds cannot."""
  section, _, field = key.partition('.')
  if section != 'model' or field not in {f.name for f in dataclasses.fields(model_config)}:
    return model_config
  if field in RUNTIME_FIELDS:
    return dataclasses.replace(model_config, **{field: resolve_compute_dtype(value) if field == 'dtype' else value})
  if getattr(model_config, field) != value:
    raise RunDirError(f'--config.{key}={value!r} cannot apply to {workdir}: its model has {field}='
                      f'{getattr(model_config, field)!r} ({os.path.join(workdir, MODEL_FILE)}). Train a new run '
                      f'for another model.')
  return model_config


def _in_current_schema(saved):
  """The family's current schema with the saved values of the keys it still has: keys a run saved
  that are no longer inputs are dropped, keys added since take their defaults."""
  config = reference_config(saved)
  known = flatten(config)
  for key, value in flatten(saved).items():
    if key in known:
      *parents, leaf = key.split('.')
      target = config
      for parent in parents:
        target = target[parent]
      target[leaf] = value
  return config


def _set(config, key: str, value, workdir: str) -> None:
  target = config
  *parents, leaf = key.split('.')
  for parent in parents:
    target = target.get(parent) if isinstance(target, ml_collections.ConfigDict) else None
  if not isinstance(target, ml_collections.ConfigDict) or leaf not in target:
    raise RunDirError(f"Unknown config key '{key}': {os.path.join(workdir, CONFIG_FILE)} has no such "
                      f"setting, so the override cannot apply to this run.")
  target[leaf] = value


def _on_these_devices(config):
  """`config` with a data-parallel mesh over the devices present when its own mesh does not fit
  them (a run trained on 8 devices evaluates on 1: checkpoints restore onto any mesh)."""
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
    return config
  except ValueError:
    print(f"Note: the run's mesh {dict(config.mesh)} does not fit the {jax.device_count()} devices here; "
          f'using a data-parallel mesh over all of them.', flush=True)
    config = config.copy_and_resolve_references()
    config.mesh.update({'data': -1, 'fsdp': 1, 'expert': 1, 'tensor': 1})
    return config


# ============================================================================ reloading a run
@dataclasses.dataclass
class Run:
  """A reloaded run: call `run.model(...)` directly, or `run.predict(lines)`."""
  config: ml_collections.ConfigDict
  model_config: Any
  model: nnx.Module
  tokenizer: Any
  step: int
  task: Any
  workdir: str

  def predict(self, lines: list[str]) -> list[Any]:
    """One output per line; inputs longer than the model's window are cut, with a note on stderr."""
    for note in self.task.predict_truncation(lines):
      print(f'note: {note}', file=sys.stderr, flush=True)
    return self.task.predict(self.model, lines, self.workdir)

  def export_hf(self, out_dir: str, adapter: bool = False) -> dict[str, Any]:
    """Write the run as a Hugging Face directory `out_dir` (new or empty); the exporter's summary.
    A LoRA run writes its model with the adapters merged into the base weights, or with `adapter`
    the adapters alone as a PEFT adapter directory for the base run's export."""
    check_hf_export(self.config.family, out_dir, adapter, lora.enabled(self.config.train))
    if adapter:
      return self.task.export_hf_adapter(self.model, out_dir, self.config.train)
    model = self.model
    if lora.enabled(self.config.train):
      model = nnx.clone(model)
      lora_model.merge_adapters(model)
    return self.task.export_hf(model, out_dir)


def check_hf_export(family: str, out_dir: str, adapter: bool = False, is_lora: bool = False) -> None:
  """A UserError unless a run of `family` (a LoRA run: `is_lora`) can be written into `out_dir`, as
  a PEFT adapter with `adapter`; cheap, so that `--mode=export_hf` calls it before loading the checkpoint."""
  if task_class(family).export_hf is Task.export_hf:
    raise no_hf_counterpart(family)
  if adapter and not is_lora:
    raise RunDirError('--hf_adapter writes the adapters of a LoRA run (train.lora_rank > 0), and this run has none; '
                      'export it without --hf_adapter.')
  if adapter and task_class(family).export_hf_adapter is Task.export_hf_adapter:
    raise RunDirError(f'--hf_adapter: a {family!r} run has no PEFT adapter export; export the merged model (without '
                      f'--hf_adapter).')
  check_target(out_dir)


def run_tokenizer(workdir: str):
  """The tokenizer a run saved in `workdir` (None for a family without text, which saves none)."""
  if not (storage.path(workdir) / tokenizers.TOKENIZER_FILE).exists():
    return None
  return tokenizers.load_tokenizer(workdir)


def load_run(workdir: str, step: int | None = None, config_overrides: dict | None = None) -> Run:
  """Reload a run's model (parameters bound), tokenizer and config on the current devices.

  `step` None is the checkpoint the run's final evaluation scored, as `--mode=eval` picks it: the
  best by `train.best_metric` with `train.final_eval_from='best'` (the default), else the newest
  that restores. So the reloaded model is the one the run's result line and metrics describe.

  The model is rebuilt from `model.json`. `config_overrides` ({'task': 'features'}) change
  settings of the saved config.json (behaviour such as decoding or the BERT task, not the model's
  shape); keys it lacks are an error. Restoring places the arrays on the current mesh, so a run
  trained on 8 devices reloads on 1 (or the reverse)."""
  config, model_config = run_config(workdir, config_overrides)
  task = task_class(config.family)(config, Prepared(run_tokenizer(workdir), model_config))
  checkpointer = Checkpointer(workdir, config.train, read_only=True, data_since=data_since(workdir))
  if checkpointer.latest_step() is None:
    raise CheckpointError(f'No checkpoint in {checkpointer.directory}; train first (python launch.py '
                          f'--config=... --workdir={workdir}).')
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1, 'tensor': 1})
  spec = state.state_spec(lora.model_builder(task, config.train), mesh, read_rng_impl(workdir),
                          trainable=lora.trainable(task, config.train))
  if step is None and config.train.final_eval_from == 'best':
    step, _ = checkpointer.best_step() or (None, None)
  if step is None:
    step, restored = checkpointer.restore_newest_intact(restore_target(spec))
  else:
    restored = checkpointer.restore(step, restore_target(spec))
  restored = restored['model']
  checkpointer.close()
  frozen = spec.abstract.frozen  # empty, but for a LoRA run
  if lora.enabled(config.train):
    frozen = base_weights(spec, task, config, model_record(workdir)[BASE_KEY])
  model = nnx.merge(spec.graphdef, restored['params'], frozen, restored['extra'])
  model.eval()
  return Run(config=config, model_config=model_config, model=model, tokenizer=task.tokenizer, step=step, task=task,
             workdir=workdir)


def base_weights(spec: state.StateSpec, task: Task, config, base: dict) -> nnx.State:
  """The frozen weights of a LoRA run (`spec`'s `frozen` part): its base run's, at the checkpoint
  `base` ({'workdir', 'step'}) names, copied by `Task.init_from` into a model whose parameters are
  abstract: no initialiser compiles, runs or holds a second copy of the weights. A LoRA run has no
  frozen weight its base run lacks (a BERT's positions are its base run's: train/tasks/bert.py)."""
  source = load_run(base['workdir'], base['step']).model
  model = nnx.merge(spec.graphdef, spec.abstract.params, spec.abstract.frozen, spec.abstract.extra)
  task.init_from(model, source)
  _, frozen, _ = state.split_model(model, spec.trainable)
  missing = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(frozen)
             if not isinstance(x, jax.Array)]
  if missing:
    raise RuntimeError(f'{task.__class__.__name__}.init_from left frozen weights of the LoRA run without a value '
                       f'from its base run {base["workdir"]}: {", ".join(missing[:5])}.')
  return jax.device_put(frozen, spec.shardings.frozen)
