"""RNN encoder-decoder translation (D2L ch. 10.7) and its Bahdanau-attention variant (ch. 11.4).

Commands (CPU, 2 cores):
  python launch.py --config=configs/seq2seq.py                  # GRU encoder-decoder, no attention
  python launch.py --config=configs/seq2seq.py:bahdanau         # the same with Bahdanau attention
  python launch.py --config=configs/seq2seq.py:long             # numbers >= 100,000 as characters, no attention
  python launch.py --config=configs/seq2seq.py:long_bahdanau    # the same with Bahdanau attention
(add --config.seed=1 for the second seed below). Test BLEU greedy / beam-4 (exact-match rate of
the beam output), measured on 2 CPU cores that other jobs were sharing:

default / bahdanau (all numbers, BPE vocabulary of 512, 4,000 steps of 64 pairs, about 4 minutes
without attention and 8 with it; 1,000 test pairs):
  default                                        99.63 / 99.63  (0.993)
  bahdanau                                       99.98 / 100.00 (1.000)

long / long_bahdanau, the long-input comparison: numbers >= 100,000 only (about 9,700 training
pairs; 284 test pairs with seed 0, 297 with seed 1) tokenized by character, so a test source is
41-72 characters (median 63) + EOS and a target 30-69; the same GRU 2 x 64, the same data and
the same 1,500 steps of 64 pairs; only model.attention_type differs. Wall clock / CPU time (user +
system) include compiling and the test decoding:
  long            seed 0:  52.43 / 52.67  (0.106)   3 min 14 s wall,  3.3 min CPU
                  seed 1:  73.04 / 75.15  (0.505)   3 min 16 s wall,  3.2 min CPU
  long_bahdanau   seed 0: 100.00 / 100.00 (1.000)  17 min 36 s wall, 12.0 min CPU
                  seed 1:  99.87 / 99.87  (0.993)  12 min 01 s wall, 12.0 min CPU
Eval loss per target character at steps 500 / 1,000 / 1,500 (seed 0): no attention 0.173 / 0.082 /
0.062, attention 0.099 / 0.0002 / 0.0001. The plain model's errors show the fixed-context
bottleneck: of its 254 wrong test translations (seed 0; seed 1: 147), 252 (144) get the thousands
wrong, the part of the source read first, and only 2 (4) the part below a thousand, read last
('six cent treize mille cinq cent dix-neuf' for 'six cent trois mille cinq cent dix-neuf'). The
attention model's only errors (seed 1) are two rare forms ('trois centsième' for 'trois cents').
Its attention.png is sparse but monotonic: the weight peaks on the English tens-and-units words
while their French counterparts are written, in source order, and spreads thinly elsewhere. The
budget is equal in steps, not in time: an attention step costs about 4 times as much on CPU
(10,500 vs 41,000 tokens/s). Given 4 times the steps, i.e. about the attention run's time, the
plain model closes the gap (seed 0, --config.train.steps=6000 --config.train.eval_every=2000
--config.train.checkpoint_every=2000: 100.00 / 100.00 (1.000), eval loss 0.010 / 0.0001 /
0.000006 at steps 2,000 / 4,000 / 6,000; 11 min 17 s wall, 11.5 min CPU). So at this size
attention learns the long inputs in a quarter of the steps; it is not the only way to learn them.

The long presets with the BPE vocabulary of 512 instead (mostly whole words): these numbers are
then only ~13 source tokens, which the 2 x 64 GRU state carries, so the fixed context is not the
bottleneck and attention does not reliably win (4,000 steps; add --config.data.tokenizer=bpe
--config.data.seq_len=20 --config.train.steps=4000 --config.train.eval_every=1000
--config.train.checkpoint_every=1000): no attention 99.34 / 99.34 (seed 0), 92.93 / 92.80 (seed 1);
attention 94.40 / 94.30, 93.68 / 93.84, with diffuse attention weights.

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
