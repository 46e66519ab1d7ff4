"""BERT: parameter counts against transformers, HF import parity (weights and tokenizer)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import support
from models.bert import BertClassifier, BertConfig, BertEncoder, BertForPretraining
from numerics import assert_close, transformer_terms

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.numerics  # parity, gradients, kernels: .ci/run reruns them with AVX2 only

# Models run compiled: op-by-op eager execution of even tiny BERTs costs seconds per call.
forward = nnx.jit(lambda model, *args, **kwargs: model(*args, **kwargs))

SENTENCES = [
    'Héllo, wörld! The naïve café-owner said: "¿Qué tal?"',
    "Don't panic -- it's 3.14159 (approximately).",
    'Unknownwordzzqx and Zyxomorph émigré façade; résumé... ÅNGSTRÖM #hashtag @user',
    'A second sentence, with commas, and CAPITALS.',
]


def hf_count(**kwargs) -> int:
  with torch.device('meta'):  # shapes only: no 110M-parameter random init
    model = transformers.BertModel(transformers.BertConfig(**kwargs))
  return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('size', ['base', 'large'])
def test_encoder_parameter_count_matches_transformers(size):
  from configs.bert import get_config
  config = get_config(size)
  config = BertConfig(**{**{k: v for k, v in config.model.items() if k in BertConfig.__dataclass_fields__},
                         'vocab_size': config.data.vocab_size, 'attention': 'xla',
                         'dtype': 'float32'})
  assert (config.vocab_size, config.max_len, config.vocab_multiple) == (30522, 512, 128)
  count = lambda config: support.abstract_parameter_count(config, lambda c: BertEncoder(c, rngs=nnx.Rngs(0)))
  unpadded = count(dataclasses.replace(config, vocab_multiple=1))
  theirs = hf_count(hidden_size=config.width, num_hidden_layers=config.num_layers,
                    num_attention_heads=config.num_heads, intermediate_size=config.mlp_dim)
  assert unpadded == theirs
  assert unpadded == {'base': 109_482_240, 'large': 335_141_888}[size]
  # The presets pad the 30,522 ids to 30,592 embedding rows: 70 more rows of zeros, never used.
  assert count(config) == unpadded + 70 * config.width


SMALL = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=40, type_vocab_size=2)


def random_hf_bert(cls, seed=0):
  """A small transformers BERT whose every parameter (LayerNorm and biases too) is random."""
  torch.manual_seed(seed)
  model = cls(transformers.BertConfig(**SMALL))
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.2)
  return model.eval()


# SMALL's logits: 2 blocks over 12 tokens, then a head's two projections (the MLM transform or the
# pooler, and the output layer).
HEAD_TERMS = transformer_terms(2, 32, 48, 12) + 2 * 32


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, SMALL['vocab_size'], (2, 12))
  segments = np.zeros_like(tokens)
  segments[:, 7:] = 1
  valid = np.ones_like(tokens, dtype=bool)
  valid[1, 9:] = False
  return tokens, segments, valid


def hf_outputs(model, tokens, segments, valid):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(segments),
                 attention_mask=torch.tensor(valid.astype(np.int64)), output_hidden_states=True)


@pytest.mark.parametrize('weights_file', ['model.safetensors', 'pytorch_model.bin'])
def test_import_pretraining_checkpoint_matches_transformers(tmp_path, weights_file):
  from interop.hf_bert import import_bert
  hf = random_hf_bert(transformers.BertForPreTraining)
  hf.save_pretrained(tmp_path)
  if weights_file == 'pytorch_model.bin':
    (tmp_path / 'model.safetensors').unlink()
    torch.save(hf.state_dict(), tmp_path / 'pytorch_model.bin')
  model, _, _, heads = import_bert(str(tmp_path), tokenizer=False)
  assert heads
  tokens, segments, valid = inputs()
  expected = hf_outputs(hf, tokens, segments, valid)
  ours = forward(model, jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(valid))
  assert len(ours.encoder.hidden_states) == SMALL['num_hidden_layers'] + 1
  for layers, (mine, theirs) in enumerate(zip(ours.encoder.hidden_states, expected.hidden_states)):
    assert_close(mine, theirs.numpy(), terms=transformer_terms(layers, 32, 48, 12), err_msg=f'after {layers} layers')
  assert_close(support.real_logits(ours.mlm_logits, SMALL['vocab_size']), expected.prediction_logits.numpy(),
               terms=HEAD_TERMS)
  assert_close(ours.nsp_logits, expected.seq_relationship_logits.numpy(), terms=HEAD_TERMS)
  # The MLM head on gathered positions equals the full logits at those positions.
  positions = jnp.asarray([[1, 3, 8], [0, 2, 5]])
  gathered = forward(model, jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(valid),
                     masked_positions=positions)
  at_positions = np.take_along_axis(np.asarray(ours.mlm_logits), np.asarray(positions)[..., None], 1)
  assert_close(gathered.mlm_logits, at_positions, terms=HEAD_TERMS)


def test_import_encoder_only_checkpoint(tmp_path):
  from interop.hf_bert import import_bert
  hf = random_hf_bert(transformers.BertModel, seed=1)
  hf.save_pretrained(tmp_path)
  model, _, _, heads = import_bert(str(tmp_path), tokenizer=False)
  assert not heads
  tokens, segments, valid = inputs(1)
  expected = hf_outputs(hf, tokens, segments, valid)
  ours = forward(model.encoder, jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(valid))
  assert_close(ours.sequence, expected.last_hidden_state.numpy(), terms=transformer_terms(2, 32, 48, 12))
  assert_close(ours.pooled, expected.pooler_output.numpy(), terms=HEAD_TERMS)


def test_import_rejects_mismatched_config(tmp_path):
  from interop.common import HFImportError
  from interop.hf_bert import import_bert
  random_hf_bert(transformers.BertModel).save_pretrained(tmp_path)
  config = (tmp_path / 'config.json').read_text().replace('"intermediate_size": 48', '"intermediate_size": 64')
  (tmp_path / 'config.json').write_text(config)
  with pytest.raises(HFImportError, match=r'is \[48, 32\], but its config.json implies \[64, 32\]'):
    import_bert(str(tmp_path), tokenizer=False)


def write_vocab(path):
  """A BERT-style vocabulary with HF's special-token layout ([PAD] 0, [UNK] 100, ...)."""
  words = ['hello', 'world', 'the', 'na', '##ive', 'cafe', 'owner', 'said', 'que', 'tal', 'don', "'", 't',
           'panic', 'it', 's', '3', '.', '14', '##15', '##9', 'approximately', 'unknown', '##word', 'and',
           'emigre', 'facade', 'resume', 'angstrom', '#', 'hash', '##tag', '@', 'user', 'a', 'second',
           'sentence', ',', 'with', 'commas', 'capitals', '-', '"', ':', '!', '?', '¿', '(', ')', ';', 'é',
           'Hello', 'The', 'A', 'CA', '##PI', '##TA', '##LS', '##é', 'caf', 'wörld', 'Qué', 'É']
  vocab = ['[PAD]'] + [f'[unused{i}]' for i in range(99)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words
  path.write_text('\n'.join(vocab) + '\n')
  return str(path)


@pytest.mark.parametrize('lowercase', [True, False])
def test_wordpiece_from_vocab_matches_bert_tokenizer_fast(tmp_path, lowercase):
  from interop.hf_bert import read_hf_tokenizer, wordpiece_from_vocab
  vocab = write_vocab(tmp_path / 'vocab.txt')
  reference = transformers.BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=lowercase)
  ours = wordpiece_from_vocab(vocab, lowercase=lowercase)
  unknown = 0
  for sentence in SENTENCES:
    expected = reference(sentence)['input_ids']
    assert [ours.bos_id] + ours.encode(sentence) + [ours.eos_id] == expected
    unknown += expected.count(ours.unk_id)
  assert unknown >= 2  # unknown words are part of what is compared
  pair = reference(SENTENCES[0], SENTENCES[1])
  assert ours.encode_pair(SENTENCES[0], SENTENCES[1]) == (pair['input_ids'], pair['token_type_ids'])
  # The saved tokenizer.json of a HF directory gives the same ids.
  reference.save_pretrained(tmp_path / 'hf')
  from_json = read_hf_tokenizer(str(tmp_path / 'hf'))
  assert all(from_json.encode_pair(s)[0] == reference(s)['input_ids'] for s in SENTENCES)


