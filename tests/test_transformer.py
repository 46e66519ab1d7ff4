"""The encoder-decoder Transformer (models/transformer.py).

References: Hugging Face's MarianMT (the same post-LN encoder-decoder) for the logits, the
paper's parameter counts, and the model's own teacher-forced forward pass for cached decoding,
masking and the scores that beam search reports.
"""
import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import decoding
from models.layers import sinusoidal_positions
from models.transformer import Transformer, TransformerConfig, count_parameters, parameter_count, translate
from numerics import assert_close, assert_trees_close, tolerance, transformer_terms
from train.task import prepare_task

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

PAD, BOS, EOS = 0, 1, 2
# LayerNorm's epsilon is Hugging Face Marian's (torch's default), so that the parity test below runs the
# compiled forward pass the other tests share.
TINY = TransformerConfig(vocab_size=19, width=32, num_heads=4, encoder_layers=2, decoder_layers=2, mlp_dim=48,
                         dropout=0.0, max_len=32, layer_norm_epsilon=1e-5)
# Encoder and decoder blocks (the decoder's cross-attention counted as a block of its own) over <= 24 tokens.
TERMS = transformer_terms(TINY.encoder_layers + 2 * TINY.decoder_layers, TINY.width, TINY.mlp_dim, 24)


# The forward pass jitted (compiled once per shape): run eagerly, each of its ~100 ops compiles on its own.
forward = nnx.jit(Transformer.__call__)


def tiny(seed=0, **overrides):
  return Transformer(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(seed))


def batch(seed=0, rows=4, source_len=7, target_len=6):
  """Random source/target ids with ragged padding (row 0 full length)."""
  rng = np.random.default_rng(seed)
  source = rng.integers(3, TINY.vocab_size, (rows, source_len))
  target = rng.integers(3, TINY.vocab_size, (rows, target_len))
  target[:, 0] = BOS
  for row in range(1, rows):
    source[row, rng.integers(1, source_len):] = PAD
  return jnp.asarray(source, jnp.int32), jnp.asarray(target, jnp.int32)


@pytest.mark.parametrize('overrides', [{}, {'pre_norm': True, 'share_embeddings': False}])
def test_cached_decoding_equals_full_forward(overrides):
  model = tiny(**overrides)
  source, target = batch()
  full = forward(model, source, target)
  cache = nnx.jit(lambda m, s: m.init_cache(s, m.encode(s), max_len=TINY.max_len))(model, source)
  step = nnx.jit(Transformer.decode_step)
  for index in range(target.shape[1]):
    logits, cache = step(model, target[:, index:index + 1], cache, index)
    assert_close(logits[:, 0], full[:, index], terms=TERMS)


def test_padded_source_positions_change_no_logit():
  model = tiny(1)
  source, target = batch(1)
  valid = source != PAD
  reference = forward(model, source, target)
  # Different tokens at the padded positions, still marked invalid: no logit may move.
  noise = jnp.asarray(np.random.default_rng(9).integers(3, TINY.vocab_size, source.shape), jnp.int32)
  changed = jnp.where(valid, source, noise)
  assert not np.array_equal(changed, source)
  noise = 1e3 * jax.random.normal(jax.random.key(0), (*source.shape, TINY.width))

  @nnx.jit  # one program for both checks: as separate ones, the encoder and the decoder compile twice
  def padded_variants(model, source, changed, target, lengths, noise):
    # Cross-attention alone: huge encoder states at padded positions must not leak either.
    poisoned = jnp.where(valid[:, :, None], model.encode(source), noise)
    return model(changed, target, source_lengths=lengths), model.decode(target, poisoned, lengths)[0]

  given_lengths, poisoned_memory = padded_variants(model, source, changed, target, valid.sum(1), noise)
  assert_close(given_lengths, reference, terms=TERMS)
  assert_close(poisoned_memory, reference, terms=TERMS)
  # A real source token does matter (the checks above are not vacuous).
  flipped = source.at[:, 0].set(jnp.where(source[:, 0] == 5, 6, 5))
  assert np.abs(np.asarray(forward(model, flipped, target) - reference)).max() > 1e-3


