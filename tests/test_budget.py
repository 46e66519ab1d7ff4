"""The wall-clock budget (train/budget.py): its reserve holds the work that closes the run (the stop's
evaluation, its save to the end of its writing, the best checkpoint's restore, the final evaluation's
losses, the family's decoding), timed from the run's first step, so that the result comes within
`train.max_minutes` even when nothing is evaluated before the end (on a scripted clock, and on the
real one); the progress line's eta is the earlier of the steps' end and the budget's."""
import json
import os
import re
import time

import orbax.checkpoint as ocp

import support
from train import budget, loop
from train import checkpoint as ckpt
from train.metrics import MetricWriter
from train.trainer import train_and_evaluate


def test_the_reserve_is_the_closing_work_as_timed():
  clock = support.scripted_clock(budget=60.0, final_eval_scale=4.0, restores=True)
  assert clock.reserve() == 0.0  # nothing timed yet
  progress = clock.progress
  progress.eval_seconds, progress.save_seconds, progress.restore_seconds, progress.decode_seconds = 2.0, 3.0, 1.5, 7.0
  # The stop's evaluation and the final one's losses (4 evaluations' worth), the save, the restore, the decoding.
  assert clock.closing_work() == {'evaluations': 10.0, 'save': 3.0, 'restore': 1.5, 'decoding': 7.0}
  assert clock.reserve() == 21.5
  clock.restores = False  # train.final_eval_from=last: nothing is restored
  assert clock.reserve() == 20.0
  assert clock.describe_reserve(1) == ('train.max_minutes=1: 20 s kept for the work that closes the run '
                                       '(evaluations 10 s, save 3 s, decoding 7 s; timed at step 1).')
  clock.now = 45.0  # 15 s left: the closing work does not fit, and the run says what to change
  assert clock.describe_reserve(1).endswith(' It does not fit the 15 s left, so the run ends now: raise '
                                            'train.max_minutes, or lower train.final_eval_examples (or '
                                            'train.final_decode_examples).')
  progress.tasks_seconds = 5.0  # train.eval_tasks was scored once: the last evaluation scores them again
  assert clock.closing_work()['tasks'] == 5.0 and clock.reserve() == 25.0


def test_a_run_that_evaluates_nothing_before_its_end_stops_for_its_closing_work():
  # 1 s steps, no evaluation before the end, a 60 s budget; at step 1 the loop timed the closing work:
  # an evaluation of 2 s (the final one's losses: 3 evaluations' worth), a save of 4 s to its end,
  # a restore of 1 s and decoding of 9 s: 8 + 4 + 1 + 9 = 22 s. Before, the reserve was 0 until an evaluation.
  train = support.smallest_config('gpt', {'train.max_minutes': 1.0, 'train.eval_every': 10_000,
                                          'train.steps': 10_000, 'train.log_every': 1}).train
  clock = support.scripted_clock(budget=60.0, final_eval_scale=3.0, restores=True)
  clock.progress.eval_seconds, clock.progress.save_seconds = 2.0, 4.0
  clock.progress.restore_seconds, clock.progress.decode_seconds = 1.0, 9.0
  step, stopped = 0, None
  while stopped is None:
    step += 1
    clock.now += 1.0
    stopped = budget.clock_stop(train, step, clock, None)
  # By hand: the first step after which 22 s more would pass 60 s is step 39 (39 + 22 = 61), a step late
  # at most: the loop checks after each step.
  assert (step, stopped) == (39, 'train.max_minutes=1.0 reached')
  assert clock.now + clock.reserve() <= 60 + 1.0


class ScriptedCheckpointer:
  """A checkpointer on a scripted clock: a save returns after `start` seconds and its writing ends
  `writing` seconds later (`wait`), as an asynchronous Orbax save does."""
  directory = 'checkpoints'

  def __init__(self, clock, start: float, writing: float):
    self.clock, self.start, self.writing, self.pending = clock, start, writing, 0.0

  def save(self, step, model, optimizer, data, metrics):
    self.wait()  # train/checkpoint.py: a save waits for the previous one first
    self.clock.now += self.start
    self.pending = self.writing

  def wait(self):
    self.clock.now, self.pending = self.clock.now + self.pending, 0.0


class NoInput:
  def get_state(self):
    return {}


def test_the_first_save_is_timed_to_the_end_of_its_writing():
  clock = support.scripted_clock(budget=60.0)
  saver = loop.Saver(ScriptedCheckpointer(clock, start=0.5, writing=3.0), NoInput(), clock, 0,
                     items=lambda state: ({}, {}), time_completion=True)
  saver(1, None)
  # Before, a save counted its start only (0.5 s): the stop's save then ended 3 s past the reserve.
  assert clock.progress.save_seconds == 3.5 and clock.now == 3.5 and clock.reserve() == 3.5
  saver(2, None)  # later saves run in the background: the loop counts their start
  assert clock.last_save_seconds == 0.5 and clock.progress.save_seconds == 3.5 and clock.outside_steps == 4.0
  saver(2, None)  # once per step
  assert clock.now == 4.0


