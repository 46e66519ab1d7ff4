"""RNN encoder-decoder: source masking, Bahdanau attention, step decoding == teacher forcing, beam-search state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import decoding
from models.rnn import run_cell
from models.seq2seq import Seq2Seq, Seq2SeqConfig
from numerics import assert_close

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

B, S, T, V = 3, 7, 5, 11
ATTENTION = ['none', 'bahdanau']
# A logit: 2 layers of GRU steps over the source and target (embed 8 + hidden 16 + the 16 wide
# context each), Bahdanau's scores and sums over the source, the output layer.
TERMS = 2 * (S + T) * (8 + 16 + 16) + 16 + 2 * S + 16


def make(attention_type, dropout=0.0, seed=0):
  config = Seq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V, embed=8, hidden=16, num_layers=2,
                         dropout=dropout, attention_type=attention_type)
  return Seq2Seq(config, rngs=nnx.Rngs(seed, dropout=seed + 1))


@nnx.jit(static_argnames='deterministic')
def forward(model, src, src_valid, tgt_in, deterministic=True):
  """The teacher-forced model under jit: one compilation per model and shape instead of one per call."""
  return model(src, src_valid, tgt_in, deterministic=deterministic)


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([S, 4, 2])
  src_valid = np.arange(S)[None] < lengths[:, None]
  src = np.where(src_valid, rng.integers(4, V, (B, S)), 0)
  tgt_in = rng.integers(4, V, (B, T))
  return jnp.asarray(src), jnp.asarray(src_valid), jnp.asarray(tgt_in)


@pytest.mark.parametrize('attention_type', ATTENTION)
def test_padded_source_tokens_do_not_matter(attention_type):
  model = make(attention_type)
  src, src_valid, tgt_in = inputs()
  logits, _ = forward(model, src, src_valid, tgt_in)
  other = jnp.where(src_valid, src, 5)  # different tokens on the padding only
  assert_close(forward(model, other, src_valid, tgt_in)[0], logits, terms=TERMS)
  # ...while a real token does matter.
  changed = src.at[1, 0].set(jnp.where(src[1, 0] == 4, 5, 4))
  assert not np.allclose(forward(model, changed, src_valid, tgt_in)[0][1], logits[1], atol=1e-4)


def test_bahdanau_weights_cover_only_real_source_tokens():
  model = make('bahdanau')
  src, src_valid, tgt_in = inputs()
  _, weights = forward(model, src, src_valid, tgt_in)
  assert weights.shape == (B, T, S)
  assert_close(weights.sum(-1), np.ones((B, T)), terms=S)
  np.testing.assert_array_equal(np.asarray(weights)[~np.broadcast_to(src_valid[:, None], weights.shape)], 0.0)


def test_bahdanau_query_is_previous_decoder_state():
  """The first step's query is the encoder's final top-layer state (the decoder's initial state)."""
  model = make('bahdanau')
  src, src_valid, tgt_in = inputs()
  state = model.encode(src, src_valid)
  _, weights = forward(model, src, src_valid, tgt_in)
  _, expected = model.attention(state['hidden'][:, -1:], state['memory'], state['memory'], src_valid)
  assert_close(weights[:, 0], expected[:, 0], terms=TERMS)


def test_no_attention_context_is_final_encoder_state():
  model = make('none')
  src, src_valid, _ = inputs()
  state = model.encode(src, src_valid)
  # Sentence 1 has 4 real tokens: its context is the top layer's state after token 4, unpadded.
  embedded = model.src_embedding(src[1:2, :4])
  first, _ = run_cell(model.encoder.cells[0], embedded)
  _, top_final = run_cell(model.encoder.cells[1], first)
  assert_close(state['context'][1], top_final[0], terms=TERMS)


@pytest.mark.parametrize('attention_type', ATTENTION)
def test_step_decoding_equals_teacher_forcing(attention_type):
  model = make(attention_type)
  src, src_valid, tgt_in = inputs()
  logits, _ = forward(model, src, src_valid, tgt_in)
  state = model.encode(src, src_valid)
  for t in range(T):
    step_logits, state = model.decode_step(tgt_in[:, t:t + 1], state, t)
    assert_close(step_logits[:, 0], logits[:, t], terms=TERMS)


def test_dropout_is_off_when_deterministic_and_on_in_training():
  model = make('bahdanau', dropout=0.5)
  src, src_valid, tgt_in = inputs()
  a = forward(model, src, src_valid, tgt_in, deterministic=True)[0]
  np.testing.assert_array_equal(a, forward(model, src, src_valid, tgt_in, deterministic=True)[0])
  assert not np.allclose(a, forward(model, src, src_valid, tgt_in, deterministic=False)[0])


def test_beam_search_reorders_the_state_correctly():
  """The log-probability beam search reports for its best hypothesis equals a teacher-forced rescoring
  of that hypothesis, which fails if any state leaf lacked the leading batch axis."""
  model = make('bahdanau', seed=3)
  src, src_valid, _ = inputs(1)
  bos, eos = 1, 2
  search = nnx.jit(lambda m, src, src_valid: decoding.beam_search(  # jitted: one compilation, not one per op
      m.decode_step, m.encode(src, src_valid), jnp.full((B, 1), bos), beam_size=3, max_len=6, eos_id=eos, alpha=0.0))
  result = search(model, src, src_valid)
  best = np.asarray(result.tokens[:, 0])  # [B, 6]: tokens, EOS, then padding
  length = 1 + np.argmax(best == eos, axis=1)
  tgt_in = jnp.asarray(np.concatenate([np.full((B, 1), bos), best[:, :-1]], axis=1))
  logits, _ = forward(model, src, src_valid, tgt_in)
  token_logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(best)[..., None], -1)[..., 0]
  rescored = jnp.where(np.arange(6)[None] < length[:, None], token_logprobs, 0.0).sum(-1)
  assert_close(result.logprobs[:, 0], rescored, terms=TERMS + V + 6)  # + the normalizer, 6 tokens