def test_padding_tokens_beyond_real_source_change_no_logit():
  # Extra padding columns (a longer padded batch) leave the logits of every real position unchanged.
  model = tiny(2)
  source, target = batch(2)
  longer = jnp.concatenate([source, jnp.zeros((source.shape[0], 5), jnp.int32)], axis=1)
  assert_close(forward(model, longer, target), forward(model, source, target), terms=TERMS)


def test_decoder_is_causal():
  model = tiny(3)
  source, target = batch(3)
  reference = forward(model, source, target)
  changed = target.at[:, 4].set((target[:, 4] + 1) % TINY.vocab_size)
  logits = forward(model, source, changed)
  assert_close(logits[:, :4], reference[:, :4], terms=TERMS)
  assert np.abs(np.asarray(logits[:, 4:] - reference[:, 4:])).max() > 1e-4


def test_the_pictures_batched_padded_weights_are_each_sentences_own():
  """The heatmaps' one compiled forward over padded rows gives each sentence the weights of its
  own unpadded forward pass: a pad key with weight, or a cut off row, would show here."""
  from models.attention import record_attention_weights
  from train.tasks.transformer import decoder_attention_weights
  model = tiny(2)
  # A full row and a padded one (source and target).
  source, target = batch(2, rows=2, source_len=7, target_len=9)
  lengths = [9, 4]
  target = target.at[1, 4:].set(PAD)
  padded = decoder_attention_weights(model, source, target)
  # Each sentence's own forward, unpadded, recorded as its own program (eagerly every op would compile on its own).
  recorded = nnx.jit(lambda model, source, target: record_attention_weights(model, lambda: model(source, target))[1])
  for row, length in enumerate(lengths):
    real = int((source[row] != PAD).sum())
    own = recorded(model, source[row:row + 1, :real], target[row:row + 1, :length])
    assert set(own) == set(padded)
    for name in ('decoder_blocks/1/cross_attention', 'decoder_blocks/1/self_attention'):
      columns = real if 'cross' in name else length
      assert_close(padded[name][row, :, :length, :columns], own[name][0], terms=TERMS)
      assert np.all(np.asarray(padded[name][row, :, :length, columns:]) == 0)  # no weight on padding or the future


def test_dropout_is_active_only_in_training():
  # One block a side: each dropout's random masks make the training pass's program several times larger.
  model = tiny(4, dropout=0.3, encoder_layers=1, decoder_layers=1)
  source, target = batch(4)
  # Jitted: run eagerly, the training pass compiles each of its ~60 ops (dropout's included) on its own.
  training = nnx.jit(functools.partial(Transformer.__call__, deterministic=False))
  np.testing.assert_array_equal(forward(model, source, target), forward(model, source, target))
  assert np.abs(np.asarray(training(model, source, target) - forward(model, source, target))).max() > 1e-3


def expected_parameters(vocab, width, mlp, layers, shared=True):
  """Hand count: embeddings + per-layer attention (4 E^2 + 4 E), FFN (2 E F + F + E), LayerNorms."""
  attention = 4 * width * width + 4 * width
  ffn = 2 * width * mlp + mlp + width
  norm = 2 * width
  encoder = layers * (attention + ffn + 2 * norm)
  decoder = layers * (2 * attention + ffn + 3 * norm)
  embeddings = vocab * width * (1 if shared else 3)
  return embeddings + encoder + decoder


@pytest.mark.parametrize('width,heads,mlp,paper_millions', [(512, 8, 2048, 65), (1024, 16, 4096, 213)])
def test_parameter_counts_match_the_paper(width, heads, mlp, paper_millions):
  # Table 3 of the paper counts base 65M and big 213M with a shared ~37k BPE vocabulary.
  config = TransformerConfig(vocab_size=37000, width=width, num_heads=heads, mlp_dim=mlp)
  count = parameter_count(config)
  assert count == expected_parameters(37000, width, mlp, 6)
  assert abs(count / 1e6 - paper_millions) / paper_millions < 0.04
  unshared = parameter_count(dataclasses.replace(config, share_embeddings=False))
  assert unshared == expected_parameters(37000, width, mlp, 6, shared=False)


