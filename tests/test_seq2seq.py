"""RNN encoder-decoder: source masking, Bahdanau attention, step decoding == teacher forcing, beam-search state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import beam_search
from models.rnn import run_cell
from models.seq2seq import Seq2Seq, Seq2SeqConfig

B, S, T, V = 3, 7, 5, 11
ATTENTION = ['none', 'bahdanau']


def make(attention_type, dropout=0.0, seed=0):
  config = Seq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V, embed=8, hidden=16, num_layers=2,
                         dropout=dropout, attention_type=attention_type)
  return Seq2Seq(config, rngs=nnx.Rngs(seed, dropout=seed + 1))


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
  logits, _ = model(src, src_valid, tgt_in)
  other = jnp.where(src_valid, src, 5)  # different tokens on the padding only
  np.testing.assert_allclose(model(other, src_valid, tgt_in)[0], logits, atol=1e-5)
  # ...while a real token does matter.
  changed = src.at[1, 0].set(jnp.where(src[1, 0] == 4, 5, 4))
  assert not np.allclose(model(changed, src_valid, tgt_in)[0][1], logits[1], atol=1e-4)


def test_bahdanau_weights_cover_only_real_source_tokens():
  model = make('bahdanau')
  src, src_valid, tgt_in = inputs()
  _, weights = model(src, src_valid, tgt_in)
  assert weights.shape == (B, T, S)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(weights)[~np.broadcast_to(src_valid[:, None], weights.shape)], 0.0)


def test_bahdanau_query_is_previous_decoder_state():
  """The first step's query is the encoder's final top-layer state (the decoder's initial state)."""
  model = make('bahdanau')
  src, src_valid, tgt_in = inputs()
  state = model.encode(src, src_valid)
  _, weights = model(src, src_valid, tgt_in)
  _, expected = model.attention(state['hidden'][:, -1:], state['memory'], state['memory'], src_valid)
  np.testing.assert_allclose(weights[:, 0], expected[:, 0], atol=1e-6)


def test_no_attention_context_is_final_encoder_state():
  model = make('none')
  src, src_valid, _ = inputs()
  state = model.encode(src, src_valid)
  # Sentence 1 has 4 real tokens: its context is the top layer's state after token 4, unpadded.
  embedded = model.src_embedding(src[1:2, :4])
  first, _ = run_cell(model.encoder.cells[0], embedded)
  _, top_final = run_cell(model.encoder.cells[1], first)
  np.testing.assert_allclose(state['context'][1], top_final[0], atol=1e-5)


@pytest.mark.parametrize('attention_type', ATTENTION)
def test_step_decoding_equals_teacher_forcing(attention_type):
  model = make(attention_type)
  src, src_valid, tgt_in = inputs()
  logits, _ = model(src, src_valid, tgt_in)
  state = model.encode(src, src_valid)
  for t in range(T):
    step_logits, state = model.decode_step(tgt_in[:, t:t + 1], state, t)
    np.testing.assert_allclose(step_logits, logits[:, t], atol=1e-5)


def test_dropout_is_off_when_deterministic_and_on_in_training():
  model = make('bahdanau', dropout=0.5)
  src, src_valid, tgt_in = inputs()
  a = model(src, src_valid, tgt_in, deterministic=True)[0]
  np.testing.assert_array_equal(a, model(src, src_valid, tgt_in, deterministic=True)[0])
  assert not np.allclose(a, model(src, src_valid, tgt_in, deterministic=False)[0])


def test_beam_search_reorders_the_state_correctly():
  """The log-probability beam search reports for its best hypothesis equals a teacher-forced rescoring
  of that hypothesis, which fails if any state leaf lacked the leading batch axis."""
  model = make('bahdanau', seed=3)
  src, src_valid, _ = inputs(1)
  bos, eos = 1, 2
  result = beam_search.beam_search(model.decode_step, model.encode(src, src_valid), jnp.full((B,), bos),
                                   beam_size=3, max_len=6, eos_id=eos, alpha=0.0)
  best = np.asarray(result.tokens[:, 0])
  for b in range(B):
    hyp = best[b][: list(best[b]).index(eos) + 1]
    tgt_in = jnp.asarray([[bos] + list(hyp[:-1])])
    logits, _ = model(src[b:b + 1], src_valid[b:b + 1], tgt_in)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits[0]), jnp.asarray(hyp)[:, None], -1).sum()
    np.testing.assert_allclose(result.logprobs[b, 0], logprob, atol=1e-4)


def test_unknown_attention_type_fails_clearly():
  with pytest.raises(ValueError, match='attention_type'):
    make('luong')