def test_the_eta_is_the_earlier_of_the_steps_end_and_the_budgets(tmp_path, monkeypatch, capsys):
  start = time.time()
  monkeypatch.setattr(time, 'time', lambda: start)
  writer = MetricWriter(str(tmp_path), 1000)
  monkeypatch.setattr(time, 'time', lambda: start + 50.0)  # 10 steps in 50 s: 990 more take 4950 s
  for seconds_left in (None, 30.0, 6000.0):
    writer.progress(10, {'train/loss': 2.5}, seconds_left)
  monkeypatch.undo()
  writer.close()
  assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()] == ['eta=4950s', 'eta=30s', 'eta=4950s']


# ============================================================================ on the real clock
def saved_progress(workdir: str, step: int) -> dict:
  manager = ckpt.Checkpointer(workdir, read_only=True).manager
  return manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']['progress']


def test_the_result_of_a_run_that_evaluates_nothing_before_its_end_comes_within_the_budget(tmp_path, capsys,
                                                                                          monkeypatch):
  # A translation run whose closing work is large beside its budget: no evaluation during training, the whole
  # validation and test splits scored at the end and 16 of the 100 test pairs decoded with greedy and beam
  # search (2 batches, beam 8). Before, the reserve was 0 until an evaluation: such a run returned past its
  # budget by its whole closing work. The budget leaves room for a slow CPU shared by three workers: there
  # the start-up (data, compilation) took 20 s of a 30 s budget, and 48 decoded pairs (8 s) no longer fit.
  # Each step waits 0.2 s first (support.slow_train_steps): the budget's stop, reserve and result come as
  # they do for a model whose steps take that long, in ~80 steps where the tiny model's ~500 (~70 ms of CPU
  # each on 8 devices) used the cores the budget's whole time.
  # Tolerance: 4 s, for the step during which the budget less its reserve runs out, the closing work's
  # variation from its timing at step 1 (the suite's other workers share the cores), and what is not counted
  # (the teacher-forced test loss's compilation, printing the result, closing the logs).
  minutes, tolerance = 0.6, 4.0
  support.slow_train_steps(monkeypatch, 0.2)
  config = support.smallest_config('transformer', {
      'data.cache_dir': str(tmp_path / 'cache'), 'data.seq_len': 40, 'train.steps': 1_000_000,
      'train.max_minutes': minutes, 'train.eval_every': 1_000_000, 'train.checkpoint_every': 1_000_000,
      'train.eval_batch_size': 8, 'train.final_eval_examples': 0, 'train.final_decode_examples': 16,
      'train.final_eval_from': 'best', 'train.async_checkpoints': True, 'train.log_every': 1,
      'decode.beam_size': 8, 'pictures.count': 0})
  workdir = str(tmp_path / 'run')
  started = time.time()
  results = train_and_evaluate(config, workdir)  # what launch.py prints as the result line
  seconds = time.time() - started
  out = capsys.readouterr().out
  kept = re.search(r'(\S+) s kept for the work that closes the run \(evaluations (\S+) s, save (\S+) s, '
                   r'restore (\S+) s, decoding (\S+) s; timed at step 1\)\.(.*)', out)
  assert results['stopped'] == f'train.max_minutes={minutes} reached' and 'test/bleu' in results, results
  assert seconds <= 60 * minutes + tolerance, (seconds, results['step'], kept and kept.group(0))
  assert kept and all(float(value) > 0 for value in kept.groups()[:5]) and not kept[6], out
  progress = saved_progress(workdir, results['step'])
  assert all(progress[f'{part}_seconds'] > 0 for part in ('eval', 'save', 'restore', 'decode')), progress
  # The loop stopped with the reserve left (the stop's checkpoint holds the clock after its step and evaluation).
  assert progress['seconds'] + float(kept[1]) <= 60 * minutes + 1.0, (progress['seconds'], kept[1])
  etas = [int(eta) for eta in re.findall(r'^step \d+/1000000 .* eta=(\d+)s$', out, re.MULTILINE)]
  assert etas and max(etas) <= 60 * minutes, etas  # the budget's end, not a million steps'
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    evaluated = [row['step'] for row in map(json.loads, f) if 'eval/loss' in row]
  assert evaluated == [results['step']]  # the stop's evaluation only