def peaky_model(seed):
  """A random model with sharper output distributions, so searches disagree often."""
  model = tiny(seed)
  model.source_embedding.embedding[...] = model.source_embedding.embedding[...] * 4.0
  return model


@nnx.jit
def log_softmax_forward(model, source, target_in):
  """The model's log-probabilities as one compiled program (op by op, each call compiles ~50)."""
  return jax.nn.log_softmax(model(source, target_in), axis=-1)


def teacher_forced_logprob(model, source, tokens):
  """Per row: sum of log p(token) over the tokens up to EOS, from one uncached forward pass."""
  rows = [row + [EOS] for row in decoding.strip(tokens, EOS)]
  # As wide as the decoded [B, T_max] (+ 1), not the longest row: greedy and beam outputs share one
  # program (the decoder is causal: columns after a row's end change none of its log-probabilities).
  target_in = np.full((len(rows), np.shape(tokens)[1] + 1), PAD, np.int32)
  for r, row in enumerate(rows):
    target_in[r, :len(row)] = [BOS] + row[:-1]
  logprobs = np.asarray(log_softmax_forward(model, source, jnp.asarray(target_in)))
  total = [sum(logprobs[r, i, t] for i, t in enumerate(row)) for r, row in enumerate(rows)]
  return np.array(total), np.array([len(r) for r in rows])


def test_translate_beam_scores_are_exact_and_beat_greedy():
  # (beam size 1 == greedy is tested on a toy model in test_beam_search.py and on every family in test_decoding.py)
  model = peaky_model(5)
  source, _ = batch(5, rows=6)
  kwargs = dict(bos_id=BOS, eos_id=EOS, max_len_ratio=1.0, max_len_offset=4)
  greedy, greedy_logprob = translate(model, source, beam_size=1, **kwargs)
  beam, beam_scores = translate(model, source, beam_size=4, alpha=0.6, **kwargs)
  # Scores are re-derived from the uncached model, so cache reordering errors would show here.
  logprob, lengths = teacher_forced_logprob(model, source, beam)
  # A score sums <= 11 tokens' log-probabilities, each with a normalizer over the vocabulary.
  score_terms = TERMS + TINY.vocab_size + 11
  assert_close(beam_scores, logprob / decoding.length_penalty(lengths, 0.6), terms=score_terms)
  greedy_rescored, greedy_lengths = teacher_forced_logprob(model, source, greedy)
  assert_close(greedy_logprob, greedy_rescored, terms=score_terms)
  greedy_scores = greedy_rescored / decoding.length_penalty(greedy_lengths, 0.6)
  slack = tolerance(terms=score_terms, scale=float(np.abs(greedy_scores).max()))  # a tie may round either way
  assert np.all(np.asarray(beam_scores) >= greedy_scores - slack)
  assert not np.array_equal(beam, greedy), 'the test should exercise a case where beam search differs'


def test_logits_match_hugging_face_marian():
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  config = TINY
  model = tiny(6)
  hf_config = transformers.MarianConfig(
      vocab_size=config.vocab_size, d_model=config.width, encoder_layers=2, decoder_layers=2,
      encoder_attention_heads=config.num_heads, decoder_attention_heads=config.num_heads,
      encoder_ffn_dim=config.mlp_dim, decoder_ffn_dim=config.mlp_dim, activation_function='relu',
      max_position_embeddings=config.max_len, pad_token_id=PAD, decoder_start_token_id=BOS, eos_token_id=EOS,
      scale_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
  hf = transformers.MarianMTModel(hf_config).eval()
  load_into_marian(model, hf, torch)
  source, target = batch(6)
  ours = forward(model, source, target)
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(np.asarray(source)), attention_mask=torch.tensor(np.asarray(source != PAD)),
                decoder_input_ids=torch.tensor(np.asarray(target))).logits.numpy()
  assert_close(ours, theirs, terms=TERMS)


