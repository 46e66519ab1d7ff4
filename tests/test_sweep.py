"""Sweeps: grid expansion, dry run, and a real 4-trial sweep that survives a failing trial and
writes sweep.csv, sweep.md and the eval-loss plot."""
import csv
import json
import os
import subprocess
import sys

import matplotlib.image
import pytest

import support
from train import sweep as sweep_lib

SWEEP_FILE = '''
def get_sweep():
  return {{
      'config': 'configs/gpt.py:tiny',
      'overrides': {{'data.source': {source!r}, 'train.steps': 4, 'train.eval_every': 2, 'train.checkpoint_every': 4,
                    'train.eval_steps': 0, 'train.log_every': 2}},
      'grid': {{'train.lr': [0.001, 0.003], 'train.warmup_steps': [1]}},
      'trials': [{{'model.width': 16}}, {{'model.num_heads': 3}}],  # the last one fails: 3 heads, width 32
  }}
'''


@pytest.fixture(scope='module')
def sweep_file(tmp_path_factory):
  root = tmp_path_factory.mktemp('sweep')
  path = root / 'tiny.py'
  path.write_text(SWEEP_FILE.format(source=support.write_corpus(str(root / 'corpus'), files=3, lines=30)))
  return str(path)


def test_grid_and_trials_expand_in_order(sweep_file):
  sweep = sweep_lib.load_sweep(sweep_file)
  assert [t.own for t in sweep.trials] == [{'train.lr': 0.001, 'train.warmup_steps': 1},
                                           {'train.lr': 0.003, 'train.warmup_steps': 1},
                                           {'model.width': 16}, {'model.num_heads': 3}]
  assert [t.name for t in sweep.trials] == ['00-lr=0.001-warmup_steps=1', '01-lr=0.003-warmup_steps=1',
                                            '02-width=16', '03-num_heads=3']
  with pytest.raises(sweep_lib.SweepError, match='non-empty list'):
    sweep_lib.expand({'grid': {'train.lr': 0.1}})
  with pytest.raises(sweep_lib.SweepError, match='Unknown sweep keys'):
    sweep_lib.expand({'grids': {}})


def test_dry_run_prints_one_launch_command_per_trial(sweep_file, tmp_path):
  result = subprocess.run([sys.executable, 'launch.py', f'--sweep={sweep_file}', '--sweep_dry_run',
                           f'--workdir={tmp_path}/dry', '--config.train.steps=3'],
                          cwd=support.REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  commands = result.stdout.strip().splitlines()
  assert len(commands) == 4 and not os.path.exists(tmp_path / 'dry')
  assert all('launch.py --config=configs/gpt.py:tiny' in c for c in commands)
  # The command-line override comes after the sweep's own and before the trial's values.
  assert commands[0].index('--config.train.steps=4') < commands[0].index('--config.train.steps=3') < \
      commands[0].index('--config.train.lr=0.001')
  assert f'--workdir={tmp_path}/dry/03-num_heads=3' in commands[3]


def test_sweep_survives_a_failing_trial_and_writes_table_and_plot(sweep_file, tmp_path):
  workdir = str(tmp_path / 'sweep')
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1')
  trials = sweep_lib.run_sweep(sweep_lib.load_sweep(sweep_file), workdir, env=env)
  assert [t.status for t in trials] == ['ok', 'ok', 'ok', 'failed']
  assert 'num_heads=3 does not divide' in trials[3].error
  with open(os.path.join(workdir, 'sweep.csv')) as f:
    rows = list(csv.DictReader(f))
  assert [r['status'] for r in rows] == ['ok', 'ok', 'ok', 'failed'] and rows[0]['train.lr'] == '0.001'
  for trial, row in zip(trials[:3], rows):
    with open(os.path.join(workdir, trial.name, 'metrics.jsonl')) as f:
      best_eval = min(m['eval/loss'] for m in map(json.loads, f) if 'eval/loss' in m)
    # The trial's final line: the best checkpoint's loss over the whole validation split (eval_steps=0).
    assert float(row['eval/loss']) == pytest.approx(best_eval, rel=1e-6) and row['step'] == '4'
  assert rows[3]['eval/loss'] == '' and 'does not divide' in rows[3]['error']
  table = open(os.path.join(workdir, 'sweep.md')).read()
  assert '3 of 4 trials ok' in table and table.count('\n| 0') == 4
  image = matplotlib.image.imread(os.path.join(workdir, 'eval_loss.png'))
  assert image.ndim == 3 and image.shape[1] > 300
  assert os.path.exists(os.path.join(workdir, 'logs', '03-num_heads=3.log'))
