"""The one trainer: `train_and_evaluate(config, workdir)` runs any family's `Task`.

Stages, in order (each has a banner in `train_and_evaluate`):
  1. config      validate it once, before anything touches disk
  2. setup       mesh, task, data and tokenizer, the resolved model config, the state's shardings,
                 and a freshly initialised state unless a checkpoint will be restored; a failure
                 here leaves no workdir behind (train/workdir_guard.py)
  3. resume      restore the newest intact checkpoint of `workdir`, if any (train/resume.py); then
                 save config.json and model.json (only now, so a failed resume leaves the run's
                 files as they were)
  4. loop        one jit-compiled step (train/steps.py), periodic eval, checkpoints, metrics
                 (train/loop.py); SIGTERM or Ctrl-C saves and returns; `train.max_minutes` (its
                 clock and reserve for stage 5, and wsd's cooldown against it: train/budget.py),
                 `train.early_stopping_patience`, `train.stop_at_target` and the end of a wall-clock
                 wsd cooldown save and go on to stage 5; a NaN/inf loss stops with the last good
                 checkpoint kept
Every evaluation, the best checkpoint and what a checkpoint's model holds are the parameters
`Setup.evaluated` gives: the trained ones, or schedule-free AdamW's average.
  5. final       the validation split (up to train.final_eval_examples of it) and the family's own
                 evaluation (BLEU, samples, pictures) of the checkpoint `train.final_eval_from` names
                 (train/evaluation.py)
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import grain
import jax
import optax
from flax import nnx

import storage
from errors import UserError
from train import checkpoint as ckpt
from train import rundir
from train import budget, compilation, downstream, evaluation, lora, loop, memory, optim, resume, sharding, steps
from train import state as state_lib
from train.metrics import MetricWriter
from train.optim import make_optimizer
from train.state import StateSpec, TrainState
from train.task import RUNTIME_FIELDS, Task, task_class
from train.validation import validate_config
from train.workdir_guard import WorkdirGuard

READ_AHEAD_BATCHES = 4  # training batches a reader thread prepares ahead of the step that uses them


# ============================================================================ stage 2: setup
@dataclasses.dataclass(frozen=True)
class Setup:
  """What every later stage reads, fixed once built: the task and its data, the mesh, the
  optimizer, the state's shapes and shardings, the compiled eval step. The state itself is
  passed from stage to stage."""
  config: Any
  task: Task  # holds the prepared data, tokenizer and model config
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: Callable
  spec: StateSpec
  eval_step: Callable  # jit-compiled (params, frozen, extra, batch) -> loss metrics
  # Jitted (opt_state, params) -> the parameters every evaluation scores and checkpoints hold as the model
  # (train/optim.py `eval_params`: schedule-free's average); None: the trained parameters themselves.
  eval_params: Callable | None = None
  target: loop.Target | None = None  # train.target
  base: dict | None = None  # a LoRA run's base run {'workdir', 'step'} (rundir.lora_base)
  task_scorer: downstream.Downstream | None = None  # train.eval_tasks' scorer (train/downstream.py)

  def evaluated(self, state: TrainState) -> TrainState:
    """`state` with the parameters every evaluation scores and the checkpoint's model holds:
    schedule-free's averaged ones, else its own."""
    if self.eval_params is None:
      return state
    return dataclasses.replace(state, params=self.eval_params(state.opt_state, state.params))

  def checkpoint_items(self, state: TrainState) -> tuple[dict, Any]:
    """(the checkpoint's model item, its optimizer item) of `state` (train/checkpoint.py)."""
    model = {'params': self.evaluated(state).params, 'extra': state.extra}
    return model, ckpt.optimizer_item(state.opt_state, state.params, self.eval_params is not None)


