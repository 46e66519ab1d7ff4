"""Scoring a model state on the validation split, during training and at the end.

Eval batches hold this process's rows of the whole validation split; the last one is filled with
weight-0 copies (data/batching.py), so every example counts once and every process runs the same
number of batches. During training `train.eval_steps` batches are scored (0: all); the final
evaluation (after training and in `--mode=eval`, the same function) scores them all and adds the
family's own evaluation (BLEU, samples, pictures).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from data import batching
from errors import UserError
from train import sharding
from train import state as state_lib
from train.metrics import MetricWriter, reduce_metrics
from train.state import TrainState


def eval_batches(setup):
  """This process's rows of every eval batch (`setup`: trainer.Setup)."""
  examples, batch_size = setup.task.prepared.datasets.eval, setup.task.eval_batch_size
  if len(examples) == 0:
    raise UserError('The eval split is empty; give a data.eval_source with examples (or more data to carve it from).')
  processes, index = jax.process_count(), jax.process_index()
  return batching.padded_batches(examples[index::processes], batch_size // processes,
                                 num_batches=-(-len(examples) // batch_size))


def batches_during_training(setup) -> int:
  """How many eval batches each evaluation during training scores (`train.eval_steps`, 0 = all)."""
  total = -(-len(setup.task.prepared.datasets.eval) // setup.task.eval_batch_size)
  return min(setup.config.train.eval_steps or total, total)


def describe(setup) -> str:
  """One line: how many validation examples each evaluation during training scores."""
  total, batch_size = len(setup.task.prepared.datasets.eval), setup.task.eval_batch_size
  scored = min(batches_during_training(setup) * batch_size, total)
  line = f'Each evaluation during training scores {scored} of the {total} validation examples'
  if scored < total:
    return line + (f' (train.eval_steps={setup.config.train.eval_steps}; 0 = all); the final evaluation '
                   f'scores all {total}.')
  return line + '.'


def evaluate_loss(setup, state: TrainState, num_batches: int | None = None) -> dict[str, float]:
  """Mean loss metrics (eval/...) over the first `num_batches` eval batches (None: the whole split)."""
  batches = eval_batches(setup)
  total = None
  for i in range(len(batches) if num_batches is None else min(num_batches, len(batches))):
    metrics = setup.eval_step(state.params, state.extra, sharding.global_batch(batches[i], setup.mesh))
    total = _add_metrics(total, metrics)
  return setup.task.summarize({f'eval/{k}': v for k, v in reduce_metrics(total).items()})


def _add_metrics(total: dict | None, metrics: dict) -> dict:
  metrics = jax.device_get(metrics)
  if total is None:
    return {k: [np.asarray(s, np.float64), np.asarray(c, np.float64)] for k, (s, c) in metrics.items()}
  for k, (s, c) in metrics.items():
    total[k][0] += s
    total[k][1] += c
  return total


def final_evaluation(setup, state: TrainState, workdir: str, writer: MetricWriter | None, step: int
                     ) -> dict[str, Any]:
  """What the final line reports about `state` (the checkpoint being scored): eval/... over the
  whole validation split, and the family's evaluation (test metrics, samples, pictures).

  With a `writer` (training), the family's metrics and pictures are logged at `step`; the
  whole-split eval/... are not (the loop logged eval/... for its own steps: one value per name and step)."""
  with sharding.use_mesh(setup.mesh):
    results = evaluate_loss(setup, state)
    print('Final evaluation, whole validation split: ' + ' '.join(f'{k}={v:.4f}' for k, v in results.items()),
          flush=True)
    model = state_lib.model_of(setup.spec, state)
    model.eval()
    family = setup.task.evaluate(model, workdir)
  scalars = {k: v for k, v in family.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if writer is not None and scalars:
    writer.write(step, scalars)
  for name, path in family.get('images', {}).items() if writer is not None else ():
    writer.write_image(step, name, path)
  return {**results, **family}
