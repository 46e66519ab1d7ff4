"""RNN sequence-to-sequence translation, with or without Bahdanau attention (D2L ch. 10.7, 11.4).

Data and evaluation are shared with the Transformer family (train/translation.py).
`data.min_number` > 0 keeps only numbers_en_fr pairs whose English number is at least that large
(every split; data/translation.py), the long-input setting where the fixed context vector of the
plain encoder-decoder is the bottleneck that attention removes.

Loss: token cross-entropy over the real target positions only (target_out != pad). After the
shared evaluation, the Bahdanau model's attention weights (output x source) of the longest test
sentences are drawn.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from errors import ConfigError
from models.seq2seq import ATTENTION_TYPES, Seq2Seq, Seq2SeqConfig, translate
from train import pictures
from train.losses import example_weights, lm_loss
from train.translation import TranslationTask

HEATMAPS = 3  # test sentences drawn for the Bahdanau model

def validate(config):
  if config.model.attention_type not in ATTENTION_TYPES:
    raise ConfigError(f'config.model.attention_type={config.model.attention_type!r}: use one of {ATTENTION_TYPES}.')
  if config.data.min_number < 0:
    raise ConfigError(f'config.data.min_number={config.data.min_number} must be >= 0.')


class Task(TranslationTask):
  model_config_class = Seq2SeqConfig

  @classmethod
  def resolved_from_tokenizer(cls, config, tokenizer):
    return {'src_vocab_size': tokenizer.vocab_size, 'tgt_vocab_size': tokenizer.vocab_size}

  def build_model(self, rngs):
    return Seq2Seq(self.model_config, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    pad = self.tokenizer.pad_id
    logits, _ = model(batch['source'], batch['source'] != pad, batch['target_in'], deterministic=deterministic)
    return lm_loss(logits, batch['target_out'], example_weights(batch, batch['target_out'] != pad),
                   self.config.train.label_smoothing, z_loss=self.config.train.z_loss)

  def translate_batch(self, model, source, beam_size):
    tok, decode = self.tokenizer, self.config.decode
    tokens, _ = translate(model, source, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                          max_len=self.config.data.seq_len, beam_size=beam_size, alpha=float(decode.length_penalty),
                          max_len_ratio=float(decode.max_len_ratio))
    return tokens

  # ------------------------------------------------------------------ pictures
  def attention_images(self, model, source, outputs, workdir, texts):
    del texts  # each panel is labelled with its tokens
    if model.attention is None or not len(source):
      return {}
    longest = np.argsort(-(source != self.tokenizer.pad_id).sum(-1), kind='stable')[:HEATMAPS]
    panels = [[pictures.Panel(weights, output_tokens, source_tokens, f'test sentence {int(i) + 1}', 'source',
                              'output')
               for i, (source_tokens, output_tokens, weights) in zip(
                   longest, self.attention_maps(model, source[longest], [outputs[i] for i in longest]))]]
    path = os.path.join(workdir, 'attention.png')
    pictures.plot_attention(path, panels, 'Bahdanau attention weights')
    return {'attention': path}

  def attention_maps(self, model, source: np.ndarray, outputs: list[list[int]]):
    """Per sentence of source [N, S] and its output ids (without EOS): (source labels, output labels
    with EOS, weights [output, source]) from re-running the decoder over the output with teacher forcing."""
    tok, length = self.tokenizer, self.config.data.seq_len
    outputs = [list(ids[:length - 1]) + [tok.eos_id] for ids in outputs]
    target_in = np.full((len(source), length), tok.pad_id, np.int32)
    for row, output in enumerate(outputs):
      target_in[row, :len(output)] = [tok.bos_id] + output[:-1]
    weights = jax.device_get(teacher_forced_attention(model, jnp.asarray(source), jnp.asarray(source != tok.pad_id),
                                                      jnp.asarray(target_in)))
    maps = []
    for row, output in enumerate(outputs):
      source_ids = source[row][source[row] != tok.pad_id]
      maps.append((pictures.token_labels(tok, source_ids), pictures.token_labels(tok, output),
                   np.asarray(weights[row, :len(output), :len(source_ids)])))
    return maps


@nnx.jit
def teacher_forced_attention(model: Seq2Seq, source: jax.Array, source_mask: jax.Array,
                             target_in: jax.Array) -> jax.Array:
  """[B, S] source and its mask, [B, T] BOS + target -> [B, T, S] attention weights (one compiled
  program; run eagerly, the recurrent forward is a dispatch and a compilation per op)."""
  return model(source, source_mask, target_in)[1]
