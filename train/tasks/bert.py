"""BERT: pretraining (masked LM + next sentence), classification fine-tuning, features, HF import.

`config.task` selects the data, loss and evaluation; the model config's `heads` (resolved from the
task, with the class names for 'classifier', and saved in the run's model.json) selects the model a
checkpoint holds: 'pretraining' (BertForPretraining), 'classifier' (BertClassifier) or 'none' (the
bare BertEncoder). A run trained for one task can be reloaded for another
(`load_run(workdir, config_overrides={'task': 'features'})`): the heads follow the checkpoint, the
behaviour follows the task.

Fine-tuning starts from another run with `config.init_from=<workdir>` (a pretraining run, or a
Hugging Face checkpoint imported with --mode=import_hf): that run's tokenizer and model sizes are
adopted in `prepare`, and `init_from` copies its encoder (the pretraining heads too when both runs
pretrain). A fine-tuning run may ask for more positions (`model.max_len`) than its source has:
the source's position vectors fill the first rows and the others are learned in fine-tuning.
"""
from __future__ import annotations

import dataclasses
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import storage
from data import batching, bert_data
from data.tokenizers import bert_inputs, load_tokenizer
from errors import ConfigError
from models import lora
from models.bert import BertConfig, BertEncoder, BertForPretraining, build_bert
from train import evaluation
from train import task as task_lib
from train.lora import enabled as lora_enabled
from train.rundir import run_config
from train.losses import classification_loss, example_weights, token_cross_entropy, token_losses
from train import classification

HEADS = {'pretrain': 'pretraining', 'classify': 'classifier', 'features': 'none'}  # config.task -> model heads
TASKS = tuple(HEADS)
# Model sizes a fine-tuning run takes from the run it starts from.
ARCHITECTURE_KEYS = ('vocab_size', 'vocab_multiple', 'max_len', 'type_vocab_size', 'num_layers', 'num_heads', 'width', 'mlp_dim',
                     'layer_norm_epsilon', 'activation', 'qk_norm')


def pretraining_loss(model: BertForPretraining, batch, *, deterministic: bool, z_loss: float = 0.0):
  """MLM cross-entropy over the chosen positions + NSP cross-entropy (+ the MLM's z-loss, z_loss *
  log(Z)^2 averaged like the MLM loss, when z_loss > 0) -> (loss, metrics). The 'loss' metric is the
  two cross-entropies alone; the z-loss is reported as 'z_loss'."""
  out = model(batch['tokens'], batch['segments'], batch['valid'], masked_positions=batch['masked_positions'],
              deterministic=deterministic)
  weights = example_weights(batch, batch['masked_weights'])  # [B, P]
  mlm, mlm_z, mlm_correct = token_losses(out.mlm_logits, batch['masked_labels'], z_loss=z_loss)
  mlm_count = weights.sum()
  mlm_sum = (mlm * weights).sum()
  mlm_correct = (mlm_correct * weights).sum()
  nsp, nsp_correct = token_cross_entropy(out.nsp_logits, batch['next_sentence'])
  rows = example_weights(batch, jnp.ones(nsp.shape))  # [B]
  examples = rows.sum()
  nsp_sum = (nsp * rows).sum()
  loss = mlm_sum / jnp.maximum(mlm_count, 1.0) + nsp_sum / jnp.maximum(examples, 1.0)
  metrics = {'loss': (loss * examples, examples), 'mlm_loss': (mlm_sum, mlm_count),
             'mlm_accuracy': (mlm_correct, mlm_count), 'nsp_loss': (nsp_sum, examples),
             'nsp_accuracy': ((nsp_correct * rows).sum(), examples)}
  if not z_loss:
    return loss, metrics
  z_sum = (mlm_z * weights).sum()
  return loss + z_sum / jnp.maximum(mlm_count, 1.0), {**metrics, 'z_loss': (z_sum, mlm_count)}


