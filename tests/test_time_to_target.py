"""scripts/time_to_target.py's same-wall-clock mode with a fake launcher (no training): each arm gets the
step count its schedule expects at the clock, from a probe where its schedule decays over
train.steps, and the table says how."""
import json
import os

import pytest

import support


@pytest.fixture
def script(monkeypatch):
  """The script as a module, its launcher replaced: each call is recorded, and a run the clock ends
  reaches `clock_steps(minutes)` steps, one of N steps reaches N."""
  module = support.load_file('scripts/time_to_target.py')
  module.calls = []
  module.clock_steps = lambda minutes: int(95 * minutes)

  def launch(args, overrides, workdir, log):
    module.calls.append((args, dict(overrides), workdir))
    if '--mode=prepare' in args:
      return {'mode': 'prepare'}
    by_clock = overrides['train.steps'] == module.UNBOUNDED_STEPS
    step = module.clock_steps(overrides['train.max_minutes']) if by_clock else overrides['train.steps']
    os.makedirs(workdir)
    with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:  # a train row, then an evaluation's
      f.write(json.dumps({'step': step, 'train/loss': 2.0, 'train/tokens_per_s': 9.0}) + '\n')
      f.write(json.dumps({'step': step, 'eval/loss': 1000 / step, 'time/seconds': step / 2,
                          'time/seconds_excluding_compile': step / 2 - 1}) + '\n')
    return {'mode': 'train', 'step': step, 'test/accuracy': 0.5 + step / 10_000,
            **({'stopped': f'train.max_minutes={overrides["train.max_minutes"]} reached'} if by_clock else {})}

  monkeypatch.setattr(module, 'launch', launch)
  return module


def trained(script):
  """(workdir name, train.steps, train.max_minutes, train.schedule if overridden) of each training launch."""
  return [(os.path.basename(workdir), overrides['train.steps'], overrides['train.max_minutes'],
           overrides.get('train.schedule'))
          for args, overrides, workdir in script.calls if '--mode=prepare' not in args]


def test_a_linear_baseline_trains_the_steps_its_probe_reached_and_the_wsd_recipe_runs_on_the_clock(script, tmp_path):
  out = str(tmp_path / 'out')
  script.main(['--config=configs/classifier.py:default', '--baseline=classifier-2019', '--minutes=3',
               '--metric=test/accuracy', '--rounds=2', f'--out={out}'])
  # The probe: the baseline (linear, which decays over train.steps) on the clock, 3 min -> 285 steps; then the
  # rounds, alternating: the baseline over those 285 steps, the recipe (wsd) on the clock; all capped at 3 min.
  assert trained(script) == [('probe-baseline-3min', 1_000_000, 3.0, 'linear'),
                             ('recipe-0', 1_000_000, 3.0, None), ('baseline-0', 285, 3.0, 'linear'),
                             ('baseline-1', 285, 3.0, 'linear'), ('recipe-1', 1_000_000, 3.0, None)]
  table = open(os.path.join(out, 'table.md')).read()
  assert ('- baseline: linear decays over train.steps=285: the steps it reached in 3 min with '
          'train.steps=1,000,000 (the probe rows)') in table
  assert '- recipe: wsd needs no step count: train.steps=1,000,000, ended by the clock' in table
  assert '| baseline | probe |' in table and '| 1000000 | 285 | train.max_minutes=3.0 reached |' in table
  assert '| baseline | 0 |' in table and '| 285 | 285 | - |' in table
  results = json.load(open(os.path.join(out, 'results.json')))
  assert [run['round'] for run in results['runs']] == ['probe', 0, 0, 1, 1]
  # curves.csv: each run's evaluations (not its train rows), with the clock they were logged at.
  with open(os.path.join(out, 'curves.csv')) as f:
    curves = [line.split(',') for line in f.read().splitlines()]
  assert curves[0] == ['arm', 'round', 'step', 'eval/loss', 'time/seconds', 'time/seconds_excluding_compile']
  assert curves[1:3] == [['baseline', 'probe', '285', str(1000 / 285), '142.5', '141.5'],
                         ['recipe', '0', '285', str(1000 / 285), '142.5', '141.5']]
  assert len(curves) == 6
  assert results['methods']['baseline'].startswith('linear decays over train.steps=285')


