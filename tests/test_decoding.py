"""One decoding loop serves every family (models/decoding.py).

For a tiny random model of each family, greedy decoding through the model's entry point (the
shared `decoding.decode` over the model's cached step function) gives exactly the tokens of an
argmax over the model recomputed from scratch at every step, with no cache; for the two
translation models, beam search with one beam gives exactly the greedy output; and sampling
through the same loop is seeded and draws from the model's distribution.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import decoding, gpt, rnn_lm, seq2seq, transformer
from numerics import assert_close, transformer_terms

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

PAD, BOS, EOS = 0, 1, 2


def greedy_without_cache(logits_after, batch: int, max_len: int, eos_id=None, limits=None):
  """Reference greedy decoding: logits_after(outputs [B, t]) -> [B, V] scores of output token t,
  recomputed from scratch. EOS is forced at a row's limit; rows are padded after EOS.
  Returns (tokens [B, max_len], summed log-probabilities [B])."""
  tokens = np.full((batch, max_len), PAD, np.int32)
  total, done = np.zeros(batch), np.zeros(batch, bool)
  for t in range(max_len):
    logprobs = np.array(jax.nn.log_softmax(logits_after(tokens[:, :t])))
    if limits is not None:
      logprobs[(t + 1 >= limits)[:, None] & (np.arange(logprobs.shape[1]) != eos_id)[None, :]] = -np.inf
    choice = logprobs.argmax(-1)
    tokens[:, t] = np.where(done, PAD, choice)
    total += np.where(done, 0.0, logprobs[np.arange(batch), choice])
    done |= choice == eos_id
  return tokens, total


def ragged_source(vocab, rows=4, length=7, seed=0):
  """[rows, length] ids in [3, vocab) with right padding of different lengths (row 0 full)."""
  rng = np.random.default_rng(seed)
  lengths = np.array([length] + list(rng.integers(1, length, rows - 1)))
  source = np.where(np.arange(length)[None] < lengths[:, None], rng.integers(3, vocab, (rows, length)), PAD)
  return jnp.asarray(source, jnp.int32), lengths


def limits_for(lengths, ratio, offset, max_len):
  return np.clip(np.floor(ratio * lengths).astype(int) + offset, 1, max_len)


def teacher_forced(forward, max_len):
  """logits_after for an encoder-decoder: forward(target_in [B, max_len]) -> [B, max_len, V]; target_in
  is BOS + the outputs so far, right-padded (the decoder is causal, so the padding changes nothing)."""
  def logits_after(outputs):
    batch, t = outputs.shape
    target_in = np.full((batch, max_len), PAD, np.int32)
    target_in[:, 0], target_in[:, 1:t + 1] = BOS, outputs
    return forward(jnp.asarray(target_in))[:, t]
  return logits_after


def continued(forward, prompts, length):
  """logits_after for a language model: row r is prompts[r] + its outputs so far, right-padded to `length`."""
  def logits_after(outputs):
    sequences = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    tokens = np.zeros((len(prompts), length), np.int32)
    for row, sequence in enumerate(sequences):
      tokens[row, :len(sequence)] = sequence
    logits = forward(jnp.asarray(tokens))
    return logits[np.arange(len(prompts)), [len(s) - 1 for s in sequences]]
  return logits_after


# ----------------------------------------------------------------------------- the four families
# tests/test_transformer.py's TINY: translating 6 sources of 7 tokens greedily with the limits below compiles the
# program its beam-scores test compiles (the persistent compilation cache shares it).
TRANSFORMER = transformer.TransformerConfig(vocab_size=19, width=32, num_heads=4, encoder_layers=2, decoder_layers=2,
                                            mlp_dim=48, dropout=0.0, max_len=32, layer_norm_epsilon=1e-5)


# A summed log-probability: the decoder's logits (encoder and decoder blocks, cross-attention counted
# as a block), the normalizer over the vocabulary, <= 11 steps; likewise for the 2-layer GRU seq2seq
# over 7 source and 9 target steps (embed 8 + hidden 16 + context 16 each) with Bahdanau's sums.
TRANSFORMER_TERMS = transformer_terms(6, 32, 48, 16, vocab=19, positions=11)
SEQ2SEQ_TERMS = 2 * (7 + 9) * (8 + 16 + 16) + 2 * 7 + 16 + 11 + 9


def tiny_transformer(seed=0):
  model = transformer.Transformer(TRANSFORMER, rngs=nnx.Rngs(seed))
  # Sharper outputs (the embedding is tied to the logits), so no argmax is a near tie.
  model.source_embedding.embedding[...] = model.source_embedding.embedding[...] * 4.0
  return model


def tiny_seq2seq(seed=0):
  config = seq2seq.Seq2SeqConfig(src_vocab_size=11, tgt_vocab_size=11, embed=8, hidden=16, num_layers=2, dropout=0.0,
                                 attention_type='bahdanau')
  return seq2seq.Seq2Seq(config, rngs=nnx.Rngs(seed))


def test_transformer_greedy_equals_uncached_argmax():
  model = tiny_transformer()
  source, lengths = ragged_source(TRANSFORMER.vocab_size, rows=6)
  ratio, offset = 1.0, 4
  max_len = int(ratio * source.shape[1]) + offset
  tokens, logprobs = transformer.translate(model, source, bos_id=BOS, eos_id=EOS, beam_size=1, max_len_ratio=ratio,
                                           max_len_offset=offset)
  forward = nnx.jit(transformer.Transformer.__call__)
  expected, expected_logprobs = greedy_without_cache(teacher_forced(lambda t: forward(model, source, t), max_len),
                                                     len(lengths), max_len, EOS,
                                                     limits_for(lengths, ratio, offset, max_len))
  np.testing.assert_array_equal(tokens, expected)
  assert_close(logprobs, expected_logprobs, terms=TRANSFORMER_TERMS)


def test_seq2seq_greedy_equals_uncached_argmax():
  model = tiny_seq2seq()
  source, lengths = ragged_source(11, seed=1)
  max_len, ratio = 8, 1.0
  tokens, logprobs = seq2seq.translate(model, source, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=max_len, beam_size=1,
                                       alpha=0.6, max_len_ratio=ratio, max_len_offset=1)
  forward = nnx.jit(lambda m, source, target_in: m(source, source != PAD, target_in)[0])
  expected, expected_logprobs = greedy_without_cache(teacher_forced(lambda t: forward(model, source, t), max_len),
                                                     len(lengths), max_len, EOS, limits_for(lengths, ratio, 1, max_len))
  np.testing.assert_array_equal(tokens, expected)
  assert_close(logprobs, expected_logprobs, terms=SEQ2SEQ_TERMS)


@pytest.mark.parametrize('scan_layers', [False, True])
def test_gpt_greedy_equals_uncached_argmax(scan_layers):
  config = gpt.GPT2Config(vocab_size=37, max_len=32, num_layers=2, num_heads=2, width=16, dropout=0.0,
                          scan_layers=scan_layers)
  model = gpt.GPT(config, rngs=nnx.Rngs(0))
  # Positions strong enough to change outputs, so a left-padded row decoded at shifted positions would show.
  model.position_embedding.embedding[...] = model.position_embedding.embedding[...] * 50.0
  prompts, new = [[5, 6, 7, 8, 9], [3], [12, 13]], 8
  tokens, valid = decoding.left_pad(prompts, PAD)
  out, lengths = gpt.generate(model, tokens, valid, jax.random.key(0), max_new_tokens=new, temperature=0.0, top_k=0,
                              top_p=1.0, eos_id=None, pad_id=PAD)
  forward = nnx.jit(lambda m, t: m(t)[0])
  expected, _ = greedy_without_cache(continued(lambda t: forward(model, t), prompts, 16), len(prompts), new)
  np.testing.assert_array_equal(out, expected)
  np.testing.assert_array_equal(lengths, [new] * len(prompts))


def test_rnn_lm_greedy_equals_uncached_argmax():
  model = rnn_lm.RNNLM(rnn_lm.RNNLMConfig(vocab_size=23, cell='lstm', embed=8, hidden=16, num_layers=2),
                       rngs=nnx.Rngs(0))
  prompts, new = [[5, 6, 7, 8], [9], [10, 11]], 6
  tokens, valid = decoding.left_pad(prompts, PAD)
  out, _ = rnn_lm.generate(model, tokens, valid, jax.random.key(0), max_new_tokens=new, temperature=0.0, top_k=0,
                           top_p=1.0, eos_id=None, pad_id=PAD)
  forward = nnx.jit(lambda m, t: m(t)[0])
  expected, _ = greedy_without_cache(continued(lambda t: forward(model, t), prompts, 12), len(prompts), new)
  np.testing.assert_array_equal(out, expected)


# ----------------------------------------------------------------------------- beam 1 == greedy
@nnx.jit(static_argnames=('beam_size', 'max_len'))
def search(model, cache, limits, beam_size, max_len):
  """Greedy `decode` (beam_size 0) or `beam_search` through model.decode_step -> ([B, max_len], [B])."""
  bos = jnp.full((limits.shape[0], 1), BOS, jnp.int32)
  if not beam_size:
    result = decoding.decode(model.decode_step, cache, bos, max_len=max_len, eos_id=EOS, max_lengths=limits)
    return result.tokens, result.logprobs
  result = decoding.beam_search(model.decode_step, cache, bos, beam_size=beam_size, max_len=max_len, eos_id=EOS,
                                alpha=0.6, max_lengths=limits)
  return result.tokens[:, 0], result.logprobs[:, 0]


@pytest.mark.parametrize('family', ['seq2seq', 'transformer'])
def test_one_beam_is_greedy(family):
  max_len = 9
  # The encoder's state for decoding: one compilation for the three seeds (eagerly, each op compiles on its own).
  encode = nnx.jit(lambda m, s: m.encode(s, s != PAD) if family == 'seq2seq' else m.init_cache(s, m.encode(s), max_len))
  for seed in range(3):
    if family == 'seq2seq':
      model = tiny_seq2seq(seed)
      source, lengths = ragged_source(11, seed=seed)
    else:
      model = tiny_transformer(seed)
      source, lengths = ragged_source(TRANSFORMER.vocab_size, seed=seed)
    cache = encode(model, source)
    limits = jnp.asarray(limits_for(lengths, 1.0, 2, max_len))
    greedy, greedy_logprob = search(model, cache, limits, 0, max_len)
    beam, beam_logprob = search(model, cache, limits, 1, max_len)
    np.testing.assert_array_equal(beam, greedy)
    assert_close(beam_logprob, greedy_logprob, terms=SEQ2SEQ_TERMS if family == 'seq2seq' else TRANSFORMER_TERMS)


def test_sampling_draws_from_the_model_and_is_seeded():
  """Temperature 1 draws the first new token from the model's next-token distribution."""
  model = rnn_lm.RNNLM(rnn_lm.RNNLMConfig(vocab_size=5, embed=4, hidden=8), rngs=nnx.Rngs(1))
  prompt = jnp.full((4000, 1), 3, jnp.int32)
  valid = jnp.ones(prompt.shape, bool)
  sample = lambda seed: rnn_lm.generate(model, prompt, valid, jax.random.key(seed), max_new_tokens=2, temperature=1.0,
                                        top_k=0, top_p=1.0, eos_id=None, pad_id=PAD)[0]
  out = np.asarray(sample(0))
  np.testing.assert_array_equal(out, sample(0))
  assert not np.array_equal(out, sample(1))
  first = np.asarray(nnx.jit(lambda m, t: jax.nn.softmax(m(t)[0][0, -1]))(model, prompt[:1]))  # one program
  # Sampling noise, not rounding: 4,000 draws put each frequency within ~4 standard errors
  # (sqrt(p (1 - p) / 4000) <= 0.008) of its probability.
  np.testing.assert_allclose(np.bincount(out[:, 0], minlength=5) / len(out), first, atol=0.03)
