"""The GPT `default` recipe, tuned: TPE over the optimizer, learning rates, schedule, warmup and the
decoder options, at 0.4x the old recipe's 400 steps, on the standard-library text (issue #33).

  python launch.py --sweep=configs/sweeps/gpt_recipe.py --workdir=runs/sweep-gpt-recipe

Each trial trains configs/gpt.py:default (4 layers, width 256, 32 x 128 tokens a step, the 2,048-id
BPE) for 160 steps and is scored by its validation loss (the whole held-out split at the best
checkpoint); the median pruner stops a trial whose loss at an evaluation (every 40 steps, from step
80) is worse than the median of the finished trials there. 12 trials, one at a time: on 2 CPU cores
a trial takes minutes, and two at once share the same cores. Learning rates are searched on a log
scale; Muon's matrices take AdamW-sized rates (`train.muon_rms_scale` 0.2, Moonshot's consistent
RMS), so one range serves both optimizers. Weight decay (0.1), z-loss (0), learned positions and
wsd's cooldown fraction (0.2) stay at the preset's values: 12 trials cannot search 13 dimensions.

Run 2026-11-27 on 2 cores of an AMD EPYC with --sweep_workers=1; every trial is a row of
measurements/gpt_recipe_study.csv, and docs/families/gpt.md reports the outcome: the best trial did
not beat the `default` preset (the ablation's choice, configs/sweeps/gpt_recipe_ablation.py) by more
than a seed's spread, so the preset was kept (and wsd, whose cooldown can follow a wall-clock budget,
over a cosine tied to the step count); the optimizer is what separates the trials.
"""


def get_sweep():
  return {
      'config': 'configs/gpt.py:default',
      'overrides': {'train.steps': 160, 'train.eval_every': 40, 'train.eval_steps': 8, 'train.checkpoint_every': 160,
                    'decode.num_samples': 0, 'decode.prompts': ''},
      'space': {
          'train.optimizer': ['adamw', 'muon'],
          'train.lr': {'low': 1e-3, 'high': 3e-2, 'log': True},
          'train.adam_lr': {'low': 1e-3, 'high': 1e-2, 'log': True},  # muon's AdamW side (embeddings, head)
          'train.schedule': ['cosine', 'wsd'],
          'train.warmup_steps': {'low': 0, 'high': 40, 'step': 10},
          'model.qk_norm': [False, True],
          'model.mlp': ['gelu', 'relu2'],
          'model.logit_softcap': [0.0, 15.0],
          'model.zero_init_out': [False, True],
      },
      'sampler': {'name': 'tpe', 'n_startup_trials': 6, 'multivariate': True},
      'seed': 0,
      'n_trials': 12,
      'pruner': {'name': 'median', 'n_startup_trials': 4, 'n_warmup_steps': 80},
      'metric': 'eval/loss', 'direction': 'minimize',
  }
