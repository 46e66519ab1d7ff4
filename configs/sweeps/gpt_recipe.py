"""The GPT `default` recipe, tuned: TPE over the optimizer, learning rates, schedule, warmup and the
decoder options, at 0.4x the old recipe's 400 steps, on the standard-library text (issue #33).

  python launch.py --sweep=configs/sweeps/gpt_recipe.py --workdir=runs/sweep-gpt-recipe

Each trial trains configs/gpt.py:default (4 layers, width 256, 32 x 128 tokens a step, the 2,048-id
BPE) for 160 steps and is scored by its validation loss (the whole held-out split at the best
checkpoint); the median pruner stops a trial whose loss at an evaluation (every 40 steps, from step
80) is worse than the median of the finished trials there. 12 trials, one at a time: on 2 CPU cores
a trial is ~4 minutes, and two at once share the same cores. Learning rates are searched on a log
scale; Muon's matrices take AdamW-sized rates (`train.muon_rms_scale` 0.2, Moonshot's consistent
RMS), so one range serves both optimizers. Weight decay (0.1), z-loss (0), learned positions and
wsd's cooldown fraction (0.2) stay at the preset's values: 12 trials cannot search 13 dimensions.

Run 2026-11-27 (AMD EPYC, 2 cores, --sweep_workers=1; 63 min in all, 230-470 s a trial, the slower
ones sharing the cores with other runs; every trial: measurements/gpt_recipe_study.csv): 11 of 12
finished, 1 pruned. Best, trial 06: Muon lr 6.6e-3, AdamW side 7.2e-3, cosine with 40 warmup steps,
no QK-norm, GELU, soft cap 15, zero-initialised outputs: eval loss 4.204. The `default` preset
(the ablation's choice, configs/sweeps/gpt_recipe_ablation.py) trained the same 160 steps scores
4.216, 0.012 behind; with --config.seed=1 both (one after the other, alone) the preset leads, 3.867
against 3.905, so the preset was kept (and wsd, whose cooldown can follow a wall-clock budget, over
a cosine tied to the step count). The Muon trials scored 4.20-4.35
but one whose AdamW side had lr 1.1e-3 (4.74); the AdamW trials 4.75-6.38 (lr 1e-3 to 2.8e-2, one
pruned): the optimizer is what separates the trials.
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
