"""Recurrent language model with the two minibatch samplers of D2L ch. 9.3.

The training documents become one token stream (documents joined by EOS). `data.sampler`:

  'random'      the stream is cut into windows of seq_len + 1 tokens (inputs and shifted
                targets), shuffled into batches (batching.Shuffled); each batch starts from a
                zero state.
  'sequential'  the stream is cut into batch_size rows (batching.Stream); batch k holds window k
                of every row, so row b of batch k+1 continues row b of batch k. The final state
                of a batch is carried into the next one (model.carried) with its gradient
                stopped there (truncated backpropagation through time). Every pass over the
                stream starts at a new random offset with a fresh state (the batch's 'reset'
                flag).

Both samplers read the same tokens, so the same `train.steps` is the same budget. Evaluation:
the trainer's eval/loss and eval/perplexity are on held-out windows, each from a zero state;
`evaluate` adds 'eval/stream_perplexity', the held-out stream read sequentially with the state carried
throughout, and samples continuations of `decode.prompts`.
"""
from __future__ import annotations

import dataclasses

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import batching
from data import token_cache
from data.lm import lm_streams
from errors import ConfigError
from models import rnn_lm as rnn_lm_model
from models.rnn_lm import RNNLM, RNNLMConfig
from train import sampling
from train import task as task_lib
from train.losses import example_weights, lm_loss

SAMPLERS = ('random', 'sequential')


@nnx.jit
def _nll_and_state(model, tokens, state):
  logits, state = model(tokens[:, :-1], state)
  _, metrics = lm_loss(logits, tokens[:, 1:])
  return metrics['loss'], state


def stream_perplexity(model: RNNLM, stream, num_rows: int, seq_len: int) -> float:
  """exp(mean NLL) of a token stream (an array, or a slice of a cached one) read as `num_rows` consecutive rows with the state carried throughout
  (fewer rows when the stream is short, so that each row holds at least one window)."""
  num_rows = max(1, min(num_rows, (len(stream) - 1) // seq_len))
  length = len(stream) // num_rows
  rows = [stream[row * length:(row + 1) * length] for row in range(num_rows)]
  state = model.initial_state(num_rows)
  total, count = 0.0, 0.0
  for start in range(0, length - 1, seq_len):
    window = np.stack([np.asarray(row[start:start + seq_len + 1]) for row in rows])
    (nll, tokens), state = _nll_and_state(model, jnp.asarray(window), state)
    total, count = total + float(nll), count + float(tokens)
  return float(np.exp(total / count))


def validate(config):
  if config.data.sampler not in SAMPLERS:
    raise ConfigError(f'config.data.sampler={config.data.sampler!r}: use one of {SAMPLERS}.')
  if config.model.cell not in ('rnn', 'gru', 'lstm'):
    raise ConfigError(f"config.model.cell={config.model.cell!r}: use 'rnn', 'gru' or 'lstm'.")
  if config.data.sampler == 'sequential' and config.train.grad_accum != 1:
    raise ConfigError('config.train.grad_accum must be 1 with data.sampler=sequential: the carried state '
                      'holds one row per example of the whole batch. Use a smaller train.batch_size instead.')


def sequential(config) -> bool:
  """Whether training carries the state across consecutive windows of each row (data.sampler)."""
  return config.data.sampler == 'sequential'


class Task(task_lib.Task):
  model_config_class = RNNLMConfig

  @property
  def sequential(self) -> bool:
    return sequential(self.config)

  generate = staticmethod(rnn_lm_model.generate)

  @classmethod
  def prepare(cls, config, workdir, platform=None):
    """Windows of the token streams; `evaluation` holds the held-out stream (for its perplexity
    with the state carried across windows)."""
    data, train = config.data, config.train
    tokenizer, streams, caches = lm_streams(data, workdir, config.seed, jax.process_index(), jax.process_count())
    # data.max_examples windows of seq_len tokens (0: the whole stream, not one token)
    train_stream = streams['train'][:data.max_examples * data.seq_len + 1 if data.max_examples else len(streams['train'])]
    eval_tokens = train.eval_steps * task_lib.eval_batch_size(config) * data.seq_len + 1 if train.eval_steps else 0
    eval_stream = streams['valid'][:eval_tokens or len(streams['valid'])]
    # Windows at stride seq_len: every token but the first is a target once.
    windows = lambda stream: token_cache.Windows(stream, data.seq_len + 1, data.seq_len)
    if sequential(config):
      train_examples = grain.MapDataset.source(batching.stream_rows(train_stream, train.batch_size, data.seq_len)
                                               ).map(lambda row: {'tokens': row})
    else:
      train_examples = grain.MapDataset.source(windows(train_stream))
    datasets = task_lib.Datasets(train=train_examples, eval=grain.MapDataset.source(windows(eval_stream)),
                                 caches=caches)
    return dataclasses.replace(cls.without_data(config, tokenizer, platform), datasets=datasets, family_data=eval_stream)

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': tokenizer.vocab_size, 'carried_batch': config.train.batch_size if sequential(config) else 0}

  def batch_plan(self):
    # Sequential: one stream row per row of the global batch, its state carried to the next batch.
    return batching.Stream(self.config.data.seq_len) if self.sequential else batching.Shuffled()

  def build_model(self, rngs):
    return RNNLM(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    tokens = batch['tokens']
    carry = self.sequential and not deterministic
    state = None
    if carry:
      keep = (~batch['reset'])[:, None, None]
      state = jax.tree.map(lambda s: s * keep.astype(s.dtype), jax.lax.stop_gradient(model.carried.get_value()))
    logits, final = model(tokens[:, :-1], state, deterministic=deterministic)
    if carry:
      model.carried.set_value(jax.lax.stop_gradient(final))
    return lm_loss(logits, tokens[:, 1:], example_weights(batch), z_loss=self.config.train.z_loss)

  def count_tokens(self, batch):
    inputs = batch['tokens'][:, :-1]  # windows of seq_len + 1: the model reads seq_len of them
    return inputs.size, inputs.size

  def summarize(self, metrics):
    return {**metrics, 'eval/perplexity': float(np.exp(min(metrics['eval/loss'], 50.0)))}

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, self.model_config.vocab_size, (batch_size, self.config.data.seq_len + 1), dtype=np.int32)
    batch = {'tokens': tokens}
    if self.sequential:
      batch['reset'] = np.zeros((batch_size,), bool)
    return batch

  # ------------------------------------------------------------------ after training
  def evaluate(self, model, workdir):
    perplexity = stream_perplexity(model, self.prepared.family_data, self.eval_batch_size, self.config.data.seq_len)
    print(f'Held-out stream perplexity (state carried across windows): {perplexity:.3f}', flush=True)
    results = {'eval/stream_perplexity': perplexity}
    samples = sampling.sample_prompts(self.generate, model, self.tokenizer, self.config.decode, workdir,
                                      seed=self.config.seed)
    if samples:
      results['samples'] = samples
    return results

  def predict(self, model, lines, workdir):
    return sampling.continue_prompts(self.generate, model, self.tokenizer, lines, self.config.decode,
                                     seed=self.config.seed)