def test_shorter_probes_are_fitted_by_least_squares(script, tmp_path):
  # 1 min -> 100 steps, 2 min -> 220: 120 steps a minute after a set-up worth 20 steps, 340 at 3 min.
  script.clock_steps = lambda minutes: {1.0: 100, 2.0: 220, 3.0: 330}[minutes]  # 3 min: the recipe, wsd
  out = str(tmp_path / 'out')
  script.main(['--config=configs/gpt.py:default', '--baseline=gpt-2019', '--minutes=3', '--probe_minutes=1,2',
               '--rounds=1', f'--out={out}'])
  assert trained(script)[:2] == [('probe-baseline-1min', 1_000_000, 1.0, 'cosine'),
                                 ('probe-baseline-2min', 1_000_000, 2.0, 'cosine')]
  assert ('baseline-0', 340, 3.0, 'cosine') in trained(script)
  assert 'cosine decays over train.steps=340: fitted at 3 min to the steps it reached in 1 min (100), 2 min (220)' \
      in open(os.path.join(out, 'table.md')).read()


def test_one_probe_at_other_minutes_is_refused_before_anything_runs(script, tmp_path):
  with pytest.raises(SystemExit, match='--probe_minutes=1: one probe'):
    script.main(['--config=configs/gpt.py:default', '--baseline=gpt-2019', '--minutes=3', '--probe_minutes=1',
                 f'--out={tmp_path}'])
  assert script.calls == []


def test_steps_at_a_clock_by_hand(script):
  assert script.steps_at(3.0, {3.0: 285}) == 285  # measured at the clock itself
  assert script.steps_at(10.0, {1.0: 100, 2.0: 220, 3.0: 340}) == 1180  # 120 a minute, 20 fewer for the set-up
  assert script.steps_at(10.0, {2.0: 200, 4.0: 420, 6.0: 600}) == 1006  # least squares: 100 m + 20 / 3, 1006.7 at 10
  with pytest.raises(SystemExit, match='cannot tell the set-up time'):
    script.steps_at(3.0, {1.0: 100})
  with pytest.raises(SystemExit, match='no step rate'):
    script.steps_at(3.0, {1.0: 100, 2.0: 100})


def test_schedules_that_need_no_step_count_run_on_the_clock_without_a_probe(script, tmp_path):
  # transformer-2019's rsqrt and the preset's wsd: neither is probed; both end by the clock.
  script.main(['--config=configs/transformer.py:default', '--baseline=transformer-2019', '--minutes=2',
               '--metric=test/bleu', '--rounds=1', f'--out={tmp_path}'])
  assert trained(script) == [('recipe-0', 1_000_000, 2.0, None), ('baseline-0', 1_000_000, 2.0, 'rsqrt')]
  assert '- baseline: rsqrt needs no step count' in open(os.path.join(tmp_path, 'table.md')).read()


def test_run_through_trains_every_arm_all_its_steps_against_the_dense_baseline(script, tmp_path):
  out = str(tmp_path / 'out')
  script.main(['--config=configs/gpt.py:moe', '--baseline=gpt-dense', '--steps=400', '--rounds=1', '--run_through',
               f'--out={out}'])
  runs = [(os.path.basename(workdir), overrides['train.steps'], overrides.get('train.stop_at_target'),
           overrides.get('model.moe_experts'))
          for args, overrides, workdir in script.calls if '--mode=prepare' not in args]
  # The dense baseline's 400 steps set the target; then both arms train all 400 steps, the target recorded.
  assert runs == [('baseline-full', 400, None, 0), ('recipe-0', 400, False, None), ('baseline-0', 400, False, 0)]
  assert all(overrides['train.target'] == 'eval/loss<=2.5' for _, overrides, workdir in script.calls
             if os.path.basename(workdir or '').endswith('-0'))


def test_run_through_needs_steps(script, tmp_path):
  with pytest.raises(SystemExit, match='--run_through goes with --steps'):
    script.main(['--config=configs/gpt.py:moe', '--baseline=gpt-dense', '--minutes=3', '--run_through',
                 f'--out={tmp_path}'])
