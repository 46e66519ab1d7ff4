"""The one trainer: `train_and_evaluate(config, workdir)` runs any family's `Task`.

Stages, in order (each has a banner below):
  1. config      validate it once, before anything touches disk
  2. setup       mesh, task, data and tokenizer, the resolved model config, sharded state
  3. resume      restore the newest intact checkpoint of `workdir`, if any; then save config.json
                 and model.json (only now, so a failed resume leaves the run's files as they were)
  4. loop        one jit-compiled step (gradient accumulation inside), periodic eval, checkpoints,
                 metrics; SIGTERM or Ctrl-C saves and returns; `train.max_minutes` and
                 `train.early_stopping_patience` save and go on to stage 5; a NaN/inf loss stops
                 with the last good checkpoint kept
  5. final       the family's own evaluation (BLEU, samples, pictures) of the best checkpoint
                 (`train.final_eval_from`), saying which step it scored
One training holds a workdir at a time (train/workdir_lock.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
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

import storage
from errors import UserError
from train import checkpoint as ckpt
from data import batching
from train import compilation, memory, sharding
from train.workdir_lock import WorkdirLock
from train import state as state_lib
from train.metrics import MetricWriter, reduce_metrics
from train.optim import make_optimizer
from train.state import StateSpec, TrainState
from train.task import RUNTIME_FIELDS, Prepared, Task, get_task
from train.validation import validate_config

READ_AHEAD_BATCHES = 4  # training batches a reader thread prepares ahead of the step that uses them


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
    # Strided micro-batches (micro-batch k holds rows k, k + grad_accum, ...): each device's rows of
    # the batch hold its share of every micro-batch, so no example moves between devices.
    micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]), 0, 1),
                         batch)

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
    scalars = {'loss': loss, 'grad_norm': optax.tree.norm(grads), 'real_tokens': task.count_tokens(batch)[1]}
    return new_state, (scalars, metrics)

  return train_step


def jit_train_step(task: Task, spec: StateSpec, tx: optax.GradientTransformation, grad_accum: int):
  """`make_train_step` jitted as training runs it: state sharded by `spec`, the batch split over the
  data-parallel axes, the old state donated. Trace it inside `sharding.use_mesh(spec.mesh)`."""
  return jax.jit(make_train_step(task, spec.graphdef, tx, grad_accum),
                 in_shardings=(spec.shardings, sharding.batch_sharding(spec.mesh)),
                 out_shardings=(spec.shardings, None), donate_argnums=(0,))


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
  eval_step: Callable  # jit-compiled (params, extra, batch) -> loss metrics

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
  memory.log_estimate(config, task.model_config, spec.abstract, spec.shardings, mesh)
  state = state_lib.init_state(spec, task.build_model, tx, config.seed)
  eval_step = jax.jit(make_eval_step(task, spec.graphdef))
  setup = Setup(config, task, prepared, mesh, tx, schedule, spec, state, eval_step)
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
@dataclasses.dataclass
class Progress:
  """What the loop carries across a resume besides the model: saved in every checkpoint's data item."""
  best_value: float | None = None  # the best `train.best_metric` so far
  best_step: int = 0
  evals_since_best: int = 0  # evaluations without improvement, for `train.early_stopping_patience`
  seconds: float = 0.0  # wall time spent in train_and_evaluate so far, for `train.max_minutes`

  def record(self, step: int, metrics: dict[str, float], metric: str, mode: str) -> None:
    if metric not in metrics:
      raise UserError(f'train.best_metric={metric!r} is not among the eval metrics {sorted(metrics)}; '
                      f'set it to one of them.')
    value = metrics[metric]
    better = self.best_value is None or (value < self.best_value if mode == 'min' else value > self.best_value)
    if better:
      self.best_value, self.best_step, self.evals_since_best = value, step, 0
    else:
      self.evals_since_best += 1


def restore_latest(setup: Setup, checkpointer: ckpt.Checkpointer, data_iter, log=print) -> tuple[int, Progress]:
  """Restore the newest intact checkpoint (state, input position, progress) into `setup`.

  Returns its step (0 when there is none) and the loop's progress. Newer checkpoints that do not
  restore are moved aside with a message (see `Checkpointer.restore_newest_intact`)."""
  abstract_opt = state_lib.with_shardings(setup.spec.abstract.opt_state, setup.spec.shardings.opt_state)
  step, restored = checkpointer.restore_newest_intact(
      ckpt.restore_target(setup.spec), abstract_opt, set_aside_broken=jax.process_index() == 0, log=log)
  if step is None:
    return 0, Progress()
  setup.state = TrainState(params=restored['model']['params'], extra=restored['model']['extra'],
                           opt_state=restored['optimizer'], step=jnp.asarray(step, jnp.int32))
  data = restored['data']
  if 'input' not in data:  # checkpoints written before Progress held the iterator state alone
    data = {'input': data, 'progress': {}} if data else {}
  if data:  # an imported run (step 0) has no input position yet
    data_iter.set_state(data['input'])
  return step, Progress(**data.get('progress', {}))


