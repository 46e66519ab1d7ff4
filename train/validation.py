"""Config validation, run once before anything is built or written.

Each problem is reported in one `ConfigError` naming the key and the fix: unknown keys (checked
against the family's own `configs/<family>.py:get_config`), `model.*` keys that are not fields of
the family's model-config dataclass (the model is built from that dataclass alone, so the key
would do nothing), wrong types, impossible values (heads not dividing the width, a mesh larger
than the devices, a batch the data axes cannot split), and the family's own checks
(`validate(config)` in `train/tasks/<family>.py`).
"""
from __future__ import annotations

import difflib
import importlib

import jax
import ml_collections
import numpy as np

from configs.base import flatten  # noqa: F401  (callers take it from here too)
from errors import ConfigError

MODEL_DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # model.dtype: the compute dtype ('auto': per platform)


def reference_config(config) -> ml_collections.ConfigDict:
  """The family's schema: `configs/<family>.py`'s get_config for the same preset."""
  family = config.get('family')
  if not family:
    raise ConfigError('config.family is missing: configs must start from configs.base.base_config(family).')
  try:
    module = importlib.import_module(f'configs.{family}')
  except ModuleNotFoundError as e:
    raise ConfigError(f'Unknown family {family!r}: there is no configs/{family}.py.') from e
  preset = config.get('preset') or 'default'
  return module.get_config(preset)


def unknown_key_message(key: str, known, where: str) -> str:
  close = difflib.get_close_matches(key, list(known), n=1)
  hint = f" Did you mean '{close[0]}'?" if close else ''
  return f"Unknown config key '{key}'.{hint} Valid keys are listed in {where}."


def check_keys_and_types(config, reference) -> None:
  given, expected = flatten(config), flatten(reference)
  for key, value in given.items():
    if key not in expected:
      raise ConfigError(unknown_key_message(key, expected, f'configs/{config.family}.py and configs/base.py'))
    want = type(expected[key])
    if expected[key] is None or value is None:
      continue
    if want is float and isinstance(value, int) and not isinstance(value, bool):
      continue
    if not isinstance(value, want):
      raise ConfigError(f"config.{key} must be {want.__name__}, got {value!r} ({type(value).__name__}); "
                        f'e.g. --config.{key}={expected[key]!r}.')


def check_values(config, num_devices: int | None = None) -> None:
  """`num_devices`: the devices the mesh spans (None: all of this run's, `jax.device_count()`)."""
  t, m = config.train, config.model
  positive = {'train.steps': t.steps, 'train.batch_size': t.batch_size, 'train.grad_accum': t.grad_accum,
              'train.eval_every': t.eval_every, 'train.checkpoint_every': t.checkpoint_every,
              'train.log_every': t.log_every, 'train.keep_checkpoints': t.keep_checkpoints,
              'data.seq_len': config.data.seq_len}
  for key, value in positive.items():
    if value <= 0:
      raise ConfigError(f'config.{key}={value} must be positive.')
  non_negative = {'train.eval_batch_size': t.eval_batch_size, 'train.warmup_steps': t.warmup_steps,
                  'train.eval_steps': t.eval_steps, 'train.weight_decay': t.weight_decay,
                  'train.grad_clip': t.grad_clip, 'data.max_examples': config.data.max_examples,
                  'train.early_stopping_patience': t.early_stopping_patience, 'train.max_minutes': t.max_minutes,
                  'train.z_loss': t.z_loss, 'data.cache_workers': config.data.cache_workers,
                  'train.final_eval_examples': t.get('final_eval_examples', 0),
                  'train.final_decode_examples': t.get('final_decode_examples', 0),
                  'train.eval_tasks_every': t.get('eval_tasks_every', 0),
                  'train.eval_tasks_limit': t.get('eval_tasks_limit', 0)}
  for key, value in non_negative.items():
    if value < 0:
      raise ConfigError(f'config.{key}={value} must be >= 0.')
  if t.lr <= 0:
    raise ConfigError(f'config.train.lr={t.lr} must be positive.')
  if t.get('eval_tasks_every', 0) % t.eval_every:
    raise ConfigError(f'config.train.eval_tasks_every={t.eval_tasks_every} must be a multiple of '
                      f'config.train.eval_every={t.eval_every}: tasks are scored at evaluations (0 = at every one).')
  if t.final_eval_from not in ('best', 'last'):
    raise ConfigError(f"config.train.final_eval_from={t.final_eval_from!r}: use 'best' or 'last'.")
  if t.best_mode not in ('min', 'max'):
    raise ConfigError(f"config.train.best_mode={t.best_mode!r}: use 'min' or 'max'.")
  check_optimizer(t)
  if m.get('dtype') not in (None, *MODEL_DTYPES):
    raise ConfigError(f"config.model.dtype={m.dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'.")
  from models.attention import ATTENTION_IMPLEMENTATIONS
  if m.get('attention') is not None and m.attention not in ATTENTION_IMPLEMENTATIONS:
    raise ConfigError(f'config.model.attention={m.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}.')
  width, heads = m.get('width'), m.get('num_heads')
  if width is not None and heads is not None and (heads <= 0 or width % heads):
    raise ConfigError(f'config.model.num_heads={heads} does not divide config.model.width={width}; '
                      f'choose num_heads among the divisors of width.')
  for rate in ('dropout', 'attention_dropout', 'token_dropout'):
    if not 0 <= m.get(rate, 0.0) < 1:
      raise ConfigError(f'config.model.{rate}={m[rate]} must be in [0, 1): the fraction of values dropped in training.')
  check_mesh(config, num_devices)