def setup_run(config, workdir: str, model_config=None, rng_impl: str | None = None,
              scorer: downstream.Downstream | None = None) -> Setup:
  """The run's setup: task, mesh, optimizer, the state's shapes and shardings, the jitted eval step.
  No array is created: a resume or an evaluation restores every one (`fresh_state` initialises).

  `model_config` (a finished run's model.json, for evaluation) replaces the one the config and
  data resolve to. Training in a workdir that already holds a model checks that the config still
  resolves to it, so that a resume never restores into a different model. `rng_impl` likewise.
  `scorer`: train.eval_tasks' (train/downstream.py), whose metrics train.target may name.
  """
  compilation.enable_cache(config.compile_cache)
  base = rundir.lora_base(config, workdir) if lora.enabled(config.train) else None
  mesh = sharding.make_mesh(config.mesh)
  family = task_class(config.family)
  prepared = family.prepare(config, workdir)
  if model_config is not None:
    prepared = dataclasses.replace(prepared, model_config=model_config)
  else:
    resume.check_same_model(rundir.read_model_config(workdir, family.model_config_class), prepared.model_config, workdir)
  task = family(config, prepared)
  rng_impl = rng_impl or resume.rng_impl(config, workdir)
  tx, schedule = make_optimizer(config.train)
  spec = state_lib.state_spec(lora.model_builder(task, config.train), mesh, rng_impl, tx,
                              trainable=lora.trainable(task, config.train))
  split = optim.describe_split(config.train, spec.abstract.params)  # Muon without a matrix stops here
  averaged = optim.averages(config.train)
  eval_params = jax.jit(optim.eval_params, out_shardings=spec.shardings.params) if averaged else None
  setup = Setup(config, task, mesh, tx, schedule, spec, jax.jit(steps.make_eval_step(task, spec.graphdef)),
                eval_params, loop.parse_target(config.train.target), base, scorer)
  batches = evaluation.eval_batches(setup)  # an empty eval split stops here, before anything is saved
  # A target no evaluation logs stops here, before anything compiles (not when a run that scored tasks is
  # evaluated: the scorer comes with training only, train/downstream.py `check`).
  if setup.target is not None and (scorer is not None or not downstream.enabled(config.train)):
    task_metrics = list(scorer.metric_names) if scorer is not None else []
    loop.check_target_metric(setup.target, config.train.target, eval_metric_names(setup, batches[0]) + task_metrics)
  if split and jax.process_index() == 0:
    print(split, flush=True)
  memory.log_estimate(config, task.model_config, spec.abstract, spec.shardings, mesh)
  return setup


def fresh_state(setup: Setup) -> TrainState:
  """A freshly initialised sharded state (parameters from `config.seed`, or copied from
  `config.init_from`'s run when fine-tuning; a LoRA run's frozen weights are its base run's, never drawn)."""
  config = setup.config
  if setup.base is not None:  # LoRA: the adapters (and new heads) from config.seed, the rest the base run's, frozen
    state = state_lib.init_state(setup.spec, lora.model_builder(setup.task, config.train), setup.tx, config.seed,
                                 frozen=False)
    return dataclasses.replace(state, frozen=base_weights(setup))
  state = state_lib.init_state(setup.spec, lora.model_builder(setup.task, config.train), setup.tx, config.seed)
  if config.init_from:
    state = _init_from(setup, state, config.init_from)
  return state


def base_weights(setup: Setup) -> nnx.State:
  """The state's frozen parameters: a LoRA run's base weights as `fresh_state` copies them; none otherwise."""
  if setup.base is None:
    return setup.spec.abstract.frozen  # an empty State
  return rundir.base_weights(setup.spec, setup.task, setup.config, setup.base)


def eval_metric_names(setup: Setup, batch) -> list[str]:
  """The eval/... names every evaluation during training logs, from the eval step's output shapes
  (traced, not compiled) and the family's derived metrics."""
  abstract = setup.spec.abstract
  shapes = jax.eval_shape(setup.eval_step, abstract.params, abstract.frozen, abstract.extra, batch)
  return sorted(setup.task.summarize({f'eval/{name}': 1.0 for name in shapes}))


def _init_from(setup: Setup, state: TrainState, source_workdir: str) -> TrainState:
  """Fine-tuning: the task copies what it wants from another run's model; the optimizer starts fresh."""
  source = rundir.load_run(source_workdir).model
  state = state_lib.copied_from(setup.spec, state, lambda model: setup.task.init_from(model, source))
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.spec.shardings.opt_state)(state.params)
  return dataclasses.replace(state, opt_state=opt_state)


