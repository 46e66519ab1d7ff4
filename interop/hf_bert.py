"""BERT and Hugging Face: read a BERT directory (config.json, weights, vocabulary) into
`models.bert`, and write our BERTs as directories that `transformers` loads with no custom code.

Import: weights from model.safetensors (sharded files included) or pytorch_model.bin (needs
torch). Checkpoints of BertModel, BertForPreTraining, BertForMaskedLM and
BertForSequenceClassification all work: the encoder is always read, the pretraining heads when
present. Old Google checkpoints name LayerNorm parameters gamma/beta instead of weight/bias. The
tokenizer is the directory's tokenizer.json when there is one, else a WordPiece built from
vocab.txt with BERT's normalisation, which reproduces `BertTokenizerFast`'s ids.

Export: BertEncoder -> BertModel, BertForPretraining -> BertForPreTraining, BertClassifier ->
BertForSequenceClassification (label names in config.json's id2label).

HF stores linear weights as [out, in]; `nnx.Linear.kernel` is [in, out]. The MLM output matrix
is the tied token embedding (HF does not store `cls.predictions.decoder.*`). HF's word embeddings
and MLM bias hold the tokenizer's `vocab_size` rows; ours may be padded (`vocab_multiple`): the
padded rows are zeros on import and left out on export.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import numpy as np
import tokenizers
from flax import nnx

from data.tokenizers import HFTokenizer, configure_wordpiece
from interop.common import (HFImportError, TensorName, built_without_parameters, fields_from_hf, fields_to_hf,
                            layer_norm_names, linear_names, load_tensors, numpy_params, output_directory,
                            read_hf_config, read_json, read_tensors, reading_tokenizer,
                            refuse_options_without_counterpart, reject_unused, to_hf_tensors, write_json,
                            write_safetensors, write_tokenizer)
from models.bert import BertClassifier, BertConfig, BertEncoder, BertForPretraining

# HF `hidden_act` -> models.layers.ACTIVATIONS key, and back.
HF_ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'relu': 'relu'}
ACTIVATIONS_TO_HF = {'gelu': 'gelu', 'gelu_tanh': 'gelu_pytorch_tanh', 'relu': 'relu'}
# (config.json key, BertConfig field, value when the key is missing: None = required).
CONFIG_KEYS = (
    ('vocab_size', 'vocab_size', None), ('max_position_embeddings', 'max_len', 512),
    ('type_vocab_size', 'type_vocab_size', 2), ('num_hidden_layers', 'num_layers', None),
    ('num_attention_heads', 'num_heads', None), ('hidden_size', 'width', None), ('intermediate_size', 'mlp_dim', None),
    ('hidden_dropout_prob', 'dropout', 0.1), ('attention_probs_dropout_prob', 'attention_dropout', 0.1),
    ('layer_norm_eps', 'layer_norm_epsilon', 1e-12), ('initializer_range', 'init_std', 0.02))
# Tensors a BERT checkpoint may carry that no model here uses.
_IGNORED_SUFFIXES = ('position_ids', 'cls.predictions.decoder.weight', 'cls.predictions.decoder.bias')


class ImportedBert(NamedTuple):
  """heads_loaded: the checkpoint held the MLM and NSP heads (else they keep their fresh init)."""
  model: BertForPretraining
  tokenizer: HFTokenizer | None
  config: BertConfig
  heads_loaded: bool


def encoder_tensor_names(config: BertConfig, prefix: str = '', path: tuple = ()) -> list[TensorName]:
  """Every BertEncoder parameter (below `path` in the model) with its HF name: prefix 'bert.'
  inside BertForPreTraining / BertForSequenceClassification files, '' in BertModel ones. HF
  shapes: embeddings [rows, E]; query/key/value/output.dense of attention [E, E], intermediate
  [F, E], output [E, F] (all [out, in], transposed from our kernels)."""
  names = [TensorName(prefix + 'embeddings.word_embeddings.weight', (path + ('embeddings', 'token', 'embedding'),),
                      rows=config.vocab_size),
           TensorName(prefix + 'embeddings.position_embeddings.weight',
                      (path + ('embeddings', 'position', 'embedding'),)),
           TensorName(prefix + 'embeddings.token_type_embeddings.weight',
                      (path + ('embeddings', 'segment', 'embedding'),))]
  names += layer_norm_names(prefix + 'embeddings.LayerNorm', path + ('embeddings', 'norm'))
  for i in range(config.num_layers):
    hf, block = f'{prefix}encoder.layer.{i}.', path + ('blocks', i)
    attention = block + ('self_attention',)
    for part in ('query', 'key', 'value'):
      names += linear_names(hf + 'attention.self.' + part, attention + (part,), transpose=True)
    names += linear_names(hf + 'attention.output.dense', attention + ('out',), transpose=True)
    names += layer_norm_names(hf + 'attention.output.LayerNorm', block + ('self_attention_norm',))
    names += linear_names(hf + 'intermediate.dense', block + ('mlp', 'up'), transpose=True)
    names += linear_names(hf + 'output.dense', block + ('mlp', 'down'), transpose=True)
    names += layer_norm_names(hf + 'output.LayerNorm', block + ('mlp_norm',))
  return names + linear_names(prefix + 'pooler.dense', path + ('pooler',), transpose=True)


def pretraining_head_names(config: BertConfig) -> list[TensorName]:
  """The MLM transform and bias and the NSP layer of BertForPretraining."""
  return (linear_names('cls.predictions.transform.dense', ('mlm', 'dense'), transpose=True)
          + layer_norm_names('cls.predictions.transform.LayerNorm', ('mlm', 'norm'))
          + [TensorName('cls.predictions.bias', (('mlm', 'bias'),), rows=config.vocab_size)]
          + linear_names('cls.seq_relationship', ('nsp',), transpose=True))


def tensor_names(model: nnx.Module) -> tuple[str, list[TensorName]]:
  """(HF architecture, every parameter of `model` with its name in that architecture's files)."""
  config = model.config
  if isinstance(model, BertForPretraining):
    return 'BertForPreTraining', encoder_tensor_names(config, 'bert.', ('encoder',)) + pretraining_head_names(config)
  if isinstance(model, BertClassifier):
    return 'BertForSequenceClassification', (encoder_tensor_names(config, 'bert.', ('encoder',))
                                             + linear_names('classifier', ('classifier',), transpose=True))
  if isinstance(model, BertEncoder):
    return 'BertModel', encoder_tensor_names(config)
  raise TypeError(f'{type(model).__name__} is not a BERT model of models.bert.')


# ---------------------------------------------------------------------------------------- import
def bert_config_from_hf(hf_dir: str, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128
                        ) -> BertConfig:
  """BertConfig from `hf_dir/config.json`; dtype, attention and the vocabulary padding are not stored by HF."""
  hf = read_hf_config(hf_dir, 'bert')
  path = os.path.join(hf_dir, 'config.json')
  if hf.get('position_embedding_type', 'absolute') != 'absolute':
    raise HFImportError(f"{path}: position_embedding_type={hf['position_embedding_type']!r} is not supported "
                        f"(only learned absolute positions).")
  activation = hf.get('hidden_act', 'gelu')
  if activation not in HF_ACTIVATIONS:
    raise HFImportError(f'{path}: hidden_act={activation!r} is not supported; use one of {sorted(HF_ACTIVATIONS)}.')
  return BertConfig(**fields_from_hf(hf, CONFIG_KEYS, path), activation=HF_ACTIVATIONS[activation], dtype=dtype,
                    attention=attention, vocab_multiple=vocab_multiple)


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
  """All tensors of the checkpoint as float32 NumPy, names without the 'bert.' prefix and with
  LayerNorm gamma/beta renamed weight/bias."""
  return {_normalise_name(k): v for k, v in read_tensors(hf_dir).items()}


def _normalise_name(name: str) -> str:
  name = name.removeprefix('bert.')
  if 'LayerNorm.' in name:
    name = name.replace('LayerNorm.gamma', 'LayerNorm.weight').replace('LayerNorm.beta', 'LayerNorm.bias')
  return name


def has_pretraining_heads(weights: dict[str, np.ndarray]) -> bool:
  return 'cls.predictions.bias' in weights and 'cls.seq_relationship.weight' in weights


def wordpiece_from_vocab(vocab_file: str, lowercase: bool = True) -> HFTokenizer:
  """BERT's tokenizer (normalise, split on whitespace and punctuation, WordPiece, [CLS]/[SEP]
  template) around an existing vocab.txt; matches `BertTokenizerFast(vocab_file, do_lower_case=lowercase)`."""
  if not os.path.exists(vocab_file):
    raise HFImportError(f'{vocab_file} not found: a WordPiece vocabulary has one token per line.')
  wordpiece = tokenizers.models.WordPiece
  with reading_tokenizer(vocab_file):
    tokenizer = tokenizers.Tokenizer(wordpiece(wordpiece.read_file(vocab_file), unk_token='[UNK]'))
  for token in ('[UNK]', '[CLS]', '[SEP]', '[PAD]', '[MASK]'):
    if tokenizer.token_to_id(token) is None:
      raise HFImportError(f'{vocab_file} lacks the special token {token}; it is not a BERT vocabulary.')
  return HFTokenizer(configure_wordpiece(tokenizer, lowercase), 'wordpiece')


def read_hf_tokenizer(hf_dir: str) -> HFTokenizer:
  """tokenizer.json when present, else vocab.txt with tokenizer_config.json's do_lower_case (default True)."""
  path = os.path.join(hf_dir, 'tokenizer.json')
  if os.path.exists(path):
    with reading_tokenizer(path):
      return HFTokenizer(tokenizers.Tokenizer.from_file(path), 'wordpiece')
  lowercase = True
  settings = os.path.join(hf_dir, 'tokenizer_config.json')
  if os.path.exists(settings):
    lowercase = read_json(settings, "the tokenizer's settings").get('do_lower_case', True)
  vocab = os.path.join(hf_dir, 'vocab.txt')
  if not os.path.exists(vocab):
    raise HFImportError(f'No tokenizer in {hf_dir}: expected tokenizer.json or vocab.txt.')
  return wordpiece_from_vocab(vocab, lowercase)


def import_bert(hf_dir: str, *, dtype: str = 'float32', attention: str = 'xla', vocab_multiple: int = 128,
                rngs: nnx.Rngs | None = None, tokenizer: bool = True) -> ImportedBert:
  """(BertForPretraining, tokenizer or None, config, heads_loaded) read from `hf_dir`.

  Without pretraining heads in the checkpoint the heads keep their fresh initialisation from
  `rngs` and `heads_loaded` is False (the encoder, the part fine-tuning and features use, is
  complete). A tensor no model here has a place for is an error; classifier layers are skipped.
  `vocab_multiple` pads the token embedding (as run configs do, see models/layers.py).
  """
  config = bert_config_from_hf(hf_dir, dtype, attention, vocab_multiple)
  weights = read_weights(hf_dir)
  heads = has_pretraining_heads(weights)
  build = lambda rngs: BertForPretraining(config, rngs=rngs)
  if heads:  # every parameter read from the checkpoint: none initialised first
    model = built_without_parameters(build, rngs or nnx.Rngs(0))
    names = encoder_tensor_names(config, path=('encoder',)) + pretraining_head_names(config)
    used = load_tensors(model, weights, names, hf_dir)
  else:
    model = build(rngs or nnx.Rngs(0))
    used = load_tensors(model.encoder, weights, encoder_tensor_names(config), hf_dir)
  reject_unused(sorted(k for k in weights if k not in used and not k.endswith(_IGNORED_SUFFIXES)
                       and not k.startswith('classifier.')), hf_dir)
  return ImportedBert(model, read_hf_tokenizer(hf_dir) if tokenizer else None, config, heads)


# ---------------------------------------------------------------------------------------- export
def export_bert(model: nnx.Module, tokenizer, out_dir: str, *, labels: Sequence[str] = ()) -> dict:
  """Write a BertEncoder, BertForPretraining or BertClassifier and its WordPiece tokenizer as a
  Hugging Face directory: config.json, model.safetensors (float32, [out, in] linear weights) and
  tokenizer.json + tokenizer_config.json.

  labels: a classifier's class names, index i naming logit i (default LABEL_<i>).
  `out_dir` must not exist or be empty; it appears complete or not at all. Returns
  {'architecture', 'tensors', 'parameters'}.
  """
  config = model.config
  architecture, names = tensor_names(model)
  # zero_init_out changes only the initialisation: such models export.
  refuse_options_without_counterpart(config, {'qk_norm': bool, 'activation': lambda name: name not in ACTIVATIONS_TO_HF},
                                     architecture)
  hf_config = {'architectures': [architecture], 'model_type': 'bert', **fields_to_hf(config, CONFIG_KEYS),
               'hidden_act': ACTIVATIONS_TO_HF[config.activation], 'position_embedding_type': 'absolute',
               'pad_token_id': tokenizer.pad_id, 'tie_word_embeddings': True}
  if isinstance(model, BertClassifier):
    num_classes = model.classifier.out_features
    labels = list(labels) or [f'LABEL_{i}' for i in range(num_classes)]
    if len(labels) != num_classes:
      raise ValueError(f'{len(labels)} label names for a classifier of {num_classes} classes.')
    hf_config.update(id2label={str(i): name for i, name in enumerate(labels)},
                     label2id={name: i for i, name in enumerate(labels)})
  with output_directory(out_dir) as staging:
    tensors = to_hf_tensors(numpy_params(model), names)
    write_json(staging, 'config.json', {**hf_config, 'dtype': str(tensors[names[0].hf].dtype)})
    write_safetensors(staging, tensors)
    write_tokenizer(staging, tokenizer, max_len=config.max_len,
                    model_input_names=['input_ids', 'token_type_ids', 'attention_mask'],
                    special_tokens={'cls_token': tokenizer.bos_id, 'sep_token': tokenizer.eos_id,
                                    'pad_token': tokenizer.pad_id, 'unk_token': tokenizer.unk_id,
                                    'mask_token': tokenizer.token_id('[MASK]')})
  return {'architecture': architecture, 'tensors': len(tensors),
          'parameters': int(sum(t.size for t in tensors.values()))}