def train_iterator(setup: Setup):
  """This process's rows of the global training batches, as a checkpointable grain iterator."""
  batch_size, examples = setup.config.train.batch_size, setup.prepared.datasets.train
  if len(examples) < batch_size:
    raise UserError(f'The training split has {len(examples)} examples, fewer than train.batch_size='
                    f'{batch_size}; use more data or a smaller batch.')
  batches = setup.task.train_batches(examples, batch_size, setup.config.seed, jax.process_index(),
                                     jax.process_count())
  # The examples are in memory: grain's default read-ahead (16 threads, 500 batches) only contends
  # for the GIL with the training loop, and builds hundreds of batches a short run never uses.
  # One thread a few batches ahead keeps the next batch ready.
  return iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=READ_AHEAD_BATCHES)))


# ============================================================================ stage 4: the loop
def eval_batches(setup: Setup):
  """This process's rows of every eval batch: the whole validation split, the last batch filled
  with weight-0 copies (data/batching.py), the same number of batches on every process."""
  examples, batch_size = setup.prepared.datasets.eval, setup.task.eval_batch_size
  if len(examples) == 0:
    raise UserError('The eval split is empty; give a data.eval_source with examples (or more data to carve it from).')
  processes, index = jax.process_count(), jax.process_index()
  return batching.padded_batches(examples[index::processes], batch_size // processes,
                                 num_batches=-(-len(examples) // batch_size))


def eval_batches_during_training(setup: Setup) -> int:
  """How many eval batches each evaluation during training scores (`train.eval_steps`, 0 = all)."""
  total = -(-len(setup.prepared.datasets.eval) // setup.task.eval_batch_size)
  return min(setup.config.train.eval_steps or total, total)


def describe_eval(setup: Setup) -> str:
  """One line: how many validation examples each evaluation during training scores."""
  total, batch_size = len(setup.prepared.datasets.eval), setup.task.eval_batch_size
  scored = min(eval_batches_during_training(setup) * batch_size, total)
  line = f'Each evaluation during training scores {scored} of the {total} validation examples'
  if scored < total:
    return line + (f' (train.eval_steps={setup.config.train.eval_steps}; 0 = all); the final evaluation '
                   f'scores all {total}.')
  return line + '.'


def evaluate_loss(setup: Setup, eval_step, num_batches: int | None = None) -> dict[str, float]:
  """Mean loss metrics (eval/...) over the first `num_batches` eval batches (None: the whole split)."""
  batches = eval_batches(setup)
  total = None
  for i in range(len(batches) if num_batches is None else min(num_batches, len(batches))):
    metrics = eval_step(setup.state.params, setup.state.extra, sharding.global_batch(batches[i], setup.mesh))
    total = _add_metrics(total, metrics)
  return setup.task.summarize({f'eval/{k}': v for k, v in reduce_metrics(total).items()})


class PreemptionWatcher:
  """Turns SIGTERM (preemption, `kill`) and Ctrl-C into a stop at a step boundary.

  With several processes, JAX's preemption sync point makes every host stop at the same step
  (the coordination service forwards the notice); on one process a handler sets a flag. A second
  Ctrl-C aborts at once (the last checkpoint is kept).
  """

  def __init__(self, log=print):
    self.requested: str | bool = False  # the name of the signal that asked to stop
    self.log = log
    self._previous = {}
    # Several processes stop together only through the sync point, which SIGTERM reaches.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}

  def _handler(self, signum, frame):
    if signum == signal.SIGINT and self.requested:
      raise KeyboardInterrupt
    self.requested = signal.Signals(signum).name
    if signum == signal.SIGINT:
      self.log('Ctrl-C: saving a checkpoint at the end of this step (Ctrl-C again aborts without saving).')

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


@contextlib.contextmanager
def _interruptible():
  """SIGTERM during setup ends it like Ctrl-C (KeyboardInterrupt), so a workdir this run created
  is removed again instead of keeping an orphan tokenizer."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def interrupt(signum, frame):
    raise KeyboardInterrupt

  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


class StepLogger:
  """Checks and logs completed steps one step late, so that reading the loss never stalls the device."""

  def __init__(self, setup: Setup, writer: MetricWriter, checkpointer: ckpt.Checkpointer):
    self.setup, self.writer, self.checkpointer = setup, writer, checkpointer
    self.pending = None  # (step, scalars, metrics, positions) of the step in flight
    self.last_time = time.time()
    self.positions, self.real_tokens = 0, 0.0  # summed over the steps since the last log line

  def add(self, step: int, scalars, metrics, positions: int) -> None:
    """`positions`: token positions of the step's global batch (padding included)."""
    self.flush()
    self.pending = (step, scalars, metrics, positions)

  def flush(self) -> None:
    """Check and log the pending step; raises on NaN before anything saves its parameters."""
    if self.pending is None:
      return
    step, scalars, metrics, positions = self.pending
    self.pending = None
    scalars = {k: float(v) for k, v in jax.device_get(scalars).items()}
    self.positions += positions
    self.real_tokens += scalars['real_tokens']
    if not np.isfinite(scalars['loss']):
      raise TrainingDiverged(
          f'The loss is {scalars["loss"]} at step {step}. Training stopped; the last good checkpoint in '
          f'{self.checkpointer.directory} is kept. Lower train.lr, raise train.warmup_steps or set train.grad_clip.')
    train = self.setup.config.train
    if step % train.log_every == 0 or step == train.steps:
      now = time.time()
      elapsed = max(now - self.last_time, 1e-9)
      out = {f'train/{k}': v for k, v in reduce_metrics(jax.device_get(metrics)).items()}
      out.update({'train/loss': scalars['loss'], 'train/grad_norm': scalars['grad_norm'],
                  'train/lr': float(self.setup.schedule(step - 1)), 'train/tokens_per_s': self.positions / elapsed,
                  'train/real_tokens_per_s': self.real_tokens / elapsed})
      self.last_time, self.positions, self.real_tokens = now, 0, 0.0
      self.writer.write(step, out)
      self.writer.progress(step, out)


def train_loop(setup: Setup, checkpointer: ckpt.Checkpointer, data_iter, writer: MetricWriter,
               start_step: int, progress: Progress, started: float) -> dict[str, Any]:
  """Steps from `start_step` to `train.steps` (or an earlier stop); returns {'step', 'train/compiles',
  'stopped'?, 'preempted'?}. `started` is when this process began the run (time.time())."""
  train = setup.config.train
  train_step = jit_train_step(setup.task, setup.spec, setup.tx, train.grad_accum)
  logger, watcher = StepLogger(setup, writer, checkpointer), PreemptionWatcher(writer.log)
  compiled_before = compilation.compiled('train_step')
  compiles = lambda: compilation.compiled('train_step') - compiled_before
  seconds_before = progress.seconds
  saved = [start_step]  # the step of the newest checkpoint, so that a stop never saves it twice

  def save(at: int, metrics=None) -> None:
    if saved[0] == at:
      return
    saved[0] = at
    progress.seconds = seconds_before + time.time() - started
    checkpointer.save(at, {'params': setup.state.params, 'extra': setup.state.extra}, setup.state.opt_state,
                      {'input': data_iter.get_state(), 'progress': dataclasses.asdict(progress)}, metrics)

  last_eval, step, stopped = {}, start_step, None
  try:
    with sharding.use_mesh(setup.mesh):
      while step < train.steps and stopped is None:
        if watcher.should_stop(step):
          logger.flush()
          save(step)
          checkpointer.wait()
          writer.log(f'{watcher.requested or "Preemption"}: saved step {step} to {checkpointer.directory}; rerun the '
                     f'same command to resume.')
          return {'step': step, 'preempted': True, 'train/compiles': compiles()}
        batch = sharding.global_batch(next(data_iter), setup.mesh)
        setup.state, (scalars, metrics) = train_step(setup.state, batch)
        step += 1
        logger.add(step, scalars, metrics, setup.task.count_tokens(batch)[0])
        if _budget_spent(train, step, seconds_before + time.time() - started):
          stopped = f'train.max_minutes={train.max_minutes} reached'
        evaluated = step % train.eval_every == 0 or step == train.steps or stopped is not None
        if evaluated:
          logger.flush()
          try:
            last_eval, early_stop = evaluate_during_training(setup, step, progress, writer)
          except BaseException:
            save(step)  # the step's checkpoint outlives a failed evaluation
            checkpointer.wait()
            raise
          stopped = stopped or early_stop
        # Every evaluated step is saved with its metrics, so the best checkpoint is always on disk.
        if evaluated or stopped or step % train.checkpoint_every == 0:
          logger.flush()
          save(step, last_eval if evaluated else None)
      logger.flush()
    checkpointer.wait()
  finally:
    watcher.restore()
    # Every distinct batch shape builds the train step once: few shapes are the data pipeline's job.
    writer.log(f'The train step was compiled {compiles()} time(s). ' + (compilation.cache_summary() or ''))
  if stopped:
    writer.log(f'Stopped at step {step} of {train.steps}: {stopped}.')
  return {'step': step, 'train/compiles': compiles(), **({'stopped': stopped} if stopped else {})}


def _budget_spent(train, step: int, seconds: float) -> bool:
  """Whether `seconds` of the run exceed `train.max_minutes` (0: no budget). Several processes
  agree on process 0's clock, every `train.log_every` steps."""
  if not train.max_minutes or (jax.process_count() > 1 and step % train.log_every):
    return False
  return _agreed(seconds > 60 * train.max_minutes)


def evaluate_during_training(setup: Setup, step: int, progress: Progress, writer: MetricWriter
                             ) -> tuple[dict[str, float], str | None]:
  """Score `train.eval_steps` validation batches at `step`, log them and track the best; returns
  (the metrics, why training should stop early or None)."""
  train = setup.config.train
  metrics = evaluate_loss(setup, setup.eval_step, eval_batches_during_training(setup))
  progress.record(step, metrics, train.best_metric, train.best_mode)
  writer.write(step, metrics)
  writer.log(f'step {step}: ' + ' '.join(f'{k}={v:.4f}' for k, v in metrics.items()))
  if train.early_stopping_patience and progress.evals_since_best >= train.early_stopping_patience:
    return metrics, (f'early stopping: {train.best_metric} has not improved on {progress.best_value:.4f} '
                     f'(step {progress.best_step}) in {progress.evals_since_best} evaluations')
  return metrics, None


def _agreed(flag: bool) -> bool:
  """Process 0's `flag`, on every process."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def _add_metrics(total: dict | None, metrics: dict) -> dict:
  metrics = jax.device_get(metrics)
  if total is None:
    return {k: [np.asarray(s, np.float64), np.asarray(c, np.float64)] for k, (s, c) in metrics.items()}
  for k, (s, c) in metrics.items():
    total[k][0] += s
    total[k][1] += c
  return total


# ============================================================================ stage 5: final evaluation
def final_evaluation(setup: Setup, workdir: str, writer: MetricWriter | None, step: int) -> dict[str, Any]:
  """What the final line reports about the current model (the checkpoint being scored): eval/...
  over the whole validation split, and the family's evaluation (test metrics, samples, pictures).

  Training and `--mode=eval` both call this, so their numbers agree. With a `writer` (training),
  the family's metrics and pictures are logged at `step`; the whole-split eval/... are not (the
  loop logged eval/... for its own steps: one value per name and step)."""
  with sharding.use_mesh(setup.mesh):
    results = evaluate_loss(setup, setup.eval_step)
    print('Final evaluation, whole validation split: ' + ' '.join(f'{k}={v:.4f}' for k, v in results.items()),
          flush=True)
    model = setup.model()
    model.eval()
    family = setup.task.evaluate(model, setup.prepared.datasets, workdir)
  scalars = {k: v for k, v in family.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
  if writer is not None and scalars:
    writer.write(step, scalars)
  for name, path in family.get('images', {}).items() if writer is not None else ():
    writer.write_image(step, name, path)
  return {**results, **family}


def evaluated_step(setup: Setup, checkpointer: ckpt.Checkpointer, current_step: int, log=print) -> int:
  """Load the checkpoint `train.final_eval_from` names into `setup` (unless it is the current
  state) and return its step: 'best' is the kept checkpoint with the best `train.best_metric`
  (the current one when no checkpoint has eval metrics), 'last' the current state."""
  train = setup.config.train
  best = checkpointer.best_step() if train.final_eval_from == 'best' else None
  if best is None or best[0] == current_step:
    log(f'Final evaluation: step {current_step} (train.final_eval_from={train.final_eval_from}).')
    return current_step
  step, value = best
  restored = checkpointer.restore(step, ckpt.restore_target(setup.spec))['model']
  setup.state = dataclasses.replace(setup.state, params=restored['params'], extra=restored['extra'])
  log(f'Final evaluation: the best checkpoint, step {step} ({train.best_metric}={value:.4f}), not the last '
      f'step {current_step} (train.final_eval_from=best; set it to last to score the last step).')
  return step


# ============================================================================ entry points
def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming if it holds a checkpoint); return the final metrics."""
  started = time.time()
  # 1. config
  validate_config(config)
  # 2. setup (SIGTERM and Ctrl-C here leave no workdir this call created; a second training of the
  # same workdir is refused)
  lock = WorkdirLock(workdir)
  with _removed_on_failure(workdir), _interruptible():
    _take(lock)
    try:
      _check_run_files(config, workdir)
      setup = setup_run(config, workdir)
      eval_batches(setup)
      checkpointer = ckpt.Checkpointer(workdir, config.train, data_since=ckpt.data_since(workdir))
    except BaseException:
      _release(lock)
      raise
  try:
    try:
      # 3. resume
      data_iter = train_iterator(setup)
      start_step, progress = restore_latest(setup, checkpointer, data_iter)
      history, progress = _record_data(config, workdir, start_step, progress, checkpointer)
      if jax.process_index() == 0:
        ckpt.save_config(config, workdir, history)
        ckpt.save_model_config(setup.prepared.model_config, setup.spec.rng_impl, workdir)
      writer = MetricWriter(workdir, config.train.steps, start_step, trim_after=start_step,
                            wandb=_wandb_settings(config, workdir))
      if start_step:
        writer.log(f'Resumed from the checkpoint at step {start_step} in {checkpointer.directory}.')
      writer.log(describe_eval(setup))
      # 4. loop
      results = train_loop(setup, checkpointer, data_iter, writer, start_step, progress, started)
      # 5. final evaluation: only the scored checkpoint's metrics reach the results
      if not results.get('preempted'):
        results['final_eval_step'] = evaluated_step(setup, checkpointer, results['step'], writer.log)
    finally:
      checkpointer.close()
    if not results.get('preempted'):
      results.update(final_evaluation(setup, workdir, writer, results['step']))
    writer.close()
  finally:
    _release(lock)
  return results


def _take(lock: WorkdirLock) -> None:
  """Process 0 takes the lock; every process learns whether it got it."""
  error = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except UserError as e:
      error = e
  if not _agreed(error is None):
    raise error or UserError(f'Process 0 could not lock {lock.path}: another training holds the workdir.')


def _release(lock: WorkdirLock) -> None:
  if jax.process_index() == 0:
    lock.release()


def _record_data(config, workdir: str, start_step: int, progress: Progress, checkpointer: ckpt.Checkpointer
                 ) -> tuple[list[dict], Progress]:
  """(the run's data history with this run's data, the loop's progress). A resume on other data
  (`train.allow_data_change`, checked by `_check_run_files`) starts a history entry at
  `start_step` and restarts best-checkpoint tracking: validation losses of two datasets do not compare."""
  current = {key: config.data[key] for key in ckpt.DATA_KEYS}
  history = ckpt.data_history(workdir) if start_step else []
  if history and {key: history[-1][key] for key in ckpt.DATA_KEYS} == current:
    return history, progress
  if history:
    print(f'Data changed at step {start_step} (train.allow_data_change): ' +
          ', '.join(f'data.{k}={v!r}' for k, v in current.items() if history[-1][k] != v) +
          f'; the tokenizer stays the run\'s own; the best checkpoint is tracked again from step {start_step}.',
          flush=True)
    progress = Progress(seconds=progress.seconds)
  checkpointer.data_since = start_step
  return history + [{'step': start_step, **current}], progress


def _check_run_files(config, workdir: str) -> None:
  """Tokenizer files without config.json are left by a setup that was killed: remove them so this
  run builds its own. A resumed run must ask for the tokenizer it was built with, and read the
  data it was trained on unless `train.allow_data_change`."""
  from data import tokenizers
  saved_config = os.path.join(workdir, ckpt.CONFIG_FILE)
  if not storage.path(saved_config).exists():
    orphans = [storage.path(workdir) / name for name in (tokenizers.TOKENIZER_FILE, tokenizers.META_FILE)]
    orphans = [orphan for orphan in orphans if orphan.exists()]
    if orphans and jax.process_index() == 0:
      print(f'Removing {", ".join(map(str, orphans))}: left by an interrupted setup (no {ckpt.CONFIG_FILE}).',
            flush=True)
      for orphan in orphans:
        orphan.unlink()
    _agreed(True)  # no process reads the workdir's tokenizer before process 0 has removed it
    return
  saved = ckpt.read_config(workdir)
  keys = ('tokenizer', 'vocab_size', 'lowercase')
  changed = [k for k in keys if k in saved.get('data', {}) and saved.data[k] != config.data[k]]
  if changed:
    raise ckpt.CheckpointError(
        f'{workdir} was built with ' + ', '.join(f'data.{k}={saved.data[k]!r}' for k in changed) +
        ' (its tokenizer is saved there) but the config asks for ' +
        ', '.join(f'data.{k}={config.data[k]!r}' for k in changed) +
        f". Resume with the run's own settings ({saved_config}) or use a fresh --workdir.")
  trained_on = ckpt.data_history(workdir)[-1]
  changed = [k for k in ckpt.DATA_KEYS if trained_on[k] != config.data[k]]
  if changed and not config.train.allow_data_change:
    raise ckpt.CheckpointError(
        f'{workdir} was trained on ' + ', '.join(f'data.{k}={trained_on[k]!r}' for k in changed) +
        ' but the config asks for ' + ', '.join(f'data.{k}={config.data[k]!r}' for k in changed) +
        '. Resume with the same data, use a fresh --workdir, or pass --config.train.allow_data_change=True '
        '(the run keeps its tokenizer, config.json records both, the best checkpoint is tracked anew).')


def _wandb_settings(config, workdir: str) -> dict | None:
  """The Weights & Biases run of this workdir (None: off). A resume continues the same W&B run."""
  logging = config.get('logging')
  if not logging or not logging.wandb_project:
    return None
  return {'project': logging.wandb_project, 'entity': logging.wandb_entity or None,
          'config': config.to_dict(), 'workdir': workdir}


def evaluate_run(workdir: str, config_overrides: dict | None = None) -> dict[str, Any]:
  """`--mode=eval`: eval-split metrics plus the family's evaluation of the checkpoint that
  `train.final_eval_from` names (the best by default, as after training)."""
  setup, step = restored_setup(workdir, config_overrides)
  # The run's metrics.jsonl and TensorBoard logs are training's record: evaluating writes nothing there.
  return {'step': step, **final_evaluation(setup, workdir, None, step)}


def restored_setup(workdir: str, config_overrides: dict | None = None) -> tuple[Setup, int]:
  """(the run's setup holding the checkpoint `train.final_eval_from` names, its step).

  The run's config.json (with `config_overrides`) and model.json rebuild the model; a run trained
  on another number of devices evaluates data-parallel over the devices present.
  """
  config, model_config = ckpt.run_config(workdir, config_overrides)
  checkpointer = ckpt.Checkpointer(workdir, config.train, read_only=True, data_since=ckpt.data_since(workdir))
  if checkpointer.latest_step() is None:
    raise ckpt.CheckpointError(f'No checkpoint in {checkpointer.directory}; train first or check --workdir.')
  setup = setup_run(config, workdir, model_config, ckpt.read_rng_impl(workdir))
  latest, restored = checkpointer.restore_newest_intact(ckpt.restore_target(setup.spec))
  setup.state = dataclasses.replace(setup.state, params=restored['model']['params'], extra=restored['model']['extra'])
  step = evaluated_step(setup, checkpointer, latest)
  checkpointer.close()
  return setup, step


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
    ckpt.save_config(_with_model_of(config, prepared.model_config), workdir)
    ckpt.save_model_config(prepared.model_config, rng_impl, workdir)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(config.train)
    checkpointer = ckpt.Checkpointer(workdir, config.train)
    checkpointer.save(0, {'params': params, 'extra': extra}, tx.init(params), {})
    checkpointer.wait()
    checkpointer.close()
  return {'params': int(sum(x.size for x in jax.tree.leaves(params))), 'hf_dir': hf_dir}


def _with_model_of(config, model_config):
  """A copy of `config` whose `model.*` keys hold the imported model's values (runtime fields
  aside), so that its config.json describes the checkpoint and a resume resolves the same model
  whatever preset the import started from; `data.seq_len` is capped at the model's positions."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for field in dataclasses.fields(model_config):
      if field.name in config.model and field.name not in RUNTIME_FIELDS:
        config.model[field.name] = getattr(model_config, field.name)
    config.data.seq_len = min(config.data.seq_len, config.model.get('max_len', config.data.seq_len))
  return config
