"""Translation with the encoder-decoder Transformer (models/transformer.py).

Data and evaluation are shared with the RNN seq2seq family (train/translation.py). Training
batches come BATCH_WINDOW at a time from a window of shuffled examples, in one of two ways:

  data.packing=True   several pairs per row (`data.translation.pack_pairs`: first-fit decreasing
                      over the window into BATCH_WINDOW * batch rows of data.seq_len, rows then
                      shuffled), with segment ids that keep every pair's attention and positions
                      its own. One batch shape for the whole run, and little padding. The window
                      takes as many examples as fill PACKED_FILL of its rows on average (measured
                      once on the training split); the few a window cannot place wait for their
                      next epoch.
  data.min_bucket_len one pair per row; the window is sorted by length and each batch cut to one
                      shared source/target length from a short geometric list (`bucket_lengths`:
                      16, 24, 32, 48, 64, ... up to data.seq_len), so a run compiles the train step
                      a handful of times (each distinct batch shape is one XLA compilation).
                      Cutting source and target separately to multiples of 8, as before, gave up
                      to (seq_len / 8)^2 shapes: hundreds at seq_len 128, each compiled.
Either way batch i depends only on its window, so a resumed run reads the same batches and every
process keeps its rows of the same global batch. Evaluation and decoding are never packed.

Loss: label-smoothed cross-entropy (train.label_smoothing) with teacher forcing; loss and
accuracy are averaged over the real target tokens (target_out != pad), packed or not.

After the shared evaluation (BLEU with greedy and beam search through the decoder's KV cache),
attention heatmaps (cross-attention and decoder self-attention, one panel per head of
`pictures.layer`) of the first test sentences are written as PNG files.
"""
from __future__ import annotations

import functools
import os

import grain
import jax.numpy as jnp
import numpy as np

from errors import ConfigError
from models.attention import record_attention_weights
from data import translation
from models.transformer import Transformer, TransformerConfig, translate
from train import pictures
from train.losses import example_weights, lm_loss
from train.translation import TranslationTask

BATCH_WINDOW = 16  # batches made together: sorted by length (buckets), or packed
PACKED_FILL = 0.98  # share of a packed window's tokens (longer side) its examples fill on average
PACKING_SAMPLE = 4096  # examples whose lengths set how many examples a packed window takes
MAX_LEN_OFFSET = 10  # outputs may have decode.max_len_ratio * source length + this many tokens


def bucket_lengths(seq_len: int, smallest: int) -> list[int]:
  """The padded lengths a batch may have: smallest, then powers of two and 1.5 times them (16, 24,
  32, 48, 64, 96, ...) below seq_len, then seq_len. Few shapes (7 up to 128), and a batch carries at
  most 50% padding beyond its longest example."""
  lengths, n = [], smallest
  while n < seq_len:
    lengths.append(n)
    n = n * 3 // 2 if n & (n - 1) == 0 else 2 ** n.bit_length()  # a power of two -> x1.5 -> the next power of two
  return lengths + [seq_len]


def trim(batch: dict[str, np.ndarray], pad_id: int, buckets: list[int]) -> dict[str, np.ndarray]:
  """Drop trailing all-padding columns: source and target both keep the smallest bucket length that
  holds every real token of either, so the compiled shapes are the buckets, not their pairs."""
  used = max(int((batch[name] != pad_id).sum(axis=1).max()) for name in ('source', 'target_out'))
  kept = next(length for length in buckets if length >= used)
  return {name: array[:, :kept] for name, array in batch.items()}