def check_mesh(config, num_devices: int | None = None) -> None:
  """The mesh fits the devices, its batch axes split the batch, and its expert axis splits the experts."""
  from train import sharding
  t, mesh = config.train, config.mesh
  devices = jax.device_count() if num_devices is None else num_devices
  try:
    sizes = sharding.mesh_shape(mesh, devices)
  except ValueError as e:
    raise ConfigError(f'config.mesh: {e}') from e
  if any(s <= 0 for s in sizes.values()):
    raise ConfigError(f'config.mesh sizes must be positive or -1, got {dict(mesh)}.')
  axes = ' x '.join(sharding.BATCH_AXES)
  data_parallel = int(np.prod([sizes[axis] for axis in sharding.BATCH_AXES]))
  per_step = data_parallel * t.grad_accum
  if t.batch_size % per_step:
    raise ConfigError(f'config.train.batch_size={t.batch_size} is not divisible by mesh {axes} x train.grad_accum = '
                      + ' x '.join(str(sizes[axis]) for axis in sharding.BATCH_AXES)
                      + f' x {t.grad_accum}; use a multiple of {per_step}.')
  eval_batch = t.eval_batch_size or t.batch_size
  if eval_batch % data_parallel:
    raise ConfigError(f'config.train.eval_batch_size={eval_batch} is not divisible by mesh {axes} = {data_parallel}.')
  if t.batch_size % jax.process_count():
    raise ConfigError(f'config.train.batch_size={t.batch_size} is not divisible by the {jax.process_count()} '
                      f'processes.')
  experts = config.model.get('moe_experts', 0)
  if sizes['expert'] > 1 and not experts:
    raise ConfigError(f'config.mesh.expert={sizes["expert"]} splits experts, but this model has none '
                      f'(model.moe_experts=0); set mesh.expert=1, or model.moe_experts.')
  if sizes['expert'] > 1 and config.model.get('moe_capacity_factor', 0) > 0:
    raise ConfigError(f'config.model.moe_capacity_factor={config.model.moe_capacity_factor} with mesh.expert='
                      f'{sizes["expert"]}: expert parallelism runs the dropless experts only; set '
                      f'model.moe_capacity_factor=0, or mesh.expert=1.')
  if experts % sizes['expert']:
    raise ConfigError(f'config.model.moe_experts={experts} is not divisible by mesh.expert={sizes["expert"]}: each '
                      f'device holds an equal share of the experts; choose an expert axis that divides {experts}.')


