"""The Transformer classifier's `default` recipe, tuned on bbc_news: TPE over the optimizer,
learning rates, schedule, warmup, dropout, label smoothing and the block options (issue #33).

  python launch.py --sweep=configs/sweeps/classifier_recipe.py --workdir=runs/sweep-classifier --sweep_workers=2

Each trial trains configs/classifier.py:default (2 layers, width 64, the first 512 WordPiece tokens)
for the preset's 400 steps and is scored by its validation accuracy (222 articles, the best
checkpoint); the median pruner stops a trial below the median at an evaluation (every 100 steps).
The test split (223 articles) is not looked at: scripts/tfidf_baseline.py's accuracy on it is the bar.

Run 2026-11-27 on 2 cores of an AMD EPYC with --sweep_workers=1; every trial is a row of
measurements/classifier_recipe_study.csv, and docs/recipes.md (Classifier) reports the outcome: no
trial beat the `default` preset's validation accuracy, so the preset was kept.
"""


def get_sweep():
  return {
      'config': 'configs/classifier.py:default',
      'overrides': {'train.eval_every': 100, 'train.checkpoint_every': 400},
      'space': {
          'train.optimizer': ['adamw', 'muon'],
          'train.lr': {'low': 3e-4, 'high': 1e-2, 'log': True},
          'train.adam_lr': {'low': 3e-4, 'high': 1e-2, 'log': True},  # muon's AdamW side (embeddings, head)
          'train.schedule': ['linear', 'cosine', 'wsd'],
          'train.warmup_steps': {'low': 0, 'high': 100, 'step': 20},
          'train.weight_decay': [0.01, 0.1],
          'train.label_smoothing': [0.0, 0.1],
          'model.dropout': [0.0, 0.1, 0.2, 0.3],
          'model.qk_norm': [False, True],
          'model.zero_init_out': [False, True],
      },
      'sampler': {'name': 'tpe', 'n_startup_trials': 8, 'multivariate': True},
      'seed': 0,
      'n_trials': 20,
      'pruner': {'name': 'median', 'n_startup_trials': 5, 'n_warmup_steps': 100},
      'metric': 'eval/accuracy', 'direction': 'maximize',
  }
