"""What the Hugging Face importers and exporters share: one table of tensor names per family,
reading and writing weight files, tokenizer files and the atomic output directory.

A family describes its tensors once, as a list of `TensorName`s: the HF name, the path(s) of the
parameter(s) in our model's `nnx.to_pure_dict(nnx.state(model, nnx.Param))`, and whether HF
stores the matrix transposed. `load_tensors` (import) and `to_hf_tensors` (export) both read
that list, so the two directions cannot drift apart, and both check that it covers every
parameter of the model. A mixture of experts stacks its experts' matrices in one [N, ...]
parameter where HF files hold one tensor per expert: a `TensorName` with `expert=n` is slice n.
Our token embeddings (and BERT's MLM bias) may have padded vocabulary rows (models/layers.py)
that HF does not have: import fills them with zeros and export drops them, so HF files keep the
tokenizer's vocabulary size.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import shutil
import tempfile
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from tokenizers import decoders, pre_tokenizers

import storage
from data.tokenizers import BOS, EOS, PAD, UNK, CharTokenizer, HFTokenizer
from errors import UserError

ParamPath = tuple  # keys into a pure-dict parameter state: ('blocks', 0, 'mlp', 'up', 'kernel')


class HFExportError(UserError):
  """An export that cannot work (the target directory is taken, the family has no HF class)."""


class HFImportError(UserError):
  """A Hugging Face directory that cannot be read: config.json, the weights or the tokenizer
  missing, unreadable, incomplete, or not of one model."""


def refuse_options_without_counterpart(config, options: dict, architecture: str) -> None:
  """HFExportError naming the first model option `config` uses that Hugging Face's `architecture`
  lacks: `options` maps a model-config field to a test of its value (True: the option is on).
  Called before anything is written."""
  for field, is_on in options.items():
    value = getattr(config, field)
    if is_on(value):
      raise HFExportError(f"model.{field}={value!r} has no counterpart in Hugging Face's {architecture}, so this "
                          f'model cannot be exported (export_hf writes only models that class computes the same).')


def one_line(error: Exception) -> str:
  """`error`'s message on one line (the `tokenizers` and `safetensors` libraries write several)."""
  return ' '.join(str(error).split())


class TensorName(NamedTuple):
  """One HF tensor. `ours` holds one parameter path, or several whose arrays sit side by side on
  the last axis of the HF tensor (GPT-2's fused query/key/value); `transpose`: HF stores the
  matrix as [out, in] (torch.nn.Linear) while `nnx.Linear.kernel` is [in, out]; `rows`: HF holds
  only the first `rows` rows of our (untransposed) parameter, the rest being vocabulary padding;
  `expert`: HF holds only our parameter's [expert] slice on its leading [N] (experts) axis, and the
  table names every slice 0..N-1 of it."""
  hf: str
  ours: tuple[ParamPath, ...]
  transpose: bool = False
  rows: int | None = None
  expert: int | None = None


def linear_names(hf: str, ours: ParamPath, *, transpose: bool) -> list[TensorName]:
  return [TensorName(f'{hf}.weight', (ours + ('kernel',),), transpose), TensorName(f'{hf}.bias', (ours + ('bias',),))]


def layer_norm_names(hf: str, ours: ParamPath) -> list[TensorName]:
  return [TensorName(f'{hf}.weight', (ours + ('scale',),)), TensorName(f'{hf}.bias', (ours + ('bias',),))]


