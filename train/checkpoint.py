"""Orbax checkpoints of a run, and `load_run` to reload one anywhere.

A checkpoint step holds three items, written together and atomically by Orbax:
  model      {'params': nnx.State, 'extra': nnx.State}  parameters plus every other model variable
             (dropout RNG streams, carried recurrent state)
  optimizer  the Optax state
  data       the input iterator position (JSON)
The workdir also holds `config.json` (the resolved config) and the tokenizer files, so a run
reloads without its config file:

    from train.checkpoint import load_run
    run = load_run('runs/gpt-default-...')
    run.predict(['def fibonacci(n):'])

Restoring passes abstract arrays carrying the *current* mesh's shardings, so a run trained on 8
devices reloads on 1 (or the reverse).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from errors import UserError

CHECKPOINT_DIR = 'checkpoints'
CONFIG_FILE = 'config.json'


class CheckpointError(UserError):
  """A missing, corrupt or incompatible checkpoint; the message names the fix."""


def abstract_with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
  """Keeps the latest `keep` checkpoints plus the best one by `best_metric`."""

  def __init__(self, workdir: str, train_config=None, *, read_only: bool = False):
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    policies = []
    best_metric, best_mode = 'eval/loss', 'min'
    if train_config is not None:
      policies.append(ocp.checkpoint_managers.LatestN(n=train_config.keep_checkpoints))
      best_metric, best_mode = train_config.best_metric, train_config.best_mode
      policies.append(ocp.checkpoint_managers.BestN(
          get_metric_fn=lambda metrics: metrics[best_metric], reverse=best_mode == 'min', n=1,
          keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        create=not read_only, read_only=read_only,
        enable_async_checkpointing=bool(train_config and train_config.async_checkpoints),
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if policies else None)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=('model', 'optimizer', 'data'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, model_state, opt_state, data_state: dict, metrics: dict | None = None) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(model_state), optimizer=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(data_state)), metrics=metrics, force=True)

  def restore(self, step: int, abstract_model, abstract_opt=None) -> dict[str, Any]:
    """Restore `model` (and `optimizer` and `data` when `abstract_opt` is given) at `step`."""
    items = {'model': ocp.args.StandardRestore(abstract_model)}
    if abstract_opt is not None:
      items['optimizer'] = ocp.args.StandardRestore(abstract_opt)
      items['data'] = ocp.args.JsonRestore()
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax raises assorted types for corrupt files and shape mismatches.
      raise CheckpointError(
          f'Cannot restore the checkpoint at step {step} in {self.directory}: {type(e).__name__}: '
          f'{str(e)[:600]}\nThe checkpoint is corrupt or was written by a different model config. '
          f'Use the config the run was trained with (its config.json), or a fresh --workdir.') from e

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def save_config(config, workdir: str) -> None:
  with open(os.path.join(workdir, CONFIG_FILE), 'w') as f:
    f.write(config.to_json(indent=2))


def read_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise CheckpointError(f'{path} not found: {workdir} is not a run directory '
                          f'(expected config.json, tokenizer and checkpoints/).')
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


@dataclasses.dataclass
class Run:
  """A reloaded run: call `run.model(...)` directly, or `run.predict(lines)`."""
  config: ml_collections.ConfigDict
  model: nnx.Module
  tokenizer: Any
  step: int
  task: Any
  workdir: str

  def predict(self, lines: list[str]) -> list[Any]:
    return self.task.predict(self.model, lines)


def load_run(workdir: str, step: int | None = None, config_overrides: dict | None = None) -> Run:
  """Reload a run's model (parameters bound), tokenizer and config on the current devices.

  `config_overrides` ({'task': 'features', 'features.pooling': 'mean'}) change settings of the
  saved config.json before the run is rebuilt; keys it lacks are an error."""
  from train import sharding
  from train.task import get_task
  config = read_config(workdir)
  for key, value in (config_overrides or {}).items():
    target = config
    *parents, leaf = key.split('.')
    for parent in parents:
      target = target.get(parent) if isinstance(target, ml_collections.ConfigDict) else None
    if not isinstance(target, ml_collections.ConfigDict) or leaf not in target:
      raise CheckpointError(f"Unknown config key '{key}': {os.path.join(workdir, CONFIG_FILE)} has no such "
                            f"setting, so the override cannot apply to this run.")
    target[leaf] = value
  if config_overrides:
    import importlib
    family_check = getattr(importlib.import_module(f'configs.{config.family}'), 'validate', None)
    if family_check is not None:
      family_check(config)  # e.g. features.pooling, task
  task = get_task(config)
  task.load_tokenizer(workdir)
  checkpointer = Checkpointer(workdir, read_only=True)
  step = checkpointer.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f'No checkpoint in {checkpointer.directory}; train first (python launch.py '
                          f'--config=... --workdir={workdir}).')
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1, 'tensor': 1})
  abstract_model = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(params=0, dropout=0)))
  graphdef, params, extra = nnx.split(abstract_model, nnx.Param, ...)
  abstract = {'params': params, 'extra': extra}
  abstract = abstract_with_shardings(abstract, sharding.state_shardings(abstract, mesh))
  restored = checkpointer.restore(step, abstract)['model']
  checkpointer.close()
  model = nnx.merge(graphdef, restored['params'], restored['extra'])
  model.eval()
  return Run(config=config, model=model, tokenizer=task.tokenizer, step=step, task=task, workdir=workdir)
