"""RNN sequence-to-sequence translation, with or without Bahdanau attention (D2L ch. 10.7, 11.4).

Data: data/translation.py (numbers_en_fr, tsv:<path>, tfds:<name>), one joint vocabulary, examples
{'source' [S], 'target_in' [T], 'target_out' [T]} padded with the pad id (S = T = data.seq_len).
`data.min_number` > 0 keeps only numbers_en_fr pairs whose English number is at least that large
(every split), the long-input setting where the fixed context vector of the plain encoder-decoder
is the bottleneck that attention removes.

Loss: token cross-entropy over the real target positions only (target_out != pad). After
training, `evaluate` translates the test split with greedy and beam search (models/beam_search.py),
scores both with sacreBLEU, writes the translations, and for the Bahdanau model draws the
attention weights (target x source) of a few test sentences.
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import sources
from data import translation
from models import beam_search
from models.seq2seq import Seq2Seq, Seq2SeqConfig
from train import task as task_lib
from train.losses import lm_loss

HEATMAPS = 3  # test sentences drawn for the Bahdanau model

_SMALL = {w: i for i, w in enumerate('zero one two three four five six seven eight nine ten eleven twelve thirteen '
                                     'fourteen fifteen sixteen seventeen eighteen nineteen'.split())}
_TENS = {w: 10 * i for i, w in enumerate('twenty thirty forty fifty sixty seventy eighty ninety'.split(), 2)}
_IRREGULAR_ORDINALS = {'zeroth': 'zero', 'first': 'one', 'second': 'two', 'third': 'three', 'fifth': 'five',
                       'eighth': 'eight', 'ninth': 'nine', 'twelfth': 'twelve'}


def english_number(text: str) -> int | None:
  """The value of English number words (num2words style, cardinal or ordinal), None for other text.

  'one hundred and twenty-three thousand, four hundred and fifty-sixth' -> 123456. Years such as
  'nineteen ninety-nine' are not sums of their words and come out far below their value (118).
  """
  total = current = 0
  for word in re.split(r'[\s,-]+', text.lower().strip()):
    if word in ('', 'and'):
      continue
    word = _IRREGULAR_ORDINALS.get(word, word)
    if word.endswith('ieth'):  # twentieth -> twenty
      word = word[:-4] + 'y'
    elif word.endswith('th') and word not in _SMALL:
      word = word[:-2]
    if word in _SMALL:
      current += _SMALL[word]
    elif word in _TENS:
      current += _TENS[word]
    elif word == 'hundred':
      current *= 100
    elif word == 'thousand':
      total, current = total + current * 1000, 0
    else:
      return None
  return total + current


def keep_numbers_at_least(pairs, minimum: int):
  return [(s, t) for s, t in pairs if (english_number(s) or 0) >= minimum]


def translate_batch(model: Seq2Seq, source: jax.Array, *, bos_id: int, eos_id: int, pad_id: int, max_len: int,
                    beam_size: int, alpha: float, max_len_ratio: float) -> jax.Array:
  """source [B, S] (padded) -> [B, max_len] output tokens, EOS-terminated (greedy when beam_size == 1)."""
  source_valid = source != pad_id
  state = model.encode(source, source_valid)
  limits = beam_search.max_lengths_for(source_valid.sum(-1), max_len_ratio, 10, max_len)
  bos = jnp.full((source.shape[0],), bos_id, jnp.int32)
  if beam_size == 1:
    return beam_search.greedy_search(model.decode_step, state, bos, max_len=max_len, eos_id=eos_id, pad_id=pad_id,
                                     max_lengths=limits).tokens
  result = beam_search.beam_search(model.decode_step, state, bos, beam_size=beam_size, max_len=max_len,
                                   eos_id=eos_id, pad_id=pad_id, alpha=alpha, max_lengths=limits)
  return result.tokens[:, 0]


_translate = nnx.jit(translate_batch, static_argnames=('bos_id', 'eos_id', 'pad_id', 'max_len', 'beam_size', 'alpha',
                                                       'max_len_ratio'))


class Task(task_lib.Task):

  def prepare(self, workdir):
    data = self.config.data
    splits = translation.load_pairs(data, self.config.seed)
    if data.min_number:
      if sources.parse_source(data.source)[0] != 'numbers_en_fr':
        raise sources.DataError(f'data.min_number={data.min_number} filters numbers_en_fr pairs only; '
                                f'data.source is {data.source!r}. Set data.min_number=0.')
      splits = translation.Splits(*(keep_numbers_at_least(pairs, data.min_number)
                                    for pairs in (splits.train, splits.validation, splits.test)))
    self.tokenizer = translation.get_tokenizer(data, workdir, splits.train)
    encode = lambda pairs, split: translation.encode_pairs(self.tokenizer, pairs, data.seq_len, data.seq_len,
                                                           drop_long=split == 'train', split=split)
    train, _ = encode(splits.train, 'train')
    validation, _ = encode(splits.validation, 'valid')
    test, _ = encode(splits.test, 'test')
    self.test_pairs = splits.test
    as_dataset = translation.as_dataset
    return task_lib.Datasets(train=as_dataset(train), eval=as_dataset(validation), test=as_dataset(test))

  def model_config(self) -> Seq2SeqConfig:
    vocab = self.tokenizer.vocab_size
    return Seq2SeqConfig.from_config(self.config.model, vocab, vocab)

  def build_model(self, rngs):
    return Seq2Seq(self.model_config(), rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    pad = self.tokenizer.pad_id
    logits, _ = model(batch['source'], batch['source'] != pad, batch['target_in'], deterministic=deterministic)
    return lm_loss(logits, batch['target_out'], batch['target_out'] != pad, self.config.train.label_smoothing)

  def summarize(self, metrics):
    return {**metrics, 'eval/perplexity': float(np.exp(min(metrics['eval/loss'], 50.0)))}

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    shape = (batch_size, self.config.data.seq_len)
    return {name: rng.integers(4, self.tokenizer.vocab_size, shape, dtype=np.int32)
            for name in ('source', 'target_in', 'target_out')}

  # ------------------------------------------------------------------ after training
  def translate_ids(self, model, source: np.ndarray, beam_size: int) -> list[list[int]]:
    """[N, S] padded source ids -> N output id lists (without EOS)."""
    tok, decode = self.tokenizer, self.config.decode
    batch = self.config.train.eval_batch_size or self.config.train.batch_size
    outputs = []
    for start in range(0, len(source), batch):
      chunk = source[start:start + batch]
      padded = np.full((batch, chunk.shape[1]), tok.pad_id, np.int32)  # one compiled shape
      padded[:len(chunk)] = chunk
      tokens = _translate(model, jnp.asarray(padded), bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                          max_len=self.config.data.seq_len, beam_size=beam_size,
                          alpha=float(decode.length_penalty), max_len_ratio=float(decode.max_len_ratio))
      outputs.extend(beam_search.strip(np.asarray(tokens)[:len(chunk)], tok.eos_id))
    return outputs

  def translate(self, model, source: np.ndarray, beam_size: int) -> list[str]:
    return [self.tokenizer.decode(ids) for ids in self.translate_ids(model, source, beam_size)]

  def evaluate(self, model, datasets, workdir):
    import sacrebleu
    test = datasets.test
    source = np.stack([test[i]['source'] for i in range(len(test))])
    references = [t for _, t in self.test_pairs]
    results, translations, ids = {}, {}, {}
    for name, beam in (('greedy', 1), ('beam', int(self.config.decode.beam_size))):
      ids[name] = self.translate_ids(model, source, beam)
      translations[name] = [self.tokenizer.decode(row) for row in ids[name]]
      results[f'test_bleu_{name}'] = sacrebleu.corpus_bleu(translations[name], [references]).score
      results[f'test_exact_match_{name}'] = float(np.mean([h == r for h, r in zip(translations[name], references)]))
    with open(os.path.join(workdir, 'translations.json'), 'w') as f:
      json.dump([{'source': s, 'reference': r, 'greedy': g, 'beam': b} for (s, r), g, b in
                 zip(self.test_pairs, translations['greedy'], translations['beam'])], f, indent=1, ensure_ascii=False)
    print(f'Test BLEU ({len(references)} pairs): greedy {results["test_bleu_greedy"]:.2f}, beam '
          f'{results["test_bleu_beam"]:.2f}; exact match greedy {results["test_exact_match_greedy"]:.3f}, beam '
          f'{results["test_exact_match_beam"]:.3f}', flush=True)
    for (s, r), b in list(zip(self.test_pairs, translations['beam']))[:3]:
      print(f'  {s}\n    -> {b}\n    reference {r}', flush=True)
    if model.attention is not None and len(source):
      path = os.path.join(workdir, 'attention.png')
      longest = np.argsort(-(source != self.tokenizer.pad_id).sum(-1), kind='stable')[:HEATMAPS]
      self.plot_attention(model, source[longest], [ids['greedy'][i] for i in longest], path)
      results['images'] = {'attention': path}
    return results

  def attention_maps(self, model, source: np.ndarray, outputs: list[list[int]]):
    """Per sentence of source [N, S] and its output ids (without EOS): (source tokens, output tokens
    with EOS, weights [output, source]) from re-running the decoder over the output with teacher forcing."""
    tok, length = self.tokenizer, self.config.data.seq_len
    outputs = [list(ids[:length - 1]) + [tok.eos_id] for ids in outputs]
    target_in = np.full((len(source), length), tok.pad_id, np.int32)
    for row, output in enumerate(outputs):
      target_in[row, :len(output)] = [tok.bos_id] + output[:-1]
    _, weights = model(jnp.asarray(source), jnp.asarray(source != tok.pad_id), jnp.asarray(target_in))
    # Decoded pieces read as text (byte-level BPE ids do not); special tokens and partial
    # characters fall back to the vocabulary entry.
    def label(i):
      piece = tok.decode([int(i)]).strip()
      return piece if piece and piece.isprintable() else tok.id_to_token(int(i))

    maps = []
    for row, output in enumerate(outputs):
      source_ids = source[row][source[row] != tok.pad_id]
      maps.append(([label(i) for i in source_ids], [label(i) for i in output],
                   np.asarray(weights[row, :len(output), :len(source_ids)])))
    return maps

  def plot_attention(self, model, source: np.ndarray, outputs: list[list[int]], path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    maps = self.attention_maps(model, source, outputs)
    figure, axes = plt.subplots(1, len(maps), figsize=(6 * len(maps), 5.5), squeeze=False)
    for ax, (source_tokens, output_tokens, weights) in zip(axes[0], maps):
      ax.imshow(weights, cmap='Reds', vmin=0.0, vmax=1.0)
      ax.set_xticks(range(len(source_tokens)), source_tokens, rotation=90, fontsize=8)
      ax.set_yticks(range(len(output_tokens)), output_tokens, fontsize=8)
      ax.set_xlabel('source (keys)')
      ax.set_ylabel('output (queries)')
    figure.suptitle('Bahdanau attention weights')
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

  def predict(self, model, lines):
    tok = self.tokenizer
    arrays, _ = translation.encode_pairs(tok, [(line, '') for line in lines], self.config.data.seq_len,
                                         self.config.data.seq_len, drop_long=False)
    return self.translate(model, arrays['source'], int(self.config.decode.beam_size))
