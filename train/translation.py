"""What the two translation families share: data, evaluation and prediction.

`TranslationTask` is the base of `train/tasks/transformer.py` and `train/tasks/seq2seq.py`. A
family adds its model (`build_model`, `loss`, `translate_batch`) and, optionally, attention
pictures.

Data: data/translation.py (numbers_en_fr, tsv:<path>, tfds:<name>), one joint vocabulary saved in
the workdir, examples {'source' [S], 'target_in' [T], 'target_out' [T]} padded with the pad id
(S = T = data.seq_len); training pairs longer than that are dropped, held-out ones truncated.

Evaluation after training, on the test split: sacreBLEU of the detokenized greedy and beam-search
translations of `train.final_decode_examples` test pairs (`test/bleu_greedy`, `test/bleu_beam`,
and `test/bleu` = beam), their exact matches, and the teacher-forced loss and token accuracy over
the real target tokens of `train.final_eval_examples` of them (`test/loss`, `test/accuracy`); a
larger split is scored at evenly spaced pairs (train/evaluation.py `final_indices`). Every
translation goes to `translations.json`.
"""
from __future__ import annotations

import dataclasses
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import storage
from data import translation
from models import decoding
from train import evaluation
from train import task as task_lib

SHOWN_TRANSLATIONS = 5
EVAL_CHUNK = 4096  # test pairs translated and scored at a time


