"""Learning rate x width of the tiny character-level GPT on the standard library (4 trials).

  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --workdir=runs/sweep-lr
  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --sweep_dry_run     # the 4 commands

A grid is a study too (runs/sweep-lr/study.journal): its trials run in the grid's order, rerunning
the command resumes it, and --sweep_workers=2 runs two at once. About a minute per trial on 2 CPU
cores; writes runs/sweep-lr/sweep.md, sweep.csv, eval_loss.png, history.png, importance.png.
"""


def get_sweep():
  return {
      'config': 'configs/gpt.py:tiny',
      'overrides': {'train.steps': 200, 'train.eval_every': 40, 'train.checkpoint_every': 200},
      'grid': {'train.lr': [1e-3, 3e-3], 'model.width': [32, 64]},
  }
