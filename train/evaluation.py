"""Scoring a model state on the validation split, during training and at the end.

Eval batches hold this process's rows of the validation split; the last one is filled with
weight-0 copies (data/batching.py), so every example counts once and every process runs the same
number of batches. During training the first `train.eval_steps` batches are scored (0: all). The
final evaluation (after training and in `--mode=eval`, the same function, so the two print the same
digits) scores `train.final_eval_examples` of the validation split and adds the family's own
evaluation (BLEU, accuracy, samples, pictures), which bounds the splits it scores the same way
(`final_subset`; translation decodes `train.final_decode_examples` test pairs). A bounded split is
scored at evenly spaced examples (`final_indices`): the same every run, spread over the whole split.
The run's first lines say what the final evaluation will score (`describe_final`), and the first
evaluation during training how long that should take at its rate (`describe_cost`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain
import jax
import numpy as np

from data import batching
from errors import UserError
from train import sharding
from train import state as state_lib
from train.metrics import MetricWriter, reduce_metrics
from train.state import TrainState


def final_eval_examples(config) -> int:
  """train.final_eval_examples (0 = all; a config saved before the key: all, as then)."""
  return int(config.train.get('final_eval_examples', 0))


def final_decode_examples(config) -> int:
  """train.final_decode_examples (0 = all; a config saved before the key: all, as then)."""
  return int(config.train.get('final_decode_examples', 0))


def final_indices(total: int, limit: int) -> Sequence[int]:
  """The examples of a split of `total` that a final evaluation bounded to `limit` scores: all, in
  order, when `limit` is 0 or at least `total`; else `limit` evenly spaced ones, (i * total) // limit
  for i < limit, in order (the same every run, whatever the process count)."""
  if not limit or total <= limit:
    return range(total)
  return [i * total // limit for i in range(limit)]


def final_subset(examples, limit: int):
  """`examples` (a random-access dataset) itself when `limit` (0 = all) holds it, else the
  `final_indices` of it as a grain.MapDataset."""
  if not limit or len(examples) <= limit:
    return examples
  indices = final_indices(len(examples), limit)
  return grain.MapDataset.range(len(indices)).map(lambda i: examples[indices[i]])


def final_datasets(datasets, config):
  """`datasets` (task.Datasets) with its validation and test splits bounded as the final evaluation
  scores them (`final_subset` of train.final_eval_examples): what a family's `evaluate` reads."""
  limit = final_eval_examples(config)
  return dataclasses.replace(datasets, eval=final_subset(datasets.eval, limit),
                             test=None if datasets.test is None else final_subset(datasets.test, limit))


def eval_batches(setup, limit: int = 0):
  """This process's rows of every eval batch (`setup`: trainer.Setup) of the validation split, or of
  its `final_subset` of `limit` examples (0: the whole split)."""
  examples, batch_size = setup.task.prepared.datasets.eval, setup.task.eval_batch_size
  if len(examples) == 0:
    raise UserError('The eval split is empty; give a data.eval_source with examples (or more data to carve it from).')
  examples = final_subset(examples, limit)
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
    return line + f' (train.eval_steps={setup.config.train.eval_steps}; 0 = all).'
  return line + '.'


def final_counts(setup) -> dict[str, tuple[int, int]]:
  """{what the final evaluation scores: (examples, of the split's)}: the validation split, and the test
  split where the family scores it ('test') and decodes it ('decoded test'), by the task's
  `final_test` ('scored' | 'decoded'; none: the family scores no test split)."""
  datasets, config = setup.task.prepared.datasets, setup.config
  counts = {'validation': len(datasets.eval)}
  test = getattr(setup.task, 'final_test', '')
  if test and datasets.test is not None:
    counts['test'] = len(datasets.test)
    if test == 'decoded':
      counts['decoded test'] = len(datasets.test)
  return {what: (len(final_indices(total, final_decode_examples(config) if what == 'decoded test'
                                   else final_eval_examples(config))), total) for what, total in counts.items()}


