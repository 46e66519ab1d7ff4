"""The one trainer: `train_and_evaluate(config, workdir)` runs any family's `Task`.

Stages, in order (each has a banner below):
  1. config      validate it once, before anything touches disk
  2. setup       mesh, task, data and tokenizer, the resolved model config, sharded state
  3. resume      restore the latest checkpoint of `workdir`, if any; then save config.json and
                 model.json (only now, so a failed resume leaves the run's files as they were)
  4. loop        one jit-compiled step (gradient accumulation inside), periodic eval, checkpoints,
                 metrics; SIGTERM saves and returns; a NaN/inf loss stops with the last good
                 checkpoint kept
  5. final       the family's own evaluation (BLEU, samples, pictures) of the final model
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import storage
from errors import UserError
from train import checkpoint as ckpt
from train import compilation, memory, sharding
from train import state as state_lib
from train.metrics import MetricWriter, reduce_metrics
from train.optim import make_optimizer
from train.state import StateSpec, TrainState
from train.task import RUNTIME_FIELDS, Prepared, Task, get_task
from train.validation import validate_config


class TrainingDiverged(UserError):
  """The loss became NaN or inf."""


# ============================================================================ the compiled steps
def make_train_step(task: Task, graphdef, tx: optax.GradientTransformation, grad_accum: int) -> Callable:
  """(state, batch) -> (state, (scalars, metrics)). Batch leaves are [grad_accum * micro, ...]."""

  def micro_step(params, extra, batch):
    # copy=True: fresh Variables at this trace level, so the loss may update them (RNG counts, carried RNN state).
    model = nnx.merge(graphdef, params, extra, copy=True)
    loss, metrics = task.loss(model, batch, deterministic=False)
    return loss, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

  grad_fn = jax.value_and_grad(micro_step, has_aux=True)

  def accumulated(state: TrainState, batch):
    """Mean gradient and loss over `grad_accum` micro-batches, scanned so memory holds one."""
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
    return (loss / grad_accum, (metrics, extra)), jax.tree.map(lambda g: g / grad_accum, grads)

  def train_step(state: TrainState, batch):
    if grad_accum == 1:
      (loss, (metrics, extra)), grads = grad_fn(state.params, state.extra, batch)
    else:
      (loss, (metrics, extra)), grads = accumulated(state, batch)
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


# ============================================================================ stage 2: setup
@dataclasses.dataclass
class Setup:
  """Everything stages 3-5 read: the task (bound to its resolved data), the mesh, the optimizer, the state."""
  config: Any
  task: Task
  prepared: Prepared
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: Callable
  spec: StateSpec
  state: TrainState

  def model(self) -> nnx.Module:
    return state_lib.model_of(self.spec, self.state)


def setup_run(config, workdir: str, model_config=None, rng_impl: str | None = None) -> Setup:
  """Mesh, data and a freshly initialised sharded state.

  `model_config` (a finished run's model.json, for evaluation) replaces the one the config and
  data resolve to. Training in a workdir that already holds a model checks that the config still
  resolves to it, so that a resume never restores into a different model. `rng_impl` likewise.
  """
  compilation.enable_cache(config.compile_cache)
  mesh = sharding.make_mesh(config.mesh)
  task = get_task(config)
  prepared = task.prepare(workdir)
  if model_config is not None:
    prepared = task.bind(dataclasses.replace(prepared, model_config=model_config))
  else:
    _check_same_model(ckpt.read_model_config(workdir, task.model_config_class), prepared.model_config, workdir)
  rng_impl = rng_impl or _run_rng_impl(config, workdir)
  tx, schedule = make_optimizer(config.train)
  spec = state_lib.state_spec(task.build_model, mesh, rng_impl, tx)
  memory.log_estimate(config, spec.abstract, spec.shardings, mesh)
  state = state_lib.init_state(spec, task.build_model, tx, config.seed)
  setup = Setup(config, task, prepared, mesh, tx, schedule, spec, state)
  if config.init_from:
    setup.state = _init_from(setup, config.init_from)
  return setup


def _run_rng_impl(config, workdir: str) -> str:
  """The PRNG of a new run from `config.rng_impl`; a resumed run keeps the one it was built with."""
  saved = ckpt.read_rng_impl(workdir)
  if saved is None:
    return state_lib.resolve_rng_impl(config.rng_impl)
  if config.rng_impl not in ('auto', saved):
    raise ckpt.CheckpointError(f'config.rng_impl={config.rng_impl!r} differs from the {saved!r} that {workdir} was '
                               f'built with; resume with rng_impl={saved!r} (or auto) or use a fresh --workdir.')
  return saved


def _check_same_model(saved, resolved, workdir: str) -> None:
  if saved is None:
    return
  differences = [f.name for f in dataclasses.fields(saved)
                 if f.name not in RUNTIME_FIELDS and getattr(saved, f.name) != getattr(resolved, f.name)]
  if differences:
    raise ckpt.CheckpointError(
        f'{workdir} holds a model with ' + ', '.join(f'{k}={getattr(saved, k)!r}' for k in differences) +
        ' but the config and data now give ' + ', '.join(f'{k}={getattr(resolved, k)!r}' for k in differences) +
        f'. Resume with the run\'s own config ({os.path.join(workdir, ckpt.CONFIG_FILE)}) or use a fresh --workdir.')


def _init_from(setup: Setup, source_workdir: str) -> TrainState:
  """Fine-tuning: the task copies what it wants from another run's model; the optimizer starts fresh."""
  model = setup.model()
  setup.task.init_from(model, ckpt.load_run(source_workdir).model)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  params = jax.device_put(params, setup.spec.shardings.params)
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.spec.shardings.opt_state)(params)
  return dataclasses.replace(setup.state, params=params, extra=extra, opt_state=opt_state)