def load_into_marian(model, hf, torch):
  """Copy our parameters into a MarianMTModel (torch Linear weights are [out, in])."""
  t = lambda x: torch.tensor(np.asarray(x))
  linear = lambda dst, src: (dst.weight.data.copy_(t(src.kernel[...]).T), dst.bias.data.copy_(t(src.bias[...])))
  norm = lambda dst, src: (dst.weight.data.copy_(t(src.scale[...])), dst.bias.data.copy_(t(src.bias[...])))

  def attention(dst, src):
    for a, b in (('q_proj', 'query'), ('k_proj', 'key'), ('v_proj', 'value'), ('out_proj', 'out')):
      linear(getattr(dst, a), getattr(src, b))

  hf.model.shared.weight.data.copy_(t(model.source_embedding.embedding[...]))
  # Marian lays sines and cosines out in halves; the paper (and we) interleave them.
  table = t(sinusoidal_positions(model.config.max_len, model.config.width))
  hf.model.encoder.embed_positions.weight.data.copy_(table)
  hf.model.decoder.embed_positions.weight.data.copy_(table)
  for ours, theirs in zip(model.encoder_blocks, hf.model.encoder.layers):
    attention(theirs.self_attn, ours.self_attention)
    norm(theirs.self_attn_layer_norm, ours.self_attention_norm)
    linear(theirs.fc1, ours.mlp.up)
    linear(theirs.fc2, ours.mlp.down)
    norm(theirs.final_layer_norm, ours.mlp_norm)
  for ours, theirs in zip(model.decoder_blocks, hf.model.decoder.layers):
    attention(theirs.self_attn, ours.self_attention)
    norm(theirs.self_attn_layer_norm, ours.self_attention_norm)
    attention(theirs.encoder_attn, ours.cross_attention)
    norm(theirs.encoder_attn_layer_norm, ours.cross_attention_norm)
    linear(theirs.fc1, ours.mlp.up)
    linear(theirs.fc2, ours.mlp.down)
    norm(theirs.final_layer_norm, ours.mlp_norm)


def test_count_parameters_of_a_built_model_matches_the_abstract_count():
  assert count_parameters(tiny()) == parameter_count(TINY) == expected_parameters(19, 32, 48, 2)


# ----------------------------------------------------------------------------- packing
def ragged_pairs(count, length, seed):
  """`count` right-padded example rows {'source', 'target_in', 'target_out'} [count, length], 1 to 9 tokens a side."""
  rng = np.random.default_rng(seed)
  examples = {name: np.full((count, length), PAD, np.int32) for name in ('source', 'target_in', 'target_out')}
  for row in range(count):
    s, t = rng.integers(1, 10, 2)
    examples['source'][row, :s] = rng.integers(3, TINY.vocab_size, s)
    target = rng.integers(3, TINY.vocab_size, t)
    examples['target_in'][row, :t] = np.concatenate([[BOS], target[:-1]])
    examples['target_out'][row, :t] = target
  return examples


def test_packed_rows_give_the_unpacked_loss_and_gradients():
  from data.batching import pack_pairs
  from train.losses import lm_loss
  model = tiny(5, max_len=24)
  examples = ragged_pairs(12, 24, seed=5)
  packed, left_out = pack_pairs(examples, rows=5, pad_id=PAD)
  assert left_out == 0 and packed['source_segments'].max() >= 3  # several pairs per row
  for side, tokens in (('source', 'source'), ('target', 'target_out')):
    assert np.array_equal(packed[f'{side}_segments'] > 0, packed[tokens] != PAD)
    assert (packed[tokens] != PAD).sum() == (examples[tokens] != PAD).sum()  # every pair placed once

  def loss(model, batch):
    logits = model(batch['source'], batch['target_in'], source_segments=batch.get('source_segments'),
                   target_segments=batch.get('target_segments'))
    return lm_loss(logits, batch['target_out'], batch['target_out'] != PAD)[0]

  as_jax = lambda batch: {k: jnp.asarray(v) for k, v in batch.items()}
  # One compiled program per layout: run op by op, the forward and backward passes build hundreds.
  value_and_grad = nnx.jit(nnx.value_and_grad(loss))
  unpacked = value_and_grad(model, as_jax(examples))
  packed_result = value_and_grad(model, as_jax(packed))
  # The loss adds the normalizer and the mean over the real tokens; gradients sum over every position.
  terms = transformer_terms(6, TINY.width, TINY.mlp_dim, 24, vocab=TINY.vocab_size, positions=12 * 24)
  assert_close(packed_result[0], unpacked[0], terms=terms)
  assert_trees_close(packed_result[1], unpacked[1], terms=terms)