class WindowBatches(grain.MapDataset):
  """Endless batches made BATCH_WINDOW at a time: `make_batches(windows[w], rng)` turns window w (a
  stack of shuffled examples) into the BATCH_WINDOW batches w * BATCH_WINDOW, ..., in serving order.

  Random access like any MapDataset (batch i needs only window i // BATCH_WINDOW), so the
  trainer's checkpointed iterator position stays valid; every process builds the same batches.
  """

  def __init__(self, windows: grain.MapDataset, make_batches, seed: int):
    super().__init__(windows)
    self._windows, self._make_batches, self._seed = windows, make_batches, seed
    # Batches are read in order, so one loaded window serves BATCH_WINDOW consecutive batches.
    self._window_batches = functools.lru_cache(maxsize=2)(self._load_window)

  def __len__(self):
    return len(self._windows) * BATCH_WINDOW

  def _load_window(self, window_index: int) -> list[dict[str, np.ndarray]]:
    return self._make_batches(self._windows[window_index], np.random.default_rng((self._seed, window_index)))

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    window_index, position = divmod(index, BATCH_WINDOW)
    return self._window_batches(window_index)[position]


def bucketed_batches(window: dict[str, np.ndarray], rng: np.random.Generator, batch_size: int, pad_id: int,
                     buckets: list[int]) -> list[dict[str, np.ndarray]]:
  """A window of BATCH_WINDOW * batch_size examples, sorted by length, cut into batches of similar
  lengths (each trimmed to a bucket), in a seeded random order."""
  lengths = np.maximum((window['source'] != pad_id).sum(1), (window['target_out'] != pad_id).sum(1))
  window = {k: v[np.argsort(lengths, kind='stable')] for k, v in window.items()}
  return [trim({k: v[slot * batch_size:(slot + 1) * batch_size] for k, v in window.items()}, pad_id, buckets)
          for slot in rng.permutation(BATCH_WINDOW)]


def packed_batches(window: dict[str, np.ndarray], rng: np.random.Generator, batch_size: int, pad_id: int
                   ) -> list[dict[str, np.ndarray]]:
  """A window of shuffled examples packed into BATCH_WINDOW * batch_size rows
  (`data.translation.pack_pairs`), the rows in a seeded random order, cut into batches."""
  packed, _ = translation.pack_pairs(window, BATCH_WINDOW * batch_size, pad_id)
  order = rng.permutation(BATCH_WINDOW * batch_size)
  return [{k: v[order[slot * batch_size:(slot + 1) * batch_size]] for k, v in packed.items()}
          for slot in range(BATCH_WINDOW)]


def examples_per_packed_window(examples: grain.MapDataset, rows: int, pad_id: int, seed: int) -> int:
  """How many examples to pack into `rows` rows: enough to fill PACKED_FILL of the longer side's
  tokens on average, measured on up to PACKING_SAMPLE examples of the shuffled training split.
  A window that holds more fails to place a few of its examples, which then wait for their
  next epoch's window (grain reshuffles every epoch)."""
  sample = examples.shuffle(seed=seed).batch(min(len(examples), PACKING_SAMPLE))[0]
  seq_len = sample['source'].shape[1]
  tokens = max((sample[name] != pad_id).sum(1).mean() for name in ('source', 'target_out'))
  return max(rows, int(rows * seq_len * PACKED_FILL / tokens))


def validate(config):
  if not -config.model.decoder_layers <= config.pictures.layer < config.model.decoder_layers:
    raise ConfigError(f'config.pictures.layer={config.pictures.layer} is not a decoder layer '
                      f'(model.decoder_layers={config.model.decoder_layers}).')


