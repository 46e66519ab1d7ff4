"""The Transformer encoder-decoder of "Attention Is All You Need" for translation.

Command (the CPU main job; built-in offline data, English number words -> French):
  python launch.py --config=configs/transformer.py:default
What it does: 500 steps of 32 packed rows, then test BLEU (sacreBLEU, detokenized, beam 4 and greedy)
on 1,000 held-out numbers that never occur in training, five printed translations and three
attention heatmaps (PNG, cross-attention and decoder self-attention per head) whose paths are
printed. Its measured result, with date, commit and machine: measurements/families.csv (the README's
table and docs/families/transformer.md).

The `default` recipe (issue #33): Muon (lr 7e-3; its AdamW 8e-3 for the shared embedding, norms
and biases, b2 0.95), warmup-stable-decay with no warmup and the last 35% cooled with 1-sqrt,
pre-LayerNorm blocks, no dropout, label smoothing 0.2, QK-norm, zero-initialised output
projections, 500 steps. Chosen by the TPE study configs/sweeps/transformer_recipe.py (24 trials on
the gettext English -> Spanish pairs, scripts/make_gettext_corpus.py, scored by validation token
accuracy; every trial in measurements/transformer_recipe_study.csv): its best trial, rounded, is
the preset. The study's trials, the recipe before it, and this recipe against the paper's at the
same wall clock
  python scripts/time_to_target.py --config=configs/transformer.py:default --baseline=transformer-2019 \
      --data=gettext --minutes=1.5 --metric=test/bleu --rounds=2
are reported in docs/recipes.md.

Your own parallel corpus (one `source<TAB>target` pair per line; 5% each held out for
validation and test unless data.eval_source / data.test_source name files, used whole):
  python launch.py --config=configs/transformer.py:default --config.data.source=tsv:/path/pairs.tsv
  python scripts/make_gettext_corpus.py --out_dir=/tmp/gettext     # 46,991 en->es pairs
  python launch.py --config=configs/transformer.py:default --config.data.source=tsv:/tmp/gettext/train.tsv \
    --config.data.eval_source=tsv:/tmp/gettext/valid.tsv --config.data.test_source=tsv:/tmp/gettext/test.tsv
WMT 2014 English -> German as in the paper (TFDS must have prepared it):
  python launch.py --config=configs/transformer.py:base

Presets:
  tiny     tests: seconds
  default  the CPU main job above
  base     the paper's base model: 6 + 6 layers, width 512, 8 heads, FFN 2048, dropout 0.1, shared
           source/target/output embeddings, Adam(0.9, 0.98, 1e-9), rsqrt schedule with 4,000 warmup
           steps, label smoothing 0.1, on WMT14 en->de with a 37,000-token joint BPE vocabulary
  big      the paper's big model: width 1024, 16 heads, FFN 4096, dropout 0.3
  bench    speed only (--mode=bench): the reference benchmark's torch.nn.Transformer shapes, width 256,
           4 heads, 3 + 3 layers, FFN 1024, vocabulary 8,000 (separate embeddings), batch 32 x 64, dropout 0,
           AdamW, plain cross-entropy; its speed against torch.nn.Transformer: docs/benchmarks.md

Parameter counts (they depend on the vocabulary; tests/test_transformer.py checks them):
  base, vocab 37,000:  63,082,496 (the paper's Table 3: 65M)
  big,  vocab 37,000: 214,245,376 (the paper: 213M)
The differences come from the vocabulary: the paper's shared BPE vocabulary was "about 37,000"
tokens, and each 1,000 tokens add 0.5M (base) or 1.0M (big) parameters; the layer sizes follow
the paper exactly.
"""
import ml_collections

from configs.base import apply_preset, base_config

# WMT 2014 English -> German, the paper's data for `base` and `big`.
WMT14 = dict(source='tfds:wmt14_translate/de-en', source_lang='en', target_lang='de', vocab_size=37000,
             lowercase=False)
