"""Text classification with a Transformer trained from scratch (and the pieces BERT's classify task shares).

Data: `data.classification` (bbc_news, tsv:<path>, tfds:), encoded as `[CLS] a [SEP] (b [SEP])`.
The label names found in the training split are saved in `config.data.labels` (JSON) with the
run, so a reloaded run predicts names without reading the data. Evaluation after training scores
the valid and test splits: accuracy, macro-F1 and the confusion matrix (JSON and PNG).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import classification
from data.lm import get_tokenizer
from models.classifier import ClassifierConfig, TransformerClassifier
from train import task as task_lib
from train.losses import classification_loss


# ----------------------------------------------------------------------------- shared with BERT
def saved_labels(config) -> list[str]:
  return json.loads(config.data.labels) if config.data.labels else []


def classification_datasets(task: task_lib.Task, workdir: str, tokenizer=None) -> task_lib.Datasets:
  """Read and split the data, set `task.tokenizer` (the given one, the run's saved one, or one
  trained on the training texts) and `config.data.labels` / `config.model.num_classes`."""
  config = task.config
  splits = classification.load_splits(config.data)
  labels = classification.label_names(splits['train'])
  previous = saved_labels(config)
  if previous and previous != labels:
    raise ValueError(f'config.data.labels={previous} (saved with this run) differ from the labels of the training '
                     f'data {labels}; use the data the run was trained on, or a fresh --workdir.')
  config.data.labels = json.dumps(labels)
  config.model.num_classes = len(labels)
  if tokenizer is None:
    texts = (t for e in splits['train'] for t in (e.text, e.text_b) if t)
    tokenizer = get_tokenizer(config.data, workdir, texts)
  else:
    tokenizer.save(workdir)
  task.tokenizer = tokenizer
  encode = lambda part: grain.MapDataset.source(
      classification.encode_examples(splits[part], tokenizer, labels, config.data.seq_len, split=part))
  return task_lib.Datasets(train=encode('train'), eval=encode('valid'), test=encode('test'))


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
  for name, examples in (('valid', datasets.eval), ('test', datasets.test)):
    if examples is None:
      continue
    predictions = batch_logits(logits_fn, examples, batch_size).argmax(-1)
    truth = np.asarray([examples[i]['label'] for i in range(len(examples))])
    metrics = classification.classification_metrics(truth, predictions, len(labels))
    results[f'{name}_accuracy'] = metrics['accuracy']
    results[f'{name}_macro_f1'] = metrics['macro_f1']
    report[name] = {'accuracy': metrics['accuracy'], 'macro_f1': metrics['macro_f1'], 'examples': len(truth),
                    'confusion': metrics['confusion'].tolist()}
  final = 'test' if 'test' in report else 'valid'
  path = os.path.join(workdir, 'confusion.png')
  classification.plot_confusion(np.asarray(report[final]['confusion']), labels, path,
                                f'{title}: {final} accuracy {report[final]["accuracy"]:.3f}, '
                                f'macro-F1 {report[final]["macro_f1"]:.3f}')
  with open(os.path.join(workdir, 'classification.json'), 'w') as f:
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
  examples = []
  for line in lines:
    a, b = split_pair(line)
    ids_b = tokenizer.encode(b) if b is not None else None
    tokens, segments, valid = classification.encode_pair(tokenizer.encode(a), ids_b, seq_len, tokenizer.bos_id,
                                                         tokenizer.eos_id, tokenizer.pad_id)
    examples.append({'tokens': tokens, 'segments': segments, 'valid': valid})
  probabilities = jax.nn.softmax(batch_logits(logits_fn, examples, batch_size), -1)
  return [{'label': labels[int(p.argmax())], 'probabilities': {n: round(float(q), 4) for n, q in zip(labels, p)}}
          for p in np.asarray(probabilities)]


def example_classification_batch(config, vocab_size: int, batch_size: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  seq_len = config.data.seq_len
  return {'tokens': rng.integers(5, vocab_size, (batch_size, seq_len), dtype=np.int32),
          'segments': np.zeros((batch_size, seq_len), np.int32), 'valid': np.ones((batch_size, seq_len), bool),
          'label': rng.integers(0, max(config.model.num_classes, 1), batch_size, dtype=np.int32)}


# ----------------------------------------------------------------------------- the family
class Task(task_lib.Task):

  def prepare(self, workdir):
    return classification_datasets(self, workdir)

  def model_config(self) -> ClassifierConfig:
    from models.attention import default_attention_implementation
    config = ClassifierConfig.from_config(self.config.model, self.tokenizer.vocab_size, self.config.model.num_classes)
    if config.num_classes < 2:
      raise ValueError(f'config.model.num_classes={config.num_classes}: the data must have at least 2 labels.')
    if config.attention == 'auto':
      config = ClassifierConfig(**{**config.__dict__, 'attention': default_attention_implementation()})
    return config

  def build_model(self, rngs):
    return TransformerClassifier(self.model_config(), rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    logits = model(batch['tokens'], batch['valid'], deterministic=deterministic)
    return classification_loss(logits, batch['label'], self.config.train.label_smoothing)

  def example_batch(self, batch_size):
    return example_classification_batch(self.config, self.tokenizer.vocab_size, batch_size)

  def _logits_fn(self, model):
    forward = nnx.jit(lambda m, tokens, valid: m(tokens, valid))
    return lambda batch: forward(model, batch['tokens'], batch['valid'])

  def evaluate(self, model, datasets, workdir):
    batch_size = self.config.train.eval_batch_size or self.config.train.batch_size
    return evaluate_classifier(self._logits_fn(model), datasets, saved_labels(self.config), workdir, batch_size,
                               'Transformer classifier')

  def predict(self, model, lines):
    return predict_labels(self._logits_fn(model), self.tokenizer, saved_labels(self.config),
                          self.config.data.seq_len, lines)
