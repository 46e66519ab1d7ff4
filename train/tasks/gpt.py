"""GPT language modelling: packed token windows (attention kept in each document with
data.document_masking), next-token cross-entropy, sampled continuations.

Fine-tuning starts from another GPT run with `config.init_from=<workdir>` (trained here or imported
with --mode=import_hf): that run's tokenizer and model are adopted in `prepare` (the `model.*` keys
but the runtime ones are its), and `init_from` copies every parameter; with `train.lora_rank` the
copied weights stay frozen under LoRA adapters (train/lora.py)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from data.lm import lm_datasets
from data.tokenizers import load_tokenizer
from errors import ConfigError
from models import gpt as gpt_model
from models import lora
from models.gpt import GPT, REMAT_POLICIES, GPT2Config
from models.layers import NORMS
from models.rope import ROPE_SCALINGS
from train import sampling
from train import task as task_lib
from train.losses import example_weights, lm_loss
from train.rundir import run_config


def validate(config):
  m = config.model
  if m.remat not in REMAT_POLICIES:
    raise ConfigError(f'config.model.remat={m.remat!r} is not one of {tuple(REMAT_POLICIES)}.')
  if config.data.seq_len > m.max_len:
    raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds config.model.max_len='
                      f'{m.max_len}; raise model.max_len or lower data.seq_len.')
  validate_llama_steps(m)
  if m.logit_softcap < 0:
    raise ConfigError(f'config.model.logit_softcap={m.logit_softcap} must be >= 0 (0: no cap; the NanoGPT '
                      f'speedrun uses 15 to 30).')


def validate_llama_steps(m):
  """The options of the Llama steps (models/gpt.py): one ConfigError naming the key and the fix."""
  choices = {'positions': gpt_model.POSITIONS, 'norm': NORMS, 'mlp': tuple(gpt_model.MLPS),
             'rope_scaling': ROPE_SCALINGS}
  for key, allowed in choices.items():
    if m[key] not in allowed:
      raise ConfigError(f'config.model.{key}={m[key]!r} is not one of {allowed}.')
  if m.num_kv_heads < 0 or (m.num_kv_heads and m.num_heads % m.num_kv_heads):
    raise ConfigError(f'config.model.num_kv_heads={m.num_kv_heads} does not divide config.model.num_heads='
                      f'{m.num_heads}; use a divisor of num_heads (1: multi-query, 0: one per query head).')
  if m.positions == 'rope' and (m.width // m.num_heads) % 2:
    raise ConfigError(f'config.model.positions=rope needs an even head width, and width / num_heads = '
                      f'{m.width // m.num_heads}; change model.width or model.num_heads.')
  if m.mlp_hidden < 0 or m.rope_theta <= 0:
    raise ConfigError(f'config.model.mlp_hidden={m.mlp_hidden} must be >= 0 (0: mlp_ratio * width) and '
                      f'config.model.rope_theta={m.rope_theta} positive.')
  if m.rope_scaling == 'llama3' and not (m.rope_factor > 0 and m.rope_high_freq_factor > m.rope_low_freq_factor > 0
                                         and m.rope_original_max_len > 0):
    raise ConfigError(f'config.model.rope_scaling=llama3 needs rope_factor > 0, rope_high_freq_factor > '
                      f'rope_low_freq_factor > 0 and rope_original_max_len > 0; got {m.rope_factor}, '
                      f'{m.rope_high_freq_factor}, {m.rope_low_freq_factor}, {m.rope_original_max_len}.')


class Task(task_lib.Task):
  model_config_class = GPT2Config

  generate = staticmethod(gpt_model.generate)

  @classmethod
  def prepare(cls, config, workdir, platform=None):
    source = cls._source_run(config) if config.init_from else None
    tokenizer, train, evaluation, test, caches = lm_datasets(config.data, workdir, config.seed, jax.process_index(),
                                                             jax.process_count(), source and source[1])
    prepared = cls.without_data(config, tokenizer, platform)
    if source:
      prepared = dataclasses.replace(prepared, model_config=cls._with_source_model(config, prepared.model_config,
                                                                                   source[0]))
    return dataclasses.replace(prepared, datasets=task_lib.Datasets(train=train, eval=evaluation, test=test,
                                                                    caches=caches))

  @staticmethod
  def _source_run(config) -> tuple[GPT2Config, object]:
    """(model config, tokenizer) of the run `config.init_from` names, which fine-tuning starts from."""
    source_config, source_model = run_config(config.init_from)
    if source_config.family != 'gpt':
      raise ConfigError(f'config.init_from={config.init_from} is a {source_config.family!r} run; GPT starts from a '
                        f'gpt run.')
    return source_model, load_tokenizer(config.init_from)

  @staticmethod
  def _with_source_model(config, model_config: GPT2Config, source: GPT2Config) -> GPT2Config:
    """The source run's model, with this config's runtime fields (attention, dtype, dropout, remat)."""
    runtime = {k: getattr(model_config, k) for k in task_lib.RUNTIME_FIELDS if hasattr(model_config, k)}
    changed = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)
               if f.name not in runtime and getattr(source, f.name) != getattr(model_config, f.name)}
    if changed:
      print(f'init_from {config.init_from}: model taken from that run: {changed}', flush=True)
    if config.data.seq_len > source.max_len:
      raise ConfigError(f'config.data.seq_len={config.data.seq_len} exceeds the {source.max_len} positions of '
                        f'{config.init_from}; lower data.seq_len.')
    return dataclasses.replace(source, **runtime)

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': config.model.vocab_size or tokenizer.vocab_size}

  def build_model(self, rngs):
    return GPT(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    tokens = batch['tokens']
    inputs = self.model_inputs(tokens[:, :-1])
    chunk = self.config.train.loss_chunk_tokens
    if not chunk:
      logits, _ = model(**inputs, deterministic=deterministic)
      return lm_loss(logits, tokens[:, 1:], example_weights(batch), vocab_size=self.model_config.vocab_size,
                     z_loss=self.config.train.z_loss)
    # The output layer applied chunk by chunk inside the loss: no [B, L, V] float32 logits.
    hidden, _ = model(**inputs, deterministic=deterministic, return_hidden=True)
    return model.chunked_loss(hidden, tokens[:, 1:], example_weights(batch), chunk_tokens=chunk,
                              z_loss=self.config.train.z_loss)

  def model_inputs(self, tokens):
    """[B, L] input ids of packed windows -> the model's keyword arguments: with data.document_masking
    (absent from runs saved before it: off) also segment ids and positions that restart at each EOS,
    so attention stays in each document (models/gpt.py `document_segments`)."""
    if not self.config.data.get('document_masking', False):
      return {'tokens': tokens}
    return {'tokens': tokens, **gpt_model.document_segments(tokens, self.tokenizer.eos_id)}

  def count_tokens(self, batch):
    inputs = batch['tokens'][:, :-1]  # windows of seq_len + 1: the model reads seq_len of them
    return inputs.size, inputs.size

  def summarize(self, metrics):
    return {**metrics, 'eval/perplexity': float(np.exp(min(metrics['eval/loss'], 50.0)))}

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    return {'tokens': rng.integers(0, self.model_config.vocab_size, (batch_size, self.config.data.seq_len + 1),
                                   dtype=np.int32)}

  def flops_per_token(self):
    """6N + 12 L T E (Kaplan et al. / PaLM appendix B): N = the blocks' matrices (query and output
    E x E, key and value E x K*D, two or three MLP matrices E x F) plus the LM head."""
    c = self.model_config
    kv_width = c.kv_heads * (c.width // c.num_heads)
    mlp_matrices = 3 if c.mlp == 'swiglu' else 2
    non_embedding = c.num_layers * (2 * c.width**2 + 2 * c.width * kv_width + mlp_matrices * c.width * c.mlp_width)
    return 6 * (non_embedding + c.width * c.vocab_size) + 12 * c.num_layers * self.config.data.seq_len * c.width

  # ------------------------------------------------------------------ generation
  def evaluate(self, model, workdir):
    samples = sampling.sample_prompts(self.generate, model, self.tokenizer, self.config.decode, workdir,
                                      seed=self.config.seed, max_len=self.model_config.max_len)
    return {'samples': samples} if samples else {}

  def predict_truncation(self, lines):
    return sampling.prompt_truncation_notes(self.tokenizer, lines, self.config.decode, self.model_config.max_len)

  def predict(self, model, lines, workdir):
    return sampling.continue_prompts(self.generate, model, self.tokenizer, lines, self.config.decode,
                                     seed=self.config.seed, max_len=self.model_config.max_len)

  def init_from(self, model, source):
    """Every parameter of `source`, a GPT of the same model config (`prepare` adopts it), into `model`
    (its base weights, under a LoRA run's adapters)."""
    wanted = nnx.state(model, lora.BASE)
    nnx.replace_by_pure_dict(wanted, nnx.to_pure_dict(nnx.state(source, nnx.Param)))
    nnx.update(model, wanted)
    print(f'init_from {self.config.init_from}: copied the whole model '
          f'({sum(x.size for x in jax.tree.leaves(wanted))} parameters).', flush=True)

  def export_hf(self, model, out_dir):
    """A GPT2LMHeadModel or a LlamaForCausalLM directory, whichever architecture the model is."""
    from interop import gpt_exporter
    return gpt_exporter(model.config)(model, self.tokenizer, out_dir)

  def export_hf_adapter(self, model, out_dir, train_config):
    """The LoRA adapters as a PEFT adapter of the base run's GPT2LMHeadModel or LlamaForCausalLM."""
    from interop.peft import export_gpt_adapter
    return export_gpt_adapter(model, out_dir, rank=train_config.lora_rank, alpha=train_config.lora_alpha,
                              dropout=train_config.lora_dropout)

  @classmethod
  def import_hf(cls, config, hf_dir, rngs):
    """A GPT2LMHeadModel or LlamaForCausalLM directory, by its config.json's model_type."""
    from interop import hf_gpt2, hf_llama
    from interop.common import read_hf_config
    from models.attention import resolve_compute_dtype
    importer = hf_llama.import_llama if read_hf_config(hf_dir).get('model_type') == 'llama' else hf_gpt2.import_gpt2
    imported = importer(hf_dir, dtype=resolve_compute_dtype(config.model.dtype),
                        vocab_multiple=config.model.vocab_multiple, rngs=rngs)
    return task_lib.Prepared(imported.tokenizer, imported.config), imported.model

