"""Schedules and the weight-decay mask against hand-computed values."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import gpt
from models.gpt import GPT, GPT2Config
from numerics import assert_close
from train.optim import decay_mask, learning_rate_schedule, make_optimizer


def train_config(**values):
  config = gpt.get_config('tiny').train
  config.update(values)
  return config


def test_rsqrt_is_the_noam_schedule():
  schedule = learning_rate_schedule(train_config(schedule='rsqrt', lr=1e-3, warmup_steps=100, steps=1000))
  for step, expected in ((50, 0.5e-3), (100, 1e-3), (400, 1e-3 * np.sqrt(100 / 400))):
    assert_close(schedule(step), expected, terms=1)


def test_cosine_linear_and_constant_reach_their_targets():
  cosine = learning_rate_schedule(train_config(schedule='cosine', lr=1.0, warmup_steps=10, steps=110,
                                               end_lr_fraction=0.1))
  for step, expected in ((10, 1.0), (60, 0.55), (110, 0.1)):
    assert_close(cosine(step), expected, terms=1)
  linear = learning_rate_schedule(train_config(schedule='linear', lr=1.0, warmup_steps=10, steps=110,
                                               end_lr_fraction=0.0))
  for step, expected in ((5, 0.5), (60, 0.5), (110, 0.0)):
    assert_close(linear(step), expected, terms=1, scale=1.0)
  constant = learning_rate_schedule(train_config(schedule='constant', lr=0.3, warmup_steps=0))
  for step in (0, 1000):
    assert_close(constant(step), 0.3, terms=1)


def test_weight_decay_skips_biases_norms_and_embeddings():
  model = GPT(GPT2Config(vocab_size=11, max_len=8, num_layers=1, num_heads=2, width=8), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  mask = decay_mask(params)
  flat = {'/'.join(str(getattr(k, 'key', k)) for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
  decayed = {k for k, v in flat.items() if v}
  assert decayed and all('kernel' in k for k in decayed)
  assert not any(k for k in decayed if 'embedding' in k or 'norm' in k or 'bias' in k)
  # One AdamW step with zero gradients moves only the decayed weights.
  tx, _ = make_optimizer(train_config(lr=0.1, warmup_steps=0, schedule='constant', weight_decay=0.5, grad_clip=0.0))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  moved = {'/'.join(str(getattr(k, 'key', k)) for k in path): bool(jnp.any(u != 0))
           for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
  assert {k for k, v in moved.items() if v} == decayed