def leaf_paths(tree: dict, prefix: ParamPath = ()) -> Iterator[ParamPath]:
  """The path of every leaf of the nested dict `tree`."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from leaf_paths(value, prefix + (key,))
    else:
      yield prefix + (key,)


def value_at(tree: dict, path: ParamPath):
  """The entry of the nested dict `tree` at `path`."""
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: ParamPath, value) -> None:
  value_at(tree, path[:-1])[path[-1]] = value


def _check_covers(params: dict, names: list[TensorName]) -> None:
  """The table names every parameter exactly once, or each of its expert slices once (a model
  change must update the table)."""
  slices = collections.defaultdict(list)  # path -> the expert of each name of it (None: the whole parameter)
  for name in names:
    for path in name.ours:
      slices[path].append(name.expert)
  missing = set(leaf_paths(params)) - set(slices)
  unknown = set(slices) - set(leaf_paths(params))
  uneven = [path for path, experts in slices.items() if path not in unknown and experts != [None]
            and sorted(e if e is not None else -1 for e in experts) != list(range(np.shape(value_at(params, path))[0]))]
  if missing or unknown or uneven:
    raise ValueError(f'The HF tensor table does not match the model: parameters without an HF name '
                     f'{sorted(map(str, missing))[:3]}, names of no parameter {sorted(map(str, unknown))[:3]}, '
                     f'named more than once or not by every expert {sorted(map(str, uneven))[:3]}.')


def built_without_parameters(build: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
  """`build(rngs)` with its parameters left abstract (shapes and dtypes), for an importer whose table
  names every one of them to fill them all (`load_tensors`); its other variables (the dropout streams'
  keys and counts, an MoE layer's load bias) are what `build(rngs)` makes, and `rngs` advances alike.
  The build is traced and compiled without the parameters' initialisers: no random draw of weights
  that the checkpoint replaces, which would cost the model's size in memory once more (a Mixtral
  8x7B: 187 GB in float32) and the time to draw it (eagerly, a compilation per parameter shape)."""
  abstract = {}

  def variables(rngs):
    graphdef, params, rest = nnx.split(build(rngs), nnx.Param, ...)
    abstract['graphdef'] = graphdef
    abstract['params'] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return rest
  rest = nnx.jit(variables)(rngs)
  # The parameters' Variables made again out here: those of the trace belong to it (nnx refuses their update).
  params = jax.tree.map(lambda x: x, abstract['params'])
  return nnx.merge(abstract['graphdef'], params, rest)


def load_tensors(module: nnx.Module, tensors: dict[str, np.ndarray], names: list[TensorName], hf_dir: str
                 ) -> set[str]:
  """Copy HF `tensors` (read from `hf_dir`) into every parameter of `module` in place (which may hold
  them abstract: `built_without_parameters`); returns the HF names used. HFImportError for a tensor
  missing or of another shape than config.json implies."""
  state = nnx.state(module, nnx.Param)
  params = nnx.to_pure_dict(state)
  _check_covers(params, names)
  expert_slices: dict[ParamPath, dict[int, np.ndarray]] = {}  # stacked once all are read
  for name in names:
    if name.hf not in tensors:
      raise HFImportError(f'The weights in {hf_dir} lack the tensor {name.hf!r} that its config.json implies; '
                          f'the weights and config.json are not of one model.')
    targets = [value_at(params, path) for path in name.ours]
    shapes = [t.shape if name.expert is None else t.shape[1:] for t in targets]
    shape = shapes[0][:-1] + (sum(s[-1] for s in shapes),)
    expected = shape[::-1] if name.transpose else shape
    expected = expected if name.rows is None else (name.rows,) + expected[1:]
    value = np.asarray(tensors[name.hf])
    if value.shape != expected:
      raise HFImportError(f'The tensor {name.hf} in {hf_dir} is {list(value.shape)}, but its config.json implies '
                          f'{list(expected)}; the weights and config.json are not of one model.')
    if name.rows is not None:
      value = _pad_rows(value, shape[0])
    value = value.T if name.transpose else value
    for path, target, part in zip(name.ours, targets, np.split(value, len(targets), axis=-1)):
      if name.expert is None:
        _set(params, path, jnp.asarray(part, target.dtype))
      else:
        expert_slices.setdefault(path, {})[name.expert] = part
  for path, parts in expert_slices.items():
    _set(params, path, jnp.asarray(np.stack([parts[n] for n in range(len(parts))]), value_at(params, path).dtype))
  nnx.replace_by_pure_dict(state, params)
  nnx.update(module, state)
  return {name.hf for name in names}


def reject_unused(unused: list[str], hf_dir: str) -> None:
  """HFImportError when the weights of `hf_dir` hold tensors (`unused`) that no parameter took."""
  if unused:
    raise HFImportError(f'The weights in {hf_dir} hold tensors that its config.json gives no place: {unused[:5]}; '
                        f'the weights and config.json are not of one model.')


def _pad_rows(value: np.ndarray, rows: int) -> np.ndarray:
  """An HF vocabulary tensor [V, ...] zero-padded to our `rows` >= V rows."""
  return np.concatenate([value, np.zeros((rows - value.shape[0],) + value.shape[1:], value.dtype)])


def numpy_params(model: nnx.Module) -> dict:
  """The model's parameters as a pure dict of host NumPy arrays, gathered from however they are
  sharded over this process's devices."""
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def unscanned_params(model: nnx.Module) -> dict:
  """`numpy_params` of a GPT, a scanned one's [num_layers, ...] block stacks split into one
  'blocks' entry per layer, as an unscanned GPT holds them (HF files have one tensor per layer)."""
  params = numpy_params(model)
  if model.config.scan_layers:
    params['blocks'] = {i: jax.tree.map(lambda x, i=i: x[i], params['blocks']) for i in range(model.config.num_layers)}
  return params


