"""Resuming a workdir: what it holds must match what the config asks, and its newest checkpoint restores.

A resume never restores into another model, another tokenizer or (unless
`train.allow_data_change`) other data: each mismatch stops with one line naming the fields and
leaves the run's files as they were.
"""
from __future__ import annotations

import dataclasses
import os

import jax

import storage
from data import tokenizers
from train import checkpoint as ckpt
from train import rundir
from train import state as state_lib
from train.loop import Progress
from train.multihost import agreed
from train.state import StateSpec, TrainState
from train.task import RUNTIME_FIELDS


def check_run_files(config, workdir: str) -> None:
  """Tokenizer files without config.json are left by a setup that was killed: remove them so this
  run builds its own. A resumed run must ask for the tokenizer it was built with, and read the
  data it was trained on unless `train.allow_data_change`."""
  saved_config = os.path.join(workdir, rundir.CONFIG_FILE)
  if not storage.path(saved_config).exists():
    _remove_orphan_tokenizer(workdir)
    return
  saved = rundir.read_config(workdir)
  keys = ('tokenizer', 'vocab_size', 'lowercase')
  changed = [k for k in keys if k in saved.get('data', {}) and saved.data[k] != config.data[k]]
  if changed:
    raise ckpt.CheckpointError(
        f'{workdir} was built with ' + ', '.join(f'data.{k}={saved.data[k]!r}' for k in changed) +
        ' (its tokenizer is saved there) but the config asks for ' +
        ', '.join(f'data.{k}={config.data[k]!r}' for k in changed) +
        f". Resume with the run's own settings ({saved_config}) or use a fresh --workdir.")
  trained_on = rundir.data_history(workdir)[-1]
  changed = [k for k in rundir.DATA_KEYS if trained_on[k] != config.data[k]]
  if changed and not config.train.allow_data_change:
    raise ckpt.CheckpointError(
        f'{workdir} was trained on ' + ', '.join(f'data.{k}={trained_on[k]!r}' for k in changed) +
        ' but the config asks for ' + ', '.join(f'data.{k}={config.data[k]!r}' for k in changed) +
        '. Resume with the same data, use a fresh --workdir, or pass --config.train.allow_data_change=True '
        '(the run keeps its tokenizer, config.json records both, the best checkpoint is tracked anew).')


def _remove_orphan_tokenizer(workdir: str) -> None:
  orphans = [storage.path(workdir) / name for name in (tokenizers.TOKENIZER_FILE, tokenizers.META_FILE)]
  orphans = [orphan for orphan in orphans if orphan.exists()]
  if orphans and jax.process_index() == 0:
    print(f'Removing {", ".join(map(str, orphans))}: left by an interrupted setup (no {rundir.CONFIG_FILE}).',
          flush=True)
    for orphan in orphans:
      orphan.unlink()
  agreed(True)  # no process reads the workdir's tokenizer before process 0 has removed it


def check_same_model(saved, resolved, workdir: str) -> None:
  """`saved` (the workdir's model.json, or None) and the model the config now resolves to must
  agree on every field but the runtime ones."""
  if saved is None:
    return
  differences = [f.name for f in dataclasses.fields(saved)
                 if f.name not in RUNTIME_FIELDS and getattr(saved, f.name) != getattr(resolved, f.name)]
  if differences:
    raise ckpt.CheckpointError(
        f'{workdir} holds a model with ' + ', '.join(f'{k}={getattr(saved, k)!r}' for k in differences) +
        ' but the config and data now give ' + ', '.join(f'{k}={getattr(resolved, k)!r}' for k in differences) +
        f'. Resume with the run\'s own config ({os.path.join(workdir, rundir.CONFIG_FILE)}) or use a fresh --workdir.')