# ============================================================================ stage 3: resume
def train_iterator(setup: Setup):
  """This process's rows of the global training batches, as a checkpointable grain iterator."""
  batch_size, examples = setup.config.train.batch_size, setup.task.prepared.datasets.train
  if len(examples) < batch_size:
    raise UserError(f'The training split has {len(examples)} examples, fewer than train.batch_size='
                    f'{batch_size}; use more data or a smaller batch.')
  batches = setup.task.batch_plan().global_batches(examples, batch_size, setup.config.seed, jax.process_index(),
                                                   jax.process_count())
  # The examples are in memory or in token caches (a row is one read of a page-cached file):
  # grain's default read-ahead (16 threads, 500 batches) only contends for the GIL with the
  # training loop. One thread a few batches ahead keeps the next batch ready.
  return iter(batches.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=READ_AHEAD_BATCHES)))


def save_run_files(setup: Setup, workdir: str, history: list[dict]) -> None:
  """config.json (with the data history) and model.json: what reloads the run."""
  if jax.process_index() == 0:
    rundir.save_config(setup.config, workdir, history)
    rundir.save_model_config(setup.task.prepared.model_config, setup.spec.rng_impl, workdir, setup.base)


# ============================================================================ stage 5: final evaluation
def evaluated_state(setup: Setup, state: TrainState, checkpointer: ckpt.Checkpointer, current_step: int, log=print
                    ) -> tuple[TrainState, int]:
  """(the state `train.final_eval_from` names, its step): 'best' is the kept checkpoint with the
  best `train.best_metric` (the current state when no checkpoint has eval metrics), 'last' the
  current state; its parameters are the evaluated ones (`Setup.evaluated`, as a checkpoint's model holds)."""
  train = setup.config.train
  best = checkpointer.best_step() if train.final_eval_from == 'best' else None
  if best is None or best[0] == current_step:
    log(f'Final evaluation: step {current_step} (train.final_eval_from={train.final_eval_from}).')
    return setup.evaluated(state), current_step
  step, value = best
  restored = checkpointer.restore(step, ckpt.restore_target(setup.spec))['model']
  log(f'Final evaluation: the best checkpoint, step {step} ({train.best_metric}={value:.4f}), not the last '
      f'step {current_step} (train.final_eval_from=best; set it to last to score the last step).')
  return dataclasses.replace(state, params=restored['params'], extra=restored['extra']), step


# ============================================================================ entry points
def train_and_evaluate(config, workdir: str, task_scorer: downstream.Downstream | None = None) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming if it holds a checkpoint); return the final metrics.
  `task_scorer`: train.eval_tasks' scorer (evals/during_training.py; needed with them, train/downstream.py)."""
  started, compile_started = time.time(), compilation.compile_seconds()
  # ------------------------------------------------------------------ 1. config
  validate_config(config)
  downstream.check(config, task_scorer)
  with WorkdirGuard(workdir) as guard:
    # ---------------------------------------------------------------- 2. setup
    resume.check_run_files(config, workdir)
    setup = setup_run(config, workdir, scorer=task_scorer)
    checkpointer = ckpt.Checkpointer(workdir, config.train, data_since=rundir.data_since(workdir))
    # Only a run without a checkpoint initialises: a resume restores every array, and compiling an
    # initialiser is a large part of a big model's start-up (measurements/code_comments.csv).
    state = fresh_state(setup) if checkpointer.latest_step() is None else None
    guard.set_up()
    try:
      # -------------------------------------------------------------- 3. resume
      data_iter = train_iterator(setup)
      state, start_step, progress = resume.restore_latest(setup.spec, state, checkpointer, data_iter,
                                                          averages=setup.eval_params is not None,
                                                          frozen=base_weights(setup) if state is None else state.frozen)
      history, progress = resume.record_data(config, workdir, start_step, progress, checkpointer,
                                             setup.task.prepared.datasets.caches)
      save_run_files(setup, workdir, history)
      writer = MetricWriter(workdir, config.train.steps, start_step, trim_after=start_step,
                            wandb=_wandb_settings(config, workdir))
      if start_step:
        writer.log(f'Resumed from the checkpoint at step {start_step} in {checkpointer.directory}.')
      writer.log(state_lib.describe_sizes(setup.spec))
      writer.log(evaluation.describe(setup))
      writer.log(evaluation.describe_final(setup))
      if downstream.enabled(config.train):
        writer.log(task_scorer.describe())
      # -------------------------------------------------------------- 4. loop
      train = config.train
      clock = budget.RunClock(progress, started, compile_started, 60 * train.max_minutes,
                              budget.final_eval_scale(setup), restores=train.final_eval_from == 'best')
      saver = loop.Saver(checkpointer, data_iter, clock, start_step, setup.checkpoint_items, writer.sync,
                         time_completion=bool(train.max_minutes))
      state, results = loop.train_loop(setup, state, saver, data_iter, writer, start_step)
      if not results.get('preempted'):
        state, results['final_eval_step'] = evaluated_state(setup, state, checkpointer, results['step'], writer.log)
    finally:
      checkpointer.close()
    # ---------------------------------------------------------------- 5. final evaluation
    if not results.get('preempted'):  # only the scored checkpoint's metrics reach the results
      results.update(evaluation.final_evaluation(setup, state, workdir, writer, results['step']))
    writer.close()
  return results


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
  setup, state, step = restored_setup(workdir, config_overrides)
  # The run's metrics.jsonl and TensorBoard logs are training's record: evaluating writes nothing there.
  return {'step': step, **evaluation.final_evaluation(setup, state, workdir, None, step)}