def hf_tensor(params: dict, name: TensorName) -> np.ndarray:
  """The tensor `name` names, in HF's layout, from a `numpy_params` dict."""
  parts = [np.asarray(value_at(params, path) if name.expert is None else value_at(params, path)[name.expert])
           for path in name.ours]
  value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
  value = value if name.rows is None else value[:name.rows]
  # safetensors writes an array's buffer as is: a transposed view must be made contiguous first.
  return np.ascontiguousarray(value.T if name.transpose else value)


def to_hf_tensors(params: dict, names: list[TensorName]) -> dict[str, np.ndarray]:
  """{HF name: array in HF's layout} from a `numpy_params` dict."""
  _check_covers(params, names)
  return {name.hf: hf_tensor(params, name) for name in names}


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint in `hf_dir` as float32 NumPy: model.safetensors, or
  pytorch_model.bin (needs torch), or their sharded `.index.json` forms."""
  files = [os.path.join(hf_dir, name) for name in ('model.safetensors', 'pytorch_model.bin')]
  for index_name in ('model.safetensors.index.json', 'pytorch_model.bin.index.json'):
    index = os.path.join(hf_dir, index_name)
    if os.path.exists(index):
      shards = sorted(set(read_json(index, 'a sharded checkpoint index').get('weight_map', {}).values()))
      files.insert(0, [os.path.join(hf_dir, s) for s in shards])
  for candidate in files:
    paths = candidate if isinstance(candidate, list) else [candidate]
    if all(os.path.exists(p) for p in paths):
      tensors = {}
      for path in paths:
        tensors.update(_read_tensor_file(path))
      return tensors
  raise HFImportError(f'No weights in {hf_dir}: expected model.safetensors or pytorch_model.bin (or their sharded '
                      f'.index.json forms and every shard they name).')


def _read_tensor_file(path: str) -> dict[str, np.ndarray]:
  if path.endswith('.safetensors'):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
      return {k: np.asarray(v, np.float32) for k, v in load_file(path).items()}
    except SafetensorError as e:
      raise HFImportError(f'{path} is not a readable safetensors file ({one_line(e)}); download it again.') from e
  try:
    import torch
  except ImportError as e:
    raise HFImportError(f'{path} is a PyTorch file and reading it needs torch (pip install torch), or convert '
                        f'the checkpoint to model.safetensors.') from e
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # what torch.load raises for a damaged file
    raise HFImportError(f'{path} is not a readable PyTorch checkpoint ({one_line(e)}); download it again.') from e
  return {k: v.float().numpy() for k, v in state.items()}


def read_json(path: str, what: str) -> dict:
  """The JSON object in the file at `path` (`what` it should hold, for the error)."""
  try:
    with open(path) as f:
      value = json.load(f)
  except ValueError as e:
    raise HFImportError(f'{path} is not valid JSON ({one_line(e)}); it should hold {what}: download it again.') from e
  if not isinstance(value, dict):
    raise HFImportError(f'{path} holds a JSON {type(value).__name__}, not the object of {what}.')
  return value


def read_hf_config(hf_dir: str, model_type: str | None = None) -> dict:
  """config.json of `hf_dir`, checked to describe a `model_type` model (None: any)."""
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise HFImportError(f'{path} not found: --hf_dir must be a Hugging Face {model_type or "model"} directory.')
  hf = read_json(path, 'a Hugging Face model config')
  if model_type is not None and hf.get('model_type') not in (None, model_type):
    raise HFImportError(f"{path} describes a {hf.get('model_type')!r} model, not {model_type!r}; use that family's "
                        f"config.")
  return hf


def fields_from_hf(hf: dict, keys: tuple[tuple[str, str, object], ...], path: str) -> dict:
  """{our field: value} from the entries of config.json (at `path`); `keys` holds (HF key, our
  field, default), default None meaning the key is required."""
  missing = [key for key, _, default in keys if default is None and hf.get(key) is None]
  if missing:
    raise HFImportError(f"{path} lacks {', '.join(missing)}: the model's sizes. A complete Hugging Face "
                        f'config.json has them all; download it again.')
  return {field: hf.get(key, default) for key, field, default in keys}


@contextlib.contextmanager
def reading_tokenizer(files: str) -> Iterator[None]:
  """HFImportError naming `files` for what the `tokenizers` library raises while reading them: a
  plain Exception, whose class says nothing, so every one is caught (keep the block to the read)."""
  try:
    yield
  except Exception as e:
    raise HFImportError(f'{files} does not load as a tokenizer ({one_line(e)}); download it again.') from e


def fields_to_hf(config, keys: tuple[tuple[str, str, object], ...]) -> dict:
  """The inverse of `fields_from_hf`: {HF key: value} from our config dataclass."""
  return {key: getattr(config, field) for key, field, _ in keys}


def check_target(out_dir: str) -> None:
  """An export writes a new directory: `out_dir` must not exist, or be an empty directory."""
  target = storage.path(out_dir)
  if target.exists() and not (target.is_dir() and not any(target.iterdir())):
    raise HFExportError(f'The export target {out_dir} already exists and is not empty; pass a new --hf_dir '
                        f'(or delete that directory first).')


@contextlib.contextmanager
def output_directory(out_dir: str) -> Iterator[str]:
  """A fresh directory to write an export into, renamed to `out_dir` when the block succeeds
  and deleted when it fails, so `out_dir` is either complete or absent. A gs:// `out_dir` (a name
  prefix, which no rename can make appear at once) is uploaded file by file after the block succeeds."""
  check_target(out_dir)
  if storage.is_remote(out_dir):
    staging = storage.LocalMirror(out_dir)
    try:
      yield staging.local
    except BaseException:
      shutil.rmtree(staging.local, ignore_errors=True)
      raise
    staging.close()
    return
  out_dir = os.path.abspath(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  # Next to the target, so that the final rename stays on one filesystem (and is atomic).
  staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.', suffix='.partial', dir=parent)
  try:
    yield staging
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's directory is private (0700); give it the usual mode
    os.replace(staging, out_dir)  # also replaces an empty out_dir
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def write_json(directory: str, name: str, value: dict) -> None:
  with open(os.path.join(directory, name), 'w') as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write('\n')


def write_safetensors(directory: str, tensors: dict[str, np.ndarray], name: str = 'model.safetensors') -> None:
  from safetensors.numpy import save_file
  # transformers 4.x refuses a checkpoint whose metadata does not name its format.
  save_file(tensors, os.path.join(directory, name), metadata={'format': 'pt'})


def char_to_hf(tokenizer: CharTokenizer) -> tokenizers.Tokenizer:
  """A character-level tokenizer as a `tokenizers` WordLevel model giving the same ids: every
  character is one pre-token, the decoder concatenates them."""
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate(tokenizer.vocab)},
                                                             unk_token=UNK))
  backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r'[\s\S]'), behavior='isolated')
  backend.decoder = decoders.Fuse()
  backend.add_special_tokens([PAD, BOS, EOS, UNK])  # skipped when decoding, as CharTokenizer.decode does
  return backend


def write_tokenizer(directory: str, tokenizer, *, special_tokens: dict[str, int | None], max_len: int,
                    model_input_names: list[str]) -> None:
  """tokenizer.json and tokenizer_config.json, which `transformers.AutoTokenizer` loads as is.

  special_tokens: {'bos_token': id, ...}; entries with id None are left out.
  """
  if isinstance(tokenizer, HFTokenizer):
    backend = tokenizer.tokenizer
  elif isinstance(tokenizer, CharTokenizer):
    backend = char_to_hf(tokenizer)
  else:
    raise HFExportError(f'A {type(tokenizer).__name__} has no Hugging Face form; export a run with a char, bpe or '
                        f'wordpiece tokenizer.')
  backend.save(os.path.join(directory, 'tokenizer.json'))
  # 'PreTrainedTokenizerFast' (TokenizersBackend in transformers 5) reads tokenizer.json verbatim;
  # a model-specific class (BertTokenizer) would rebuild the pipeline from its own defaults.
  write_json(directory, 'tokenizer_config.json', {
      'tokenizer_class': 'PreTrainedTokenizerFast', 'model_max_length': max_len,
      'clean_up_tokenization_spaces': False, 'model_input_names': model_input_names,
      **{name: tokenizer.id_to_token(i) for name, i in special_tokens.items() if i is not None}})
