"""wsd's wall-clock cooldown (train/budget.py `Cooldown`): re-planned as the step time changes, it ends at
lr * end_lr_fraction on the run's last step within `train.max_minutes`, the closing evaluations
reserved; one due before the warmup's end goes on from the warmup's rate (one that train.steps alone
places there is refused at validation); a resume mid-cooldown on the real clock still ends cooled
down within the budget.

The simulated runs drive the loop's own pieces (Cooldown.check, budget.clock_stop, the RunClock and
its reserve) in the loop's order, on a fake clock: each step, evaluation and save adds the
seconds the test gives it. The learning rate each update used is Optax's schedule of the plan in
force when it ran (optim.learning_rate_schedule), as the compiled step reads it from the optimizer state."""
import json
import os

import orbax.checkpoint as ocp
import pytest

import support
from configs import gpt
from errors import ConfigError
from numerics import assert_close
from train import checkpoint as ckpt
from train import budget, loop, optim
from train.trainer import train_and_evaluate
from train.validation import validate_config

PEAK, END_FRACTION = 0.01, 0.1


def train_config(**values):
  config = gpt.get_config('tiny').train
  config.update({'schedule': 'wsd', 'lr': PEAK, 'end_lr_fraction': END_FRACTION, 'warmup_steps': 2,
                 'decay_shape': 'linear', 'steps': 100_000, 'log_every': 1, 'eval_every': 1000,
                 'checkpoint_every': 1000, **values})
  return config


def simulate(train, step_seconds, eval_seconds=0.0, final_eval_scale=0.0, setup_seconds=0.0):
  """Run the trainer's clock logic with step k taking step_seconds(k) seconds and each evaluation
  `eval_seconds`; returns ({step: the learning rate its update used}, the stop's reason, the clock
  after the stop's evaluation, the clock after the final evaluation, the log)."""
  clock, log = support.scripted_clock(budget=60 * train.max_minutes, final_eval_scale=final_eval_scale), []
  clock.now = setup_seconds
  cooldown = budget.Cooldown(train, clock, 0, log.append)
  used, step, stopped = {}, 0, None
  while step < train.steps and stopped is None:
    used[step + 1] = float(optim.learning_rate_schedule(train, cooldown.plan)(step))  # the update of step + 1
    step += 1
    clock.now += step_seconds(step)
    cooldown.check(step)
    stopped = budget.clock_stop(train, step, clock, cooldown)
    if step % train.eval_every == 0 or stopped:
      clock.evaluate(eval_seconds)
  return used, stopped, clock.now, clock.now + eval_seconds * final_eval_scale, log


def assert_cooled_down(used, stopped, train):
  """The run ended by the cooldown, its last update at the end learning rate, the learning rate never rising
  after the peak."""
  assert stopped and 'the wall-clock cooldown ended' in stopped, stopped
  last = max(used)
  assert_close(used[last], PEAK * END_FRACTION, terms=1)
  assert used[last - 1] > PEAK * END_FRACTION * 1.01  # the end is reached at the last step, not before
  after_peak = [used[s] for s in sorted(used) if s > train.warmup_steps]
  assert all(b <= a for a, b in zip(after_peak, after_peak[1:])), after_peak


@pytest.mark.parametrize('first, then', [(1.0, 3.0), (3.0, 1.0)])
def test_the_cooldown_ends_at_the_end_lr_within_the_budget_when_the_step_time_changes(first, then):
  # 60 s, the cooldown over the last half: it starts at 30 s left; the step time changes 6 s later.
  train = train_config(max_minutes=1.0, decay_fraction=0.5)
  switch = int(36 / first)
  used, stopped, seconds, _, log = simulate(train, lambda step: first if step <= switch else then)
  assert_cooled_down(used, stopped, train)
  # Within the budget, and none of it unused: the next step would not have fitted.
  assert 60 - then < seconds <= 60, seconds
  assert sum(1 for line in log if line.startswith('Cooldown from step')) == 1
  start = int(30 / first)  # the first step with 30 s or less left; its update was still at the peak
  assert_close(used[start], PEAK, terms=1)
  assert used[start + 1] < PEAK
  assert log[0].startswith(f'Cooldown from step {start} to step ')


