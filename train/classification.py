"""What the two classification families share (the Transformer classifier and BERT's classify task):
data, evaluation and prediction of labels.

Data: `data.classification` (bbc_news, tsv:<path>, tfds:), encoded as `[CLS] a [SEP] (b [SEP])`
and read from example caches; the label names are those of the
training split, sorted, and become part of the model config.
Evaluation scores the eval and test splits (`eval/accuracy`, `eval/macro_f1`, `test/...`) and
writes the confusion matrix (classification.json and confusion.png).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import grain
import jax
import numpy as np

import storage
from data import classification
from data.tokenizers import bert_inputs
from train import task as task_lib


def classification_data(data_config, workdir: str, tokenizer=None) -> tuple[task_lib.Datasets, object, tuple[str, ...]]:
  """(datasets, tokenizer, label names): the given tokenizer, the run's saved one, or one trained
  on the training texts; the label names are those of the training split, sorted. Every source is
  read from an example cache (data/classification.py, labelled_datasets), built when missing."""
  tokenizer, splits, labels, caches = classification.labelled_datasets(data_config, workdir, tokenizer,
                                                                       jax.process_index(), jax.process_count())
  source = grain.MapDataset.source
  return task_lib.Datasets(train=source(splits['train']), eval=source(splits['valid']), test=source(splits['test']),
                           caches=caches), tokenizer, labels


def batch_logits(logits_fn: Callable, examples, batch_size: int) -> np.ndarray:
  """[N, C] logits of every example; the last partial batch is padded by repetition, then cut."""
  outputs = []
  for start in range(0, len(examples), batch_size):
    chunk = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
    size = len(chunk)
    chunk += [chunk[-1]] * (batch_size - size)
    batch = {k: np.stack([e[k] for e in chunk]) for k in chunk[0]}
    outputs.append(np.asarray(logits_fn(batch))[:size])
  return np.concatenate(outputs)


def evaluate_classifier(logits_fn: Callable, datasets: task_lib.Datasets, labels: list[str], workdir: str,
                        batch_size: int, title: str) -> dict:
  """Accuracy and macro-F1 of the valid and test splits; confusion matrices to JSON and PNG."""
  results, report = {}, {'labels': labels}
  for name, examples in (('eval', datasets.eval), ('test', datasets.test)):
    if examples is None:
      continue
    predictions = batch_logits(logits_fn, examples, batch_size).argmax(-1)
    truth = np.asarray([examples[i]['label'] for i in range(len(examples))])
    metrics = classification.classification_metrics(truth, predictions, len(labels))
    results[f'{name}/accuracy'] = metrics['accuracy']
    results[f'{name}/macro_f1'] = metrics['macro_f1']
    report[name] = {'accuracy': metrics['accuracy'], 'macro_f1': metrics['macro_f1'], 'examples': len(truth),
                    'confusion': metrics['confusion'].tolist()}
  final = 'test' if 'test' in report else 'eval'
  path = os.path.join(workdir, 'confusion.png')
  classification.plot_confusion(np.asarray(report[final]['confusion']), labels, path,
                                f'{title}: {final} accuracy {report[final]["accuracy"]:.3f}, '
                                f'macro-F1 {report[final]["macro_f1"]:.3f}')
  with storage.path(os.path.join(workdir, 'classification.json')).open('w') as f:
    json.dump(report, f, indent=1)
  print(' '.join(f'{k}={v:.4f}' for k, v in results.items()) + f'  confusion matrix: {path}', flush=True)
  return {**results, 'images': {'confusion': path}}


def split_pair(line: str) -> tuple[str, str | None]:
  """A predict input line: 'text', or 'text_a<TAB>text_b' for pairs."""
  a, tab, b = line.partition('\t')
  return a, (b if tab else None)


def predict_labels(logits_fn: Callable, tokenizer, labels: list[str], seq_len: int, lines: list[str],
                   batch_size: int = 32) -> list[dict]:
  """{'label', 'probabilities': {name: p}} per input line."""
  texts = [split_pair(line) for line in lines]
  tokens, segments, valid, _ = bert_inputs([tokenizer.encode(a) for a, _ in texts],
                                           [tokenizer.encode(b) if b is not None else None for _, b in texts],
                                           seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
  examples = [{'tokens': t, 'segments': s, 'valid': v} for t, s, v in zip(tokens, segments, valid)]
  probabilities = jax.nn.softmax(batch_logits(logits_fn, examples, batch_size), -1)
  return [{'label': labels[int(p.argmax())], 'probabilities': {n: round(float(q), 4) for n, q in zip(labels, p)}}
          for p in np.asarray(probabilities)]


def truncation_notes(tokenizer, seq_len: int, lines: list[str]) -> list[str]:
  """Notes for the lines `bert_inputs` cuts: [CLS] a [SEP] (b [SEP]) holds seq_len tokens."""
  notes = []
  for number, line in enumerate(lines, 1):
    a, b = split_pair(line)
    length = len(tokenizer.encode(a)) + (len(tokenizer.encode(b)) + 3 if b is not None else 2)
    if length > seq_len:
      notes.append(f'input {number} has {length} tokens with [CLS]/[SEP]; the model read only {seq_len} '
                   f'(data.seq_len); the end of the longer text was cut.')
  return notes


def example_classification_batch(model_config, seq_len: int, batch_size: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {'tokens': rng.integers(5, model_config.vocab_size, (batch_size, seq_len), dtype=np.int32),
          'segments': np.zeros((batch_size, seq_len), np.int32), 'valid': np.ones((batch_size, seq_len), bool),
          'label': rng.integers(0, max(model_config.num_classes, 1), batch_size, dtype=np.int32)}
