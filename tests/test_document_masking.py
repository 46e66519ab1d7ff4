"""data.document_masking: packed LM windows attend within each document (models/gpt.py `document_segments`).

Each EOS opens the next document (its BOS): segment ids count the EOS ids so far and positions count
from each segment's start. With masking, a document's logits in a packed window are those of the
document run alone on every attention path; without, they are not.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from data.tokenizers import CharTokenizer
from numerics import assert_close, transformer_terms
from train import task as task_lib

SEQ_LEN = 128  # one splash block
WIDTH, LAYERS = 32, 2
TERMS = transformer_terms(LAYERS, WIDTH, 4 * WIDTH, SEQ_LEN, vocab=32)  # a logit after two blocks
TEXT = 'the quick brown fox jumps over the lazy dog'


def gpt_task(tokenizer, **overrides):
  """The GPT family's Task of the `tiny` preset (2 blocks, 32 wide) on `tokenizer`, without data."""
  config = support.tiny_gpt_config('pystdlib', **{'data.document_masking': True, 'data.seq_len': SEQ_LEN,
                                                  'model.max_len': SEQ_LEN, **overrides})
  return task_lib.task_without_data(config, tokenizer)


def test_segment_ids_and_positions_restart_at_each_eos_of_a_packed_batch(tmp_path):
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for name, text in (('1.txt', 'abc'), ('2.txt', 'de'), ('3.txt', 'fghij'), ('4.txt', 'kl')):
    (corpus / name).write_text(text)
  (tmp_path / 'valid.txt').write_text('abcdefghijkl')
  config = support.tiny_gpt_config(f'text:{corpus}/*.txt', **{
      'data.eval_source': f'text:{tmp_path}/valid.txt', 'data.cache_dir': str(tmp_path / 'cache'), 'data.seq_len': 7,
      'data.document_masking': True})
  task = task_lib.prepare_task(config, str(tmp_path / 'run'))
  windows = task.prepared.datasets.train
  batch = np.stack([windows[i]['tokens'] for i in range(len(windows))])
  # The stream a b c E d e E f g h i j E k l E in two windows of 8; the second starts inside 'fghij'.
  eos, ids = task.tokenizer.eos_id, {c: task.tokenizer.encode(c)[0] for c in 'abcdefghijkl'}
  np.testing.assert_array_equal(batch, [[ids[c] if c != 'E' else eos for c in row] for row in ('abcEdeEf', 'ghijEklE')])
  inputs = task.model_inputs(jnp.asarray(batch[:, :-1]))
  np.testing.assert_array_equal(inputs['tokens'], batch[:, :-1])
  np.testing.assert_array_equal(inputs['segment_ids'], [[0, 0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 1]])
  np.testing.assert_array_equal(inputs['positions'], [[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1, 2]])
  config.data.document_masking = False  # today's windows: one sequence each
  assert set(task_lib.task_without_data(config, task.tokenizer).model_inputs(inputs['tokens'])) == {'tokens'}


def packed_row(tokenizer, lengths=(37, 50, 41)):
  """One window of SEQ_LEN ids: a document under way (no EOS at its start), then documents opened
  by EOS; and the [start, end) of each segment."""
  ids = np.asarray(tokenizer.encode(TEXT * 4), np.int32)
  row, spans, start = [], [], 0
  for number, length in enumerate(lengths):
    segment = ids[number * 7:number * 7 + length]
    row.extend(segment if number == 0 else [tokenizer.eos_id, *segment[1:]])
    spans.append((start, start + length))
    start += length
  assert len(row) == SEQ_LEN
  return jnp.asarray([row]), spans


# attention implementation, positions: splash runs in Pallas's interpreter here; 'jax_nn' gets the
# structured arguments cuDNN gets (models/attention.py `jax_nn_arguments`), computed by XLA on a CPU.
CASES = [('xla', 'learned'), ('xla', 'rope'), ('jax_nn', 'learned'), ('splash', 'learned'), ('splash', 'rope')]


@pytest.mark.numerics
@pytest.mark.parametrize('attention, positions', CASES)
def test_a_document_in_a_packed_window_has_the_logits_it_has_alone(attention, positions):
  tokenizer = CharTokenizer.train([TEXT])
  overrides = {'model.attention': attention, 'model.positions': positions}
  task = gpt_task(tokenizer, **overrides)
  model = task.build_model(nnx.Rngs(0))
  tokens, spans = packed_row(tokenizer)

  @nnx.jit  # one program: run eagerly, each of the model's ~100 ops compiles on its own for each shape
  def logits(model):
    # alone: the einsum path, lengths that are not whole splash blocks
    return (model(**task.model_inputs(tokens))[0], model(tokens)[0],
            [model(tokens[:, start:end])[0] for start, end in spans])

  packed, unmasked, alone_logits = logits(model)
  for (start, end), alone in zip(spans, alone_logits):
    got, want = support.real_logits(packed, tokenizer.vocab_size)[:, start:end], support.real_logits(
        alone, tokenizer.vocab_size)
    assert_close(got, want, terms=TERMS, err_msg=f'segment [{start}, {end})')
    if start:  # without masking, every document after the first reads the ones before it
      difference = np.max(np.abs(support.real_logits(unmasked, tokenizer.vocab_size)[:, start:end] - want))
      assert difference > 100 * np.max(np.abs(got - want)) and difference > 1e-3, difference


@pytest.mark.numerics
@pytest.mark.parametrize('chunk', [0, 16])
def test_the_training_loss_is_each_documents_loss_alone(chunk):
  """Task.loss (whole or chunked output layer): the token-weighted mean of the losses of the
  packed window's documents, each run alone with the tokens it predicts."""
  tokenizer = CharTokenizer.train([TEXT])
  task = gpt_task(tokenizer, **{'train.loss_chunk_tokens': chunk})
  model = task.build_model(nnx.Rngs(1))
  inputs, spans = packed_row(tokenizer)
  window = jnp.concatenate([inputs, jnp.asarray([[tokenizer.eos_id]])], axis=1)  # the target after the last input
  unmasked = gpt_task(tokenizer, **{'train.loss_chunk_tokens': chunk, 'data.document_masking': False})

  @nnx.jit  # one program instead of each op compiled on its own for each shape
  def losses(model):
    alone = sum((end - start) * task.loss(model, {'tokens': window[:, start:end + 1]}, deterministic=True)[0]
                for start, end in spans) / SEQ_LEN
    return (task.loss(model, {'tokens': window}, deterministic=True)[0], alone,
            unmasked.loss(model, {'tokens': window}, deterministic=True)[0])

  packed, alone, without_masking = losses(model)
  assert_close(packed, alone, terms=TERMS + SEQ_LEN)
  assert abs(float(without_masking - alone)) > 1e-4