def test_the_budget_reserves_the_closing_evaluations_and_plans_the_ones_to_come():
  # 1 s steps, a 4 s evaluation every 10 steps, and a final evaluation 5 times as long: 4 + 20 s reserved.
  train = train_config(max_minutes=2.0, decay_fraction=0.4, eval_every=10)
  used, stopped, seconds, finished, _ = simulate(train, lambda step: 1.0, eval_seconds=4.0, final_eval_scale=5.0)
  assert_cooled_down(used, stopped, train)
  # By hand: ending at step E costs E steps, the evaluations at the multiples of 10 before it, then the stop's
  # evaluation and the final one (24 s); the last E that fits in 120 s is 70 (118 s; 71 would take 123 s).
  last = max(e for e in range(1, 200) if e + 4 * ((e - 1) // 10) + 4 + 20 <= 120)
  assert last == 70 and (max(used), finished, seconds) == (70, 118, 98)


def test_a_cooldown_of_train_steps_the_budget_will_not_let_end_is_taken_over():
  # train.steps' cooldown starts at step 40 of 50, but at 1 s then 4 s a step the budget ends first.
  train = train_config(steps=50, max_minutes=1.0, decay_fraction=0.2)
  used, stopped, seconds, _, _ = simulate(train, lambda step: 1.0 if step <= 40 else 4.0)
  assert_cooled_down(used, stopped, train)
  assert seconds <= 60 and max(used) < 50
  assert_close(used[42], PEAK * (1 - 0.9 / 10), terms=1)  # train.steps' own cooldown, until the clock takes over


def test_without_a_binding_budget_the_cooldown_of_train_steps_is_kept():
  train = train_config(steps=50, max_minutes=10.0, decay_fraction=0.2)
  used, stopped, _, _, _ = simulate(train, lambda step: 1.0)
  assert stopped is None and max(used) == 50
  assert used[50] == float(optim.learning_rate_schedule(train)(49))  # train.steps' plan, to its last step


def test_a_cooldown_before_the_warmup_ends_is_refused_at_validation():
  config = support.with_overrides(gpt.get_config('tiny'), {'train.schedule': 'wsd', 'train.steps': 100,
                                                           'train.warmup_steps': 90, 'train.decay_fraction': 0.2})
  with pytest.raises(ConfigError) as error:
    validate_config(config)
  message = str(error.value)
  assert '\n' not in message and 'train.warmup_steps=90' in message and 'starts at step 80' in message
  config.train.warmup_steps = 80  # the cooldown starts as the warmup ends: accepted
  validate_config(config)


def test_a_clock_cooldown_due_during_the_warmup_goes_on_from_the_warmup_rate():
  # 30 s of budget at 1 s a step, the cooldown over the last half: due at step 15, before 20 warmup steps end.
  # It used to stop the run with a ConfigError there, unsaved.
  train = train_config(max_minutes=0.5, decay_fraction=0.5, warmup_steps=20)
  used, stopped, seconds, _, log = simulate(train, lambda step: 1.0)
  assert stopped and 'the wall-clock cooldown ended' in stopped and seconds == 30 and max(used) == 30
  # By hand: the update of step 15 (count 14) used 14/20 of the peak; the linear cooldown from there to
  # 1/10 of it is (1 - 0.7) / 0.9 = 1/3 done, and the 15 updates of counts 15 .. 29 take it to the end:
  # optim.wsd_schedule's plan of round(15 / (2/3)) = 22 steps from count 29 - 22 = 7.
  assert_close([used[s] for s in range(1, 16)], [PEAK * (s - 1) / 20 for s in range(1, 16)], terms=1, scale=PEAK)
  for s in range(16, 31):
    assert_close(used[s], PEAK * (1 - 0.9 * (s - 1 - 7) / 22), terms=1, err_msg=str(s))
  assert all(b < a for a, b in zip([used[s] for s in range(15, 31)], [used[s] for s in range(16, 31)]))
  assert_close(used[30], PEAK * END_FRACTION, terms=1)
  assert log[0].startswith('Cooldown from step 15 to step 30 ') and 'during the warmup' in log[0], log
  # A budget spent during set-up stops the run at its first step instead (the budget's own stop).
  _, stopped, _, _, _ = simulate(train, lambda step: 1.0, setup_seconds=31.0)
  assert stopped == 'train.max_minutes=0.5 reached'


def test_a_cooldown_due_while_the_warmup_rate_is_below_the_end_rate_waits_for_it():
  # The run: warmup far past the budget. At step 15 the warmup has reached 14/200 of the peak, below
  # the end rate (1/10): the warmup goes on to it (count 20), then the rate stays at the end rate to the
  # budget's end (step 30), which the 1-sqrt cooldown from progress 1 reaches.
  train = train_config(max_minutes=0.5, decay_fraction=0.5, warmup_steps=200, decay_shape='1-sqrt')
  used, stopped, seconds, _, _ = simulate(train, lambda step: 1.0)
  assert stopped and 'the wall-clock cooldown ended' in stopped and seconds == 30 and max(used) == 30
  assert_close([used[s] for s in range(1, 22)], [PEAK * (s - 1) / 200 for s in range(1, 22)], terms=1, scale=PEAK)
  for s in range(22, 31):
    assert_close(used[s], PEAK * END_FRACTION, terms=1, err_msg=str(s))


def test_cooldown_progress_inverts_the_schedule_from_the_rate_the_warmup_reached():
  train = train_config(warmup_steps=100, end_lr_fraction=0.2)
  for shape in ('linear', '1-sqrt'):
    train.decay_shape = shape
    for count in (20, 50, 99, 100, 150):
      done = budget.cooldown_progress(train, (1000, 10), count)
      # optim.wsd_schedule's cooldown at that progress has the rate the warmup (or the peak) gave `count`.
      at = float(optim.wsd_schedule(PEAK, 1, 1, 1.0, 0.2, shape)(1.0 + done))  # a cooldown of one (fractional) step
      assert_close(at, PEAK * min(count / 100, 1.0), terms=2, scale=PEAK, err_msg=f'{shape} {count}')
    assert budget.cooldown_progress(train, (1000, 10), 19) is None  # 19/100 of the peak: below the end rate
  assert budget.cooldown_progress(train, (40, 10), 45) == 0.5  # inside a cooldown: its own progress


# ============================================================================ a resume on the real clock
@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')))


def logged(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def saved_progress(workdir, step):
  manager = ckpt.Checkpointer(workdir, read_only=True).manager
  return manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']['progress']


def test_a_resume_mid_cooldown_on_the_real_clock_ends_cooled_down_within_the_budget(corpus, tmp_path, monkeypatch,
                                                                                     capsys):
  minutes = 0.3
  config = support.tiny_gpt_config(corpus, **{
      'model.num_layers': 1,  # a smaller program: each run's compilation leaves more of the budget to steps
      'train.schedule': 'wsd', 'train.optimizer': 'adamw', 'train.steps': 100_000, 'train.max_minutes': minutes,
      'train.decay_fraction': 0.8, 'train.decay_shape': 'linear', 'train.end_lr_fraction': END_FRACTION,
      'train.warmup_steps': 1, 'train.log_every': 1, 'train.eval_every': 50, 'train.eval_steps': 1,
      'train.checkpoint_every': 1000, 'train.async_checkpoints': False, 'train.final_eval_examples': 64,
      'decode.prompts': ''})
  workdir = str(tmp_path / 'run')
  # The run's programs compiled first, outside its budget (a rerun's start-up): under load a cold start-up took
  # most of the 18 s, leaving the first run too few steps to be preempted mid-cooldown.
  train_and_evaluate(support.with_overrides(config.copy_and_resolve_references(), {
      'train.steps': 5, 'train.max_minutes': 0.0}), str(tmp_path / 'compiled'))
  # Each step waits 0.2 s first (support.slow_train_steps): the cooldown is planned from the steps' measured
  # time as for a model whose steps take that long, in a few dozen steps instead of hundreds of the tiny model's.
  support.slow_train_steps(monkeypatch, 0.2)
  # The cooldown starts once 80% of the 18 s is left (or at the first step, after a slow set-up: one warmup
  # step, so never before it ends); a preemption a few checks into it.
  cooling, check = [], budget.Cooldown.check

  def counted_check(self, step):
    changed = check(self, step)
    cooling.extend([step] if self.by_clock else [])
    return changed

  monkeypatch.setattr(budget.Cooldown, 'check', counted_check)
  monkeypatch.setattr(loop.PreemptionWatcher, 'should_stop', lambda self, step: len(cooling) >= 4)
  first = train_and_evaluate(config, workdir)
  assert first.get('preempted') and first['step'] == cooling[-1], first
  monkeypatch.undo()
  support.slow_train_steps(monkeypatch, 0.2)
  before = saved_progress(workdir, first['step'])
  assert before['cooldown_start'] is not None and before['seconds'] < 60 * minutes

  again = train_and_evaluate(config, workdir)  # restores, compiles and goes on, on the real clock
  out = capsys.readouterr().out
  assert 'Resumed in the wall-clock cooldown' in out
  assert 'the wall-clock cooldown ended' in again.get('stopped', ''), again
  assert again['train/compiles'] == 1  # re-planning writes values into the optimizer state
  # The stop's evaluation and save included. Tolerance 1 s, as tests/test_budget.py's real-clock run has one: the step
  # in flight when the budget less its reserve runs out (0.2 s of waiting and the step), and the closing work's
  # variation from its timing while the suite's other workers share the cores (18.3 s of the 18 s seen once in .ci/run).
  assert saved_progress(workdir, again['step'])['seconds'] <= 60 * minutes + 1.0
  lr = {m['step']: m['train/lr'] for m in logged(workdir) if 'train/lr' in m}
  assert_close(lr[again['step']], config.train.lr * END_FRACTION, terms=1)
  cooldown = [lr[s] for s in sorted(lr) if s > config.train.warmup_steps]
  assert all(b <= a * (1 + 1e-6) for a, b in zip(cooldown, cooldown[1:]))
  assert lr[again['step'] - 1] > config.train.lr * END_FRACTION  # it ends at the last step, not before