def encoder_of(model: nnx.Module) -> BertEncoder:
  return model if isinstance(model, BertEncoder) else model.encoder


def validate(config):
  if config.task not in TASKS:
    raise ConfigError(f'config.task={config.task!r} is not one of {TASKS}.')
  if config.data.seq_len > config.model.max_len:
    raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds config.model.max_len='
                      f'{config.model.max_len} learned positions; raise model.max_len or lower data.seq_len.')
  if config.task == 'pretrain' and config.data.max_predictions < round(config.data.mask_prob * config.data.seq_len):
    raise ConfigError(f'config.data.max_predictions={config.data.max_predictions} is below mask_prob x seq_len = '
                      f'{round(config.data.mask_prob * config.data.seq_len)}; raise it.')
  if config.data.tokenizer != 'wordpiece':
    raise ConfigError(f"config.data.tokenizer={config.data.tokenizer!r}: BERT needs 'wordpiece' ([CLS], [SEP], "
                      f"[MASK] tokens).")
  if config.task != 'pretrain' and config.train.z_loss:
    raise ConfigError(f'config.train.z_loss={config.train.z_loss}: only BERT pretraining (its MLM head) has a '
                      f'z-loss, not config.task={config.task!r}; leave train.z_loss at 0.')
  if config.features.pooling not in ('none', 'cls', 'mean'):
    raise ConfigError(f"config.features.pooling={config.features.pooling!r}: use 'none', 'cls' or 'mean'.")