class TranslationTask(task_lib.Task):
  """A translation family; subclasses define the model, `loss` and `translate_batch`."""
  final_test = 'decoded'  # the final evaluation decodes the test split (train/evaluation.py final_counts)

  # ------------------------------------------------------------------ data
  @classmethod
  def prepare(cls, config, workdir, platform=None):
    """The encoded splits, read from example caches (data/translation.py, pair_datasets) built when
    missing; `family_data` is the test split's (source, reference) texts, read as they are scored."""
    tokenizer, splits, test_pairs, caches = translation.pair_datasets(config.data, workdir, config.seed,
                                                                      jax.process_index(), jax.process_count())
    datasets = task_lib.Datasets(train=grain.MapDataset.source(splits['train']),
                                 eval=grain.MapDataset.source(splits['valid']),
                                 test=grain.MapDataset.source(splits['test']), caches=caches)
    return dataclasses.replace(cls.without_data(config, tokenizer, platform), datasets=datasets,
                               family_data=test_pairs)

  def example_batch(self, batch_size):
    rng = np.random.default_rng(0)
    shape = (batch_size, self.config.data.seq_len)
    return {name: rng.integers(4, self.tokenizer.vocab_size, shape, dtype=np.int32)
            for name in ('source', 'target_in', 'target_out')}

  def count_tokens(self, batch):
    """Target tokens, as translation speeds are quoted (the source side is read once per pair)."""
    targets = batch['target_out']
    return targets.size, (targets != self.tokenizer.pad_id).sum()

  def summarize(self, metrics):
    return {**metrics, 'eval/perplexity': float(np.exp(min(metrics['eval/loss'], 50.0)))}

  # ------------------------------------------------------------------ decoding
  def translate_batch(self, model, source: jax.Array, beam_size: int) -> jax.Array:
    """Required. [B, S] padded source ids -> [B, T] output ids, EOS-terminated (greedy when beam_size <= 1)."""
    raise NotImplementedError

  def translate_ids(self, model, source: np.ndarray, beam_size: int) -> list[list[int]]:
    """[N, S] padded source ids -> N output id lists (without EOS), in batches of one compiled shape."""
    tok, batch = self.tokenizer, self.eval_batch_size
    outputs = []
    for start in range(0, len(source), batch):
      chunk = source[start:start + batch]
      padded = np.full((batch, chunk.shape[1]), tok.pad_id, np.int32)
      padded[:len(chunk)] = chunk
      tokens = self.translate_batch(model, jnp.asarray(padded), beam_size)
      outputs.extend(decoding.strip(np.asarray(tokens)[:len(chunk)], tok.eos_id))
    return outputs

  def encode_sources(self, lines: list[str]) -> np.ndarray:
    seq_len = self.config.data.seq_len
    arrays, _ = translation.encode_pairs(self.tokenizer, [(line, '') for line in lines], seq_len, seq_len,
                                         drop_long=False)
    return arrays['source']

  def predict_truncation(self, lines):
    room = self.config.data.seq_len - 1  # the source ends with EOS
    return [f'input {number} has {length} tokens; the model read only the first {room} (data.seq_len - 1).'
            for number, length in enumerate((len(self.tokenizer.encode(line)) for line in lines), 1)
            if length > room]

  def predict(self, model, lines, workdir):
    ids = self.translate_ids(model, self.encode_sources(lines), int(self.config.decode.beam_size))
    return [self.tokenizer.decode(row) for row in ids]

  # ------------------------------------------------------------------ evaluation
  def final_decoding(self):
    """The eval batches of decoded test pairs: each is translated with greedy and beam search."""
    return -(-len(self._decoded()) // self.eval_batch_size)

  def decode_unit(self, model):
    """The first eval batch of decoded test pairs, translated with greedy and beam search."""
    test = self.prepared.datasets.test
    source = np.stack([test[i]['source'] for i in self._decoded()[:self.eval_batch_size]])
    for beam in (1, int(self.config.decode.beam_size)):
      self.translate_ids(model, source, beam)

  def _decoded(self):
    """The test pairs `evaluate` decodes (train.final_decode_examples of them, evenly spaced)."""
    return evaluation.final_indices(len(self.prepared.datasets.test), evaluation.final_decode_examples(self.config))

  def evaluate(self, model, workdir):
    """The decoded test pairs (`train.final_decode_examples` of them) EVAL_CHUNK at a time (nothing held
    but one chunk): greedy and beam translations, sacreBLEU from the chunks' summed statistics (equal
    to `corpus_bleu` over them all), exact matches; the teacher-forced loss and accuracy of
    `train.final_eval_examples` test pairs; every translation to translations.json."""
    from sacrebleu.metrics import BLEU
    test, test_pairs = self.prepared.datasets.test, self.prepared.family_data
    decoded = self._decoded()
    beam_size = int(self.config.decode.beam_size)
    scores = {name: [np.zeros(4, np.int64), np.zeros(4, np.int64), 0, 0, 0] for name in ('greedy', 'beam')}
    shown, images = [], {}
    with storage.path(os.path.join(workdir, 'translations.json')).open('w') as f:
      f.write('[')
      for start in range(0, len(decoded), EVAL_CHUNK):
        indices = decoded[start:start + EVAL_CHUNK]
        source, pairs = np.stack([test[i]['source'] for i in indices]), [test_pairs[i] for i in indices]
        translations = {}
        for name, beam in (('greedy', 1), ('beam', beam_size)):
          ids = self.translate_ids(model, source, beam)
          translations[name] = [self.tokenizer.decode(row) for row in ids]
          score, total = BLEU().corpus_score(translations[name], [[r for _, r in pairs]]), scores[name]
          total[0] += score.counts
          total[1] += score.totals
          total[2:] = (total[2] + score.sys_len, total[3] + score.ref_len,
                       total[4] + sum(h == r for h, (_, r) in zip(translations[name], pairs)))
        if not start:
          images = self.attention_images(model, source, ids, workdir, [s for s, _ in pairs])
          shown = list(zip(pairs, translations['beam']))[:SHOWN_TRANSLATIONS]
        f.write(',\n'.join(json.dumps({'source': s, 'reference': r, 'greedy': g, 'beam': b}, ensure_ascii=False)
                            for (s, r), g, b in zip(pairs, translations['greedy'], translations['beam'])) +
                (',\n' if start + EVAL_CHUNK < len(decoded) else ''))
      f.write(']\n')
    results = {}
    for name, (correct, total, sys_len, ref_len, exact) in scores.items():
      results[f'test/bleu_{name}'] = BLEU.compute_bleu(correct, total, sys_len, ref_len, smooth_method='exp').score
      results[f'test/exact_match_{name}'] = exact / max(len(decoded), 1)
    results['test/bleu'] = results['test/bleu_beam']
    results.update(self.teacher_forced_metrics(model, evaluation.final_subset(test, evaluation.final_eval_examples(
        self.config))))
    told = f'{len(test)} pairs' if len(decoded) == len(test) else f'{len(decoded)} of the {len(test)} pairs decoded'
    print(f'Test ({told}): BLEU {results["test/bleu"]:.2f} (beam {beam_size}), '
          f'{results["test/bleu_greedy"]:.2f} (greedy); exact match {results["test/exact_match_beam"]:.3f}; '
          f'token accuracy {results["test/accuracy"]:.4f}', flush=True)
    for (s, r), b in shown:
      print(f'  {s}\n    -> {b}\n    (reference: {r})', flush=True)
    if images:
      results['images'] = images
      print('Attention heatmaps: ' + ', '.join(images.values()), flush=True)
    return results

  def teacher_forced_metrics(self, model, examples) -> dict[str, float]:
    """Loss and accuracy over the real target tokens of every example of `examples`."""
    step = nnx.jit(lambda m, b: self.loss(m, b, deterministic=True)[1])
    batch_size, pad = self.eval_batch_size, self.tokenizer.pad_id
    totals = {}
    for start in range(0, len(examples), batch_size):
      rows = [examples[i] for i in range(start, min(start + batch_size, len(examples)))]
      # Fillers keep one compiled shape; with no real target token they count for nothing.
      rows += [rows[-1] | {'target_out': np.full_like(rows[-1]['target_out'], pad)}] * (batch_size - len(rows))
      metrics = step(model, {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]})
      for name, (total, count) in jax.device_get(metrics).items():
        previous = totals.get(name, (0.0, 0.0))
        totals[name] = (previous[0] + float(total), previous[1] + float(count))
    return {f'test/{name}': total / max(count, 1.0) for name, (total, count) in totals.items()}

  def attention_images(self, model, source: np.ndarray, outputs: list[list[int]], workdir: str,
                       texts: list[str]) -> dict[str, str]:
    """Hook: PNG heatmaps of a few test sentences, {image name: path}, from the first decoded
    chunk: source ids [N, S], their outputs, their source texts. Default: none."""
    return {}
