"""Character-level RNN language model (D2L ch. 9-10) on the Python standard library's sources.

Commands (CPU, 2 cores):
  python launch.py --config=configs/rnn_lm.py                 # GRU, sequential partitioning
  python launch.py --config=configs/rnn_lm.py:random          # the same budget, random sampling
Both presets train 1,500 steps (3.1M characters, one pass over the data). The sequential sampler
trains almost only from warm states (a zero state once per pass), random sampling from the zero
state every batch; eval/perplexity scores 64-character windows each started from a zero state,
eval/stream_perplexity the held-out stream with the state carried. Their results are data in
measurements/rnn_lm_samplers.csv (with date, commit, machine and command);
docs/families/before-the-transformer.md reports them.

Presets:
  default   1-layer GRU, 256 units, sequential partitioning with the state carried (truncated BPTT)
  random    the same model and budget with random sampling (fresh state every batch)
  lstm      default with an LSTM cell;  rnn: default with a tanh RNN cell
  tiny      tests: seconds

Both samplers read the same token stream for the same number of steps.
Other data: --config.data.source=text:'/path/*.txt'. Sampler: --config.data.sampler=random|sequential.
"""
from configs.base import apply_preset, base_config

PRESETS = {
    'default': {},
    'random': dict(data=dict(sampler='random')),
    'lstm': dict(model=dict(cell='lstm')),
    'rnn': dict(model=dict(cell='rnn')),
    'tiny': dict(model=dict(hidden=32, embed=16),
                 data=dict(seq_len=16, max_examples=400),
                 train=dict(steps=20, batch_size=8, warmup_steps=2, eval_every=10, eval_steps=2,
                            checkpoint_every=10, log_every=5),
                 decode=dict(max_new_tokens=16, prompts='alpha |beta')),
}


def get_config(preset: str = 'default'):
  c = base_config('rnn_lm', preset, PRESETS)
  c.model.cell = 'gru'  # 'rnn' | 'gru' | 'lstm'
  c.model.embed = 64  # token embedding width
  c.model.hidden = 256  # each RNN layer's state width
  c.model.num_layers = 1  # stacked RNN layers
  c.model.dtype = 'auto'  # compute dtype, weights stay float32: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.dropout = 0.0  # training: rate on the embeddings, between stacked layers and on the outputs
  c.data.source = 'pystdlib'
  c.data.tokenizer = 'char'
  c.data.sampler = 'sequential'  # 'sequential' | 'random'
  c.data.seq_len = 64
  c.data.max_examples = 50_000  # training windows of seq_len tokens (0: the whole stream): one pass
  c.train.steps = 1500
  c.train.lr = 3e-3
  c.train.warmup_steps = 50
  c.train.weight_decay = 0.0
  c.train.eval_every = 500
  c.train.eval_steps = 40
  c.train.checkpoint_every = 500
  c.train.log_every = 50
  c.decode.max_new_tokens = 120
  c.decode.temperature = 0.6
  c.decode.prompts = 'def |import |class '
  return apply_preset(c, PRESETS)