PRESETS = {
    'tiny': dict(model=dict(width=32, num_heads=2, encoder_layers=1, decoder_layers=1, mlp_dim=64, dropout=0.0),
                 data=dict(vocab_size=300, seq_len=24, max_examples=600),
                 train=dict(steps=20, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=10, eval_steps=2,
                            checkpoint_every=10, log_every=5),
                 decode=dict(beam_size=2), pictures=dict(count=1)),
    # Muon for the hidden matrices, warmup-stable-decay, QK-norm and zero-initialised output projections
    # (issue #33; the trials in the docstring). The recipe it replaced, the paper's Adam with the rsqrt
    # schedule for 800 steps, is scripts/time_to_target.py's `transformer-2019` baseline.
    'default': dict(model=dict(width=128, num_heads=4, encoder_layers=2, decoder_layers=2, mlp_dim=512,
                               dropout=0.0, pre_norm=True, qk_norm=True, zero_init_out=True),
                    data=dict(vocab_size=1000, seq_len=24),
                    train=dict(steps=500, optimizer='muon', lr=7e-3, adam_lr=8e-3, b2=0.95, schedule='wsd',
                               warmup_steps=0, decay_fraction=0.35, label_smoothing=0.2,
                               eval_every=400, eval_steps=8, checkpoint_every=400, log_every=50)),
    'base': dict(data=WMT14,
                 # 512^-0.5 * 4000^-0.5: the paper's lrate formula at the end of warmup.
                 train=dict(steps=100_000, batch_size=256, lr=7.0e-4, warmup_steps=4000, eval_every=2000,
                            eval_steps=50, checkpoint_every=2000, log_every=100)),
    'bench': dict(model=dict(width=256, num_heads=4, encoder_layers=3, decoder_layers=3, mlp_dim=1024, dropout=0.0,
                             share_embeddings=False),
                  data=dict(vocab_size=8000, seq_len=64),
                  train=dict(optimizer='adamw', weight_decay=0.01, label_smoothing=0.0)),
    'big': dict(model=dict(width=1024, num_heads=16, mlp_dim=4096, dropout=0.3),
                data=WMT14,
                train=dict(steps=300_000, batch_size=256, lr=4.9e-4, warmup_steps=4000, eval_every=2000,
                           eval_steps=50, checkpoint_every=2000, log_every=100)),
}


def get_config(preset: str = 'default'):
  c = base_config('transformer', preset, PRESETS)
  c.data.source = 'numbers_en_fr'
  c.data.source_lang = ''  # TFDS language keys; '' = from the dataset name ('de-en': de -> en)
  c.data.target_lang = ''  # both languages share one tokenizer (data.tokenizer): a joint vocabulary
  c.data.packing = True  # several pairs per row (batch_size counts rows of seq_len); False: length buckets
  c.data.min_bucket_len = 16  # unpacked batches of similar lengths padded to 16, 24, 32, 48, ... <= seq_len; 0 = off
  c.model.attention = 'auto'  # 'auto' (GPU: cudnn, jax_nn for float32; TPU: splash; else xla) | 'xla' | 'cudnn' | 'jax_nn' | 'splash'
  c.model.dtype = 'auto'  # compute dtype, weights stay float32: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.width = 512  # d_model: embeddings and every block's output
  c.model.num_heads = 8  # attention heads per attention
  c.model.encoder_layers = 6  # encoder blocks
  c.model.decoder_layers = 6  # decoder blocks
  c.model.mlp_dim = 2048  # each block's FFN hidden width (d_ff)
  c.model.dropout = 0.1  # training: rate on the embeddings, each block's branches and the FFN hidden (P_drop)
  c.model.attention_dropout = 0.0  # training: rate on the attention weights
  c.model.pre_norm = False  # the paper's post-LayerNorm blocks
  c.model.share_embeddings = True  # source, target and output embeddings are one matrix
  c.model.layer_norm_epsilon = 1e-6  # added to the variance in every LayerNorm
  c.model.qk_norm = False  # RMSNorm of query and key heads in every attention
  c.model.zero_init_out = False  # attention output and FFN down projections start at zero
  c.train.optimizer = 'adam'
  c.train.b2 = 0.98
  c.train.eps = 1e-9
  c.train.weight_decay = 0.0
  c.train.grad_clip = 0.0
  c.train.schedule = 'rsqrt'
  c.train.label_smoothing = 0.1
  c.train.best_metric = 'eval/accuracy'
  c.train.best_mode = 'max'
  c.pictures = ml_collections.ConfigDict()
  c.pictures.count = 3  # test sentences drawn as attention heatmaps after evaluation
  c.pictures.layer = -1  # decoder layer whose heads are drawn
  return apply_preset(c, PRESETS)

