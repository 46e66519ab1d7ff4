"""The one trainer: `train_and_evaluate(config, workdir)` runs any family's `Task`.

Stages, in order:
  1. validate the config (before anything touches disk)
  2. mesh, task, data, tokenizer
  3. model and optimizer state, created sharded by the rules of train/sharding.py
  4. restore the latest checkpoint of `workdir`, if any (automatic resume)
  5. the loop: one jit-compiled step (gradient accumulation inside), periodic eval, checkpoints,
     metrics; SIGTERM saves and returns; a NaN/inf loss stops with the last good checkpoint kept
  6. final eval, the family's own evaluation (BLEU, samples, pictures), how to reload the run
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs.validation import validate_config
from errors import UserError
from train import checkpoint as ckpt
from train import memory, sharding
from train.metrics import MetricWriter, reduce_metrics
from train.optim import make_optimizer
from train.task import Datasets, Task, get_task


class TrainingDiverged(UserError):
  """The loss became NaN or inf."""


@dataclasses.dataclass
class TrainState:
  """Everything a step reads and writes; a pytree of (sharded) arrays."""
  params: nnx.State
  extra: nnx.State  # non-parameter model variables: dropout RNG streams, carried RNN state
  opt_state: Any
  step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=['params', 'extra', 'opt_state', 'step'], meta_fields=[])


class PreemptionWatcher:
  """Turns SIGTERM (preemption, `kill`) into a stop at a step boundary.

  With several processes, JAX's preemption sync point makes every host stop at the same step
  (the coordination service forwards the notice); on one process a SIGTERM handler sets a flag.
  """

  def __init__(self):
    self.requested = False
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handler)

  def _handler(self, signum, frame):
    self.requested = True

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


# ----------------------------------------------------------------------------- the step
def make_train_step(task: Task, graphdef, tx: optax.GradientTransformation, grad_accum: int) -> Callable:
  """(state, batch) -> (state, metrics). Batch leaves are [grad_accum * micro, ...]."""

  def micro_step(params, extra, batch):
    # copy=True: fresh Variables at this trace level, so the loss may update them (RNG counts, carried RNN state).
    model = nnx.merge(graphdef, params, extra, copy=True)
    loss, metrics = task.loss(model, batch, deterministic=False)
    return loss, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

  grad_fn = jax.value_and_grad(micro_step, has_aux=True)

  def train_step(state: TrainState, batch):
    if grad_accum == 1:
      (loss, (metrics, extra)), grads = grad_fn(state.params, state.extra, batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

      def accumulate(carry, micro_batch):
        grads_sum, loss_sum, metrics_sum, extra = carry
        (loss, (metrics, extra)), grads = grad_fn(state.params, extra, micro_batch)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        return (add(grads_sum, grads), loss_sum + loss, add(metrics_sum, metrics), extra), None

      zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
      first = jax.tree.map(lambda x: x[0], micro)
      metric_shapes = jax.eval_shape(lambda: grad_fn(state.params, state.extra, first)[0][1][0])
      init = (zeros(state.params), jnp.zeros((), jnp.float32), zeros(metric_shapes), state.extra)
      (grads, loss, metrics, extra), _ = jax.lax.scan(accumulate, init, micro)
      grads = jax.tree.map(lambda g: g / grad_accum, grads)
      loss = loss / grad_accum
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(params=params, extra=extra, opt_state=opt_state, step=state.step + 1)
    scalars = {'loss': loss, 'grad_norm': optax.tree.norm(grads)}
    return new_state, (scalars, metrics)

  return train_step


def make_eval_step(task: Task, graphdef) -> Callable:
  def eval_step(params, extra, batch):
    model = nnx.merge(graphdef, params, extra)
    _, metrics = task.loss(model, batch, deterministic=True)
    return metrics
  return eval_step


# ----------------------------------------------------------------------------- helpers
def _tokens_in(batch: dict[str, np.ndarray]) -> int:
  first = next(iter(batch.values()))
  return int(np.prod(first.shape[:2])) if first.ndim >= 2 else int(first.shape[0])


def _add_metrics(total: dict | None, metrics: dict) -> dict:
  metrics = jax.device_get(metrics)
  if total is None:
    return {k: [np.asarray(s, np.float64), np.asarray(c, np.float64)] for k, (s, c) in metrics.items()}
  for k, (s, c) in metrics.items():
    total[k][0] += s
    total[k][1] += c
  return total


class _Setup:
  """Stages 2-4: mesh, task, data, sharded state, restored checkpoint."""

  def __init__(self, config, workdir: str):
    self.config = config
    self.mesh = sharding.make_mesh(config.mesh)
    self.task = get_task(config)
    self.datasets: Datasets = self.task.prepare(workdir)
    self.tx, self.schedule = make_optimizer(config.train)

    def init():
      model = self.task.build_model(nnx.Rngs(params=config.seed, dropout=config.seed + 1))
      _, params, extra = nnx.split(model, nnx.Param, ...)
      return TrainState(params=params, extra=extra, opt_state=self.tx.init(params), step=jnp.zeros((), jnp.int32))

    abstract_model = nnx.eval_shape(lambda: self.task.build_model(nnx.Rngs(params=0, dropout=0)))
    self.graphdef = nnx.graphdef(abstract_model)
    abstract_state = jax.eval_shape(init)
    self.state_sharding = sharding.state_shardings(abstract_state, self.mesh)
    memory.log_estimate(config, abstract_state, self.state_sharding, self.mesh)
    with jax.set_mesh(self.mesh):
      self.state = jax.jit(init, out_shardings=self.state_sharding)()
    if config.init_from:
      self.state = self._init_from(config.init_from)

  def _init_from(self, source_workdir: str):
    """Fine-tuning: the task copies what it wants from another run's parameters."""
    model = nnx.merge(self.graphdef, self.state.params, self.state.extra)
    self.task.init_from(model, source_workdir)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, self.state_sharding.params)
    return dataclasses.replace(self.state, params=params, extra=extra,
                               opt_state=jax.jit(self.tx.init, out_shardings=self.state_sharding.opt_state)(params))

  def abstract(self):
    model = {'params': self.state.params, 'extra': self.state.extra}
    model_sh = {'params': self.state_sharding.params, 'extra': self.state_sharding.extra}
    return (ckpt.abstract_with_shardings(model, model_sh),
            ckpt.abstract_with_shardings(self.state.opt_state, self.state_sharding.opt_state))


