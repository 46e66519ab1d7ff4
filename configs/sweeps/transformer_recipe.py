"""The translation Transformer's `default` recipe, tuned on real text: TPE over the optimizer,
learning rates, schedule, warmup, dropout, label smoothing and the block options, on the gettext
English -> Spanish pairs (issue #33).

  python scripts/make_gettext_corpus.py --out_dir=/tmp/gettext
  python launch.py --sweep=configs/sweeps/transformer_recipe.py --workdir=runs/sweep-transformer --sweep_workers=2

Each trial trains configs/transformer.py:default (2 + 2 layers, width 128) for the preset's 500
steps on /tmp/gettext/train.tsv and is scored by its validation token accuracy (valid.tsv, the
best checkpoint; accuracy, not loss, because label smoothing is searched and changes the loss);
the median pruner stops a trial that is below the median at an evaluation (every 200 steps).

Run 2026-11-27 on 2 cores of an AMD EPYC with --sweep_workers=1; every trial is a row of
measurements/transformer_recipe_study.csv, and docs/recipes.md (Translation) reports the outcome:
the best trial (Muon, wsd without warmup, label smoothing, no dropout, pre-norm, QK-norm,
zero-initialised outputs) beat the earlier hand-picked preset and, rounded, is
configs/transformer.py's `default` now.
"""
GETTEXT = '/tmp/gettext'


def get_sweep():
  return {
      'config': 'configs/transformer.py:default',
      'overrides': {'data.source': f'tsv:{GETTEXT}/train.tsv', 'data.eval_source': f'tsv:{GETTEXT}/valid.tsv',
                    'data.test_source': f'tsv:{GETTEXT}/test.tsv', 'train.eval_every': 200, 'train.eval_steps': 8,
                    'train.checkpoint_every': 800, 'pictures.count': 0},
      'space': {
          'train.optimizer': ['adam', 'adamw', 'muon'],
          'train.lr': {'low': 3e-4, 'high': 1e-2, 'log': True},
          'train.adam_lr': {'low': 3e-4, 'high': 1e-2, 'log': True},  # muon's AdamW side (embeddings)
          'train.schedule': ['rsqrt', 'cosine', 'wsd'],
          'train.warmup_steps': {'low': 0, 'high': 300, 'step': 50},
          'train.decay_fraction': {'low': 0.1, 'high': 0.6},
          'train.b2': [0.95, 0.98],
          'train.label_smoothing': [0.0, 0.1, 0.2],
          'model.dropout': [0.0, 0.1, 0.2],
          'model.pre_norm': [False, True],
          'model.qk_norm': [False, True],
          'model.zero_init_out': [False, True],
      },
      'sampler': {'name': 'tpe', 'n_startup_trials': 8, 'multivariate': True},
      'seed': 0,
      'n_trials': 24,
      'pruner': {'name': 'median', 'n_startup_trials': 5, 'n_warmup_steps': 200},
      'metric': 'eval/accuracy', 'direction': 'maximize',
  }
