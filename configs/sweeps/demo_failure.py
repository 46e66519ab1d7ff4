"""Three learning rates plus one trial that fails on purpose (3 heads do not divide width 32).

Shows that a failing trial is recorded as failed, with its error, and the sweep goes on:
  python launch.py --sweep=configs/sweeps/demo_failure.py --workdir=runs/sweep-demo
"""


def get_sweep():
  return {
      'config': 'configs/gpt.py:tiny',
      'overrides': {'train.steps': 60, 'train.eval_every': 20, 'train.checkpoint_every': 60},
      'grid': {'train.lr': [1e-3, 3e-3, 1e-2]},
      'trials': [{'model.num_heads': 3}],
  }