def _data_iterator(setup: _Setup, config):
  """This process's slice of the training batches, as a checkpointable grain iterator."""
  processes, index = jax.process_count(), jax.process_index()
  local_batch = config.train.batch_size // processes
  examples = setup.datasets.train
  if len(examples) < config.train.batch_size:
    raise ValueError(f'The training split has {len(examples)} examples, fewer than train.batch_size='
                     f'{config.train.batch_size}; use more data or a smaller batch.')
  if type(setup.task).train_batches is Task.train_batches:
    batches = process_rows_of_global_batches(examples, config.train.batch_size, config.seed, index, processes)
  else:  # the family orders its own batches (bucketing, carried streams) from this process's examples
    batches = setup.task.train_batches(examples[index::processes], local_batch, config.seed)
  return iter(batches.to_iter_dataset())


def process_rows_of_global_batches(examples, batch_size: int, seed: int, process_index: int,
                                   process_count: int) -> grain.MapDataset:
  """This process's rows of each shuffled global batch, reading only those rows.

  Global batch b holds elements [b * batch_size, (b + 1) * batch_size) of the seeded, endlessly
  reshuffled order, whatever the process count, so 1 and N processes train on the same batches.
  """
  order = examples.shuffle(seed=seed).repeat()
  local = batch_size // process_count

  def row(i):
    step, offset = divmod(i, local)
    return order[step * batch_size + process_index * local + offset]

  return grain.MapDataset.range(len(order) // process_count).map(row).batch(local, drop_remainder=True)


def evaluate_loss(setup: _Setup, eval_step, params, extra, config) -> dict[str, float]:
  """Mean loss metrics over `train.eval_steps` eval batches (0 = the whole eval split)."""
  batch_size = config.train.eval_batch_size or config.train.batch_size
  processes, index = jax.process_count(), jax.process_index()
  examples = setup.datasets.eval[index::processes]
  batches = setup.task.eval_batches(examples, batch_size // processes)
  if len(batches) == 0:
    raise ValueError(f'The eval split has {len(setup.datasets.eval)} examples, fewer than one eval batch of '
                     f'{batch_size}; lower train.eval_batch_size.')
  steps = len(batches) if not config.train.eval_steps else min(config.train.eval_steps, len(batches))
  total = None
  for i in range(steps):
    total = _add_metrics(total, eval_step(params, extra, sharding.global_batch(batches[i], setup.mesh)))
  return setup.task.summarize({f'eval/{k}': v for k, v in reduce_metrics(total).items()})


# ----------------------------------------------------------------------------- entry point
def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming if it holds a checkpoint); return the final metrics."""
  validate_config(config)
  created = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  try:
    setup = _Setup(config, workdir)
    checkpointer = ckpt.Checkpointer(workdir, config.train)
  except BaseException:
    if created and jax.process_index() == 0:
      shutil.rmtree(workdir, ignore_errors=True)  # leave nothing half-written behind
    raise
  if jax.process_index() == 0:
    ckpt.save_config(config, workdir)
  try:
    return _train_loop(config, workdir, setup, checkpointer)
  finally:
    checkpointer.close()


def evaluate_run(config, workdir: str) -> dict[str, Any]:
  """`--mode=eval`: the latest checkpoint's eval-split metrics plus the family's evaluation.

  A run trained on another number of devices evaluates here with a data-parallel mesh over the
  devices present (checkpoints restore onto any mesh).
  """
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except ValueError:
    print(f'Note: the run\'s mesh {dict(config.mesh)} does not fit the {jax.device_count()} devices here; '
          f'evaluating data-parallel over all of them.', flush=True)
    config = config.copy_and_resolve_references()
    config.mesh.update({'data': -1, 'fsdp': 1, 'tensor': 1})
  validate_config(config)
  checkpointer = ckpt.Checkpointer(workdir, read_only=True)
  step = checkpointer.latest_step()
  if step is None:
    raise ckpt.CheckpointError(f'No checkpoint in {checkpointer.directory}; train first or check --workdir.')
  setup = _Setup(config, workdir)
  abstract_model, _ = setup.abstract()
  restored = checkpointer.restore(step, abstract_model)['model']
  checkpointer.close()
  setup.state = dataclasses.replace(setup.state, params=restored['params'], extra=restored['extra'])
  eval_step = jax.jit(make_eval_step(setup.task, setup.graphdef))
  with jax.set_mesh(setup.mesh):
    results = {'step': step, **evaluate_loss(setup, eval_step, setup.state.params, setup.state.extra, config)}
  writer = MetricWriter(workdir, config.train.steps, step)
  results.update(_final_evaluation(setup, workdir, writer, step))
  writer.close()
  return results


def import_hf_run(config, hf_dir: str, workdir: str) -> dict[str, Any]:
  """`--mode=import_hf`: write a Hugging Face checkpoint as a run (step 0) that trains, evals, reloads."""
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f'--hf_dir={hf_dir} is not a directory (expected config.json and the weights).')
  if os.path.isdir(os.path.join(workdir, ckpt.CHECKPOINT_DIR)):
    raise ckpt.CheckpointError(f'{workdir} already holds checkpoints; import into a fresh --workdir.')
  task = get_task(config)
  model = task.import_hf(hf_dir)  # also sets task.tokenizer and the model dimensions in task.config
  validate_config(task.config)
  created = not os.path.exists(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    task.tokenizer.save(workdir)
    ckpt.save_config(task.config, workdir)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(task.config.train)
    checkpointer = ckpt.Checkpointer(workdir, task.config.train)
    checkpointer.save(0, {'params': params, 'extra': extra}, tx.init(params), {})
    checkpointer.wait()
    checkpointer.close()
  except BaseException:
    if created:
      shutil.rmtree(workdir, ignore_errors=True)
    raise
  return {'params': int(sum(x.size for x in jax.tree.leaves(params))), 'hf_dir': hf_dir}


def restore_latest(setup: _Setup, checkpointer: ckpt.Checkpointer, data_iter) -> int:
  step = checkpointer.latest_step()
  if step is None:
    return 0
  abstract_model, abstract_opt = setup.abstract()
  restored = checkpointer.restore(step, abstract_model, abstract_opt)
  setup.state = TrainState(params=restored['model']['params'], extra=restored['model']['extra'],
                           opt_state=restored['optimizer'], step=jnp.asarray(step, jnp.int32))
  if restored['data']:  # an imported run (step 0) has no input position yet
    data_iter.set_state(restored['data'])
  return step


def _train_loop(config, workdir, setup: _Setup, checkpointer: ckpt.Checkpointer) -> dict[str, Any]:
  data_iter = _data_iterator(setup, config)
  start_step = restore_latest(setup, checkpointer, data_iter)
  writer = MetricWriter(workdir, config.train.steps, start_step)
  if start_step:
    writer.log(f'Resumed from the checkpoint at step {start_step} in {checkpointer.directory}.')
  grad_accum = config.train.grad_accum
  batch_sh = sharding.batch_sharding(setup.mesh)
  train_step = jax.jit(make_train_step(setup.task, setup.graphdef, setup.tx, grad_accum),
                       in_shardings=(setup.state_sharding, batch_sh), out_shardings=(setup.state_sharding, None),
                       donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(setup.task, setup.graphdef))
  watcher = PreemptionWatcher()
  last_eval: dict[str, float] = {}
  pending = None  # (step, scalars, metrics, tokens) of the step in flight: fetched one step late
  last_time, last_step = time.time(), start_step
  step = start_step

  def save(at_step, metrics=None):
    checkpointer.save(at_step, {'params': setup.state.params, 'extra': setup.state.extra}, setup.state.opt_state,
                      data_iter.get_state(), metrics)

  def finish_step(record):
    """Check and log a completed step; raises on NaN before anything saves its parameters."""
    nonlocal last_time, last_step
    done_step, scalars, metrics, tokens = record
    scalars = {k: float(v) for k, v in jax.device_get(scalars).items()}
    if not np.isfinite(scalars['loss']):
      raise TrainingDiverged(
          f'The loss is {scalars["loss"]} at step {done_step}. Training stopped; the last good checkpoint in '
          f'{checkpointer.directory} is kept. Lower train.lr, raise train.warmup_steps or set train.grad_clip.')
    if done_step % config.train.log_every == 0 or done_step == config.train.steps:
      now = time.time()
      out = {f'train/{k}': v for k, v in reduce_metrics(jax.device_get(metrics)).items()}
      out.update({'train/loss': scalars['loss'], 'train/grad_norm': scalars['grad_norm'],
                  'train/lr': float(setup.schedule(done_step - 1)),
                  'train/tokens_per_s': tokens * (done_step - last_step) / max(now - last_time, 1e-9)})
      last_time, last_step = now, done_step
      writer.write(done_step, out)
      writer.progress(done_step, out)

  try:
    with jax.set_mesh(setup.mesh):
      while step < config.train.steps:
        if watcher.should_stop(step):
          if pending:
            finish_step(pending)
            pending = None
          save(step)
          checkpointer.wait()
          writer.log(f'SIGTERM: saved step {step} to {checkpointer.directory}; rerun the same command to resume.')
          return {'step': step, 'preempted': True, **last_eval}
        local = next(data_iter)
        batch = sharding.global_batch(local, setup.mesh)
        setup.state, (scalars, metrics) = train_step(setup.state, batch)
        step += 1
        if pending:
          finish_step(pending)
        pending = (step, scalars, metrics, _tokens_in(local) * jax.process_count())
        is_last = step == config.train.steps
        if step % config.train.eval_every == 0 or is_last:
          finish_step(pending)
          pending = None
          last_eval = evaluate_loss(setup, eval_step, setup.state.params, setup.state.extra, config)
          writer.write(step, last_eval)
          writer.log(f'step {step}: ' + ' '.join(f'{k}={v:.4f}' for k, v in last_eval.items()))
        if step % config.train.checkpoint_every == 0 or is_last:
          if pending:
            finish_step(pending)
            pending = None
          metrics_now = last_eval if step % config.train.eval_every == 0 or is_last else None
          save(step, metrics_now)
      if pending:
        finish_step(pending)
    checkpointer.wait()
  finally:
    watcher.restore()
  results = {'step': step, **last_eval}
  results.update(_final_evaluation(setup, workdir, writer, step))
  writer.close()
  return results


def _final_evaluation(setup: _Setup, workdir: str, writer: MetricWriter, step: int) -> dict[str, Any]:
  model = nnx.merge(setup.graphdef, setup.state.params, setup.state.extra)
  model.eval()
  with jax.set_mesh(setup.mesh):
    extra = setup.task.evaluate(model, setup.datasets, workdir)
  scalars = {k: v for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if scalars:
    writer.write(step, scalars)
  for name, path in extra.get('images', {}).items():
    writer.write_image(step, name, path)
  return extra
