"""RNN encoder-decoder translation (D2L ch. 10.7) and its Bahdanau-attention variant (ch. 11.4).

Commands (CPU, 2 cores):
  python launch.py --config=configs/seq2seq.py                  # GRU encoder-decoder, no attention
  python launch.py --config=configs/seq2seq.py:bahdanau         # the same with Bahdanau attention
  python launch.py --config=configs/seq2seq.py:long             # numbers >= 100,000 as characters, no attention
  python launch.py --config=configs/seq2seq.py:long_bahdanau    # the same with Bahdanau attention
(add --config.seed=1 for a second seed). `long` / `long_bahdanau` are the long-input comparison:
numbers >= 100,000 only, tokenized by character, so a source is a few dozen characters and the
fixed context of the plain decoder is the bottleneck attention removes; the same GRU 2 x 64, the
same data and the same 1,500 steps of 64 pairs, only model.attention_type differs (equal in steps,
not in time: an attention step costs more). Their results (test BLEU greedy / beam-4, exact-match
rate, wall and CPU time, the eval loss during training, the plain model given 4 times the steps, and
the long presets with the BPE vocabulary instead) are data in measurements/ (seq2seq_results.csv,
seq2seq_eval_loss.csv), each row with its date, commit, machine and command;
docs/families/before-the-transformer.md reports them.

`model.attention_type` ('none' | 'bahdanau') switches the decoder; everything else (data, size,
budget, decoding) is shared, so presets differing only in it compare like for like. After
training: test BLEU (sacreBLEU) of greedy and beam search, translations.json, and for Bahdanau
attention.png (target x source weights of the longest test sentences).

Presets:
  default / bahdanau             numbers_en_fr (all numbers), English -> French number words
  long / long_bahdanau           numbers_en_fr restricted to numbers >= 100,000 (data.min_number),
                                 character-level (data.tokenizer='char', data.seq_len=76), 1,500 steps
  tiny                           tests: seconds
Other data: --config.data.source=tsv:/path/pairs.tsv or tfds:<name> (data.min_number=0).
"""
from configs.base import apply_preset, base_config

# Numbers >= 100,000 as characters: 20-75 source characters (median 64), so the fixed context must
# carry a long sequence. seq_len 76 fits the longest English number below a million (75
# characters, e.g. 777,777th) + EOS.
LONG = dict(data=dict(min_number=100_000, tokenizer='char', seq_len=76),
            train=dict(steps=1500, eval_every=500, checkpoint_every=500))

PRESETS = {
    'default': {},
    'bahdanau': dict(model=dict(attention_type='bahdanau')),
    'long': LONG,
    'long_bahdanau': dict(LONG, model=dict(attention_type='bahdanau')),
    'tiny': dict(model=dict(embed=16, hidden=32, num_layers=1, attention_type='bahdanau'),
                 data=dict(vocab_size=200, max_examples=400),
                 train=dict(steps=20, batch_size=16, warmup_steps=2, eval_every=10, eval_steps=2,
                            checkpoint_every=10, log_every=5),
                 decode=dict(beam_size=2)),
}


def get_config(preset: str = 'default'):
  c = base_config('seq2seq', preset, PRESETS)
  c.model.attention_type = 'none'  # 'none' | 'bahdanau'
  c.model.embed = 32  # source and target embedding width
  c.model.hidden = 64  # each GRU layer's state width, encoder and decoder
  c.model.num_layers = 2  # stacked GRU layers, encoder and decoder
  c.model.dtype = 'auto'  # compute dtype, weights stay float32: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.dropout = 0.1  # training: rate on the embeddings, between stacked layers and on the decoder's outputs
  c.model.attention_hidden = 0  # width of the additive attention's tanh layer; 0 = model.hidden
  c.data.source = 'numbers_en_fr'
  c.data.vocab_size = 512
  c.data.seq_len = 20  # source and target positions, EOS / BOS included (numbers need at most 19)
  c.data.min_number = 0  # numbers_en_fr: keep only numbers >= this (0: all)
  c.train.steps = 4000
  c.train.batch_size = 64
  c.train.lr = 3e-3
  c.train.weight_decay = 0.0
  c.train.eval_every = 1000
  c.train.eval_steps = 0
  c.train.checkpoint_every = 1000
  c.train.log_every = 100
  return apply_preset(c, PRESETS)