class Task(task_lib.Task):
  model_config_class = BertConfig
  lora_heads = ('classifier',)  # a classifier's output layer is new: a LoRA fine-tuning trains it in full

  @property
  def final_test(self) -> str:
    """'scored': a classifier's final evaluation scores the test split (train/evaluation.py final_counts)."""
    return 'scored' if self.config.task == 'classify' else ''

  # ------------------------------------------------------------------ data
  @classmethod
  def prepare(cls, config, workdir, platform=None):
    task = config.task
    if task == 'features':
      raise ConfigError('config.task=features has no training: use it with --mode=predict (or import_hf); '
                        'train with config.task=pretrain or classify.')
    source = cls._source_run(config.init_from) if config.init_from else None
    tokenizer = source[1] if source else None
    masker = None  # pretraining: draws the MLM positions of every training example
    if task == 'classify':
      datasets, tokenizer, labels = classification.classification_data(config.data, workdir, tokenizer)
      resolved = {'num_classes': len(labels), 'labels': labels}
    else:
      datasets, tokenizer, masker = cls._pretraining_datasets(config, workdir, tokenizer)
      resolved = {}
    model_config = cls.resolve_model_config(config, platform, **cls.resolved_from_tokenizer(config, tokenizer),
                                            **resolved)
    if source:
      model_config = cls._with_source_architecture(config, model_config, source[0])
    return task_lib.Prepared(tokenizer, model_config, datasets, family_data=masker)

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': config.model.vocab_size or tokenizer.vocab_size, 'heads': HEADS[config.task]}

  @staticmethod
  def _source_run(source: str) -> tuple[BertConfig, object]:
    """(model config, tokenizer) of the run fine-tuning starts from (they must match its weights)."""
    source_config, source_model = run_config(source)
    if source_config.family != 'bert':
      raise ConfigError(f'config.init_from={source} is a {source_config.family!r} run; BERT starts from a bert run.')
    return source_model, load_tokenizer(source)

  @staticmethod
  def _with_source_architecture(config, model_config: BertConfig, source: BertConfig) -> BertConfig:
    """The sizes of the run fine-tuning starts from; positions: at least the source's, more when
    this run asks for more (positions past the source's start untrained, see `init_from`)."""
    changed = {k: getattr(source, k) for k in ARCHITECTURE_KEYS
               if k != 'max_len' and getattr(model_config, k) != getattr(source, k)}
    if source.max_len > model_config.max_len or lora_enabled(config.train):  # LoRA: no new (frozen) positions
      changed['max_len'] = source.max_len
    if changed:
      print(f'init_from {config.init_from}: model sizes taken from that run: {changed}', flush=True)
    model_config = dataclasses.replace(model_config, **changed)
    if model_config.max_len > source.max_len:
      print(f'init_from {config.init_from}: positions {source.max_len}..{model_config.max_len - 1} are new '
            f'(that run has {source.max_len}); they start from random values.', flush=True)
    if config.data.seq_len > model_config.max_len:
      raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds the {model_config.max_len} '
                        f'positions of {config.init_from}; lower data.seq_len.')
    return model_config

  @staticmethod
  def _pretraining_datasets(config, workdir, tokenizer):
    """Sentence pairs read from example caches (data/bert_data.py, pretraining_datasets), built when missing."""
    data, seed = config.data, config.seed
    tokenizer, examples, caches = bert_data.pretraining_datasets(data, workdir, seed, tokenizer, jax.process_index(),
                                                                 jax.process_count())
    masker = bert_data.Masker(tokenizer, data.mask_prob, data.max_predictions)
    print(f'BERT pretraining: {len(examples["train"])} train and {len(examples["valid"])} eval sentence pairs, '
          f'vocabulary {tokenizer.vocab_size}.', flush=True)
    # Eval masks are drawn once (fixed seed) so that every evaluation scores the same positions.
    datasets = task_lib.Datasets(train=grain.MapDataset.source(examples['train']),
                                 eval=grain.MapDataset.source(examples['valid']).random_map(masker, seed=seed + 2),
                                 caches=caches)
    return datasets, tokenizer, masker

  def batch_plan(self):
    if self.config.task != 'pretrain':
      return batching.Shuffled()
    # Masks are drawn per position of the endless order, so every epoch gets new ones; their seed
    # (seed + 3) is apart from the eval masks' (seed + 2).
    return batching.Shuffled(draw=self.prepared.family_data, draw_seed_offset=3)

  # ------------------------------------------------------------------ model
  def build_model(self, rngs):
    return build_bert(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    if self.config.task == 'pretrain':
      return pretraining_loss(model, batch, deterministic=deterministic, z_loss=self.config.train.z_loss)
    logits = model(batch['tokens'], batch['segments'], batch['valid'], deterministic=deterministic)
    return classification_loss(logits, batch['label'], self.config.train.label_smoothing, example_weights(batch))

  def example_batch(self, batch_size):
    c = self.model_config
    if self.config.task != 'pretrain':
      return classification.example_classification_batch(c, self.config.data.seq_len, batch_size)
    rng = np.random.default_rng(0)
    seq_len, predictions = self.config.data.seq_len, self.config.data.max_predictions
    return {'tokens': rng.integers(5, c.vocab_size, (batch_size, seq_len), dtype=np.int32),
            'segments': (np.arange(seq_len) >= seq_len // 2).astype(np.int32)[None].repeat(batch_size, 0),
            'valid': np.ones((batch_size, seq_len), bool),
            'next_sentence': rng.integers(0, 2, batch_size, dtype=np.int32),
            'masked_positions': np.sort(rng.choice(np.arange(1, seq_len), (batch_size, predictions)), -1
                                        ).astype(np.int32),
            'masked_labels': rng.integers(5, c.vocab_size, (batch_size, predictions), dtype=np.int32),
            'masked_weights': np.ones((batch_size, predictions), np.float32)}

  def flops_per_token(self):
    """6N + 12 L T E with N the non-embedding parameters; the MLM head runs on ~15% of positions."""
    c = self.model_config
    per_layer = 4 * c.width ** 2 + 2 * c.width * c.mlp_dim
    head = self.config.data.max_predictions / self.config.data.seq_len * (c.width ** 2 + c.width * c.vocab_size)
    return 6 * (c.num_layers * per_layer + head) + 12 * c.num_layers * self.config.data.seq_len * c.width

  # ------------------------------------------------------------------ fine-tuning and import
  def init_from(self, model, source):
    both_pretrain = isinstance(model, BertForPretraining) and isinstance(source, BertForPretraining)
    target, origin = (model, source) if both_pretrain else (encoder_of(model), encoder_of(source))
    wanted = nnx.state(target, lora.BASE)  # a LoRA run's adapters start as they are (train/lora.py)
    given = nnx.to_pure_dict(nnx.state(origin, nnx.Param))
    ours = nnx.to_pure_dict(wanted)
    # More positions than the source: its rows fill the first positions, the rest keep their init.
    positions_of = lambda tree: (tree if 'embeddings' in tree else tree['encoder'])['embeddings']['position']
    ours_positions, given_positions = positions_of(ours), positions_of(given)
    old_rows, new_rows = given_positions['embedding'].shape[0], ours_positions['embedding'].shape[0]
    copied = sum(x.size for x in jax.tree.leaves(given))
    if old_rows < new_rows and given_positions['embedding'].shape[1:] == ours_positions['embedding'].shape[1:]:
      given_positions['embedding'] = ours_positions['embedding'].at[:old_rows].set(given_positions['embedding'])
    shape = lambda tree: jax.tree.map(lambda x: x.shape, tree)
    if shape(ours) != shape(given):
      raise ConfigError(f'config.init_from={self.config.init_from} holds a BERT of different sizes; its model.json '
                        f'must match this run.')
    nnx.replace_by_pure_dict(wanted, given)
    nnx.update(target, wanted)
    print(f'init_from {self.config.init_from}: copied the {"whole model" if both_pretrain else "encoder"} '
          f'({copied} parameters'
          f'{f", positions {old_rows}..{new_rows - 1} new" if old_rows < new_rows else ""}).', flush=True)

  def export_hf(self, model, out_dir):
    """BertForPreTraining (pretrain), BertForSequenceClassification with the run's label names
    (classify) or BertModel (features)."""
    from interop.hf_bert import export_bert
    return export_bert(model, self.tokenizer, out_dir, labels=list(getattr(self.model_config, 'labels', ())))

  def export_hf_adapter(self, model, out_dir, train_config):
    """The LoRA adapters as a PEFT adapter of the base run's BertForPreTraining (pretrain), or of the
    BertForSequenceClassification built on it (classify), its head saved whole (`lora_heads`)."""
    from interop.peft import export_bert_adapter
    return export_bert_adapter(model, out_dir, rank=train_config.lora_rank, alpha=train_config.lora_alpha,
                               dropout=train_config.lora_dropout, trained_in_full=self.lora_heads)

  @classmethod
  def import_hf(cls, config, hf_dir, rngs):
    from interop.hf_bert import import_bert
    from models.attention import resolve_compute_dtype
    task = config.task
    if task == 'classify':
      raise ConfigError('Import with --config.task=pretrain (or features), then fine-tune with --config.task=classify '
                        '--config.init_from=<the imported workdir>.')
    model, tokenizer, bert, heads_loaded = import_bert(hf_dir, rngs=rngs,
                                                       dtype=resolve_compute_dtype(config.model.dtype),
                                                       vocab_multiple=config.model.vocab_multiple,
                                                       attention='xla')
    if task == 'features':
      model = model.encoder
    elif not heads_loaded:
      print(f'{hf_dir} has no pretraining heads: the MLM transform and NSP layer start from random values.',
            flush=True)
    model_config = dataclasses.replace(model.config, heads=HEADS[task])
    return task_lib.Prepared(tokenizer, model_config), model

  # ------------------------------------------------------------------ after training
  def _logits_fn(self, model):
    forward = nnx.jit(lambda m, t, s, v: m(t, s, v))
    return lambda batch: forward(model, batch['tokens'], batch['segments'], batch['valid'])

  def evaluate(self, model, workdir):
    if self.config.task == 'classify':
      return classification.evaluate_classifier(self._logits_fn(model),
                                                 evaluation.final_datasets(self.prepared.datasets, self.config),
                                                 list(self.model_config.labels), workdir, self.eval_batch_size, 'BERT')
    return {}  # pretraining: the trainer's eval/... over the validation split say it all

  def predict_truncation(self, lines):
    return classification.truncation_notes(self.tokenizer, self.config.data.seq_len, lines)

  def predict(self, model, lines, workdir):
    if self.config.task == 'classify':
      if self.model_config.heads != 'classifier':
        raise ConfigError('This run has no classifier head; predict with config.task=features (or fill-mask with '
                          'config.task=pretrain on a pretraining run).')
      return classification.predict_labels(self._logits_fn(model), self.tokenizer, list(self.model_config.labels),
                                            self.config.data.seq_len, lines)
    if self.config.task == 'features':
      return self.write_features(model, lines, workdir)
    return self.fill_masks(model, lines)

  def _encode_lines(self, lines):
    """[N, L] tokens, segments, valid for 'text' or 'a<TAB>b' lines (L = the longest, <= seq_len)."""
    tok = self.tokenizer
    ids = []
    for line in lines:
      a, b = classification.split_pair(line)
      ids.append((tok.encode(a), tok.encode(b) if b is not None else None))
    length = min(self.config.data.seq_len, max(len(a) + len(b or []) + (3 if b is not None else 2) for a, b in ids))
    tokens, segments, valid, _ = bert_inputs([a for a, _ in ids], [b for _, b in ids], length, tok.bos_id,
                                             tok.eos_id, tok.pad_id)
    return tokens, segments, valid

  def write_features(self, model, lines, workdir):
    """One .npy per line: [T, E] token vectors ('none'), or [E] ('cls', 'mean') of the chosen layer(s)."""
    settings = self.config.features
    directory = settings.output_dir or os.path.join(workdir, 'features')
    storage.path(directory).mkdir(parents=True, exist_ok=True)
    encoder = encoder_of(model)
    forward = nnx.jit(lambda m, t, s, v: m(t, s, v).hidden_states)
    outputs = []
    for start in range(0, len(lines), 32):
      tokens, segments, valid = self._encode_lines(lines[start:start + 32])
      hidden = forward(encoder, tokens, segments, valid)
      if settings.mean_last:
        states = jnp.mean(jnp.stack(hidden[-settings.mean_last:]), 0)
      else:
        states = hidden[settings.layer]
      states = np.asarray(states, np.float32)
      for row, (vectors, mask, ids) in enumerate(zip(states, valid, tokens)):
        if settings.pooling == 'cls':
          array = vectors[0]
        elif settings.pooling == 'mean':
          array = vectors[mask].mean(0)
        else:
          array = vectors[mask]
        path = os.path.join(directory, f'{start + row:06d}.npy')
        with storage.path(path).open('wb') as f:
          np.save(f, array)
        outputs.append({'file': path, 'shape': list(array.shape),
                        'tokens': [self.tokenizer.id_to_token(int(i)) for i in ids[mask]]})
    return outputs

  def fill_masks(self, model, lines, top_k: int = 5):
    """Pretraining runs: the top-k tokens for each [MASK] of each line."""
    if not isinstance(model, BertForPretraining):
      raise ConfigError('This checkpoint has no MLM head; predict with config.task=features or classify.')
    mask_id = self.tokenizer.token_id('[MASK]')
    forward = nnx.jit(lambda m, t, s, v: m(t, s, v).mlm_logits)
    tokens, segments, valid = self._encode_lines(lines)
    logits = np.asarray(forward(model, tokens, segments, valid))
    outputs = []
    for row, line in enumerate(lines):
      fills = []
      for position in np.flatnonzero(tokens[row] == mask_id):
        best = np.argsort(-logits[row, position])[:top_k]
        fills.append([self.tokenizer.id_to_token(int(i)) for i in best])
      outputs.append({'masks': fills} if fills else {'error': 'no [MASK] token in the line'})
    return outputs
