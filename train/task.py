"""What a model family hands to the shared trainer.

The trainer (train/trainer.py) owns the loop, sharding, optimizer, checkpoints and metrics. A
family owns its data, model, loss and extra evaluation by subclassing `Task` in
`train/tasks/<family>.py` (class name `Task`); `config.family` selects the module.

Data flows one way. The run config (`ml_collections`, what the user asked for) is read, never
written. `Task.prepare(config, workdir)` reads the data, trains or loads the tokenizer and resolves
the family's frozen model-config dataclass (vocabulary size, classes and their names, attention
implementation, positions) into a `Prepared` value; `Task(config, prepared)` is the family, a
value nothing reassigns. The trainer builds the model from the model config alone and saves it as
`model.json` beside `config.json`, so a reloaded run is rebuilt from what was built, not from
what was asked; training and `--mode=eval` build the task the same way.

Batches are dicts of numpy arrays with a leading batch axis; every leaf is sharded on that axis.
Loss metrics are dicts name -> (sum, count) so that averages over tokens stay exact across
gradient-accumulation micro-batches, devices and eval batches.

Metric names, for every family:
  train/<name>   the training step's loss metrics, loss, grad_norm, lr, tokens_per_s (positions the
                 step computes on, padding included), real_tokens_per_s (padding excluded)
  eval/<name>    the validation split (`data.eval_source`): the loss metrics during training, and
                 whatever `Task.evaluate` adds about it (e.g. eval/stream_perplexity)
  test/<name>    the test split (`data.test_source`), scored after training by `Task.evaluate`
                 (e.g. test/bleu, test/accuracy, test/macro_f1)
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from typing import Any

import grain
import jax
import numpy as np
from flax import nnx

from data import batching
from errors import ConfigError, UserError
from train import sampling

Metrics = dict[str, tuple[jax.Array, jax.Array]]
# Model-config fields that change how a model computes, not what it holds: a resumed or reloaded
# run may change them; every other field is fixed by the run's model.json.
RUNTIME_FIELDS = ('attention', 'dtype', 'dropout', 'attention_dropout', 'remat')


@dataclasses.dataclass
class Datasets:
  """Tokenized examples (dicts of fixed-shape numpy arrays), indexable with grain."""
  train: grain.MapDataset
  eval: grain.MapDataset
  test: grain.MapDataset | None = None
  # The token caches read (data/token_cache.py), {split: cache name}; config.json's data history
  # records them, and a resume onto other caches is refused like other data. {}: read in memory.
  caches: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `Task.prepare` resolves from the config and the data; a `Task` is built from it and the config.

  Training, `--mode=eval` and `--mode=predict` build it the same way (`prepare`, which reads the
  data); `load_run`, benchmarks and imports build it without data (`Task.without_data`)."""
  tokenizer: Any  # data.tokenizers.Tokenizer, or None for families without text
  model_config: Any  # the family's frozen model-config dataclass (Task.model_config_class)
  datasets: Datasets | None = None  # None when a run is reloaded without its data
  family_data: Any = None  # what the family reads besides the splits: test pairs, a held-out stream, the MLM masker