def rng_impl(config, workdir: str) -> str:
  """The PRNG of a new run from `config.rng_impl`; a resumed run keeps the one it was built with."""
  saved = rundir.read_rng_impl(workdir)
  if saved is None:
    return state_lib.resolve_rng_impl(config.rng_impl)
  if config.rng_impl not in ('auto', saved):
    raise ckpt.CheckpointError(f'config.rng_impl={config.rng_impl!r} differs from the {saved!r} that {workdir} was '
                               f'built with; resume with rng_impl={saved!r} (or auto) or use a fresh --workdir.')
  return saved


def restore_latest(spec: StateSpec, state: TrainState | None, checkpointer: ckpt.Checkpointer, data_iter, log=print,
                   averages: bool = False, frozen=None) -> tuple[TrainState, int, Progress]:
  """(the newest intact checkpoint's state, its step, the loop's progress), with the input
  iterator moved to its position; (`state`, a fresh one, 0, fresh progress) when the workdir has none.
  `averages`: the optimizer saves the parameters it trains in its item (schedule-free;
  train/checkpoint.py), which the state continues from. `frozen`: the state's frozen parameters,
  which no checkpoint holds (a LoRA run's base weights; None: none).

  Newer checkpoints that do not restore are moved aside with a message (see
  `Checkpointer.restore_newest_intact`)."""
  step, restored = checkpointer.restore_newest_intact(
      ckpt.restore_target(spec), ckpt.optimizer_target(spec, averages), set_aside_broken=jax.process_index() == 0,
      log=log)
  if step is None:
    return state, 0, Progress()
  params, opt_state = ckpt.trained_state(restored, averages)
  state = TrainState(params=params, extra=restored['model']['extra'], opt_state=opt_state,
                     step=state_lib.step_array(spec, step), frozen=spec.abstract.frozen if frozen is None else frozen)
  data = restored['data']
  if 'input' not in data:  # checkpoints written before Progress held the iterator state alone
    data = {'input': data, 'progress': {}} if data else {}
  if data:  # an imported run (step 0) has no input position yet
    data_iter.set_state(data['input'])
  return state, step, Progress(**data.get('progress', {}))


def record_data(config, workdir: str, start_step: int, progress: Progress, checkpointer: ckpt.Checkpointer,
                caches: dict[str, str] | None = None) -> tuple[list[dict], Progress]:
  """(the run's data history with this run's data, the loop's progress). A resume on other data
  (`train.allow_data_change`, checked by `check_run_files`) starts a history entry at
  `start_step` and restarts best-checkpoint tracking: validation losses of two datasets do not compare.

  `caches` ({split: token-cache name}, data/token_cache.py) name the tokens the sources gave: a
  resume whose sources now tokenize to other caches (a file of the corpus changed) is refused
  like other sources. Entries written before caches existed match any."""
  current = {key: config.data[key] for key in rundir.DATA_KEYS}
  if caches:
    current['caches'] = caches
  history = rundir.data_history(workdir) if start_step else []
  if history and all(history[-1].get(key, value) == value for key, value in current.items()):
    return history, progress
  if history:
    changes = ', '.join(f'data.{k}={v!r}' for k, v in current.items() if history[-1].get(k, v) != v)
    if not config.train.allow_data_change:  # the sources are the same (check_run_files): their caches are not
      raise ckpt.CheckpointError(
          f'{workdir} was trained on the token caches {history[-1]["caches"]} but its data now gives '
          f'{caches}: a file of the corpus changed since. Restore the corpus, use a fresh --workdir, or pass '
          '--config.train.allow_data_change=True (the best checkpoint is then tracked anew).')
    print(f'Data changed at step {start_step} (train.allow_data_change): {changes}; the tokenizer stays the run\'s '
          f'own; the best checkpoint is tracked again from step {start_step}.', flush=True)
    # The clock, the tokens and wsd's cooldown go on; the target, like the best, is met anew on the new data.
    progress = Progress(seconds=progress.seconds, compile_seconds=progress.compile_seconds, tokens=progress.tokens,
                        cooldown_start=progress.cooldown_start, cooldown_steps=progress.cooldown_steps)
  checkpointer.data_since = start_step
  return history + [{'step': start_step, **current}], progress
