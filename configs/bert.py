"""BERT: masked-LM + next-sentence pretraining, sequence classification, features, HF import.

`config.task` picks what a run does:
  pretrain   MLM + NSP on documents (sentence pairs, 15% of tokens chosen: 80% [MASK], 10% random,
             10% unchanged); eval reports MLM and NSP accuracy
  classify   fine-tune on labelled texts (single sentences, or pairs from 3-column TSV) from the
             pooled [CLS] vector; initialise from a pretraining run with --config.init_from=<workdir>
             (or from an imported checkpoint); eval: accuracy, macro-F1, confusion matrix (+ PNG)
  features   --mode=predict writes one .npy of vectors per input line (a chosen layer, the mean of
             the last K layers, or [CLS]); load_run(workdir).model(...) returns all hidden states.
             Any trained BERT run predicts features with --mode=predict --workdir=<run>
             --config.task=features [--config.features.pooling=mean]: the overrides apply to that
             run's config.json

Commands (CPU, bbc_news: 2,225 BBC articles, 5 topics, 80/10/10 split by article):
  python launch.py --config=configs/bert.py:default --workdir=runs/bert-pretrain
  python launch.py --config=configs/bert.py:finetune --config.init_from=runs/bert-pretrain \\
      --workdir=runs/bert-bbc
  python launch.py --config=configs/bert.py:finetune --workdir=runs/bert-bbc-scratch   # no pretraining
What `finetune` is: the `default` model read at 256 tokens, 340 steps of 32 (6 epochs), lr 5e-4 with
linear decay (the best validation score of the runs tried; the test split chose nothing). Its runs
from scratch and after `default` pretraining, at other learning rates and lengths, against TF-IDF +
logistic regression (scripts/tfidf_baseline.py), with date, commit and machine:
measurements/bert_bbc_news.csv (docs/families/bert.md). The pretraining run has 128 positions;
`finetune` asks for 256, so positions 128..255 start from random values (init_from copies the
first 128).

Hugging Face checkpoints (with or without pretraining heads):
  python launch.py --config=configs/bert.py:base --config.task=features --mode=import_hf \\
      --hf_dir=/path/bert-base-uncased --workdir=runs/bert-base
  python launch.py --config=configs/bert.py:finetune --config.init_from=runs/bert-base \\
      --config.train.lr=3e-5 --workdir=runs/bert-base-bbc

Presets:
  tiny      tests: seconds
  default   CPU pretraining on bbc_news (2 layers, 128 wide, 2 heads, 128 tokens)
  finetune  the default model fine-tuned for classification (task=classify), 256 tokens
  base      BERT-base 12/768/12/3072: encoder 109,482,240 parameters (vocab 30,522, 512 positions); stored:
            109,536,000, the embedding padded to 30,592 rows (model.vocab_multiple, zero rows never used)
  large     BERT-large 24/1024/16/4096: encoder 335,141,888 parameters
  bench     speed only (--mode=bench): the reference benchmark's shapes, 6/384/6/1536, vocabulary 8,192,
            batch 16 x 128, MLM + NSP, dropout 0, AdamW; its speed against HF BertForPreTraining:
            docs/benchmarks.md

Other data: --config.data.source=text:'/path/*.txt' (one document per file, or documents
separated by blank lines in a single file), tfds:<name>[:<split>] (a `data.text_field`
feature; classification also `data.label_field`), tsv:<path> (classification: text<TAB>label or
text_a<TAB>text_b<TAB>label per line).
"""
import ml_collections

from configs.base import apply_preset, base_config

TASKS = ('pretrain', 'classify', 'features')
# The encoder's sizes besides BERT-base's, which get_config sets.
SIZES = {
    'tiny': dict(num_layers=2, num_heads=2, width=32, mlp_dim=64, max_len=64),
    'default': dict(num_layers=2, num_heads=2, width=128, mlp_dim=512, max_len=128),
    'large': dict(num_layers=24, num_heads=16, width=1024, mlp_dim=4096),
}
# BERT-base and BERT-large pretraining (Devlin et al. 2019): the 30,522-token vocabulary, the schedule.
PRETRAINING = dict(data=dict(vocab_size=30522),
                   train=dict(steps=1_000_000, batch_size=256, lr=1e-4, schedule='linear', warmup_steps=10_000,
                              end_lr_fraction=0.0, eval_every=10_000, checkpoint_every=10_000))
