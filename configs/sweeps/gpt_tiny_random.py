"""Random search over the tiny GPT's learning rate (log scale), depth and width: 12 trials, median pruning.

  python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --workdir=runs/sweep-random --sweep_workers=2
  python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --sweep_dry_run     # the 12 proposals

An Optuna study in runs/sweep-random/study.journal: rerunning the command resumes it, and a second
host running the same command with the same --workdir on a shared disk (or
--sweep_storage=postgresql://...) takes the trials this one has not. A trial whose eval/loss is
worse than the median of the finished trials at the same step (once 3 trials have finished; from
step 10, its first evaluation) stops there, its checkpoint kept. Seconds per trial on 2 CPU cores
(mostly process start and compilation).
"""


def get_sweep():
  return {'config': 'configs/gpt.py:tiny',
          'overrides': {'train.steps': 60, 'train.eval_every': 10, 'train.checkpoint_every': 60},
          'space': {'train.lr': {'low': 1e-4, 'high': 3e-2, 'log': True},   # float range
                    'model.num_layers': {'low': 1, 'high': 3},             # int range (int bounds)
                    'model.width': [32, 64]},                              # categorical
          'sampler': 'random', 'seed': 0, 'n_trials': 12,                  # grid | random | qmc | tpe | gp
          'pruner': {'name': 'median', 'n_startup_trials': 3, 'n_warmup_steps': 10},
          'metric': 'eval/loss', 'direction': 'minimize'}