@contextlib.contextmanager
def _removed_on_failure(workdir: str):
  """A workdir this call creates is deleted again if setup fails: nothing half-written is left."""
  directory = storage.path(workdir)
  created = not directory.exists()
  directory.mkdir(parents=True, exist_ok=True)
  try:
    yield
  except BaseException:
    if created and jax.process_index() == 0:
      with contextlib.suppress(OSError):  # the original error matters, not a failed clean-up
        directory.rmtree()
    raise


# ============================================================================ stage 3: resume
def restore_latest(setup: Setup, checkpointer: ckpt.Checkpointer, data_iter) -> int:
  """Restore the latest checkpoint (state and input position) into `setup`; its step, or 0."""
  step = checkpointer.latest_step()
  if step is None:
    return 0
  abstract_opt = state_lib.with_shardings(setup.spec.abstract.opt_state, setup.spec.shardings.opt_state)
  restored = checkpointer.restore(step, ckpt.restore_target(setup.spec), abstract_opt)
  setup.state = TrainState(params=restored['model']['params'], extra=restored['model']['extra'],
                           opt_state=restored['optimizer'], step=jnp.asarray(step, jnp.int32))
  if restored['data']:  # an imported run (step 0) has no input position yet
    data_iter.set_state(restored['data'])
  return step


def train_iterator(setup: Setup):
  """This process's rows of the global training batches, as a checkpointable grain iterator."""
  batch_size, examples = setup.config.train.batch_size, setup.prepared.datasets.train
  if len(examples) < batch_size:
    raise UserError(f'The training split has {len(examples)} examples, fewer than train.batch_size='
                    f'{batch_size}; use more data or a smaller batch.')
  batches = setup.task.train_batches(examples, batch_size, setup.config.seed, jax.process_index(),
                                     jax.process_count())
  return iter(batches.to_iter_dataset())