class Task:
  """A model family, as a value: `Task(config, prepared)` is never changed after construction.

  Required: `model_config_class`, `prepare`, `build_model`, `loss`, `example_batch`. Optional:
  `resolved_from_tokenizer`, `evaluate`, `predict`, and the rest below with their defaults.
  """
  model_config_class: type = type(None)  # required: the family's frozen model-config dataclass
  # Language models: the compiled prompt continuation, (model, tokens [B, P], valid [B, P], rng, *,
  # max_new_tokens, temperature, top_k, top_p, eos_id, pad_id) -> (new tokens [B, N], lengths [B]).
  generate = None
  # Modules a LoRA fine-tuning trains in full beside its adapters (train/lora.py): those `init_from`
  # does not copy from the base run, e.g. a new classifier.
  lora_heads: tuple[str, ...] = ()

  def __init__(self, config, prepared: Prepared):
    self.config = config
    self.prepared = prepared
    self._frozen = True

  def __setattr__(self, name, value):
    if getattr(self, '_frozen', False):
      raise AttributeError(f'A Task is a value: {name!r} cannot be assigned after construction.')
    super().__setattr__(name, value)

  @property
  def tokenizer(self):
    return self.prepared.tokenizer

  @property
  def model_config(self):
    return self.prepared.model_config

  # ------------------------------------------------------------------ preparing (before a Task exists)
  @classmethod
  def prepare(cls, config, workdir: str, platform: str | None = None) -> Prepared:
    """Required. Read and tokenize the data (load the tokenizer from `workdir` when the run saved
    one, else train it and save it there) and resolve the model config for `platform` ('cpu' |
    'gpu' | 'tpu'; None: this backend)."""
    raise NotImplementedError

  @classmethod
  def without_data(cls, config, tokenizer, platform: str | None = None) -> Prepared:
    """The tokenizer and the model config resolved as in training, without reading data
    (reloading a run, benchmarks, compiling)."""
    return Prepared(tokenizer, cls.resolve_model_config(config, platform, **cls.resolved_from_tokenizer(config, tokenizer)))

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer) -> dict[str, Any]:
    """Model-config values that come from the tokenizer (e.g. {'vocab_size': ...}). Default: none."""
    del config, tokenizer
    return {}

  @classmethod
  def resolve_model_config(cls, config, platform: str | None = None, **resolved) -> Any:
    """`model_config_class` from the `config.model` keys (ConfigError for one that is not a field),
    the 'auto' dtype and the 'auto' attention (for the dtype) resolved for `platform`, and `resolved`
    (values that come from the data) on top."""
    from models.attention import default_attention_implementation, resolve_compute_dtype
    check_model_fields(config.model.keys(), cls.model_config_class)
    values = dict(config.model.items())
    if 'dtype' in values:
      values['dtype'] = resolve_compute_dtype(values['dtype'], platform)
    if values.get('attention') == 'auto':
      values['attention'] = default_attention_implementation(values.get('dtype', 'float32'), platform)
    return cls.model_config_class(**{**values, **resolved})

  # ------------------------------------------------------------------ batches
  def batch_plan(self) -> batching.BatchPlan:
    """How training examples become batches (data/batching.py): the trainer reads
    `batch_plan().global_batches(...)`. Default: independent examples, shuffled every epoch."""
    return batching.Shuffled()

  @property
  def eval_batch_size(self) -> int:
    return eval_batch_size(self.config)

  # ------------------------------------------------------------------ model
  def build_model(self, rngs: nnx.Rngs) -> nnx.Module:
    """Required. A freshly initialised model from `self.model_config` alone."""
    raise NotImplementedError

  def loss(self, model: nnx.Module, batch: dict[str, jax.Array], *, deterministic: bool
           ) -> tuple[jax.Array, Metrics]:
    """Required. (scalar loss to minimise, metrics name -> (sum, count)); runs under jit."""
    raise NotImplementedError

  def example_batch(self, batch_size: int) -> dict[str, np.ndarray]:
    """Required. A synthetic batch with the training shapes (benchmarks, compilation checks)."""
    raise NotImplementedError

  def summarize(self, eval_metrics: dict[str, float]) -> dict[str, float]:
    """Derived eval metrics (e.g. perplexity from the mean loss). Default: unchanged."""
    return eval_metrics

  def count_tokens(self, batch: dict) -> tuple[int, Any]:
    """(positions, real tokens) of a training batch, for tokens/s: positions are what the step
    computes on, padding included (an int, from the shapes); real tokens the non-padding ones
    among them (a scalar; works on numpy arrays and under jit). Default: `tokens` [B, L], with
    `valid` [B, L] marking the real ones when the batch has it."""
    tokens = batch['tokens']
    return tokens.size, (tokens.size if 'valid' not in batch else batch['valid'].sum())

  def flops_per_token(self) -> float | None:
    """Training FLOPs per token (forward + backward), for MFU in benchmark mode."""
    return None

  # ------------------------------------------------------------------ after training
  def evaluate(self, model: nnx.Module, workdir: str) -> dict[str, Any]:
    """Extra evaluation after the loop (BLEU, samples, accuracy, pictures) of `self.prepared`'s
    data, named as in the module docstring; pictures as {'images': {name: path}}. Default: none."""
    return {}

  def final_decoding(self) -> int:
    """How many units of decoding (`decode_unit`) `evaluate` runs: the budget times one at the run's
    first step and keeps that many (train/budget.py). Default: a language model (`generate`)
    continues the decode.prompts once; other families decode nothing."""
    return int(self.generate is not None and bool(sampling.prompt_list(self.config.decode)))

  def decode_unit(self, model: nnx.Module) -> None:
    """One unit of the decoding `evaluate` runs on `model`, its outputs dropped. Default: the
    continuations of the decode.prompts."""
    sampling.continue_prompts(self.generate, model, self.tokenizer, sampling.prompt_list(self.config.decode),
                              self.config.decode, seed=self.config.seed,
                              max_len=getattr(self.model_config, 'max_len', None))

  def predict(self, model: nnx.Module, lines: list[str], workdir: str) -> list[Any]:
    """`--mode=predict`: one JSON-serialisable output per input line."""
    raise UserError(f'--mode=predict is not available for family {self.config.family!r}.')

  def predict_truncation(self, lines: list[str]) -> list[str]:
    """One note per predict input the model cannot read whole (longer than its window). Default:
    the family reads inputs of any length."""
    del lines
    return []

  @classmethod
  def import_hf(cls, config, hf_dir: str, rngs: nnx.Rngs) -> tuple[Prepared, nnx.Module]:
    """`--mode=import_hf`: (tokenizer and model config, the model) read from a Hugging Face directory;
    `rngs` initialise what the checkpoint lacks (and the dropout streams)."""
    raise UserError(f'--mode=import_hf is not available for family {config.family!r}.')

  def export_hf(self, model: nnx.Module, out_dir: str) -> dict[str, Any]:
    """`--mode=export_hf`: write `model` and the tokenizer as a Hugging Face directory `out_dir`
    (checked by `interop.common.check_target` first); returns the exporter's summary."""
    raise no_hf_counterpart(self.config.family)

  def export_hf_adapter(self, model: nnx.Module, out_dir: str, train_config) -> dict[str, Any]:
    """`--mode=export_hf --hf_adapter`: a LoRA run's adapters (`model`'s, configured by `train_config`)
    as a PEFT adapter directory `out_dir` for its base run's Hugging Face export; the exporter's summary."""
    raise UserError(f'--hf_adapter: a {self.config.family!r} run has no PEFT adapter export; export the merged '
                    f'model (without --hf_adapter).')

  def init_from(self, model: nnx.Module, source: nnx.Module) -> None:
    """`config.init_from`: copy parameters from another run's model `source` into `model`, in place."""
    raise ConfigError(f'config.init_from is not supported by family {self.config.family!r}.')


