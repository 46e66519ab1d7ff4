"""Optimizer and learning-rate schedules from `config.train`, all built from Optax pieces."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from errors import ConfigError

SCHEDULES = ('constant', 'cosine', 'linear', 'rsqrt')


def learning_rate_schedule(train_config) -> optax.Schedule:
  """Peak `lr` after `warmup_steps` of linear warmup, then:

  constant: stays at lr.  cosine / linear: decays to lr * end_lr_fraction at `steps`.
  rsqrt: lr * sqrt(warmup / step), the "Noam" schedule of Attention Is All You Need
  (d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) with the d_model factor folded into lr).
  """
  lr, warmup, steps = train_config.lr, train_config.warmup_steps, train_config.steps
  end = lr * train_config.end_lr_fraction
  name = train_config.schedule
  if name == 'constant':
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]) \
        if warmup else optax.constant_schedule(lr)
  if name == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end)
  if name == 'linear':
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.linear_schedule(lr, end, max(steps - warmup, 1))], [warmup])
  if name == 'rsqrt':
    warmup = max(warmup, 1)
    decay = lambda count: lr * jnp.sqrt(warmup / jnp.maximum(count + warmup, 1.0))
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])
  raise ConfigError(f'Unknown train.schedule {name!r}; choose one of {SCHEDULES}.')


def decay_mask(params) -> object:
  """True for parameters that get weight decay: matrices of Linear layers (kernels).

  Biases, LayerNorm scales/offsets and embedding tables are excluded, as in GPT-2 and BERT.
  """
  def keep(path, _):
    names = [str(k.key) for k in path if hasattr(k, 'key')]  # nnx.State paths end in '.value'
    return bool(names) and names[-1] == 'kernel'
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(train_config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(train_config)
  if train_config.optimizer == 'adamw':
    opt = optax.adamw(schedule, b1=train_config.b1, b2=train_config.b2, eps=train_config.eps,
                      weight_decay=train_config.weight_decay, mask=decay_mask)
  elif train_config.optimizer == 'adam':
    opt = optax.adam(schedule, b1=train_config.b1, b2=train_config.b2, eps=train_config.eps)
  else:
    raise ConfigError(f"Unknown train.optimizer {train_config.optimizer!r}; choose 'adamw' or 'adam'.")
  if train_config.grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(train_config.grad_clip), opt)
  return opt, schedule
