"""BERT: pretraining (masked LM + next sentence), classification fine-tuning, features, HF import.

`config.task` selects the data, loss and evaluation; `config.model.heads` (filled in from the task
and saved with the run) selects the model a checkpoint holds: 'pretraining' (BertForPretraining),
'classifier' (BertClassifier) or 'none' (the bare BertEncoder). A run trained for one task can be
reloaded for another (`load_run(workdir, config_overrides={'task': 'features'})`): the heads follow
the checkpoint, the behaviour follows the task.

Fine-tuning starts from another run with `config.init_from=<workdir>` (a pretraining run, or a
Hugging Face checkpoint imported with --mode=import_hf): that run's tokenizer and model sizes are
adopted in `prepare`, and `init_from` copies its encoder (the pretraining heads too when both runs
pretrain). A fine-tuning run may ask for more positions (`model.max_len`) than its source has:
the source's position vectors fill the first rows and the others are learned in fine-tuning.
"""
from __future__ import annotations

import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from data import bert_data
from data.lm import get_tokenizer
from models.bert import BertClassifier, BertConfig, BertEncoder, BertForPretraining
from train import task as task_lib
from train.losses import classification_loss
from train.tasks import classifier as classifier_task

HEADS = {'pretrain': 'pretraining', 'classify': 'classifier', 'features': 'none'}
# Model sizes a fine-tuning run takes from the run it starts from.
ARCHITECTURE_KEYS = ('vocab_size', 'max_len', 'type_vocab_size', 'num_layers', 'num_heads', 'width', 'mlp_dim',
                     'layer_norm_epsilon', 'activation')


def pretraining_loss(model: BertForPretraining, batch, *, deterministic: bool):
  """MLM cross-entropy over the chosen positions + NSP cross-entropy -> (loss, metrics)."""
  out = model(batch['tokens'], batch['segments'], batch['valid'], masked_positions=batch['masked_positions'],
              deterministic=deterministic)
  weights = batch['masked_weights'].astype(jnp.float32)
  mlm = optax.softmax_cross_entropy_with_integer_labels(out.mlm_logits, batch['masked_labels'])
  mlm_count = weights.sum()
  mlm_sum = (mlm * weights).sum()
  mlm_correct = ((out.mlm_logits.argmax(-1) == batch['masked_labels']) * weights).sum()
  nsp = optax.softmax_cross_entropy_with_integer_labels(out.nsp_logits, batch['next_sentence'])
  batch_size = jnp.asarray(nsp.shape[0], jnp.float32)
  nsp_correct = (out.nsp_logits.argmax(-1) == batch['next_sentence']).sum().astype(jnp.float32)
  loss = mlm_sum / jnp.maximum(mlm_count, 1.0) + nsp.mean()
  return loss, {'loss': (loss * batch_size, batch_size), 'mlm_loss': (mlm_sum, mlm_count),
                'mlm_accuracy': (mlm_correct, mlm_count), 'nsp_loss': (nsp.sum(), batch_size),
                'nsp_accuracy': (nsp_correct, batch_size)}


def encoder_of(model: nnx.Module) -> BertEncoder:
  return model if isinstance(model, BertEncoder) else model.encoder