def restored_setup(workdir: str, config_overrides: dict | None = None) -> tuple[Setup, TrainState, int]:
  """(the run's setup, the state of the checkpoint `train.final_eval_from` names, its step).

  The run's config.json (with `config_overrides`) and model.json rebuild the model; a run trained
  on another number of devices evaluates data-parallel over the devices present.
  """
  config, model_config = rundir.run_config(workdir, config_overrides)
  checkpointer = ckpt.Checkpointer(workdir, config.train, read_only=True, data_since=rundir.data_since(workdir))
  if checkpointer.latest_step() is None:
    raise ckpt.CheckpointError(f'No checkpoint in {checkpointer.directory}; train first or check --workdir.')
  setup = setup_run(config, workdir, model_config, rundir.read_rng_impl(workdir))
  latest, restored = checkpointer.restore_newest_intact(ckpt.restore_target(setup.spec))
  # A checkpoint's model holds the evaluated parameters (schedule-free's average), so the restored
  # state is evaluated as it is; evaluating needs no optimizer state.
  setup = dataclasses.replace(setup, eval_params=None)
  state = TrainState(params=restored['model']['params'], extra=restored['model']['extra'], opt_state=None,
                     step=state_lib.step_array(setup.spec, latest), frozen=base_weights(setup))
  state, step = evaluated_state(setup, state, checkpointer, latest)
  checkpointer.close()
  return setup, state, step


def import_hf_run(config, hf_dir: str, workdir: str) -> dict[str, Any]:
  """`--mode=import_hf`: write a Hugging Face checkpoint as a run (step 0) that trains, evals, reloads."""
  if not os.path.isdir(hf_dir):
    raise UserError(f'--hf_dir={hf_dir} is not a directory (expected config.json and the weights).')
  if (storage.path(workdir) / ckpt.CHECKPOINT_DIR).is_dir():
    raise ckpt.CheckpointError(f'{workdir} already holds checkpoints; import into a fresh --workdir.')
  validate_config(config)
  rng_impl = state_lib.resolve_rng_impl(config.rng_impl)
  prepared, model = task_class(config.family).import_hf(config, hf_dir, state_lib.make_rngs(config.seed, rng_impl))
  with WorkdirGuard(workdir):
    prepared.tokenizer.save(workdir)
    rundir.save_config(_with_model_of(config, prepared.model_config), workdir)
    rundir.save_model_config(prepared.model_config, rng_impl, workdir)
    _, params, extra = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(config.train)
    checkpointer = ckpt.Checkpointer(workdir, config.train)
    checkpointer.save(0, {'params': params, 'extra': extra},
                      ckpt.optimizer_item(tx.init(params), params, optim.averages(config.train)), {})
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


def prepare_data(config) -> dict[str, Any]:
  """`--mode=prepare`: read and tokenize the config's data into its token caches (data.cache_dir),
  this process its share of the shards, without training. The tokenizer is kept with the caches, so
  a later run on the same data and tokenizer settings, in any workdir, reads them as built."""
  import tempfile

  from train.task import prepare_task
  validate_config(config)
  started = time.time()
  with tempfile.TemporaryDirectory(prefix='prepare-') as scratch:
    datasets = prepare_task(config, scratch).prepared.datasets
  sizes = {'train': len(datasets.train), 'valid': len(datasets.eval)}
  if datasets.test is not None:
    sizes['test'] = len(datasets.test)
  return {'caches': datasets.caches, 'examples': sizes, 'seconds': round(time.time() - started, 1)}
