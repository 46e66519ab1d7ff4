"""GPT language modelling: packed token windows (attention kept in each document with
data.document_masking), next-token cross-entropy, sampled continuations.

A mixture-of-experts GPT (model.moe_experts > 0, models/moe.py) trains on the cross-entropy plus
train.moe_aux_loss times the Switch load-balancing loss and train.moe_z_loss times the router
z-loss (each the mean over the MoE blocks), and with model.moe_router_bias moves each block's
load bias after every (micro-)step by train.moe_bias_rate. It logs, every train.log_every steps:
  train/moe/load_balancing_loss, train/moe/z_loss    the two losses, before their coefficients
  train/moe/dropped_fraction                         token-slots dropped over capacity (0 when dropless)
  train/moe/block_<i>/max_load, .../min_load         block i's most and least loaded expert, as a
                                                     multiple of an even share (1 = balanced)
and after training draws the last two across blocks and steps (moe_expert_load.png, `evaluate`).
Evaluations run the plain model: eval/loss stays the cross-entropy.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from data.lm import lm_datasets
from errors import ConfigError
from models import gpt as gpt_model
from models.gpt import GPT, REMAT_POLICIES, GPT2Config
from models.layers import NORMS
from models.moe import RouterStatistics, record_router_statistics
from models.rope import ROPE_SCALINGS
from train import pictures, sampling
from train import task as task_lib
from train.losses import example_weights, lm_loss
from train.metrics import read_logged


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
  if m.get('head_dim', 0) < 0:
    raise ConfigError(f'config.model.head_dim={m.head_dim} must be >= 0 (0: width // num_heads).')
  validate_moe(config)


MOE_KEYS = ('moe_top_k', 'moe_shared_experts', 'moe_every', 'moe_hidden', 'moe_norm_topk_prob',
            'moe_capacity_factor', 'moe_router_bias')


def validate_moe(config):
  """The mixture-of-experts keys (models/moe.py): one ConfigError naming the key and the fix."""
  m, t = config.model, config.train
  experts = m.get('moe_experts', 0)
  if experts < 0:
    raise ConfigError(f'config.model.moe_experts={experts} must be >= 0 (0: a dense model).')
  if not experts:
    defaults = {f.name: f.default for f in dataclasses.fields(GPT2Config)}
    changed = [key for key in MOE_KEYS if key in m and m[key] != defaults[key]]
    if changed:
      raise ConfigError(f'config.model.{changed[0]}={m[changed[0]]!r} is set on a dense model '
                        f'(model.moe_experts=0); set model.moe_experts to the number of experts, or drop it.')
    return
  checks = (
      (1 <= m.moe_top_k <= experts, f'config.model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts='
                                    f'{experts}.'),
      (m.moe_every >= 1, f'config.model.moe_every={m.moe_every} must be >= 1 (1: every block holds experts).'),
      (m.moe_every <= m.num_layers, f'config.model.moe_every={m.moe_every} exceeds model.num_layers={m.num_layers}: '
                                    f'no block would hold experts; lower it.'),
      (not m.scan_layers or m.moe_every == 1,
       f'config.model.moe_every={m.moe_every} with model.scan_layers=True: scanned blocks are identical, so set '
       f'moe_every=1 or scan_layers=False.'),
      (m.moe_hidden >= 0, f'config.model.moe_hidden={m.moe_hidden} must be >= 0 (0: the dense MLP width).'),
      (m.moe_shared_experts >= 0, f'config.model.moe_shared_experts={m.moe_shared_experts} must be >= 0.'),
      (m.moe_capacity_factor >= 0, f'config.model.moe_capacity_factor={m.moe_capacity_factor} must be >= 0 '
                                   f'(0: dropless; 1.25 is a common capacity).'),
  )
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  for key in ('moe_aux_loss', 'moe_z_loss', 'moe_bias_rate'):
    if t[key] < 0:
      raise ConfigError(f'config.train.{key}={t[key]} must be >= 0 (0: off).')


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
  head_width = m.get('head_dim', 0) or m.width // m.num_heads
  if m.positions == 'rope' and head_width % 2:
    raise ConfigError(f'config.model.positions=rope needs an even head width, and it is {head_width}; change '
                      f'model.head_dim, or model.width or model.num_heads.')
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
    tokenizer, train, evaluation, test, caches = lm_datasets(config.data, workdir, config.seed, jax.process_index(),
                                                             jax.process_count())
    prepared = cls.without_data(config, tokenizer, platform)
    return dataclasses.replace(prepared, datasets=task_lib.Datasets(train=train, eval=evaluation, test=test,
                                                                    caches=caches))

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': config.model.vocab_size or tokenizer.vocab_size}

  def build_model(self, rngs):
    return GPT(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    tokens = batch['tokens']
    chunk = self.config.train.loss_chunk_tokens
    # With chunks the output layer is applied chunk by chunk inside the loss: no [B, L, V] float32 logits.
    forward = functools.partial(model, **self.model_inputs(tokens[:, :-1]), deterministic=deterministic,
                                return_hidden=bool(chunk))
    statistics = None
    if self.model_config.moe_experts and not deterministic:
      (outputs, _), recorded = record_router_statistics(model, forward)
      statistics = model.router_statistics(recorded)
    else:
      outputs, _ = forward()
    if chunk:
      loss, metrics = model.chunked_loss(outputs, tokens[:, 1:], example_weights(batch), chunk_tokens=chunk,
                                         z_loss=self.config.train.z_loss)
    else:
      loss, metrics = lm_loss(outputs, tokens[:, 1:], example_weights(batch), vocab_size=self.model_config.vocab_size,
                              z_loss=self.config.train.z_loss)
    if statistics is None:
      return loss, metrics
    return self.balanced_loss(model, loss, metrics, statistics)

  def balanced_loss(self, model, loss, metrics, statistics: RouterStatistics):
    """The cross-entropy `loss` plus the routers' balancing losses, with their metrics (module
    docstring); with moe_router_bias the blocks' load biases move towards the even load."""
    train = self.config.train
    balancing, z_loss = jnp.mean(statistics.load_balancing_loss), jnp.mean(statistics.z_loss)
    if self.model_config.moe_router_bias:
      model.update_load_bias(statistics.load, train.moe_bias_rate)
    return (loss + train.moe_aux_loss * balancing + train.moe_z_loss * z_loss,
            {**metrics, **moe_metrics(statistics, self.model_config.moe_blocks())})

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
    """6N + 12 L T H*D (Kaplan et al. / PaLM appendix B): N = the matrices a token passes through
    (query and output E x H*D, key and value E x K*D, two or three MLP matrices E x F; in an MoE
    block the router E x N and the MLP matrices of its k chosen and its shared experts, E x H
    each, not all N) plus the LM head."""
    c = self.model_config
    mlp_matrices = 3 if c.mlp == 'swiglu' else 2
    attention = 2 * c.width * c.num_heads * c.head_width + 2 * c.width * c.kv_heads * c.head_width
    dense_mlp = mlp_matrices * c.width * c.mlp_width
    moe_mlp = (c.moe_top_k + c.moe_shared_experts) * mlp_matrices * c.width * c.expert_width + c.width * c.moe_experts
    mlp = sum(moe_mlp if c.is_moe_block(i) else dense_mlp for i in range(c.num_layers))
    return (6 * (c.num_layers * attention + mlp + c.width * c.vocab_size)
            + 12 * c.num_layers * self.config.data.seq_len * c.num_heads * c.head_width)

  # ------------------------------------------------------------------ generation
  def evaluate(self, model, workdir):
    samples = sampling.sample_prompts(self.generate, model, self.tokenizer, self.config.decode, workdir,
                                      seed=self.config.seed, max_len=self.model_config.max_len)
    results = {'samples': samples} if samples else {}
    picture = self.expert_load_picture(workdir) if self.model_config.moe_experts else None
    return {**results, 'images': {'moe/expert_load': picture}} if picture else results

  def expert_load_picture(self, workdir) -> str | None:
    """moe_expert_load.png in `workdir`: each MoE block's most and least loaded expert at every logged
    step (from metrics.jsonl); None before any step logged them."""
    blocks = self.model_config.moe_blocks()
    names = [f'train/moe/block_{b}/{kind}_load' for kind in ('max', 'min') for b in blocks]
    steps, values = read_logged(workdir, names)
    if not steps:
      return None
    load = {kind: np.array([values[f'train/moe/block_{b}/{kind}_load'] for b in blocks]) for kind in ('max', 'min')}
    return pictures.plot_expert_load(os.path.join(workdir, 'moe_expert_load.png'), steps, blocks, load['max'],
                                     load['min'], f'Expert load, {self.model_config.moe_experts} experts, '
                                     f'top-{self.model_config.moe_top_k}')

  def predict_truncation(self, lines):
    return sampling.prompt_truncation_notes(self.tokenizer, lines, self.config.decode, self.model_config.max_len)

  def predict(self, model, lines, workdir):
    return sampling.continue_prompts(self.generate, model, self.tokenizer, lines, self.config.decode,
                                     seed=self.config.seed, max_len=self.model_config.max_len)

  def export_hf(self, model, out_dir):
    """A GPT2LMHeadModel or a LlamaForCausalLM directory, whichever architecture the model is."""
    from interop import gpt_exporter
    return gpt_exporter(model.config)(model, self.tokenizer, out_dir)

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


def moe_metrics(statistics: RouterStatistics, blocks: list[int]) -> dict:
  """The training metrics of the module docstring, as (sum, count), from `statistics` over the MoE
  `blocks` (leaves leading with [M])."""
  one = jnp.ones((), jnp.float32)
  share = statistics.load / jnp.mean(statistics.load, axis=-1, keepdims=True)  # [M, N], 1 = even
  metrics = {'moe/load_balancing_loss': (jnp.mean(statistics.load_balancing_loss), one),
             'moe/z_loss': (jnp.mean(statistics.z_loss), one),
             'moe/dropped_fraction': (jnp.sum(statistics.dropped), jnp.sum(statistics.load))}
  for row, block in enumerate(blocks):
    metrics[f'moe/block_{block}/max_load'] = (jnp.max(share[row]), one)
    metrics[f'moe/block_{block}/min_load'] = (jnp.min(share[row]), one)
  return metrics
