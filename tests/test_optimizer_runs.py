"""The new optimizers and schedules through the one trainer: a wall-clock wsd cooldown that starts
without recompiling and resumes mid-cooldown bit for bit (Muon, scanned layers, data=2 x fsdp=2 x
tensor=2), schedule-free AdamW evaluated and saved at its averaged parameters and resumed bit for
bit (data=4 x fsdp=2), the target clock across a resume, and an RNN trained by Muon that stops at
its target.

A resume is made as a preemption leaves a run: a copy of the finished run's workdir without the
checkpoints after the step it resumes from (each saved by the same code as a preemption's), so
one uninterrupted run serves as both the reference and the interrupted run's first part."""
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import support
from numerics import assert_close
from train import checkpoint as ckpt
from train import compilation
from train import budget
from train.trainer import evaluate_run, train_and_evaluate

TOKENS_PER_STEP = 8 * 32  # the tiny GPT's batch: 8 windows of 32 predicted tokens


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')))


def tiny(corpus, **overrides):
  return support.tiny_gpt_config(corpus, **{'train.log_every': 1, 'train.async_checkpoints': False,
                                            'train.eval_steps': 1, **overrides})


def metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def saved(workdir, step):
  """The checkpoint of `step` as written: {'model', 'optimizer', 'data'}."""
  manager = ckpt.Checkpointer(workdir, read_only=True).manager
  return manager.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(), optimizer=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))


def assert_bit_identical(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def resumed_from(workdir, step, copy):
  """Train again in a copy of `workdir` holding its checkpoints up to `step`."""
  shutil.copytree(workdir, copy)
  for name in os.listdir(os.path.join(copy, ckpt.CHECKPOINT_DIR)):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(copy, ckpt.CHECKPOINT_DIR, name))
  return copy


@pytest.fixture
def clock(monkeypatch):
  """The run's clock: one second per training step (progress.tokens counts them, across resumes), none
  for compiling, evaluating and saving."""
  monkeypatch.setattr(budget.RunClock, 'seconds', lambda self: self.progress.tokens / TOKENS_PER_STEP)
  monkeypatch.setattr(budget.RunClock, 'compile_seconds', lambda self: 0.0)


def test_a_wall_clock_wsd_cooldown_ends_the_run_cooled_down_and_resumes_mid_cooldown(corpus, tmp_path, clock, capsys):
  # 15 s of budget, far from train.steps: the cooldown starts with 25% (3.75 s) left, after step 12, and
  # plans the 3 steps that fit at the measured 1 s per step, the last (step 15, count 14) at the end lr.
  # Three cooldown rates (2/3, 1/3, 0 of the peak) and a checkpoint (step 13) inside them to resume from.
  config = tiny(corpus, **{'model.scan_layers': True, 'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2,
                           'train.optimizer': 'muon', 'train.schedule': 'wsd',
                           'train.steps': 100, 'train.max_minutes': 0.25, 'train.decay_fraction': 0.25,
                           'train.decay_shape': 'linear', 'train.end_lr_fraction': 0.0, 'train.warmup_steps': 2,
                           'train.eval_every': 5, 'train.checkpoint_every': 13, 'train.target': 'eval/loss<=0.01'})
  workdir = str(tmp_path / 'straight')
  results = train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert results['step'] == 15 and 'the wall-clock cooldown ended' in results['stopped'], results
  assert results['train/compiles'] == 1  # the cooldown's start is a value of the optimizer state
  assert "Cooldown from step 12 to step 15" in out
  assert 'Muon takes 12 matrices' in out  # 2 layers x 6 kernels, stacked by scan_layers
  straight = saved(workdir, 15)  # restored once: each restore of a checkpoint costs ~0.5 s
  assert (straight['data']['progress']['cooldown_start'], straight['data']['progress'][
      'cooldown_steps']) == (11, 3)  # optim.wsd_schedule's start: count 11 at progress 0, count 14 at 1
  lr = {m['step']: m['train/lr'] for m in metrics(workdir) if 'train/lr' in m}
  peak = config.train.lr
  for step in range(6, 16):  # step s logs the lr of its update, count s - 1
    count = step - 1
    expected = peak if count < 12 else peak * (1 - (count - 11) / 3)
    assert_close(lr[step], expected, terms=1, scale=peak, err_msg=str(step))
  assert results['target/met'] is False and 'target/step' not in results

  copy = resumed_from(workdir, 13, str(tmp_path / 'resumed'))  # mid-cooldown
  again = train_and_evaluate(config, copy)
  assert 'Resumed from the checkpoint at step 13' in capsys.readouterr().out
  assert again['step'] == 15 and again['eval/loss'] == results['eval/loss'] and again['train/compiles'] == 1
  resumed = saved(copy, 15)
  assert_bit_identical(straight['model'], resumed['model'])
  assert_bit_identical(straight['optimizer'], resumed['optimizer'])  # Muon's momentum, its AdamW's moments, the plan