def test_unknown_attention_type_fails_clearly():
  with pytest.raises(ValueError, match='attention_type'):
    make('luong')


# ----------------------------------------------------------------------------- the translation task
def test_english_number_reads_num2words_output():
  from num2words import num2words
  from data.translation import english_number
  rng = np.random.default_rng(0)
  numbers = [0, 1, 12, 20, 21, 100, 101, 999, 1000, 100000, 100001, 999999] + rng.integers(0, 10**6, 300).tolist()
  for n in numbers:
    for kind in ('cardinal', 'ordinal'):
      assert english_number(num2words(n, to=kind, lang='en')) == n, (n, kind)
  assert english_number('bonjour') is None
  # Years are below 100,000 whatever their reading, so a threshold above 2,100 drops them all.
  assert english_number(num2words(1999, to='year', lang='en')) < 2100


def seq2seq_task(tmp_path, attention_type='bahdanau', pairs=200):
  from configs import seq2seq
  config = seq2seq.get_config('tiny')
  rng = np.random.default_rng(0)
  words = 'un deux trois quatre cinq six sept huit neuf dix'.split()
  english = 'one two three four five six seven eight nine ten'.split()
  with open(tmp_path / 'pairs.tsv', 'w') as f:
    for _ in range(pairs):
      index = rng.integers(0, 10, rng.integers(1, 5))
      f.write(' '.join(english[i] for i in index) + '\t' + ' '.join(words[i] for i in index) + '\n')
  config.data.source = f'tsv:{tmp_path}/pairs.tsv'
  config.data.seq_len = 12
  config.model.attention_type = attention_type
  return config


def test_loss_ignores_padded_target_positions(tmp_path):
  from train.tasks.seq2seq import Task
  config = seq2seq_task(tmp_path)
  task = Task(config, Task.prepare(config, str(tmp_path)))
  datasets = task.prepared.datasets
  model = task.build_model(nnx.Rngs(0))
  batch = {k: np.stack([datasets.train[i][k] for i in range(8)]) for k in ('source', 'target_in', 'target_out')}
  # The loss and the teacher-forced logits as one compiled program.
  loss_and_logits = nnx.jit(lambda model, batch: (
      task.loss(model, batch, deterministic=True),
      model(batch['source'], batch['source'] != task.tokenizer.pad_id, batch['target_in'])[0]))
  (loss, metrics), logits = loss_and_logits(model, batch)
  valid = batch['target_out'] != task.tokenizer.pad_id
  assert 0 < valid.sum() < valid.size
  assert float(metrics['loss'][1]) == valid.sum()
  # Other decoder inputs after the end of the target change nothing.
  noisy = dict(batch, target_in=np.where(valid, batch['target_in'], 5))
  # 24 GRU steps (12 source, 12 target) of embed 16 + hidden 32 + context 32, Bahdanau's sums over the
  # source, the output layer, the normalizer over the vocabulary and the mean over the real tokens.
  loss_terms = 24 * (16 + 32 + 32) + 2 * 12 + 32 + task.model_config.tgt_vocab_size + int(valid.sum())
  assert_close(loss_and_logits(model, noisy)[0][0], loss, terms=loss_terms)
  per_token = -jax.nn.log_softmax(logits)[np.arange(8)[:, None], np.arange(12)[None], batch['target_out']]
  assert_close(loss, per_token[valid].mean(), terms=loss_terms)