class Task(task_lib.Task):

  def __init__(self, config):
    super().__init__(config)
    self.workdir = None
    self.masker = None

  @property
  def heads(self) -> str:
    return self.config.model.heads or HEADS[self.config.task]

  # ------------------------------------------------------------------ data
  def prepare(self, workdir):
    self.workdir = workdir
    task = self.config.task
    if task == 'features':
      raise ValueError('config.task=features has no training: use it with --mode=predict (or import_hf); '
                       'train with config.task=pretrain or classify.')
    self.config.model.heads = self.heads
    tokenizer = self._adopt_source(self.config.init_from) if self.config.init_from else None
    if task == 'classify':
      datasets = classifier_task.classification_datasets(self, workdir, tokenizer)
    else:
      datasets = self._pretraining_datasets(workdir, tokenizer)
    if not self.config.model.vocab_size:
      self.config.model.vocab_size = self.tokenizer.vocab_size
    return datasets

  def _adopt_source(self, source: str):
    """Tokenizer and architecture of the run fine-tuning starts from (they must match its weights)."""
    from data.tokenizers import load_tokenizer
    from train.checkpoint import read_config
    source_config = read_config(source)
    if source_config.family != 'bert':
      raise ValueError(f'config.init_from={source} is a {source_config.family!r} run; BERT starts from a bert run.')
    changed = {k: source_config.model[k] for k in ARCHITECTURE_KEYS
               if k != 'max_len' and self.config.model[k] != source_config.model[k]}
    # Positions: at least the source's; more when this run asks for more (positions past the
    # source's start untrained and are learned in fine-tuning, see `init_from`).
    if source_config.model.max_len > self.config.model.max_len:
      changed['max_len'] = source_config.model.max_len
    self.config.model.update(changed)
    if changed:
      print(f'init_from {source}: model sizes taken from that run: {changed}', flush=True)
    if self.config.model.max_len > source_config.model.max_len:
      print(f'init_from {source}: positions {source_config.model.max_len}..{self.config.model.max_len - 1} are new '
            f'(that run has {source_config.model.max_len}); they start from random values.', flush=True)
    if self.config.data.seq_len > self.config.model.max_len:
      raise ValueError(f'config.data.seq_len={self.config.data.seq_len} exceeds the {self.config.model.max_len} '
                       f'positions of {source}; lower data.seq_len.')
    return load_tokenizer(source)

  def _pretraining_datasets(self, workdir, tokenizer):
    data, seed = self.config.data, self.config.seed
    train_texts, eval_texts, _ = bert_data.pretraining_documents(data)
    if tokenizer is None:
      tokenizer = get_tokenizer(data, workdir, train_texts)
    else:
      tokenizer.save(workdir)
    self.tokenizer = tokenizer
    examples = lambda texts, dupe, seed_, cap: bert_data.pretraining_examples(
        bert_data.tokenize_documents(texts, tokenizer), tokenizer, data.seq_len, dupe_factor=dupe,
        short_seq_prob=data.short_seq_prob, seed=seed_, max_examples=cap)
    train = examples(train_texts, data.dupe_factor, seed, data.max_examples)
    evaluation = examples(eval_texts, 1, seed + 1, data.max_examples)
    self.masker = bert_data.Masker(tokenizer, data.mask_prob, data.max_predictions)
    print(f'BERT pretraining: {len(train["tokens"])} train and {len(evaluation["tokens"])} eval sentence pairs, '
          f'vocabulary {tokenizer.vocab_size}.', flush=True)
    # Eval masks are drawn once (fixed seed) so that every evaluation scores the same positions.
    return task_lib.Datasets(train=as_dataset(train),
                             eval=as_dataset(evaluation).random_map(self.masker, seed=seed + 2))

  def train_batches(self, examples, batch_size, seed):
    if self.config.task != 'pretrain':
      return super().train_batches(examples, batch_size, seed)
    # Masks are drawn after `repeat`, per position in the stream: every epoch gets new ones.
    return examples.shuffle(seed=seed).repeat().random_map(self.masker, seed=seed + 3).batch(
        batch_size, drop_remainder=True)

  def load_tokenizer(self, workdir):
    super().load_tokenizer(workdir)
    self.workdir = workdir

  # ------------------------------------------------------------------ model
  def bert_config(self) -> BertConfig:
    from models.attention import default_attention_implementation
    config = BertConfig.from_config(self.config.model, self.config.model.vocab_size or self.tokenizer.vocab_size)
    if config.attention == 'auto':
      config = BertConfig(**{**config.__dict__, 'attention': default_attention_implementation()})
    return config

  def build_model(self, rngs):
    config = self.bert_config()
    if self.heads == 'pretraining':
      return BertForPretraining(config, rngs=rngs)
    if self.heads == 'classifier':
      if self.config.model.num_classes < 2:
        raise ValueError(f'config.model.num_classes={self.config.model.num_classes}: the data must have at least '
                         f'2 labels.')
      return BertClassifier(config, self.config.model.num_classes, rngs=rngs)
    return BertEncoder(config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    if self.config.task == 'pretrain':
      return pretraining_loss(model, batch, deterministic=deterministic)
    logits = model(batch['tokens'], batch['segments'], batch['valid'], deterministic=deterministic)
    return classification_loss(logits, batch['label'], self.config.train.label_smoothing)

  def example_batch(self, batch_size):
    vocab = self.config.model.vocab_size or self.tokenizer.vocab_size
    if self.config.task != 'pretrain':
      return classifier_task.example_classification_batch(self.config, vocab, batch_size)
    rng = np.random.default_rng(0)
    seq_len, predictions = self.config.data.seq_len, self.config.data.max_predictions
    return {'tokens': rng.integers(5, vocab, (batch_size, seq_len), dtype=np.int32),
            'segments': (np.arange(seq_len) >= seq_len // 2).astype(np.int32)[None].repeat(batch_size, 0),
            'valid': np.ones((batch_size, seq_len), bool),
            'next_sentence': rng.integers(0, 2, batch_size, dtype=np.int32),
            'masked_positions': np.sort(rng.choice(np.arange(1, seq_len), (batch_size, predictions)), -1
                                        ).astype(np.int32),
            'masked_labels': rng.integers(5, vocab, (batch_size, predictions), dtype=np.int32),
            'masked_weights': np.ones((batch_size, predictions), np.float32)}

  def flops_per_token(self):
    """6N + 12 L T E with N the non-embedding parameters; the MLM head runs on ~15% of positions."""
    c = self.bert_config()
    per_layer = 4 * c.width ** 2 + 2 * c.width * c.mlp_dim
    head = self.config.data.max_predictions / self.config.data.seq_len * (c.width ** 2 + c.width * c.vocab_size)
    return 6 * (c.num_layers * per_layer + head) + 12 * c.num_layers * self.config.data.seq_len * c.width

  # ------------------------------------------------------------------ fine-tuning and import
  def init_from(self, model, source_workdir):
    from train.checkpoint import load_run
    source = load_run(source_workdir).model
    both_pretrain = isinstance(model, BertForPretraining) and isinstance(source, BertForPretraining)
    target, origin = (model, source) if both_pretrain else (encoder_of(model), encoder_of(source))
    wanted = nnx.state(target, nnx.Param)
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
      raise ValueError(f'config.init_from={source_workdir} holds a BERT of different sizes; its config.json model '
                       f'settings must match this run.')
    nnx.replace_by_pure_dict(wanted, given)
    nnx.update(target, wanted)
    print(f'init_from {source_workdir}: copied the {"whole model" if both_pretrain else "encoder"} '
          f'({copied} parameters'
          f'{f", positions {old_rows}..{new_rows - 1} new" if old_rows < new_rows else ""}).', flush=True)

  def import_hf(self, hf_dir):
    from models.hf_bert import load_hf_bert
    task = self.config.task
    if task == 'classify':
      raise ValueError('Import with --config.task=pretrain (or features), then fine-tune with --config.task=classify '
                       '--config.init_from=<the imported workdir>.')
    model, self.tokenizer, heads_loaded = load_hf_bert(hf_dir, rngs=nnx.Rngs(params=0, dropout=self.config.seed),
                                                       dtype=self.config.model.dtype, attention='xla')
    bert = model.config
    self.config.model.update({k: getattr(bert, k) for k in ARCHITECTURE_KEYS})
    self.config.model.update(dropout=bert.dropout, attention_dropout=bert.attention_dropout, init_std=bert.init_std,
                             heads=self.heads)
    self.config.data.update(tokenizer='wordpiece', vocab_size=self.tokenizer.vocab_size,
                            seq_len=min(self.config.data.seq_len, bert.max_len))
    if task == 'features':
      return model.encoder
    if not heads_loaded:
      print(f'{hf_dir} has no pretraining heads: the MLM transform and NSP layer start from random values.',
            flush=True)
    return model

  # ------------------------------------------------------------------ after training
  def _batch_size(self):
    return self.config.train.eval_batch_size or self.config.train.batch_size

  def evaluate(self, model, datasets, workdir):
    if self.config.task == 'classify':
      forward = nnx.jit(lambda m, t, s, v: m(t, s, v))
      logits_fn = lambda batch: forward(model, batch['tokens'], batch['segments'], batch['valid'])
      return classifier_task.evaluate_classifier(logits_fn, datasets, classifier_task.saved_labels(self.config),
                                                 workdir, self._batch_size(), 'BERT')
    metrics_fn = nnx.jit(lambda m, batch: pretraining_loss(m, batch, deterministic=True)[1])
    total = {}
    batches = datasets.eval.batch(self._batch_size())
    for i in range(len(batches)):
      for name, (s, c) in jax.device_get(metrics_fn(model, batches[i])).items():
        previous = total.get(name, (0.0, 0.0))
        total[name] = (previous[0] + float(s), previous[1] + float(c))
    results = {f'final_{name}': s / max(c, 1.0) for name, (s, c) in total.items()}
    print('Whole eval split: ' + ' '.join(f'{k}={v:.4f}' for k, v in results.items()), flush=True)
    return results

  def predict(self, model, lines):
    if self.config.task == 'classify':
      forward = nnx.jit(lambda m, t, s, v: m(t, s, v))
      logits_fn = lambda batch: forward(model, batch['tokens'], batch['segments'], batch['valid'])
      return classifier_task.predict_labels(logits_fn, self.tokenizer, classifier_task.saved_labels(self.config),
                                            self.config.data.seq_len, lines)
    if self.config.task == 'features':
      return self.write_features(model, lines)
    return self.fill_masks(model, lines)

  def _encode_lines(self, lines):
    """[N, L] tokens, segments, valid for 'text' or 'a<TAB>b' lines (L = the longest, <= seq_len)."""
    from data.classification import encode_pair
    tok = self.tokenizer
    ids = []
    for line in lines:
      a, b = classifier_task.split_pair(line)
      ids.append((tok.encode(a), tok.encode(b) if b is not None else None))
    length = min(self.config.data.seq_len, max(len(a) + len(b or []) + (3 if b is not None else 2) for a, b in ids))
    rows = [encode_pair(a, b, length, tok.bos_id, tok.eos_id, tok.pad_id) for a, b in ids]
    return tuple(np.stack(column) for column in zip(*rows))

  def write_features(self, model, lines):
    """One .npy per line: [T, E] token vectors ('none'), or [E] ('cls', 'mean') of the chosen layer(s)."""
    settings = self.config.features
    directory = settings.output_dir or os.path.join(self.workdir or '.', 'features')
    os.makedirs(directory, exist_ok=True)
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
        np.save(path, array)
        outputs.append({'file': path, 'shape': list(array.shape),
                        'tokens': [self.tokenizer.id_to_token(int(i)) for i in ids[mask]]})
    return outputs

  def fill_masks(self, model, lines, top_k: int = 5):
    """Pretraining runs: the top-k tokens for each [MASK] of each line."""
    if not isinstance(model, BertForPretraining):
      raise ValueError('This checkpoint has no MLM head; predict with config.task=features or classify.')
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


def as_dataset(arrays: dict[str, np.ndarray]) -> grain.MapDataset:
  """Stacked [N, ...] arrays -> a MapDataset of per-example dicts."""
  return grain.MapDataset.range(len(arrays['tokens'])).map(lambda i: {k: v[i] for k, v in arrays.items()})