# ============================================================================ stage 4: the loop
def evaluate_loss(setup: Setup, eval_step) -> dict[str, float]:
  """Mean loss metrics over `train.eval_steps` eval batches (0 = the whole eval split)."""
  batch_size = setup.task.eval_batch_size
  processes, index = jax.process_count(), jax.process_index()
  examples = setup.prepared.datasets.eval
  batches = setup.task.eval_batches(examples[index::processes], batch_size // processes)
  if len(batches) == 0:
    raise UserError(f'The eval split has {len(examples)} examples, fewer than one eval batch of '
                    f'{batch_size}; lower train.eval_batch_size.')
  eval_steps = setup.config.train.eval_steps
  steps = len(batches) if not eval_steps else min(eval_steps, len(batches))
  total = None
  for i in range(steps):
    metrics = eval_step(setup.state.params, setup.state.extra, sharding.global_batch(batches[i], setup.mesh))
    total = _add_metrics(total, metrics)
  return setup.task.summarize({f'eval/{k}': v for k, v in reduce_metrics(total).items()})


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


class StepLogger:
  """Checks and logs completed steps one step late, so that reading the loss never stalls the device."""

  def __init__(self, setup: Setup, writer: MetricWriter, checkpointer: ckpt.Checkpointer, start_step: int):
    self.setup, self.writer, self.checkpointer = setup, writer, checkpointer
    self.pending = None  # (step, scalars, metrics, tokens) of the step in flight
    self.last_time, self.last_step = time.time(), start_step

  def add(self, step: int, scalars, metrics, tokens: int) -> None:
    self.flush()
    self.pending = (step, scalars, metrics, tokens)

  def flush(self) -> None:
    """Check and log the pending step; raises on NaN before anything saves its parameters."""
    if self.pending is None:
      return
    step, scalars, metrics, tokens = self.pending
    self.pending = None
    scalars = {k: float(v) for k, v in jax.device_get(scalars).items()}
    if not np.isfinite(scalars['loss']):
      raise TrainingDiverged(
          f'The loss is {scalars["loss"]} at step {step}. Training stopped; the last good checkpoint in '
          f'{self.checkpointer.directory} is kept. Lower train.lr, raise train.warmup_steps or set train.grad_clip.')
    train = self.setup.config.train
    if step % train.log_every == 0 or step == train.steps:
      now = time.time()
      out = {f'train/{k}': v for k, v in reduce_metrics(jax.device_get(metrics)).items()}
      out.update({'train/loss': scalars['loss'], 'train/grad_norm': scalars['grad_norm'],
                  'train/lr': float(self.setup.schedule(step - 1)),
                  'train/tokens_per_s': tokens * (step - self.last_step) / max(now - self.last_time, 1e-9)})
      self.last_time, self.last_step = now, step
      self.writer.write(step, out)
      self.writer.progress(step, out)


def train_loop(setup: Setup, checkpointer: ckpt.Checkpointer, data_iter, writer: MetricWriter,
               start_step: int) -> dict[str, Any]:
  """Steps from `start_step` to `train.steps`; returns {'step', 'preempted'?, eval metrics}."""
  config = setup.config
  train_step = jax.jit(make_train_step(setup.task, setup.spec.graphdef, setup.tx, config.train.grad_accum),
                       in_shardings=(setup.spec.shardings, sharding.batch_sharding(setup.mesh)),
                       out_shardings=(setup.spec.shardings, None), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(setup.task, setup.spec.graphdef))
  logger, watcher = StepLogger(setup, writer, checkpointer, start_step), PreemptionWatcher()
  compiled_before = compilation.compiled('train_step')
  compiles = lambda: compilation.compiled('train_step') - compiled_before
  save = lambda at, metrics=None: checkpointer.save(at, {'params': setup.state.params, 'extra': setup.state.extra},
                                                     setup.state.opt_state, data_iter.get_state(), metrics)
  last_eval, step = {}, start_step
  try:
    with jax.set_mesh(setup.mesh):
      while step < config.train.steps:
        if watcher.should_stop(step):
          logger.flush()
          save(step)
          checkpointer.wait()
          writer.log(f'SIGTERM: saved step {step} to {checkpointer.directory}; rerun the same command to resume.')
          return {'step': step, 'preempted': True, 'train/compiles': compiles(), **last_eval}
        local = next(data_iter)
        setup.state, (scalars, metrics) = train_step(setup.state, sharding.global_batch(local, setup.mesh))
        step += 1
        logger.add(step, scalars, metrics, _tokens_in(local) * jax.process_count())
        is_last = step == config.train.steps
        evaluated = step % config.train.eval_every == 0 or is_last
        if evaluated:
          logger.flush()
          last_eval = evaluate_loss(setup, eval_step)
          writer.write(step, last_eval)
          writer.log(f'step {step}: ' + ' '.join(f'{k}={v:.4f}' for k, v in last_eval.items()))
        if step % config.train.checkpoint_every == 0 or is_last:
          logger.flush()
          save(step, last_eval if evaluated else None)
      logger.flush()
    checkpointer.wait()
  finally:
    watcher.restore()
    # Every distinct batch shape builds the train step once: few shapes are the data pipeline's job.
    writer.log(f'The train step was compiled {compiles()} time(s). ' + (compilation.cache_summary() or ''))
  return {'step': step, 'train/compiles': compiles(), **last_eval}


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


# ============================================================================ stage 5: final evaluation
def final_evaluation(setup: Setup, workdir: str, writer: MetricWriter, step: int) -> dict[str, Any]:
  """The family's evaluation of the current model (test metrics, samples, pictures), logged at `step`."""
  model = setup.model()
  model.eval()
  with jax.set_mesh(setup.mesh):
    results = setup.task.evaluate(model, setup.prepared.datasets, workdir)
  scalars = {k: v for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if scalars:
    writer.write(step, scalars)
  for name, path in results.get('images', {}).items():
    writer.write_image(step, name, path)
  return results


# ============================================================================ entry points
def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming if it holds a checkpoint); return the final metrics."""
  # 1. config
  validate_config(config)
  # 2. setup
  with _removed_on_failure(workdir):
    setup = setup_run(config, workdir)
    checkpointer = ckpt.Checkpointer(workdir, config.train)
  try:
    # 3. resume
    data_iter = train_iterator(setup)
    start_step = restore_latest(setup, checkpointer, data_iter)
    if jax.process_index() == 0:
      ckpt.save_config(config, workdir)
      ckpt.save_model_config(setup.prepared.model_config, setup.spec.rng_impl, workdir)
    writer = MetricWriter(workdir, config.train.steps, start_step)
    if start_step:
      writer.log(f'Resumed from the checkpoint at step {start_step} in {checkpointer.directory}.')
    # 4. loop
    results = train_loop(setup, checkpointer, data_iter, writer, start_step)
  finally:
    checkpointer.close()
  # 5. final evaluation
  if not results.get('preempted'):
    results.update(final_evaluation(setup, workdir, writer, results['step']))
  writer.close()
  return results


def evaluate_run(workdir: str, config_overrides: dict | None = None) -> dict[str, Any]:
  """`--mode=eval`: the latest checkpoint's eval-split metrics plus the family's evaluation.

  The run's config.json (with `config_overrides`) and model.json rebuild the model; a run trained
  on another number of devices evaluates data-parallel over the devices present.
  """
  config, model_config = ckpt.run_config(workdir, config_overrides)
  checkpointer = ckpt.Checkpointer(workdir, read_only=True)
  step = checkpointer.latest_step()
  if step is None:
    raise ckpt.CheckpointError(f'No checkpoint in {checkpointer.directory}; train first or check --workdir.')
  setup = setup_run(config, workdir, model_config, ckpt.read_rng_impl(workdir))
  restored = checkpointer.restore(step, ckpt.restore_target(setup.spec))['model']
  checkpointer.close()
  setup.state = dataclasses.replace(setup.state, params=restored['params'], extra=restored['extra'])
  eval_step = jax.jit(make_eval_step(setup.task, setup.spec.graphdef))
  with jax.set_mesh(setup.mesh):
    results = {'step': step, **evaluate_loss(setup, eval_step)}
  writer = MetricWriter(workdir, config.train.steps, step)
  results.update(final_evaluation(setup, workdir, writer, step))
  writer.close()
  return results


def import_hf_run(config, hf_dir: str, workdir: str) -> dict[str, Any]:
  """`--mode=import_hf`: write a Hugging Face checkpoint as a run (step 0) that trains, evals, reloads."""
  if not os.path.isdir(hf_dir):
    raise UserError(f'--hf_dir={hf_dir} is not a directory (expected config.json and the weights).')
  if (storage.path(workdir) / ckpt.CHECKPOINT_DIR).is_dir():
    raise ckpt.CheckpointError(f'{workdir} already holds checkpoints; import into a fresh --workdir.')
  validate_config(config)
  task = get_task(config)
  rng_impl = state_lib.resolve_rng_impl(config.rng_impl)
  prepared, model = task.import_hf(hf_dir, state_lib.make_rngs(config.seed, rng_impl))
  with _removed_on_failure(workdir):
    prepared.tokenizer.save(workdir)
    ckpt.save_config(config, workdir)
    ckpt.save_model_config(prepared.model_config, rng_impl, workdir)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(config.train)
    checkpointer = ckpt.Checkpointer(workdir, config.train)
    checkpointer.save(0, {'params': params, 'extra': extra}, tx.init(params), {})
    checkpointer.wait()
    checkpointer.close()
  return {'params': int(sum(x.size for x in jax.tree.leaves(params))), 'hf_dir': hf_dir}