def test_schedule_free_evaluates_and_saves_its_average_and_resumes_bit_for_bit(corpus, tmp_path):
  config = tiny(corpus, **{'mesh.data': 4, 'mesh.fsdp': 2, 'train.optimizer': 'schedule_free_adamw', 'model.num_layers': 1,
                           'train.schedule': 'constant',
                           'train.warmup_steps': 2, 'train.steps': 6, 'train.eval_every': 3,
                           'train.checkpoint_every': 4, 'train.eval_steps': 0, 'train.final_eval_from': 'last',
                           'train.target': 'eval/loss<=100'})
  workdir = str(tmp_path / 'straight')
  results = train_and_evaluate(config, workdir)
  # The checkpoint's model is x = (y - (1 - b1) z) / b1 of the trained y and Optax's z, both in its optimizer item.
  last = saved(workdir, 6)
  y, sf_state = last['optimizer']['params'], last['optimizer']['state'][1]  # (clipping's state, schedule-free's)
  b1 = float(sf_state['b1'])
  x = jax.tree.map(lambda y, z: (np.asarray(y) - (1 - b1) * np.asarray(z)) / b1, y, sf_state['z'])
  for mine, hand, trained in zip(jax.tree.leaves(last['model']['params']), jax.tree.leaves(x), jax.tree.leaves(y)):
    np.testing.assert_allclose(mine, hand, rtol=1e-5, atol=1e-7)
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(last['model']['params']), jax.tree.leaves(y))) > 1e-4
  # What was evaluated during training, in the result line and by --mode=eval (which reads the model) is x.
  logged = next(m['eval/loss'] for m in metrics(workdir) if m['step'] == 6 and 'eval/loss' in m)
  assert results['eval/loss'] == pytest.approx(logged, abs=1e-6)
  initialisers = compilation.compiled('init')
  assert initialisers >= 1  # the straight run's (the count works)
  assert evaluate_run(workdir)['eval/loss'] == pytest.approx(logged, abs=1e-6)
  # The target clock: met at the first evaluation (step 3), in metrics.jsonl and the result line.
  assert (results['target/met'], results['target/step'], results['target/tokens']) == (True, 3, 3 * TOKENS_PER_STEP)
  assert 0 < results['target/seconds_excluding_compile'] < results['target/seconds']
  assert [m['step'] for m in metrics(workdir) if 'target/step' in m] == [3]
  # Each evaluation's row carries the run's clock (the target's, at step 3), growing.
  clock = [(m['step'], m['time/seconds'], m['time/seconds_excluding_compile'])
           for m in metrics(workdir) if 'eval/loss' in m]
  assert clock[0] == (3, results['target/seconds'], results['target/seconds_excluding_compile'])
  assert [step for step, *_ in clock] == [3, 6] and clock[1][1] > clock[0][1] and clock[1][2] > clock[0][2]

  copy = resumed_from(workdir, 4, str(tmp_path / 'resumed'))
  again = train_and_evaluate(config, copy)
  assert again['step'] == 6 and again['eval/loss'] == results['eval/loss']
  # ... over a resume too: the resumed run's clock goes on from the checkpoint's.
  resumed_clock = {m['step']: m['time/seconds'] for m in metrics(copy) if 'eval/loss' in m}
  assert resumed_clock[3] == clock[0][1] and resumed_clock[6] > resumed_clock[3]
  # Evaluating and resuming restore every array: neither builds (nor loads) an initialiser.
  assert compilation.compiled('init') == initialisers
  assert {k: v for k, v in again.items() if k.startswith('target')} == {
      k: v for k, v in results.items() if k.startswith('target')}  # recorded before the resume, kept
  resumed = saved(copy, 6)
  assert_bit_identical(last['model'], resumed['model'])
  assert_bit_identical(last['optimizer'], resumed['optimizer'])


def test_an_rnn_trained_by_muon_stops_at_its_target(corpus, tmp_path, capsys):
  from configs import rnn_lm
  config = support.with_overrides(rnn_lm.get_config('tiny'), {
      'data.source': corpus, 'train.optimizer': 'muon', 'train.schedule': 'wsd', 'train.eval_every': 2,
      'train.async_checkpoints': False, 'train.target': 'eval/loss<=1000', 'train.stop_at_target': True,
      'decode.prompts': ''})  # no samples: their decoding loop would compile
  results = train_and_evaluate(config, str(tmp_path / 'rnn'))
  assert results['step'] == 2 and results['stopped'] == 'train.target eval/loss<=1000 met', results
  assert results['target/step'] == 2 and results['final_eval_step'] == 2 and np.isfinite(results['eval/loss'])
  assert 'Muon takes 2 matrices, 4,608 parameters (rnn/cells/0)' in capsys.readouterr().out
  assert ckpt.Checkpointer(str(tmp_path / 'rnn'), read_only=True).latest_step() == 2
