"""LoRA (Hu et al. 2021): low-rank adapters on a trained model's projections.

A projection x W + b becomes x W + b + (alpha / r) * dropout(x) A B with A [in, r] and B [r, out]
(`LoRALinear`: Flax NNX's `nnx.LoRALinear`, whose `nnx.LoRA` holds A and B as `nnx.LoRAParam`s,
plus LoRA's scaling and dropout, which nnx's layer has not). B starts at zero, so an adapted model
computes what its base did until training moves the adapters. The base kernel and bias stay where
`nnx.Linear` keeps them ('.../query/kernel'), so every path the checkpoints, sharding rules and
Hugging Face tables know is unchanged; A and B sit at '.../query/lora/lora_a' and '.../lora_b'.

`add_adapters(model, targets, ...)` swaps the projections `targets` names for adapted ones, in
place. A target is a short name (`ALIASES`: q, k, v, o of attention, up, gate, down of the MLP) or
a regular expression searched in the projection's path ('blocks/0/self_attention/query'). A scanned
stack of blocks (GPT's scan_layers: kernels [layers, in, out]) gets one adapter per layer, stacked
the same way. `merge_adapters(model)` folds them back into plain `nnx.Linear` kernels
W + (alpha / r) A B, the model a Hugging Face export writes.

The adapter's dropout is off unless the model is in training mode (`model.train()`, the train step's).

Shape legend: E in-features, F out-features, r rank, L stacked layers.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

# The parameters of a model without its adapters: what a base run has and a LoRA run keeps frozen.
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
# Short target names -> the regular expression each stands for (searched in a projection's path).
ALIASES = {'q': r'attention/query$', 'k': r'attention/key$', 'v': r'attention/value$', 'o': r'attention/out$',
           'up': r'mlp/up$', 'gate': r'mlp/gate$', 'down': r'mlp/down$'}


class TargetError(ValueError):
  """A target that names no projection of the model."""


class LoRALinear(nnx.LoRALinear):
  """`base` (an nnx.Linear, its kernel and bias shared, not copied) plus a rank-`rank` adapter scaled
  by alpha / rank, its input dropped at rate `dropout` in training: [..., E] -> [..., F]."""

  def __init__(self, base: nnx.Linear, *, rank: int, alpha: float, dropout: float, rngs: nnx.Rngs):
    # nnx.LoRALinear builds its own kernel and bias (zeros here: they are replaced by the base's at once).
    super().__init__(base.in_features, base.out_features, lora_rank=rank, use_bias=base.use_bias, dtype=base.dtype,
                     param_dtype=base.param_dtype, precision=base.precision, lora_dtype=base.dtype,
                     kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.kernel, self.bias = base.kernel, base.bias
    self.scale = alpha / rank
    self.lora_dropout = nnx.Dropout(dropout, deterministic=True, rngs=rngs) if dropout else None

  def adapter(self, x: jax.Array) -> jax.Array:
    """(alpha / r) * dropout(x) A B: [..., E] -> [..., F]."""
    return self.scale * self.lora(x if self.lora_dropout is None else self.lora_dropout(x))

  def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
    return nnx.Linear.__call__(self, x, out_sharding=out_sharding) + self.adapter(x)


def adapter_of(linear: nnx.Module, x: jax.Array) -> jax.Array | float:
  """What `linear`'s adapter adds to its output for `x` (0 for a plain projection): for modules that
  read a projection's kernel themselves rather than calling it (GatedFeedForward)."""
  return linear.adapter(x) if isinstance(linear, LoRALinear) else 0.0


def _path(path: tuple) -> str:
  return '/'.join(str(part) for part in path)


def projections(model: nnx.Module) -> dict[str, nnx.Linear]:
  """{path 'blocks/0/self_attention/query': module} of every plain nnx.Linear in `model`."""
  return {_path(path): module for path, module in nnx.iter_modules(model) if type(module) is nnx.Linear}


def matched(model: nnx.Module, targets: tuple[str, ...]) -> dict[str, list[str]]:
  """{target: the paths of the projections it matches}; TargetError for a target matching none,
  naming the model's projections."""
  paths = list(projections(model))
  found = {target: [p for p in paths if re.search(ALIASES.get(target, target), p)] for target in targets}
  for target, hits in found.items():
    if not hits:
      kinds = sorted({re.sub(r'(^|/)\d+(?=/)', r'\1*', p) for p in paths})
      raise TargetError(f'{target!r} matches no projection of this model: use {", ".join(ALIASES)} or a regular '
                        f'expression searched in these paths: {", ".join(kinds)}.')
  return found


def _put(model: nnx.Module, path: str, module: nnx.Module) -> None:
  """Set the submodule of `model` at `path` ('blocks/0/mlp/up') to `module`."""
  *parents, name = (int(p) if p.isdigit() else p for p in path.split('/'))
  parent = dict(nnx.iter_modules(model))[tuple(parents)]
  if isinstance(name, int):
    parent[name] = module
  else:
    setattr(parent, name, module)


def add_adapters(model: nnx.Module, targets: tuple[str, ...], *, rank: int, alpha: float, dropout: float,
                 rngs: nnx.Rngs) -> list[str]:
  """Replace the projections `targets` match with `LoRALinear`s, in place; their paths, sorted."""
  chosen = sorted({path for hits in matched(model, targets).values() for path in hits})
  for path, base in projections(model).items():
    if path not in chosen:
      continue
    adapt = lambda base, rngs: LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout, rngs=rngs)
    if base.kernel.ndim == 3:  # a scanned stack: one adapter (and dropout stream) per layer
      adapt = nnx.split_rngs(splits=base.kernel.shape[0])(nnx.vmap(adapt, in_axes=(0, 0), out_axes=0))
    _put(model, path, adapt(base, rngs))
  return chosen


def adapted(model: nnx.Module) -> dict[str, LoRALinear]:
  """{path: module} of the adapted projections of `model`."""
  return {_path(path): module for path, module in nnx.iter_modules(model) if isinstance(module, LoRALinear)}


def delta(layer: LoRALinear) -> jax.Array:
  """The adapter as a kernel update (alpha / r) A B: [E, F], or [L, E, F] for a scanned stack."""
  return layer.scale * jnp.matmul(layer.lora.lora_a[...], layer.lora.lora_b[...])


def merge_adapters(model: nnx.Module) -> None:
  """Fold every adapter of `model` into its base kernel, in place: each LoRALinear becomes the plain
  nnx.Linear computing x (W + (alpha / r) A B) + b, so the model is its family's own again."""
  for path, layer in adapted(model).items():
    # An abstract Linear (no arrays drawn) whose variables are then set: nnx.Linear takes no kernel of its own.
    plain = nnx.eval_shape(lambda: nnx.Linear(layer.in_features, layer.out_features, use_bias=layer.use_bias,
                                              dtype=layer.dtype, param_dtype=layer.param_dtype,
                                              precision=layer.precision, rngs=nnx.Rngs(0)))
    plain.kernel = nnx.Param((layer.kernel[...] + delta(layer)).astype(layer.kernel.dtype))
    plain.bias = layer.bias
    _put(model, path, plain)