def test_classifier_head_and_padding_mask():
  """Padding tokens (any id) never change the encoder's real positions or the classifier's logits."""
  config = BertConfig(vocab_size=50, max_len=16, num_layers=2, num_heads=2, width=16, mlp_dim=32)
  model = BertClassifier(config, num_classes=3, rngs=nnx.Rngs(0))
  tokens = jnp.asarray([[2, 7, 8, 9, 3, 0, 0, 0]])
  valid = tokens != 0
  noisy = tokens.at[0, 5:].set(jnp.asarray([11, 12, 13]))
  logits = forward(model, tokens, None, valid)
  assert logits.shape == (1, 3)
  terms = transformer_terms(2, 16, 32, 8) + 2 * 16  # + the pooler and the classifier
  assert_close(forward(model, noisy, None, valid), logits, terms=terms)
  assert_close(forward(model, tokens[:, :5], None, valid[:, :5]), logits, terms=terms)


def test_init_statistics():
  """BERT's init: dense and embedding matrices ~ N(0, 0.02) truncated at 2 std, biases zero, LayerNorm one."""
  model = BertForPretraining(BertConfig(vocab_size=2000, num_layers=1, width=64, num_heads=2, mlp_dim=128,
                                        max_len=16), rngs=nnx.Rngs(0))
  block = model.encoder.blocks[0]
  for matrix in (model.encoder.embeddings.token.embedding, block.self_attention.query.kernel, block.mlp.up.kernel):
    values = np.asarray(matrix[...])
    # std of N(0, 1) truncated to [-2, 2] is 0.8796: the 0.02 is the untruncated std, as in TF BERT.
    assert abs(values.std() - 0.02 * 0.8796) < 0.001 and np.abs(values).max() <= 0.04 + 1e-6
  assert not np.asarray(block.mlp.up.bias[...]).any() and not np.asarray(model.mlm.bias[...]).any()
  assert np.all(np.asarray(block.mlp_norm.scale[...]) == 1)
