"""GPT language modelling: packed token windows, next-token cross-entropy, sampled continuations."""
from __future__ import annotations

import numpy as np

from data.lm import lm_datasets
from errors import ConfigError
from models import gpt as gpt_model
from models.gpt import GPT, REMAT_POLICIES, GPT2Config
from train import sampling
from train import task as task_lib
from train.losses import chunked_lm_loss, lm_loss


def validate(config):
  if config.model.remat not in REMAT_POLICIES:
    raise ConfigError(f'config.model.remat={config.model.remat!r} is not one of {tuple(REMAT_POLICIES)}.')
  if config.data.seq_len > config.model.max_len:
    raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds config.model.max_len='
                      f'{config.model.max_len}; raise model.max_len or lower data.seq_len.')


class Task(task_lib.Task):
  model_config_class = GPT2Config

  generate = staticmethod(gpt_model.generate)

  def load_data(self, workdir):
    tokenizer, train, evaluation, test = lm_datasets(self.config.data, workdir, self.config.seed)
    return task_lib.Prepared(task_lib.Datasets(train=train, eval=evaluation, test=test), tokenizer,
                             self.resolve_model_config(**self.resolved_from_tokenizer(tokenizer)))

  def resolved_from_tokenizer(self, tokenizer):
    return {'vocab_size': self.config.model.vocab_size or tokenizer.vocab_size}

  def build_model(self, rngs):
    return GPT(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    tokens = batch['tokens']
    chunk = self.config.train.loss_chunk_tokens
    if not chunk:
      logits, _ = model(tokens[:, :-1], deterministic=deterministic)
      return lm_loss(logits, tokens[:, 1:], vocab_size=self.model_config.vocab_size)
    # The tied output layer applied chunk by chunk inside the loss: no [B, L, V] float32 logits.
    hidden, _ = model(tokens[:, :-1], deterministic=deterministic, return_hidden=True)
    return chunked_lm_loss(hidden, model.token_embedding.table(), tokens[:, 1:], chunk_tokens=chunk,
                           vocab_size=self.model_config.vocab_size)

  def summarize(self, metrics):
    return {**metrics, 'eval/perplexity': float(np.exp(min(metrics['eval/loss'], 50.0)))}

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    return {'tokens': rng.integers(0, self.model_config.vocab_size, (batch_size, self.config.data.seq_len + 1),
                                   dtype=np.int32)}

  def flops_per_token(self):
    """6N + 12 L T E (Kaplan et al. / PaLM appendix B): N = non-embedding params plus the tied LM head."""
    c = self.model_config
    non_embedding = c.num_layers * (4 * c.width**2 + 2 * c.mlp_ratio * c.width**2)
    return 6 * (non_embedding + c.width * c.vocab_size) + 12 * c.num_layers * self.config.data.seq_len * c.width

  # ------------------------------------------------------------------ generation
  def evaluate(self, model, datasets, workdir):
    samples = sampling.sample_prompts(self.generate, model, self.tokenizer, self.config.decode, workdir,
                                      seed=self.config.seed, max_len=self.model_config.max_len)
    return {'samples': samples} if samples else {}

  def predict_truncation(self, lines):
    return sampling.prompt_truncation_notes(self.tokenizer, lines, self.config.decode, self.model_config.max_len)

  def predict(self, model, lines, workdir):
    return sampling.continue_prompts(self.generate, model, self.tokenizer, lines, self.config.decode,
                                     seed=self.config.seed, max_len=self.model_config.max_len)

  def import_hf(self, hf_dir, rngs):
    from interop.hf_gpt2 import import_gpt2
    imported = import_gpt2(hf_dir, dtype=self.config.model.dtype, vocab_multiple=self.config.model.vocab_multiple,
                           rngs=rngs)
    return self.bind(task_lib.Prepared(None, imported.tokenizer, imported.config)), imported.model

