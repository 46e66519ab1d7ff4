"""Translation with the encoder-decoder Transformer (models/transformer.py).

Data and evaluation are shared with the RNN seq2seq family (train/translation.py). Training
batches group examples of similar length (windows of BUCKET_WINDOW batches sorted by length) and
cut the padding of source and target to one shared length from a short geometric list
(`bucket_lengths`: 16, 24, 32, 48, 64, ... up to data.seq_len), so that a whole run compiles the
train step a handful of times (each distinct batch shape is one XLA compilation) and little compute
goes to padding. Cutting source and target separately to multiples of 8, as before, gave up to
(seq_len / 8)^2 shapes: hundreds at seq_len 128, each compiled.

Loss: label-smoothed cross-entropy (train.label_smoothing) with teacher forcing; loss and
accuracy are averaged over the real target tokens (target_out != pad).

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
from models.transformer import Transformer, TransformerConfig, translate
from train import pictures
from train.losses import lm_loss
from train.translation import TranslationTask

BUCKET_WINDOW = 16  # batches sorted together by length
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


class BucketedBatches(grain.MapDataset):
  """Batches of similar-length examples: each window of BUCKET_WINDOW batches of shuffled
  examples is sorted by length, cut into batches, and those are served in a seeded random order.

  Random access like any MapDataset (batch i needs only window i // BUCKET_WINDOW), so the
  trainer's checkpointed iterator position stays valid.
  """

  def __init__(self, windows: grain.MapDataset, batch_size: int, pad_id: int, buckets: list[int], seed: int):
    super().__init__(windows)
    self._windows, self._batch_size, self._pad_id, self._buckets, self._seed = windows, batch_size, pad_id, buckets, seed
    # Batches are read in order, so one loaded window serves BUCKET_WINDOW consecutive batches.
    self._sorted_window = functools.lru_cache(maxsize=2)(self._load_sorted_window)

  def __len__(self):
    return len(self._windows) * BUCKET_WINDOW

  def _load_sorted_window(self, window_index: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(window examples sorted by length, seeded order in which its batches are served)."""
    window = self._windows[window_index]
    lengths = np.maximum((window['source'] != self._pad_id).sum(1), (window['target_out'] != self._pad_id).sum(1))
    order = np.argsort(lengths, kind='stable')
    return {k: v[order] for k, v in window.items()}, np.random.default_rng((self._seed, window_index)).permutation(
        BUCKET_WINDOW)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    window_index, position = divmod(index, BUCKET_WINDOW)
    window, slots = self._sorted_window(window_index)
    rows = slice(slots[position] * self._batch_size, (slots[position] + 1) * self._batch_size)
    return trim({k: v[rows] for k, v in window.items()}, self._pad_id, self._buckets)


def validate(config):
  if not -config.model.decoder_layers <= config.pictures.layer < config.model.decoder_layers:
    raise ConfigError(f'config.pictures.layer={config.pictures.layer} is not a decoder layer '
                      f'(model.decoder_layers={config.model.decoder_layers}).')


class Task(TranslationTask):
  model_config_class = TransformerConfig

  def resolved_from_tokenizer(self, tokenizer):
    return {'vocab_size': tokenizer.vocab_size, 'pad_id': tokenizer.pad_id,
            'max_len': max_decode_len(self.config.decode.max_len_ratio, self.config.data.seq_len)}

  def train_batches(self, examples, batch_size, seed, process_index, process_count):
    smallest = self.config.data.min_bucket_len
    if not smallest:
      return super().train_batches(examples, batch_size, seed, process_index, process_count)
    buckets = bucket_lengths(self.config.data.seq_len, smallest)
    # Every process builds the same global batches and keeps its rows of each.
    windows = examples.shuffle(seed=seed).repeat().batch(batch_size * BUCKET_WINDOW, drop_remainder=True)
    local = batch_size // process_count
    rows = slice(process_index * local, (process_index + 1) * local)
    return BucketedBatches(windows, batch_size, self.tokenizer.pad_id, buckets, seed).map(
        lambda batch: {k: v[rows] for k, v in batch.items()})

  # ------------------------------------------------------------------ model
  def build_model(self, rngs):
    return Transformer(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    logits = model(batch['source'], batch['target_in'], deterministic=deterministic)
    return lm_loss(logits, batch['target_out'], batch['target_out'] != self.model_config.pad_id,
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
      pictures.plot_attention(path, panels, f'Decoder layer {layer + 1}: "{self.test_pairs[n][0]}" -> '
                                            f'"{tok.decode(outputs[n])}"')
      images[f'attention/sentence_{n}'] = path
    return images


def max_decode_len(max_len_ratio: float, source_len: int) -> int:
  """Longest output decoding may produce for a source of `source_len` tokens."""
  return int(max_len_ratio * source_len) + MAX_LEN_OFFSET
