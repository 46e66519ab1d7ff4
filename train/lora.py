"""LoRA fine-tuning of a run: which model trains, which of its parameters train, and the checks.

`train.lora_rank` > 0 fine-tunes the run `config.init_from` names (its base run) with the adapters of
models/lora.py on the projections `train.lora_targets` names, scaled by `train.lora_alpha` / rank,
their inputs dropped at `train.lora_dropout` in training. The base weights are frozen: they are in
`TrainState.frozen` (train/state.py), so they get no gradient and no optimizer state, and no
checkpoint holds them. A checkpoint holds the adapters, plus the parameters the base run does not
have (`Task.lora_heads`: a BERT classifier's new output layer), which train in full. The run's
model.json names the base run and the checkpoint step its weights are (train/rundir.py `BASE_KEY`),
which `load_run`, `--mode=eval`, `--mode=predict`, a resume and `--mode=export_hf` load again.
"""
from __future__ import annotations

import re

from flax import nnx

from configs.base import train_defaults
from errors import ConfigError
from models import lora as lora_model

SETTINGS = ('lora_alpha', 'lora_dropout', 'lora_targets')  # what a rank > 0 would use


def enabled(train_config) -> bool:
  """Whether the run fine-tunes LoRA adapters (saved runs from before LoRA have no lora_rank: no)."""
  return train_config.get('lora_rank', 0) > 0


def targets(train_config) -> tuple[str, ...]:
  """`train.lora_targets` as its comma-separated entries."""
  return tuple(entry.strip() for entry in train_config.lora_targets.split(',') if entry.strip())


def model_builder(task, train_config):
  """rngs -> the task's model, with LoRA adapters on the projections `train.lora_targets` names
  when the run is a LoRA run (ConfigError when a target names no projection, or a module the run trains
  in full: the task's `lora_heads`)."""
  if not enabled(train_config):
    return task.build_model
  t = train_config

  def build(rngs: nnx.Rngs) -> nnx.Module:
    model = task.build_model(rngs)
    try:
      chosen = lora_model.add_adapters(model, targets(t), rank=t.lora_rank, alpha=t.lora_alpha,
                                       dropout=t.lora_dropout, rngs=rngs)
    except lora_model.TargetError as e:
      raise ConfigError(f'config.train.lora_targets: {e}') from e
    # A head trains in full: an adapter beside it would add nothing, and PEFT saves such a module whole.
    heads = [path for path in chosen if set(path.split('/')) & set(task.lora_heads)]
    if heads:
      raise ConfigError(f'config.train.lora_targets={t.lora_targets!r} adapts {", ".join(heads)}, which a LoRA run '
                        f'trains in full; leave it out of the targets.')
    return model

  return build


def trainable(task, train_config):
  """The nnx filter of the parameters training changes: all of them, or for a LoRA run the adapters
  and the task's `lora_heads` (modules the base run does not have)."""
  if not enabled(train_config):
    return nnx.Param
  return nnx.Any(nnx.LoRAParam, *(nnx.PathContains(name) for name in task.lora_heads))


def check_config(config, supports_init_from: bool) -> None:
  """The LoRA keys of `config` (`supports_init_from`: its family's Task copies another run's
  parameters); a ConfigError naming the key and the fix."""
  t, defaults = config.train, train_defaults()
  changed = [f'train.{key}={t[key]!r}' for key in SETTINGS if t[key] != defaults[key]]
  if t.lora_rank < 0 or (t.lora_rank == 0 and changed):
    raise ConfigError(f'config.train.lora_rank={t.lora_rank}: LoRA needs a rank > 0 (0 = full fine-tuning'
                      + (f', where {", ".join(changed)} does nothing' if changed else '') + '); e.g. '
                      '--config.train.lora_rank=8.')
  if not enabled(t):
    return
  if not supports_init_from:
    raise ConfigError(f'config.train.lora_rank: LoRA fine-tunes a run of a family that copies another run '
                      f'(config.init_from); the {config.family!r} family does not.')
  if not config.init_from:
    raise ConfigError('config.train.lora_rank: LoRA fine-tunes a trained run; name it with '
                      '--config.init_from=<its workdir>.')
  if t.lora_alpha <= 0:
    raise ConfigError(f'config.train.lora_alpha={t.lora_alpha} must be positive (the adapters are scaled by '
                      f'alpha / rank).')
  if not 0 <= t.lora_dropout < 1:
    raise ConfigError(f'config.train.lora_dropout={t.lora_dropout} must be in [0, 1): the fraction of the '
                      f"adapters' inputs dropped in training.")
  if not targets(t):
    raise ConfigError(f'config.train.lora_targets={t.lora_targets!r} names no projection; e.g. q,v '
                      f'(any of {", ".join(lora_model.ALIASES)}, or regular expressions of their paths).')
  for target in targets(t):
    try:
      re.compile(lora_model.ALIASES.get(target, target))
    except re.error as e:
      raise ConfigError(f'config.train.lora_targets: {target!r} is not a regular expression ({e}); name '
                        f'projections by {", ".join(lora_model.ALIASES)} or by a pattern of their paths.') from e
  if t.optimizer == 'muon':
    raise ConfigError('config.train.optimizer=muon takes hidden weight matrices, and a LoRA run trains only its '
                      'adapters; use --config.train.optimizer=adamw (or adam, lion, adafactor).')


def check_base(base_config, base_workdir: str) -> None:
  """The base run of a LoRA run (its saved config) must not be a LoRA run itself."""
  if enabled(base_config.get('train', {})):
    raise ConfigError(f'config.init_from={base_workdir} is itself a LoRA run; start from its base run '
                      f'({base_config.get("init_from")}), or export it merged (--mode=export_hf) and import that.')