PRESETS = {
    'tiny': dict(model=SIZES['tiny'],
                 data=dict(vocab_size=400, seq_len=32, max_predictions=6, dupe_factor=1, max_examples=1000),
                 train=dict(steps=20, batch_size=8, lr=1e-3, warmup_steps=5, eval_every=10, eval_steps=2,
                            checkpoint_every=10, log_every=5)),
    # No dropout: 2,000 steps see each pair about twice, far from overfitting.
    'default': dict(model=dict(**SIZES['default'], dropout=0.0, attention_dropout=0.0),
                    data=dict(dupe_factor=3),
                    train=dict(steps=2000, lr=1e-3, schedule='linear', warmup_steps=200,
                               end_lr_fraction=0.0, eval_every=250, eval_steps=0, checkpoint_every=500,
                               log_every=25)),
    # 256 tokens (the first half of a median article); with init_from=<a default pretraining run>
    # positions 128..255 are new and learned here.
    'finetune': dict(task='classify', model={**SIZES['default'], 'max_len': 256},
                     data=dict(seq_len=256),
                     train=dict(steps=340, lr=5e-4, schedule='linear', warmup_steps=34,
                                end_lr_fraction=0.0, eval_every=100, eval_steps=0, checkpoint_every=100,
                                log_every=20, best_metric='eval/accuracy', best_mode='max')),
    'base': PRETRAINING,
    'bench': dict(model=dict(num_layers=6, num_heads=6, width=384, mlp_dim=1536, dropout=0.0,
                             attention_dropout=0.0),
                  data=dict(vocab_size=8192),
                  train=dict(batch_size=16, lr=1e-4, grad_clip=0.0)),
    'large': dict(PRETRAINING, model=SIZES['large']),
}

# `--mode=import_hf` without --config: the preset a Hugging Face config.json's model_type starts from.
HF_MODEL_TYPES = {'bert': 'base'}


def get_config(preset: str = 'default'):
  c = base_config('bert', preset, PRESETS)
  c.task = 'pretrain'  # 'pretrain' (MLM + NSP) | 'classify' (a label per text or pair) | 'features' (vectors)

  c.data.source = 'bbc_news'
  c.data.tokenizer = 'wordpiece'
  c.data.vocab_size = 8000
  c.data.text_field = 'text'  # tfds: the feature holding the text
  c.data.label_field = 'label'  # tfds classification: the feature holding the label
  c.data.documents = 'auto'  # text:<glob> pretraining: 'file' | 'blank_line' | 'auto' (one file: blank lines)
  c.data.dupe_factor = 5  # pretraining: sentence pairs are cut this many times, differently
  c.data.short_seq_prob = 0.1  # pretraining: fraction of pairs shorter than seq_len, as in BERT
  c.data.mask_prob = 0.15  # pretraining: share of tokens chosen for MLM (80% [MASK], 10% random, 10% kept)
  c.data.max_predictions = 20  # MLM positions per sequence (>= mask_prob * seq_len)

  c.model.attention = 'auto'  # 'auto' (GPU: cudnn, jax_nn for float32; TPU: splash; else xla) | 'xla' | 'cudnn' | 'jax_nn' | 'splash'
  c.model.vocab_size = 0  # 0 = the tokenizer's size; an imported checkpoint sets its own
  # Embedding rows padded to a multiple of this (whole matmul tiles for the output layer); the padded
  # ids are never predicted. A run config without this key is unpadded (vocab_multiple=1).
  c.model.vocab_multiple = 128
  c.model.dtype = 'auto'  # compute dtype, weights stay float32: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.num_layers = 12  # encoder blocks (BERT-base's sizes; the presets set their own)
  c.model.num_heads = 12  # attention heads per block
  c.model.width = 768  # hidden size: embeddings and every block's output
  c.model.mlp_dim = 3072  # each block's FFN hidden width
  c.model.max_len = 512  # learned positions: the longest sequence the model reads
  c.model.type_vocab_size = 2  # segment embeddings: sentence A = 0, B = 1
  c.model.dropout = 0.1  # training: rate on the embeddings, each block's branches and the classifier's input
  c.model.attention_dropout = 0.1  # training: rate on the attention weights
  c.model.layer_norm_epsilon = 1e-12  # added to the variance in every LayerNorm
  c.model.activation = 'gelu'  # 'relu' | 'gelu' | 'gelu_tanh' | 'silu' | 'relu2' (models/layers.py ACTIVATIONS)
  c.model.init_std = 0.02  # standard deviation of the truncated normal every kernel and embedding starts from
  c.model.qk_norm = False  # RMSNorm of query and key heads (Hugging Face's BERT has none: no export)
  c.model.zero_init_out = False  # attention output and FFN down projections start at zero

  c.train.b2 = 0.999  # BERT's Adam
  c.train.weight_decay = 0.01

  c.features = ml_collections.ConfigDict()
  c.features.layer = -1  # hidden state index: 0 = embeddings, i = block i, -1 = last
  c.features.mean_last = 0  # K > 0: average the last K layers instead of `layer`
  c.features.pooling = 'none'  # 'none' (one vector per token) | 'cls' | 'mean' (over real tokens)
  c.features.output_dir = ''  # '' = <workdir>/features
  return apply_preset(c, PRESETS)