def test_numbers_filter_keeps_only_large_numbers(tmp_path, monkeypatch):
  from data import translation
  from train.tasks.seq2seq import Task
  pairs = [('one hundred and two thousand', 'cent deux mille'), ('twelve', 'douze'),
           ('two hundred thousandth', 'deux cent millième'), ('ninety-nine thousand', 'quatre-vingt-dix-neuf mille')]
  splits = translation.Splits(pairs * 20, pairs, pairs)
  monkeypatch.setattr(translation, 'numbers_en_fr', lambda seed, sizes=None: splits)
  config = seq2seq_task(tmp_path)
  config.data.source = 'numbers_en_fr'
  config.data.cache_dir = str(tmp_path / 'cache')  # the fake numbers' cache and tokenizer stay apart
  config.data.min_number = 100_000
  config.data.seq_len = 48
  test_pairs = Task.prepare(config, str(tmp_path)).family_data
  assert [s for s, _ in test_pairs] == ['one hundred and two thousand', 'two hundred thousandth']


def test_training_end_to_end_writes_bleu_and_attention_picture(tmp_path):
  from train.trainer import train_and_evaluate
  config = seq2seq_task(tmp_path, pairs=200)
  config.model.dropout = 0.0  # what is checked is the evaluation's files: no dropout masks to compile
  config.train.eval_batch_size = 8
  config.train.steps = 4
  config.train.eval_every = 4
  config.train.checkpoint_every = 4
  results = train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['step'] == 4
  for key in ('test/bleu_greedy', 'test/bleu_beam', 'test/accuracy', 'eval/perplexity'):
    assert np.isfinite(results[key])
  assert (tmp_path / 'run' / 'attention.png').exists()
  assert (tmp_path / 'run' / 'translations.json').exists()


def test_long_presets_differ_only_in_attention_and_fit_the_longest_numbers():
  """long / long_bahdanau: the same data, size and budget; character-level sequences long enough for
  the longest English and French number words below a million (EOS or BOS included)."""
  from configs import seq2seq
  from num2words import num2words
  plain, attention = seq2seq.get_config('long').to_dict(), seq2seq.get_config('long_bahdanau').to_dict()
  assert plain['model'].pop('attention_type') == 'none'
  assert attention['model'].pop('attention_type') == 'bahdanau'
  plain.pop('preset'), attention.pop('preset')
  assert plain == attention
  assert plain['data']['tokenizer'] == 'char'
  longest = max(len(num2words(n, to=kind, lang=lang)) for n in (777_777, 777_377, 797_797, 777_797)
                for kind in ('cardinal', 'ordinal') for lang in ('en', 'fr'))
  assert longest + 1 <= plain['data']['seq_len']


def test_char_tokenizer_encodes_translation_pairs(tmp_path):
  """Character ids with EOS on the source, BOS / EOS around the target, pad after; decoding gives the text back."""
  from data import translation
  from data.tokenizers import load_tokenizer, train_tokenizer
  pairs = [('two hundred thousandth', 'deux cent millième'), ('one', 'un')]
  tok = train_tokenizer('char', [text for pair in pairs for text in pair], 0)
  tok.save(str(tmp_path))
  arrays, kept = translation.encode_pairs(tok, pairs, 24, 20, drop_long=True)
  assert kept.tolist() == [0, 1]
  source, target_in, target_out = arrays['source'][0], arrays['target_in'][0], arrays['target_out'][0]
  assert source[len(pairs[0][0])] == tok.eos_id and (source[len(pairs[0][0]) + 1:] == tok.pad_id).all()
  assert target_in[0] == tok.bos_id and target_out[len(pairs[0][1])] == tok.eos_id
  np.testing.assert_array_equal(target_in[1:len(pairs[0][1]) + 1], target_out[:len(pairs[0][1])])
  assert tok.decode(source.tolist()) == pairs[0][0] and tok.decode(target_out.tolist()) == pairs[0][1]
  assert tok.decode(arrays['source'][1].tolist()) == 'one'
  # The saved vocabulary reloads with the same ids.
  assert load_tokenizer(str(tmp_path)).encode('deux') == tok.encode('deux')
