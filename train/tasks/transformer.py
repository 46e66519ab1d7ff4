"""Translation with the encoder-decoder Transformer (models/transformer.py).

Data: data/translation.py (numbers_en_fr, tsv:<path>, tfds:<name>), one joint subword vocabulary
saved in the workdir, examples {'source' [S], 'target_in' [T], 'target_out' [T]} with
S = T = data.seq_len. Training batches group examples of similar length (windows of
BUCKET_WINDOW batches sorted by length) and cut the padding to a multiple of data.bucket_width,
so few shapes are compiled and little compute goes to padding.

Loss: label-smoothed cross-entropy (train.label_smoothing) with teacher forcing; loss and
accuracy are averaged over the real target tokens (target_out != pad).

After training, `evaluate` translates the test split with greedy and beam search
(models/beam_search.py through the decoder's KV cache), reports sacreBLEU on detokenized text,
teacher-forced token accuracy and exact matches, prints a few translations, writes all of them
to translations.json and draws attention heatmaps (cross-attention and decoder self-attention,
one panel per head of `pictures.layer`) as PNG files returned under 'images'.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import sources, translation
from models import beam_search
from models.attention import default_attention_implementation, record_attention_weights
from models.transformer import Transformer, TransformerConfig, translate
from train import pictures
from train import task as task_lib
from train.losses import lm_loss

BUCKET_WINDOW = 16  # batches sorted together by length
SHOWN_TRANSLATIONS = 5
MAX_LEN_OFFSET = 10  # outputs may have decode.max_len_ratio * source length + this many tokens


def trim(batch: dict[str, np.ndarray], pad_id: int, width: int) -> dict[str, np.ndarray]:
  """Drop trailing all-padding columns, keeping source and target lengths multiples of `width`."""
  def kept_length(array):
    used = int((array != pad_id).sum(axis=1).max())
    return min(array.shape[1], max(width, -(-used // width) * width))
  source, target = kept_length(batch['source']), kept_length(batch['target_out'])
  return {'source': batch['source'][:, :source], 'target_in': batch['target_in'][:, :target],
          'target_out': batch['target_out'][:, :target]}


class BucketedBatches(grain.MapDataset):
  """Batches of similar-length examples: each window of BUCKET_WINDOW batches of shuffled
  examples is sorted by length, cut into batches, and those are served in a seeded random order.

  Random access like any MapDataset (batch i needs only window i // BUCKET_WINDOW), so the
  trainer's checkpointed iterator position stays valid.
  """

  def __init__(self, windows: grain.MapDataset, batch_size: int, pad_id: int, width: int, seed: int):
    super().__init__(windows)
    self._windows, self._batch_size, self._pad_id, self._width, self._seed = windows, batch_size, pad_id, width, seed
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
    return trim({k: v[rows] for k, v in window.items()}, self._pad_id, self._width)


class Task(task_lib.Task):

  # ------------------------------------------------------------------ data
  def prepare(self, workdir):
    data = self.config.data
    self.splits = translation.load_pairs(data, self.config.seed)
    self.tokenizer = translation.get_tokenizer(data, workdir, self.splits.train)
    encode = lambda pairs, split: translation.encode_pairs(self.tokenizer, pairs, data.seq_len, data.seq_len,
                                                           drop_long=split == 'train', split=split)[0]
    train = encode(self.splits.train, 'train')
    if not len(train['source']):
      raise sources.DataError(f'No training pair fits in data.seq_len={data.seq_len} tokens; raise data.seq_len.')
    as_dataset = translation.as_dataset
    return task_lib.Datasets(train=as_dataset(train), eval=as_dataset(encode(self.splits.validation, 'valid')),
                             test=as_dataset(encode(self.splits.test, 'test')))

  def train_batches(self, examples, batch_size, seed):
    width = self.config.data.bucket_width
    if not width:
      return super().train_batches(examples, batch_size, seed)
    windows = examples.shuffle(seed=seed).repeat().batch(batch_size * BUCKET_WINDOW, drop_remainder=True)
    return BucketedBatches(windows, batch_size, self.tokenizer.pad_id, width, seed)

  # ------------------------------------------------------------------ model
  def model_config(self) -> TransformerConfig:
    config = TransformerConfig.from_config(self.config.model, self.tokenizer.vocab_size, self.tokenizer.pad_id,
                                           max_len=self.max_decode_len(self.config.data.seq_len))
    if config.attention == 'auto':
      config = dataclasses.replace(config, attention=default_attention_implementation())
    return config

  def max_decode_len(self, source_len: int) -> int:
    """Longest output decoding may produce for a source of `source_len` tokens."""
    return int(self.config.decode.max_len_ratio * source_len) + MAX_LEN_OFFSET

  def build_model(self, rngs):
    return Transformer(self.model_config(), rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    logits = model(batch['source'], batch['target_in'], deterministic=deterministic)
    return lm_loss(logits, batch['target_out'], batch['target_out'] != self.tokenizer.pad_id,
                   self.config.train.label_smoothing)

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    shape = (batch_size, self.config.data.seq_len)
    return {name: rng.integers(4, self.tokenizer.vocab_size, shape, dtype=np.int32)
            for name in ('source', 'target_in', 'target_out')}

  def flops_per_token(self):
    # 6 x parameters per target token (the encoder runs once per pair, about as long as the target).
    config = self.model_config()
    width, mlp = config.width, config.mlp_dim
    per_layer = 4 * width * width + 2 * width * mlp
    matmul = config.encoder_layers * per_layer + config.decoder_layers * (per_layer + 4 * width * width)
    return 6.0 * (matmul + width * config.vocab_size)

  # ------------------------------------------------------------------ after training
  def translate(self, model, source: np.ndarray, beam_size: int) -> tuple[list[list[int]], list[str]]:
    """[N, S] padded source ids -> (N output id lists without EOS, N detokenized translations)."""
    tok, decode = self.tokenizer, self.config.decode
    batch = self.config.train.eval_batch_size or self.config.train.batch_size
    outputs = []
    for start in range(0, len(source), batch):
      chunk = source[start:start + batch]
      padded = np.full((batch, chunk.shape[1]), tok.pad_id, np.int32)  # one compiled shape
      padded[:len(chunk)] = chunk
      tokens, _ = translate(model, jnp.asarray(padded), bos_id=tok.bos_id, eos_id=tok.eos_id, beam_size=beam_size,
                            alpha=float(decode.length_penalty), max_len_ratio=float(decode.max_len_ratio),
                            max_len_offset=MAX_LEN_OFFSET)
      outputs.extend(beam_search.strip(np.asarray(tokens)[:len(chunk)], tok.eos_id))
    return outputs, [tok.decode(ids) for ids in outputs]

  def token_accuracy(self, model, examples) -> dict[str, float]:
    """Teacher-forced loss and accuracy over the real target tokens of `examples`."""
    step = nnx.jit(lambda m, b: self.loss(m, b, deterministic=True)[1])
    batch_size = self.config.train.eval_batch_size or self.config.train.batch_size
    totals = {}
    for start in range(0, len(examples), batch_size):
      rows = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
      rows += [rows[-1] | {'target_out': np.full_like(rows[-1]['target_out'], self.tokenizer.pad_id)}] * (
          batch_size - len(rows))  # fillers have no real target token, so they count for nothing
      metrics = step(model, {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]})
      for name, (total, count) in jax.device_get(metrics).items():
        s, c = totals.get(name, (0.0, 0.0))
        totals[name] = (s + float(total), c + float(count))
    return {name: s / max(c, 1.0) for name, (s, c) in totals.items()}

  def evaluate(self, model, datasets, workdir):
    import sacrebleu
    test = datasets.test
    if test is None or not len(test):
      return {}
    source = np.stack([test[i]['source'] for i in range(len(test))])
    pairs = self.splits.test
    references = [target for _, target in pairs]
    results, translations = {}, {}
    for name, beam in (('greedy', 1), ('beam', int(self.config.decode.beam_size))):
      _, translations[name] = self.translate(model, source, beam)
      results[f'test/bleu_{name}'] = sacrebleu.corpus_bleu(translations[name], [references]).score
      results[f'test/exact_match_{name}'] = float(np.mean([h == r for h, r in zip(translations[name], references)]))
    results['test/bleu'] = results['test/bleu_beam']
    results.update({f'test/{k}': v for k, v in self.token_accuracy(model, test).items()})
    with open(os.path.join(workdir, 'translations.json'), 'w') as f:
      json.dump([{'source': s, 'reference': r, 'greedy': g, 'beam': b} for (s, r), g, b in
                 zip(pairs, translations['greedy'], translations['beam'])], f, indent=1, ensure_ascii=False)
    print(f'Test ({len(references)} pairs): BLEU {results["test/bleu"]:.2f} (beam {self.config.decode.beam_size}), '
          f'{results["test/bleu_greedy"]:.2f} (greedy); exact match {results["test/exact_match_beam"]:.3f}; '
          f'token accuracy {results["test/accuracy"]:.4f}', flush=True)
    for (s, r), b in list(zip(pairs, translations['beam']))[:SHOWN_TRANSLATIONS]:
      print(f'  {s}\n    -> {b}\n    (reference: {r})', flush=True)
    images = self.draw_attention(model, source, workdir)
    if images:
      results['images'] = images
      print('Attention heatmaps: ' + ', '.join(images.values()), flush=True)
    return results

  def draw_attention(self, model, source: np.ndarray, workdir: str) -> dict[str, str]:
    """PNG heatmaps of the first `pictures.count` test sentences; {image name: path}."""
    count = min(int(self.config.pictures.count), len(source))
    if not count:
      return {}
    tok = self.tokenizer
    layer = self.config.pictures.layer % self.config.model.decoder_layers
    images = {}
    for n in range(count):
      source_ids = [int(i) for i in source[n] if i != tok.pad_id]
      output, text = self.translate(model, source[n:n + 1], int(self.config.decode.beam_size))
      target_out = output[0] + [tok.eos_id]
      target_in = [tok.bos_id] + output[0]
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
      pictures.plot_attention(path, panels, f'Decoder layer {layer + 1}: "{self.splits.test[n][0]}" -> "{text[0]}"')
      images[f'attention/sentence_{n}'] = path
    return images

  def predict(self, model, lines):
    seq_len = self.config.data.seq_len
    arrays, _ = translation.encode_pairs(self.tokenizer, [(line, '') for line in lines], seq_len, seq_len,
                                         drop_long=False)
    return self.translate(model, arrays['source'], int(self.config.decode.beam_size))[1]