def check_optimizer(t) -> None:
  """`config.train`'s optimizer, schedule and target (train/optim.py, train/loop.py)."""
  from train.loop import parse_target
  from train.optim import DECAY_SHAPES, OPTIMIZERS, SCHEDULES, resolve_ns_dtype, step_cooldown
  if t.optimizer not in OPTIMIZERS:
    raise ConfigError(f'config.train.optimizer={t.optimizer!r} is not one of {OPTIMIZERS}.')
  if t.schedule not in SCHEDULES:
    raise ConfigError(f'config.train.schedule={t.schedule!r} is not one of {SCHEDULES}.')
  if t.optimizer == 'schedule_free_adamw' and t.schedule != 'constant':
    raise ConfigError(f"config.train.schedule={t.schedule!r}: schedule_free_adamw replaces the schedule (it averages "
                      "instead of decaying); set train.schedule=constant (train.warmup_steps is its warmup).")
  if t.optimizer == 'schedule_free_adamw' and not 0 < t.b1 < 1:
    raise ConfigError(f'config.train.b1={t.b1}: schedule_free_adamw interpolates with b1, which must be in (0, 1).')
  if t.decay_shape not in DECAY_SHAPES:
    raise ConfigError(f'config.train.decay_shape={t.decay_shape!r} is not one of {DECAY_SHAPES}.')
  if not 0 <= t.decay_fraction <= 1:
    raise ConfigError(f'config.train.decay_fraction={t.decay_fraction} must be in [0, 1].')
  cooldown_start = step_cooldown(t)[0]
  if t.schedule == 'wsd' and cooldown_start < t.warmup_steps:  # the cooldown would jump the lr to its peak
    raise ConfigError(f'config.train.warmup_steps={t.warmup_steps} outlasts wsd\'s stable phase: the cooldown over the '
                      f'last train.decay_fraction={t.decay_fraction} of train.steps={t.steps} starts at step '
                      f'{cooldown_start}; lower train.warmup_steps or train.decay_fraction, or raise train.steps.')
  if not 0 <= t.muon_momentum < 1:
    raise ConfigError(f'config.train.muon_momentum={t.muon_momentum} must be in [0, 1).')
  resolve_ns_dtype(t.muon_ns_dtype)
  for key in ('adam_lr', 'muon_rms_scale'):
    if t[key] < 0:
      raise ConfigError(f'config.train.{key}={t[key]} must be >= 0 (0: {"train.lr" if key == "adam_lr" else "off"}).')
  parse_target(t.target)
  if t.stop_at_target and not t.target:
    raise ConfigError('config.train.stop_at_target=True needs a train.target, e.g. '
                      "--config.train.target='eval/loss<=3.28'.")


def check_decode(config) -> None:
  d = config.decode
  if d.max_new_tokens < 1:
    raise ConfigError(f'config.decode.max_new_tokens={d.max_new_tokens} must be at least 1.')
  if d.temperature < 0:
    raise ConfigError(f'config.decode.temperature={d.temperature} must be >= 0 (0 = greedy).')
  if d.top_k < 0:
    raise ConfigError(f'config.decode.top_k={d.top_k} must be >= 0 (0 = off).')
  if not 0 < d.top_p <= 1:
    raise ConfigError(f'config.decode.top_p={d.top_p} must be in (0, 1] (1 = off).')
  if d.beam_size < 0:
    raise ConfigError(f'config.decode.beam_size={d.beam_size} must be >= 0 (0 or 1: greedy).')
  if d.max_len_ratio <= 0:
    raise ConfigError(f'config.decode.max_len_ratio={d.max_len_ratio} must be positive.')
  if d.num_samples < 0:
    raise ConfigError(f'config.decode.num_samples={d.num_samples} must be >= 0 (0: no samples at the end).')


def validate_config(config, num_devices: int | None = None) -> None:
  """Raise ConfigError describing the first problem found; the mesh must span `num_devices`
  (None: all of this run's devices; a compile-only target's otherwise)."""
  # Imported here: launch.py's flag check reads this module and need not load flax and grain.
  from train import lora
  from train.task import Task, check_model_fields, task_module
  check_keys_and_types(config, reference_config(config))
  family = task_module(config.family).Task
  check_model_fields(config.model.keys(), family.model_config_class)
  check_values(config, num_devices)
  check_decode(config)
  lora.check_config(config, family.init_from is not Task.init_from)
  family_check = getattr(task_module(config.family), 'validate', None)
  if family_check is not None:
    family_check(config)