def test_attention_never_crosses_segments():
  from data.batching import pack_pairs
  model = tiny(6, max_len=24)
  packed, _ = pack_pairs(ragged_pairs(8, 24, seed=6), rows=2, pad_id=PAD)
  segments = {name: jnp.asarray(packed[name]) for name in ('source_segments', 'target_segments')}
  run = lambda source, target_in: forward(model, jnp.asarray(source), jnp.asarray(target_in), **segments)
  reference = run(packed['source'], packed['target_in'])
  # New tokens for segment 2 on both sides: every other position keeps its logits.
  rng = np.random.default_rng(0)
  changed = {name: np.where(packed[f'{side}_segments'] == 2, rng.integers(3, TINY.vocab_size, packed[name].shape),
                            packed[name]) for name, side in (('source', 'source'), ('target_in', 'target'))}
  logits = run(changed['source'], changed['target_in'])
  in_two = packed['target_segments'] == 2
  assert_close(np.asarray(logits)[~in_two], np.asarray(reference)[~in_two], terms=TERMS)
  assert np.abs(np.asarray(logits - reference)[in_two]).max() > 1e-3


def test_positions_restart_in_every_segment():
  from models.transformer import positions_in_segments
  np.testing.assert_array_equal(positions_in_segments(jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]])),
                                [[0, 1, 2, 0, 1, 0, 0, 1]])


# ----------------------------------------------------------------------------- the task
def write_tsv(path, count=600):
  """A toy corpus: English number words -> digits, enough for the tiny preset's splits."""
  from num2words import num2words
  path.write_text('\n'.join(f'{num2words(n)}\t{n}' for n in range(count)), encoding='utf-8')
  return str(path)


def tiny_config(tmp_path):
  from configs.transformer import get_config
  config = get_config('tiny')
  config.data.source = 'tsv:' + write_tsv(tmp_path / 'pairs.tsv')
  return config


def test_loss_is_label_smoothed_cross_entropy_over_real_target_tokens(tmp_path):
  config = tiny_config(tmp_path)
  config.data.packing = False  # one pair per row; packed rows have their own test
  task = prepare_task(config, str(tmp_path / 'run'))
  # Built eagerly: one compilation per parameter shape (as one program, every parameter's random draw compiles).
  model = task.build_model(nnx.Rngs(0))
  batch = {k: jnp.asarray(v) for k, v in task.example_batch(3).items()}
  target_out = np.array(batch['target_out'])
  target_out[0, 5:] = task.tokenizer.pad_id  # ragged real lengths
  target_out[2, 1:] = task.tokenizer.pad_id
  batch['target_out'] = jnp.asarray(target_out)
  # The loss and the logits as one program (one compilation of the model's forward pass, not two).
  (loss, metrics), logits = nnx.jit(lambda m, b: (task.loss(m, b, deterministic=True),
                                                  m(b['source'], b['target_in'])))(model, batch)
  logits = np.asarray(logits, np.float64)
  logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
      logits.max(-1, keepdims=True)
  eps, vocab = config.train.label_smoothing, logits.shape[-1]
  real = target_out != task.tokenizer.pad_id
  picked = np.take_along_axis(logprobs, target_out[..., None], -1)[..., 0]
  per_token = -(1 - eps) * picked - eps / vocab * logprobs.sum(-1)
  config_model = task.model_config
  assert_close(loss, per_token[real].mean(), terms=transformer_terms(
      config_model.encoder_layers + 2 * config_model.decoder_layers, config_model.width, config_model.mlp_dim,
      target_out.shape[1], vocab=vocab, positions=real.sum()))
  assert float(metrics['loss'][1]) == real.sum()
  assert float(metrics['accuracy'][0]) == (logits.argmax(-1) == target_out)[real].sum()  # a count: exact


