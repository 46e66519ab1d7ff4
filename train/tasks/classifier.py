"""Text classification with a Transformer trained from scratch.

Data, evaluation and prediction are shared with BERT's classify task (train/classification.py).
The label names found in the training split are part of the model config (`labels`, saved in the
run's model.json), so a reloaded run predicts names without reading the data.
"""
from __future__ import annotations


from flax import nnx

from data import batching
from errors import ConfigError
from models.classifier import POOLINGS, ClassifierConfig, TransformerClassifier
from train import evaluation
from train import task as task_lib
from train.classification import (classification_data, evaluate_classifier, example_classification_batch,
                                  predict_labels, truncation_notes)
from train.losses import classification_loss, example_weights


def validate(config):
  if config.data.seq_len > config.model.max_len:
    raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds config.model.max_len='
                      f'{config.model.max_len}; raise model.max_len or lower data.seq_len.')
  if config.model.pooling not in POOLINGS:
    raise ConfigError(f'config.model.pooling={config.model.pooling!r} is not one of {POOLINGS}.')
  if config.data.min_bucket_len < 0:
    raise ConfigError(f'config.data.min_bucket_len={config.data.min_bucket_len} is negative; give the shortest '
                      f'padded training length (e.g. 64), or 0 to pad every batch to data.seq_len.')
  if config.train.z_loss:
    raise ConfigError(f'config.train.z_loss={config.train.z_loss}: the classifier has no z-loss (it is for '
                      f'vocabulary softmaxes); leave train.z_loss at 0.')


class Task(task_lib.Task):
  model_config_class = ClassifierConfig
  final_test = 'scored'  # the final evaluation scores the test split (train/evaluation.py final_counts)

  @classmethod
  def prepare(cls, config, workdir, platform=None):
    datasets, tokenizer, labels = classification_data(config.data, workdir)
    model_config = cls.resolve_model_config(config, platform, **cls.resolved_from_tokenizer(config, tokenizer),
                                            num_classes=len(labels), labels=labels)
    return task_lib.Prepared(tokenizer, model_config, datasets)

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': tokenizer.vocab_size}

  def batch_plan(self):
    """Texts of similar lengths batched together, each batch cut to a bucket length
    (data.min_bucket_len > 0), or every batch padded to data.seq_len."""
    data = self.config.data
    if data.min_bucket_len:
      return batching.LengthBuckets(self.tokenizer.pad_id, data.seq_len, data.min_bucket_len, ('tokens',))
    return batching.Shuffled()

  def build_model(self, rngs):
    return TransformerClassifier(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    logits = model(batch['tokens'], batch['valid'], deterministic=deterministic)
    return classification_loss(logits, batch['label'], self.config.train.label_smoothing, example_weights(batch))

  def example_batch(self, batch_size):
    return example_classification_batch(self.model_config, self.config.data.seq_len, batch_size)

  def _logits_fn(self, model):
    forward = nnx.jit(lambda m, tokens, valid: m(tokens, valid))
    return lambda batch: forward(model, batch['tokens'], batch['valid'])

  def evaluate(self, model, workdir):
    return evaluate_classifier(self._logits_fn(model), evaluation.final_datasets(self.prepared.datasets, self.config),
                               list(self.model_config.labels), workdir, self.eval_batch_size, 'Transformer classifier')

  def predict_truncation(self, lines):
    return truncation_notes(self.tokenizer, self.config.data.seq_len, lines)

  def predict(self, model, lines, workdir):
    return predict_labels(self._logits_fn(model), self.tokenizer, list(self.model_config.labels),
                          self.config.data.seq_len, lines)