class Task(TranslationTask):
  model_config_class = TransformerConfig

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'vocab_size': tokenizer.vocab_size, 'pad_id': tokenizer.pad_id,
            'max_len': max_decode_len(config.decode.max_len_ratio, config.data.seq_len)}

  def train_batches(self, examples, batch_size, seed, process_index, process_count):
    data, pad = self.config.data, self.tokenizer.pad_id
    if data.packing:
      window = examples_per_packed_window(examples, BATCH_WINDOW * batch_size, pad, seed)
      make_batches = functools.partial(packed_batches, batch_size=batch_size, pad_id=pad)
    elif data.min_bucket_len:
      window = BATCH_WINDOW * batch_size
      make_batches = functools.partial(bucketed_batches, batch_size=batch_size, pad_id=pad,
                                       buckets=bucket_lengths(data.seq_len, data.min_bucket_len))
    else:
      return super().train_batches(examples, batch_size, seed, process_index, process_count)
    # Every process builds the same global batches and keeps its rows of each.
    windows = examples.shuffle(seed=seed).repeat().batch(window, drop_remainder=True)
    local = batch_size // process_count
    rows = slice(process_index * local, (process_index + 1) * local)
    return WindowBatches(windows, make_batches, seed).map(lambda batch: {k: v[rows] for k, v in batch.items()})

  def example_batch(self, batch_size):
    batch = super().example_batch(batch_size)
    if self.config.data.packing:  # the packed training shape: here four pairs per row
      seq_len = self.config.data.seq_len
      segments = np.repeat(np.arange(1, 5, dtype=np.int32), -(-seq_len // 4))[:seq_len]
      batch |= {name: np.tile(segments, (batch_size, 1)) for name in ('source_segments', 'target_segments')}
    return batch

  # ------------------------------------------------------------------ model
  def build_model(self, rngs):
    return Transformer(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    # Packed batches (data.packing) carry segment ids; the loss is the same mean over real tokens.
    logits = model(batch['source'], batch['target_in'], source_segments=batch.get('source_segments'),
                   target_segments=batch.get('target_segments'), deterministic=deterministic)
    return lm_loss(logits, batch['target_out'], example_weights(batch, batch['target_out'] != self.model_config.pad_id),
                   self.config.train.label_smoothing)

  def flops_per_token(self):
    # 6 x parameters per target token (the encoder runs once per pair, about as long as the target).
    config = self.model_config
    width, mlp = config.width, config.mlp_dim
    per_layer = 4 * width * width + 2 * width * mlp
    matmul = config.encoder_layers * per_layer + config.decoder_layers * (per_layer + 4 * width * width)
    return 6.0 * (matmul + width * config.vocab_size)

  def translate_batch(self, model, source, beam_size):
    tok, decode = self.tokenizer, self.config.decode
    tokens, _ = translate(model, source, bos_id=tok.bos_id, eos_id=tok.eos_id, beam_size=beam_size,
                          alpha=float(decode.length_penalty), max_len_ratio=float(decode.max_len_ratio),
                          max_len_offset=MAX_LEN_OFFSET)
    return tokens

  # ------------------------------------------------------------------ pictures
  def attention_images(self, model, source, outputs, workdir):
    """Heatmaps of the first `pictures.count` test sentences and their beam-search translations."""
    count = min(int(self.config.pictures.count), len(source))
    tok = self.tokenizer
    layer = self.config.pictures.layer % self.model_config.decoder_layers
    images = {}
    for n in range(count):
      source_ids = [int(i) for i in source[n] if i != tok.pad_id]
      target_out = outputs[n] + [tok.eos_id]
      target_in = [tok.bos_id] + outputs[n]
      _, weights = record_attention_weights(model, lambda: model(jnp.asarray([source_ids]), jnp.asarray([target_in])))
      source_labels, in_labels, out_labels = (pictures.token_labels(tok, ids)
                                              for ids in (source_ids, target_in, target_out))
      cross = weights[f'decoder_blocks/{layer}/cross_attention'][0]
      self_attention = weights[f'decoder_blocks/{layer}/self_attention'][0]
      panels = [
          [pictures.Panel(np.asarray(cross[h]), out_labels, source_labels, f'cross-attention, head {h + 1}',
                          'source', 'predicted target') for h in range(cross.shape[0])],
          [pictures.Panel(np.asarray(self_attention[h]), out_labels, in_labels, f'self-attention, head {h + 1}',
                          'decoder input', 'predicted target') for h in range(self_attention.shape[0])]]
      path = os.path.join(workdir, f'attention_{n}.png')
      pictures.plot_attention(path, panels, f'Decoder layer {layer + 1}: "{self.prepared.evaluation[n][0]}" -> '
                                            f'"{tok.decode(outputs[n])}"')
      images[f'attention/sentence_{n}'] = path
    return images


def max_decode_len(max_len_ratio: float, source_len: int) -> int:
  """Longest output decoding may produce for a source of `source_len` tokens."""
  return int(max_len_ratio * source_len) + MAX_LEN_OFFSET
