"""What each part of the new GPT recipe buys: the old `default` recipe and the recipe built up a
part at a time, listed trials at 0.3x the old recipe's 400 steps, on the standard-library text (#33).

  python launch.py --sweep=configs/sweeps/gpt_recipe_ablation.py --workdir=runs/gpt-recipe-ablation

configs/gpt.py:default's model (4 layers, width 256, 32 x 128 tokens a step, the 2,048-id BPE),
120 steps, scored by the validation loss at the best checkpoint (evaluations every 40 steps). The
trials, in order: the 2019 recipe (AdamW, warmup + cosine, GPT-2 block: scripts/time_to_target.py's
`gpt-2019`); Muon for the hidden matrices; + warmup-stable-decay (the last 20% cooling, 1-sqrt);
+ the speedrun block (QK-norm, ReLU^2, logits soft-capped at 15, zero-initialised output
projections); the same at twice the learning rate; and AdamW with the same schedule and block. This
is what 2 CPU cores allow in minutes (~4 a trial); configs/sweeps/gpt_recipe.py is the TPE study
over the same choices for a machine with hours. Its results: measurements/gpt_recipe_ablation.csv,
reported by docs/families/gpt.md.
"""

OLD = {'train.optimizer': 'adamw', 'train.schedule': 'cosine', 'train.lr': 2e-3, 'train.warmup_steps': 50,
       'model.qk_norm': False, 'model.mlp': 'gelu', 'model.logit_softcap': 0.0, 'model.zero_init_out': False}
MUON = dict(OLD, **{'train.optimizer': 'muon', 'train.lr': 4e-3, 'train.adam_lr': 4e-3})
WSD = dict(MUON, **{'train.schedule': 'wsd', 'train.warmup_steps': 20})
BLOCK = {'model.qk_norm': True, 'model.mlp': 'relu2', 'model.logit_softcap': 15.0, 'model.zero_init_out': True}


def get_sweep():
  return {
      'config': 'configs/gpt.py:default',
      'overrides': {'train.steps': 120, 'train.eval_every': 40, 'train.eval_steps': 8, 'train.checkpoint_every': 120,
                    'decode.num_samples': 0, 'decode.prompts': ''},
      'trials': [
          OLD,
          MUON,
          WSD,
          dict(WSD, **BLOCK),
          dict(WSD, **BLOCK, **{'train.lr': 8e-3, 'train.adam_lr': 8e-3}),
          dict(WSD, **BLOCK, **{'train.optimizer': 'adamw'}),
      ],
      'metric': 'eval/loss', 'direction': 'minimize',
  }