def describe_final(setup) -> str:
  """One line: how many examples of each split the final evaluation will score."""
  config, counts = setup.config, final_counts(setup)
  line = 'The final evaluation will score ' + ' and '.join(
      _examples(*counts[what], what) for what in ('validation', 'test') if what in counts)
  keys = f'train.final_eval_examples={final_eval_examples(config)}'
  if 'decoded test' in counts:
    line += f', and decode {_examples(*counts["decoded test"], "test")}'
    keys += f', train.final_decode_examples={final_decode_examples(config)}'
  return line + f' ({keys}; 0 = all; a larger split evenly spaced), timed at the first evaluation.'


def _examples(scored: int, total: int, split: str) -> str:
  """'all 222 test examples', '50000 of the 186641 validation examples'."""
  return f'all {total} {split} examples' if scored == total else f'{scored} of the {total} {split} examples'


def describe_cost(setup, seconds: float) -> str:
  """One line: the final evaluation's time at the rate of an evaluation during training that took
  `seconds` (compilation excluded); decoding, which costs far more per example than a loss, is not
  estimated."""
  batch_size, counts = setup.task.eval_batch_size, final_counts(setup)
  rate = batches_during_training(setup) * batch_size / max(seconds, 1e-6)
  examples = sum(-(-scored // batch_size) * batch_size for what, (scored, _) in counts.items()
                 if what != 'decoded test')  # in whole batches
  line = (f'The final evaluation should take about {_duration(examples / rate)} to score {examples} examples at this '
          f'evaluation\'s {rate:,.0f} examples/s (compilation excluded)')
  if 'decoded test' in counts:
    line += f', and longer to decode {counts["decoded test"][0]} test examples (greedy and beam search)'
  return line + '.'


def _duration(seconds: float) -> str:
  """'under a second', '45 s', '12 min', '3.5 h'."""
  if seconds < 1:
    return 'under a second'
  if seconds < 120:
    return f'{seconds:.0f} s'
  return f'{seconds / 60:.0f} min' if seconds < 7200 else f'{seconds / 3600:.1f} h'


def evaluate_loss(setup, state: TrainState, num_batches: int | None = None, limit: int = 0) -> dict[str, float]:
  """Mean loss metrics (eval/...) over the first `num_batches` eval batches (None: all of them) of the
  validation split, or of its `final_subset` of `limit` examples (0: the whole split)."""
  batches = eval_batches(setup, limit)
  total = None
  for i in range(len(batches) if num_batches is None else min(num_batches, len(batches))):
    metrics = setup.eval_step(state.params, state.frozen, state.extra,
                              sharding.global_batch(batches[i], setup.mesh))
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
  """What the final line reports about `state` (the checkpoint being scored): eval/... over
  `train.final_eval_examples` of the validation split (`final_subset`), and the family's evaluation
  (test metrics, samples, pictures), bounded likewise.

  With a `writer` (training), the family's metrics and pictures are logged at `step`; the final
  eval/... are not (the loop logged eval/... for its own steps: one value per name and step)."""
  scored, total = final_counts(setup)['validation']
  with sharding.use_mesh(setup.mesh):
    results = evaluate_loss(setup, state, limit=final_eval_examples(setup.config))
    what = 'whole validation split' if scored == total else f'{scored} of the {total} validation examples'
    print(f'Final evaluation, {what}: ' + ' '.join(f'{k}={v:.4f}' for k, v in results.items()), flush=True)
    model = state_lib.model_of(setup.spec, state)
    model.eval()
    family = setup.task.evaluate(model, workdir)
  scalars = {k: v for k, v in family.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if writer is not None and scalars:
    writer.write(step, scalars)
  for name, path in family.get('images', {}).items() if writer is not None else ():
    writer.write_image(step, name, path)
  return {**results, **family}