def test_the_task_chooses_packed_length_bucketed_or_shuffled_batches():
  from configs.transformer import get_config
  from data import batching
  from data.tokenizers import CharTokenizer
  from train.task import task_without_data
  config = get_config('tiny')
  plan = lambda: task_without_data(config, CharTokenizer('abc')).batch_plan()
  pad = CharTokenizer('abc').pad_id
  assert plan() == batching.Packed(pad)  # the default
  config.data.packing = False
  assert plan() == batching.LengthBuckets(pad, config.data.seq_len, config.data.min_bucket_len)
  config.data.min_bucket_len = 0
  assert plan() == batching.Shuffled()


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """One 4-step packed run on the number-words corpus, a checkpoint every 2 steps, its final evaluation
  with BLEU (greedy and beam) and pictures: (config, workdir, results); read by the tests below."""
  from train import trainer
  tmp_path = tmp_path_factory.mktemp('transformer_run')
  config = tiny_config(tmp_path)
  config.train.update(steps=4, eval_every=4, checkpoint_every=2, log_every=1, eval_steps=1)
  workdir = str(tmp_path / 'run')
  return config, workdir, trainer.train_and_evaluate(config, workdir)


def test_packed_training_resumes_bit_exactly_and_reports_real_tokens(trained, tmp_path):
  import support
  from train.rundir import load_run
  from train import trainer
  config, straight, _ = trained
  resumed = support.copy_run_back_to(straight, 2, str(tmp_path / 'resumed'))  # the packer's position too
  # Its final evaluation scores and decodes one example (the parameters are what is compared; the
  # straight run's evaluation is read by test_train_evaluate_predict_on_a_tsv_corpus).
  resumed_config = copy.deepcopy(config)
  resumed_config.train.update(final_eval_examples=1, final_decode_examples=1)
  trainer.train_and_evaluate(resumed_config, resumed)
  a, b = (nnx.state(load_run(workdir).model, nnx.Param) for workdir in (straight, resumed))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # tokens/s counts target positions, padding included; real_tokens/s only the real target tokens
  # of the same batches: their ratio at step 1 is the first batch's share of real tokens.
  import json
  import os
  with open(os.path.join(straight, 'metrics.jsonl')) as f:
    first = next(m for m in map(json.loads, f) if m['step'] == 1 and 'train/tokens_per_s' in m)
  task = prepare_task(config, straight)
  datasets = task.prepared.datasets
  batch = task.batch_plan().global_batches(datasets.train, config.train.batch_size, config.seed, 0, 1)[0]
  real_share = (batch['target_out'] != task.tokenizer.pad_id).mean()
  assert 0.2 < real_share < 1.0
  assert_close(first['train/real_tokens_per_s'] / first['train/tokens_per_s'], real_share, terms=2)  # two rates' ratio


def test_train_evaluate_predict_on_a_tsv_corpus(trained):
  import json
  import os
  from train.rundir import load_run
  config, workdir, results = trained
  assert results['step'] == config.train.steps
  for key in ('test/bleu', 'test/bleu_greedy', 'test/accuracy', 'eval/loss'):
    assert np.isfinite(results[key]), key
  (name, path), = results['images'].items()
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  with open(os.path.join(workdir, 'translations.json')) as f:
    assert {'source', 'reference', 'greedy', 'beam'} <= set(json.load(f)[0])
  run = load_run(workdir)
  outputs = run.predict(['seven', 'one hundred and twelve'])
  assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