def check_model_fields(keys, model_config_class: type) -> None:
  """Raise ConfigError for the first of `keys` (a config's `model.*` keys) that is not a field of
  `model_config_class`, naming it, the class and the valid fields."""
  fields = [f.name for f in dataclasses.fields(model_config_class)]
  for key in keys:
    if key not in fields:
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f" Did you mean '{close[0]}'?" if close else ''
      where = model_config_class.__module__.replace('.', '/') + '.py'
      raise ConfigError(f'config.model.{key} is not a field of {model_config_class.__name__} ({where}), so the model '
                        f"would ignore it.{hint} Its fields: {', '.join(fields)}.")


def eval_batch_size(config) -> int:
  return config.train.eval_batch_size or config.train.batch_size


def task_class(family: str) -> type[Task]:
  """The `Task` class of `train/tasks/<family>.py`."""
  return task_module(family).Task


def prepare_task(config, workdir: str, platform: str | None = None) -> Task:
  """The family's Task with its data read (training, --mode=eval, --mode=predict); `platform`
  ('cpu' | 'gpu' | 'tpu') is the one its steps are compiled for (None: this process's backend)."""
  cls = task_class(config.family)
  return cls(config, cls.prepare(config, workdir, platform))


def task_without_data(config, tokenizer, platform: str | None = None) -> Task:
  """The family's Task bound to `tokenizer` alone (reloading a run, benchmarks, compiling)."""
  cls = task_class(config.family)
  return cls(config, cls.without_data(config, tokenizer, platform))


def no_hf_counterpart(family: str) -> UserError:
  """The error for exporting a family whose Task writes no Hugging Face directory, naming those that do."""
  names = sorted(info.name for info in pkgutil.iter_modules(importlib.import_module('train.tasks').__path__))
  exporting = tuple(name for name in names if task_class(name).export_hf is not Task.export_hf)
  return UserError(f'A {family!r} run has no Hugging Face counterpart: export_hf writes runs of the families '
                   f'{exporting}; pass the --workdir of one of those.')


def task_module(family: str):
  try:
    return importlib.import_module(f'train.tasks.{family}')
  except ModuleNotFoundError as e:
    if e.name == f'train.tasks.{family}':
      raise ConfigError(f'Unknown family {family!r}: no module train/tasks/{family}.py.') from e
    raise
