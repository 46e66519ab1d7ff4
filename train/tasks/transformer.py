"""Translation with the encoder-decoder Transformer (models/transformer.py).

Data and evaluation are shared with the RNN seq2seq family (train/translation.py). Training
batches (data/batching.py):

  data.packing=True   `batching.Packed`: several pairs per row with segment ids; one batch shape.
  data.min_bucket_len `batching.LengthBuckets`: one pair per row, each batch cut to one shared
                      source/target length of a short geometric list, so the train step compiles
                      a handful of times (cutting each side to multiples of 8 would give up to
                      (seq_len / 8)^2 shapes: hundreds at seq_len 128).
Neither: `batching.Shuffled`, pairs padded to data.seq_len. Evaluation and decoding are never
packed.

Loss: label-smoothed cross-entropy (train.label_smoothing) with teacher forcing; loss and
accuracy are averaged over the real target tokens (target_out != pad), packed or not.

After the shared evaluation (BLEU with greedy and beam search through the decoder's KV cache),
attention heatmaps (cross-attention and decoder self-attention, one panel per head of
`pictures.layer`) of the first test sentences are written as PNG files.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from errors import ConfigError
from data import batching
from models.attention import record_attention_weights
from models.transformer import Transformer, TransformerConfig, translate
from train import pictures
from train.losses import example_weights, lm_loss
from train.translation import TranslationTask

MAX_LEN_OFFSET = 10  # outputs may have decode.max_len_ratio * source length + this many tokens


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

  def batch_plan(self):
    data, pad = self.config.data, self.tokenizer.pad_id
    if data.packing:
      return batching.Packed(pad)
    if data.min_bucket_len:
      return batching.LengthBuckets(pad, data.seq_len, data.min_bucket_len)
    return batching.Shuffled()

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
                   self.config.train.label_smoothing, z_loss=self.config.train.z_loss)

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
  def attention_images(self, model, source, outputs, workdir, texts):
    """Heatmaps of the first `pictures.count` decoded test sentences and their beam-search translations."""
    count = min(int(self.config.pictures.count), len(source))
    if not count:
      return {}
    tok = self.tokenizer
    layer = self.config.pictures.layer % self.model_config.decoder_layers
    # All sentences in one compiled forward of one shape per run: the sources as the test chunk pads
    # them [count, S], the decoder inputs (BOS + output) padded to the T_max `translate` decodes to.
    # Neither padding moves a real weight: padded sources are masked, and the decoder is causal.
    longest = max(min(self.model_config.max_len, max_decode_len(float(self.config.decode.max_len_ratio),
                                                                source.shape[1])),
                  *(len(outputs[n]) + 1 for n in range(count)))
    target_in = np.full((count, longest), tok.pad_id, np.int32)
    for n in range(count):
      target_in[n, :len(outputs[n]) + 1] = [tok.bos_id] + outputs[n]
    weights = jax.device_get(decoder_attention_weights(model, jnp.asarray(source[:count]), jnp.asarray(target_in)))
    images = {}
    for n in range(count):
      source_ids = [int(i) for i in source[n] if i != tok.pad_id]
      target_out = outputs[n] + [tok.eos_id]
      source_labels, in_labels, out_labels = (pictures.token_labels(tok, ids)
                                              for ids in (source_ids, target_in[n, :len(target_out)], target_out))
      rows, columns = len(target_out), len(source_ids)
      cross = weights[f'decoder_blocks/{layer}/cross_attention'][n, :, :rows, :columns]
      self_attention = weights[f'decoder_blocks/{layer}/self_attention'][n, :, :rows, :rows]
      panels = [
          [pictures.Panel(cross[h], out_labels, source_labels, f'cross-attention, head {h + 1}',
                          'source', 'predicted target') for h in range(cross.shape[0])],
          [pictures.Panel(self_attention[h], out_labels, in_labels, f'self-attention, head {h + 1}',
                          'decoder input', 'predicted target') for h in range(self_attention.shape[0])]]
      path = os.path.join(workdir, f'attention_{n}.png')
      pictures.plot_attention(path, panels, f'Decoder layer {layer + 1}: "{texts[n]}" -> '
                                            f'"{tok.decode(outputs[n])}"')
      images[f'attention/sentence_{n}'] = path
    return images


@nnx.jit
def decoder_attention_weights(model: Transformer, source: jax.Array, target_in: jax.Array) -> dict[str, jax.Array]:
  """[B, S] source, [B, T] BOS + target -> {'decoder_blocks/i/cross_attention': [B, H, T, S],
  'decoder_blocks/i/self_attention': [B, H, T, T], encoder blocks' likewise} with teacher forcing."""
  return record_attention_weights(model, lambda: model(source, target_in))[1]


def max_decode_len(max_len_ratio: float, source_len: int) -> int:
  """Longest output decoding may produce for a source of `source_len` tokens."""
  return int(max_len_ratio * source_len) + MAX_LEN_OFFSET
