"""What a model family hands to the shared trainer.

The trainer (train/trainer.py) owns the loop, sharding, optimizer, checkpoints and metrics. A
family owns its data, model, loss and extra evaluation by subclassing `Task` in
`train/tasks/<family>.py` (class name `Task`); `config.family` selects the module.

Data flows one way. The run config (`ml_collections`, what the user asked for) is read, never
written. `Task.prepare(workdir)` reads the data, trains or loads the tokenizer and resolves the
family's frozen model-config dataclass (vocabulary size, classes and their names, attention
implementation, positions); the trainer builds the model from that dataclass alone and saves it as
`model.json` beside `config.json`, so a reloaded run is rebuilt from what was built, not from
what was asked.

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
import importlib
from typing import Any

import grain
import jax
import numpy as np
from flax import nnx

from errors import ConfigError, UserError

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


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `Task.prepare` resolves from the config and the data; the model is built from it alone."""
  datasets: Datasets | None  # None when a finished run is reloaded without its data
  tokenizer: Any  # data.tokenizers.Tokenizer, or None for families without text
  model_config: Any  # the family's frozen model-config dataclass (Task.model_config_class)


class Task:
  """Base class of a model family. Subclasses override the methods marked 'required'.

  After `prepare` (training) or `bind` (reloading a run), `self.tokenizer` and
  `self.model_config` hold what was resolved; `self.config` is never written to.
  """
  model_config_class: type = type(None)  # required: the family's frozen model-config dataclass
  # Language models: the compiled prompt continuation, (model, tokens [B, P], valid [B, P], rng, *,
  # max_new_tokens, temperature, top_k, top_p, eos_id, pad_id) -> (new tokens [B, N], lengths [B]).
  generate = None

  def __init__(self, config, platform: str | None = None):
    self.config = config
    self.platform = platform  # what 'auto' attention resolves for: 'cpu' | 'gpu' | 'tpu' (None: this backend)
    self.tokenizer = None
    self.model_config = None

  # ------------------------------------------------------------------ data
  def prepare(self, workdir: str) -> Prepared:
    """Data, tokenizer and resolved model config for training in `workdir`."""
    return self.bind(self.load_data(workdir))

  def load_data(self, workdir: str) -> Prepared:
    """Required. Read and tokenize the data (load the tokenizer from `workdir` when the run saved
    one, else train it and save it there) and resolve the model config."""
    raise NotImplementedError

  def bind(self, prepared: Prepared) -> Prepared:
    """Adopt a resolved tokenizer and model config (from `prepare`, a saved run, or an import)."""
    self.tokenizer, self.model_config = prepared.tokenizer, prepared.model_config
    return prepared

  def load_tokenizer(self, workdir: str):
    """The tokenizer a finished run saved in `workdir` (families without text return None)."""
    from data.tokenizers import load_tokenizer
    return load_tokenizer(workdir)

  def resolve_model_config(self, **resolved) -> Any:
    """`model_config_class` from the `config.model` keys (ConfigError for one that is not a field),
    the 'auto' attention resolved for `self.platform` and the dtype, and `resolved` (values that
    come from the data) on top."""
    from train.validation import check_model_fields
    check_model_fields(self.config.model.keys(), self.model_config_class)
    values = dict(self.config.model.items())
    if values.get('attention') == 'auto':
      from models.attention import default_attention_implementation
      values['attention'] = default_attention_implementation(values.get('dtype', 'float32'), self.platform)
    return self.model_config_class(**{**values, **resolved})

  def bind_tokenizer(self, tokenizer) -> Prepared:
    """Bind to `tokenizer` alone, the model config resolved as in training (benchmarks, tests: no data)."""
    return self.bind(Prepared(None, tokenizer, self.resolve_model_config(**self.resolved_from_tokenizer(tokenizer))))

  def legacy_model_config(self, saved_config, tokenizer) -> Any:
    """The model config of a run saved before `model.json` existed, from its `config.json` (which
    then also held the values resolved from the data). Default: resolve as in training."""
    del saved_config
    return self.resolve_model_config(**self.resolved_from_tokenizer(tokenizer))

  def resolved_from_tokenizer(self, tokenizer) -> dict[str, Any]:
    """Model-config values that come from the tokenizer (e.g. {'vocab_size': ...}). Default: none."""
    del tokenizer
    return {}

  def train_batches(self, examples: grain.MapDataset, batch_size: int, seed: int, process_index: int,
                    process_count: int) -> grain.MapDataset:
    """This process's rows of every global training batch: endless, seeded and deterministic.

    `examples` is the whole training split. Global batch b is the same whatever the process count,
    so 1 and N processes train on the same batches (and a resume continues the same order). The
    default shuffles `train_order(examples, seed)`; override `train_order` for per-example
    randomness (e.g. fresh MLM masks every epoch) and this method only for batches that are not
    made of independent examples (length buckets, carried streams).
    """
    return process_rows_of_global_batches(self.train_order(examples, seed), batch_size, process_index,
                                          process_count)

  def train_order(self, examples: grain.MapDataset, seed: int) -> grain.MapDataset:
    """The endless order in which training examples are read."""
    return examples.shuffle(seed=seed).repeat()

  @property
  def eval_batch_size(self) -> int:
    return self.config.train.eval_batch_size or self.config.train.batch_size

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
  def evaluate(self, model: nnx.Module, datasets: Datasets, workdir: str) -> dict[str, Any]:
    """Extra evaluation after the loop (BLEU, samples, accuracy, pictures), named as in the module
    docstring; pictures as {'images': {name: path}}. Default: none."""
    return {}

  def predict(self, model: nnx.Module, lines: list[str], workdir: str) -> list[Any]:
    """`--mode=predict`: one JSON-serialisable output per input line."""
    raise UserError(f'--mode=predict is not available for family {self.config.family!r}.')

  def predict_truncation(self, lines: list[str]) -> list[str]:
    """One note per predict input the model cannot read whole (longer than its window). Default:
    the family reads inputs of any length."""
    del lines
    return []

  def import_hf(self, hf_dir: str, rngs: nnx.Rngs) -> tuple[Prepared, nnx.Module]:
    """`--mode=import_hf`: (tokenizer and model config, the model) read from a Hugging Face directory;
    `rngs` initialise what the checkpoint lacks (and the dropout streams)."""
    raise UserError(f'--mode=import_hf is not available for family {self.config.family!r}.')

  def init_from(self, model: nnx.Module, source: nnx.Module) -> None:
    """`config.init_from`: copy parameters from another run's model `source` into `model`, in place."""
    raise ConfigError(f'config.init_from is not supported by family {self.config.family!r}.')


def process_rows_of_global_batches(order: grain.MapDataset, batch_size: int, process_index: int,
                                   process_count: int) -> grain.MapDataset:
  """This process's rows of each global batch of the endless example order `order`, reading only those rows.

  Global batch b holds elements [b * batch_size, (b + 1) * batch_size) of `order`, whatever the
  process count.
  """
  local = batch_size // process_count

  def row(i):
    step, offset = divmod(i, local)
    return order[step * batch_size + process_index * local + offset]

  return grain.MapDataset.range(len(order) // process_count).map(row).batch(local, drop_remainder=True)


def get_task(config, platform: str | None = None) -> Task:
  """The family's Task; `platform` ('cpu' | 'gpu' | 'tpu') is the one its steps are compiled for
  (None: this process's default backend)."""
  return task_module(config.family).Task(config, platform)


def task_module(family: str):
  try:
    return importlib.import_module(f'train.tasks.{family}')
  except ModuleNotFoundError as e:
    if e.name == f'train.tasks.{family}':
      raise ConfigError(f'Unknown family {family!r}: no module train/tasks/{family}.py.') from e
    raise
