"""Read a Hugging Face BERT directory (config.json, weights, vocabulary) into `models.bert`.

Weights come from model.safetensors (read as NumPy by `safetensors`, sharded files included) or
pytorch_model.bin (needs torch). Checkpoints of BertModel, BertForPreTraining, BertForMaskedLM
and BertForSequenceClassification all work: the encoder is always read, the pretraining heads
when present. HF stores linear weights as [out, in]; `nnx.Linear.kernel` is [in, out]. Old
Google checkpoints name LayerNorm parameters gamma/beta instead of weight/bias.

The tokenizer is the directory's tokenizer.json when there is one, else a WordPiece built from
vocab.txt with BERT's normalisation, which reproduces `BertTokenizerFast`'s ids.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bert import BertConfig, BertEncoder, BertForPretraining

# HF `hidden_act` -> models.layers.ACTIVATIONS key.
HF_ACTIVATIONS = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'relu': 'relu'}
# Tensors a BERT checkpoint may carry that no model here uses.
_IGNORED_SUFFIXES = ('position_ids', 'cls.predictions.decoder.weight', 'cls.predictions.decoder.bias')


def bert_config_from_hf(hf_dir: str, **overrides) -> BertConfig:
  """BertConfig from `hf_dir/config.json`; `overrides` set the fields HF does not store (dtype, attention)."""
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} not found: --hf_dir must be a Hugging Face BERT directory.')
  with open(path) as f:
    hf = json.load(f)
  if hf.get('model_type') not in (None, 'bert'):
    raise ValueError(f"{path} describes a {hf.get('model_type')!r} model, not 'bert'; use that family's config.")
  if hf.get('position_embedding_type', 'absolute') != 'absolute':
    raise ValueError(f"{path}: position_embedding_type={hf['position_embedding_type']!r} is not supported "
                     f"(only learned absolute positions).")
  activation = hf.get('hidden_act', 'gelu')
  if activation not in HF_ACTIVATIONS:
    raise ValueError(f'{path}: hidden_act={activation!r} is not supported; use one of {sorted(HF_ACTIVATIONS)}.')
  return BertConfig(
      vocab_size=hf['vocab_size'], max_len=hf.get('max_position_embeddings', 512),
      type_vocab_size=hf.get('type_vocab_size', 2), num_layers=hf['num_hidden_layers'],
      num_heads=hf['num_attention_heads'], width=hf['hidden_size'], mlp_dim=hf['intermediate_size'],
      dropout=hf.get('hidden_dropout_prob', 0.1), attention_dropout=hf.get('attention_probs_dropout_prob', 0.1),
      layer_norm_epsilon=hf.get('layer_norm_eps', 1e-12), activation=HF_ACTIVATIONS[activation],
      init_std=hf.get('initializer_range', 0.02), **overrides)


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
  """All tensors of the checkpoint as float32 NumPy, names without the 'bert.' prefix and with
  LayerNorm gamma/beta renamed weight/bias."""
  files = [os.path.join(hf_dir, name) for name in ('model.safetensors', 'pytorch_model.bin')]
  for index_name in ('model.safetensors.index.json', 'pytorch_model.bin.index.json'):
    index = os.path.join(hf_dir, index_name)
    if os.path.exists(index):
      with open(index) as f:
        shards = sorted(set(json.load(f)['weight_map'].values()))
      files.insert(0, [os.path.join(hf_dir, s) for s in shards])
  for candidate in files:
    paths = candidate if isinstance(candidate, list) else [candidate]
    if all(os.path.exists(p) for p in paths):
      tensors = {}
      for path in paths:
        tensors.update(_read_tensor_file(path))
      return {_normalise_name(k): v for k, v in tensors.items()}
  raise FileNotFoundError(f'No weights in {hf_dir}: expected model.safetensors or pytorch_model.bin '
                          f'(or their sharded .index.json forms).')


def _read_tensor_file(path: str) -> dict[str, np.ndarray]:
  if path.endswith('.safetensors'):
    from safetensors.numpy import load_file
    return {k: np.asarray(v, np.float32) for k, v in load_file(path).items()}
  try:
    import torch
  except ImportError as e:
    raise ImportError(f'{path} is a PyTorch file and reading it needs torch (pip install torch), or convert '
                      f'the checkpoint to model.safetensors.') from e
  state = torch.load(path, map_location='cpu', weights_only=True)
  return {k: v.float().numpy() for k, v in state.items()}


def _normalise_name(name: str) -> str:
  name = name.removeprefix('bert.')
  if 'LayerNorm.' in name:
    name = name.replace('LayerNorm.gamma', 'LayerNorm.weight').replace('LayerNorm.beta', 'LayerNorm.bias')
  return name


class _Loader:
  """Copies named tensors into NNX variables, checking shapes and remembering what was used."""

  def __init__(self, weights: dict[str, np.ndarray]):
    self.weights = weights
    self.used: set[str] = set()

  def take(self, name: str) -> np.ndarray:
    if name not in self.weights:
      raise ValueError(f'The checkpoint lacks {name!r}; is it a BERT checkpoint matching config.json?')
    self.used.add(name)
    return self.weights[name]

  def assign(self, variable, value: np.ndarray) -> None:
    if variable.shape != value.shape:
      raise ValueError(f'Shape mismatch: checkpoint {value.shape} vs model {variable.shape}.')
    variable[...] = jnp.asarray(value, variable.dtype)

  def linear(self, linear: nnx.Linear, name: str) -> None:
    self.assign(linear.kernel, self.take(name + '.weight').T)
    self.assign(linear.bias, self.take(name + '.bias'))

  def norm(self, norm: nnx.LayerNorm, name: str) -> None:
    self.assign(norm.scale, self.take(name + '.weight'))
    self.assign(norm.bias, self.take(name + '.bias'))


def load_encoder_weights(encoder: BertEncoder, weights: dict[str, np.ndarray]) -> set[str]:
  """Fill every parameter of `encoder` from normalised HF names; returns the names used."""
  load = _Loader(weights)
  embeddings = encoder.embeddings
  load.assign(embeddings.token.embedding, load.take('embeddings.word_embeddings.weight'))
  load.assign(embeddings.position.embedding, load.take('embeddings.position_embeddings.weight'))
  load.assign(embeddings.segment.embedding, load.take('embeddings.token_type_embeddings.weight'))
  load.norm(embeddings.norm, 'embeddings.LayerNorm')
  for i, block in enumerate(encoder.blocks):
    prefix = f'encoder.layer.{i}.'
    attention = block.self_attention
    load.linear(attention.query, prefix + 'attention.self.query')
    load.linear(attention.key, prefix + 'attention.self.key')
    load.linear(attention.value, prefix + 'attention.self.value')
    load.linear(attention.out, prefix + 'attention.output.dense')
    load.norm(block.self_attention_norm, prefix + 'attention.output.LayerNorm')
    load.linear(block.mlp.up, prefix + 'intermediate.dense')
    load.linear(block.mlp.down, prefix + 'output.dense')
    load.norm(block.mlp_norm, prefix + 'output.LayerNorm')
  load.linear(encoder.pooler, 'pooler.dense')
  return load.used


def has_pretraining_heads(weights: dict[str, np.ndarray]) -> bool:
  return 'cls.predictions.bias' in weights and 'cls.seq_relationship.weight' in weights


def load_pretraining_head_weights(model: BertForPretraining, weights: dict[str, np.ndarray]) -> set[str]:
  """Fill the MLM and NSP heads (the MLM output matrix is the tied token embedding)."""
  load = _Loader(weights)
  load.linear(model.mlm.dense, 'cls.predictions.transform.dense')
  load.norm(model.mlm.norm, 'cls.predictions.transform.LayerNorm')
  load.assign(model.mlm.bias, load.take('cls.predictions.bias'))
  load.linear(model.nsp, 'cls.seq_relationship')
  return load.used


def wordpiece_from_vocab(vocab_file: str, lowercase: bool = True):
  """BERT's tokenizer (normalise, split on whitespace and punctuation, WordPiece, [CLS]/[SEP]
  template) around an existing vocab.txt; matches `BertTokenizerFast(vocab_file, do_lower_case=lowercase)`."""
  import tokenizers
  from tokenizers import models

  from data.tokenizers import HFTokenizer, configure_wordpiece
  if not os.path.exists(vocab_file):
    raise FileNotFoundError(f'{vocab_file} not found: a WordPiece vocabulary has one token per line.')
  tokenizer = tokenizers.Tokenizer(models.WordPiece(models.WordPiece.read_file(vocab_file), unk_token='[UNK]'))
  for token in ('[UNK]', '[CLS]', '[SEP]', '[PAD]', '[MASK]'):
    if tokenizer.token_to_id(token) is None:
      raise ValueError(f'{vocab_file} lacks the special token {token}; it is not a BERT vocabulary.')
  return HFTokenizer(configure_wordpiece(tokenizer, lowercase), 'wordpiece')


def read_hf_tokenizer(hf_dir: str):
  """tokenizer.json when present, else vocab.txt with tokenizer_config.json's do_lower_case (default True)."""
  import tokenizers

  from data.tokenizers import HFTokenizer
  path = os.path.join(hf_dir, 'tokenizer.json')
  if os.path.exists(path):
    return HFTokenizer(tokenizers.Tokenizer.from_file(path), 'wordpiece')
  lowercase = True
  settings = os.path.join(hf_dir, 'tokenizer_config.json')
  if os.path.exists(settings):
    with open(settings) as f:
      lowercase = json.load(f).get('do_lower_case', True)
  vocab = os.path.join(hf_dir, 'vocab.txt')
  if not os.path.exists(vocab):
    raise FileNotFoundError(f'No tokenizer in {hf_dir}: expected tokenizer.json or vocab.txt.')
  return wordpiece_from_vocab(vocab, lowercase)


def load_hf_bert(hf_dir: str, *, rngs: nnx.Rngs, tokenizer: bool = True, **config_overrides):
  """(BertForPretraining, tokenizer or None, heads_loaded) read from `hf_dir`.

  Without pretraining heads in the checkpoint the heads keep their fresh initialisation and
  `heads_loaded` is False (the encoder, the part fine-tuning and features use, is complete).
  """
  config = bert_config_from_hf(hf_dir, **config_overrides)
  weights = read_weights(hf_dir)
  model = BertForPretraining(config, rngs=rngs)
  used = load_encoder_weights(model.encoder, weights)
  heads = has_pretraining_heads(weights)
  if heads:
    used |= load_pretraining_head_weights(model, weights)
  unused = sorted(k for k in weights if k not in used and not k.endswith(_IGNORED_SUFFIXES)
                  and not k.startswith('classifier.'))
  if unused:
    raise ValueError(f'The checkpoint has tensors this BERT does not use: {unused[:5]}; is config.json right?')
  return model, (read_hf_tokenizer(hf_dir) if tokenizer else None), heads
