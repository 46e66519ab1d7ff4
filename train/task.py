"""What a model family hands to the shared trainer.

The trainer (train/trainer.py) owns the loop, sharding, optimizer, checkpoints and metrics. A
family owns its data, model, loss and extra evaluation by subclassing `Task` in
`train/tasks/<family>.py` (class name `Task`); `config.family` selects the module.

Batches are dicts of numpy arrays with a leading batch axis; every leaf is sharded on that axis.
Loss metrics are dicts name -> (sum, count) so that averages over tokens stay exact across
gradient-accumulation micro-batches, devices and eval batches.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import grain
import jax
import numpy as np
from flax import nnx

Metrics = dict[str, tuple[jax.Array, jax.Array]]


@dataclasses.dataclass
class Datasets:
  """Tokenized examples (dicts of fixed-shape numpy arrays), indexable with grain."""
  train: grain.MapDataset
  eval: grain.MapDataset
  test: grain.MapDataset | None = None


class Task:
  """Base class of a model family. Subclasses override the methods marked 'required'."""

  def __init__(self, config):
    self.config = config
    self.tokenizer = None

  # ------------------------------------------------------------------ data
  def prepare(self, workdir: str) -> Datasets:
    """Required. Set `self.tokenizer` (load it from `workdir` when the run saved one, else train
    it and save it there) and return the tokenized datasets."""
    raise NotImplementedError

  def load_tokenizer(self, workdir: str) -> None:
    """Set `self.tokenizer` from a finished run's workdir (reloading without data)."""
    from data.tokenizers import load_tokenizer
    self.tokenizer = load_tokenizer(workdir)

  def train_batches(self, examples: grain.MapDataset, batch_size: int, seed: int) -> grain.MapDataset:
    """This process's training batches: an endless, seeded, deterministic MapDataset of batches.

    `examples` is already this process's slice. Override for length bucketing or stateful
    ordering (e.g. truncated BPTT streams).
    """
    return examples.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)

  def eval_batches(self, examples: grain.MapDataset, batch_size: int) -> grain.MapDataset:
    return examples.batch(batch_size, drop_remainder=True)

  # ------------------------------------------------------------------ model
  def build_model(self, rngs: nnx.Rngs) -> nnx.Module:
    """Required. A freshly initialised model (vocabulary sizes from `self.tokenizer`)."""
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

  # ------------------------------------------------------------------ after training
  def evaluate(self, model: nnx.Module, datasets: Datasets, workdir: str) -> dict[str, Any]:
    """Extra evaluation after the loop (BLEU, samples, accuracy, pictures). Default: none."""
    return {}

  def predict(self, model: nnx.Module, lines: list[str]) -> list[Any]:
    """`--mode=predict`: one JSON-serialisable output per input line."""
    raise NotImplementedError(f'--mode=predict is not available for family {self.config.family!r}.')

  def import_hf(self, hf_dir: str) -> nnx.Module:
    """`--mode=import_hf`: a model (and `self.tokenizer`) read from a Hugging Face directory."""
    raise NotImplementedError(f'--mode=import_hf is not available for family {self.config.family!r}.')

  def init_from(self, model: nnx.Module, source_workdir: str) -> None:
    """`config.init_from`: copy parameters from another run into `model`, in place."""
    raise NotImplementedError(f'config.init_from is not supported by family {self.config.family!r}.')

  def flops_per_token(self) -> float | None:
    """Training FLOPs per token (forward + backward), for MFU in benchmark mode."""
    return None


def get_task(config) -> Task:
  try:
    module = importlib.import_module(f'train.tasks.{config.family}')
  except ModuleNotFoundError as e:
    if e.name == f'train.tasks.{config.family}':
      raise ValueError(f'Unknown family {config.family!r}: no module train/tasks/{config.family}.py.') from e
    raise
  return module.Task(config)
