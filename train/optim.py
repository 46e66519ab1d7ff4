"""Optimizers and learning-rate schedules from `config.train`: every update rule is Optax's own.

`train.optimizer`:
  adamw                optax.adamw; weight decay on kernels only (`decay_mask`)
  adam                 optax.adam
  muon                 optax.contrib.muon: Newton-Schulz orthogonalised momentum for the hidden weight
                       matrices `MUON_RULES` pick, its built-in AdamW for every other parameter
  schedule_free_adamw  optax.contrib.schedule_free around AdamW's second-moment scaling (the chain
                       optax.contrib.schedule_free_adamw builds, with `decay_mask` given to its weight
                       decay); trains on one sequence of parameters and is evaluated and saved at the
                       average `optax.contrib.schedule_free_eval_params` gives (`eval_params`)
  lion                 optax.lion (Chen et al. 2023: use a learning rate 3-10x below AdamW's)
  adafactor            optax.adafactor with factored second moments and no momentum (Shazeer & Stern
                       2018); `multiply_by_parameter_scale=False`, so `train.lr` is an absolute step as
                       for the others, and decoupled weight decay lr * weight_decay on kernels
`train.grad_clip` clips the global gradient norm before any of them.

Muon (`train.lr` for the matrices, `train.adam_lr` for its AdamW, 0 = the same; both follow the
schedule). `train.muon_rms_scale` is Optax's `consistent_rms`: each matrix's update is scaled to an
RMS of muon_rms_scale (Moonlight, Liu et al. 2025: 0.2 * sqrt(max(fan_in, fan_out))), AdamW's
typical update RMS, so Muon takes AdamW's learning rate and weight decay, and a learning rate
holds across widths; 0 falls back to Keller Jordan's sqrt(max(1, fan_out / fan_in)), whose
learning rates are ~0.02. Weight decay (`train.weight_decay`, times the learning rate) applies to
every matrix Muon takes; its AdamW side has none (Optax's muon takes no mask for it, and that side
holds the embeddings, norms and biases the AdamW optimizer does not decay either; the output
layers lose their decay, as in modded-nanogpt's Adam). Matrices of the same shape are
orthogonalised together, one batched Newton-Schulz chain per shape (`stacked_muon`), each matrix
still on its own; `train.muon_ns_dtype` runs the chain's matmuls in bfloat16 ('auto': on GPU and
TPU, as the NanoGPT speedrun does) or float32 (CPU). The optimizer state is Optax's per-parameter one.

Schedules (`train.schedule`), peak `train.lr` after `train.warmup_steps` of linear warmup:
  constant  stays at lr
  cosine    cosine decay to lr * end_lr_fraction at `steps`
  linear    linear decay to lr * end_lr_fraction at `steps`
  rsqrt     lr * sqrt(warmup / step), the "Noam" schedule
  wsd       warmup-stable-decay: constant until a cooldown over the last `decay_fraction` of the
            steps to lr * end_lr_fraction, `decay_shape` 'linear' or '1-sqrt' (Hägele et al. 2024)
Schedule-free AdamW replaces the schedule: only 'constant' (its warmup) is accepted with it.

wsd's cooldown can start at a step only known while training (`train.max_minutes`: when
decay_fraction of the budget is left, train/loop.py `Cooldown`, which re-plans it as the step
time changes). Its start and length are therefore hyperparameters in the optimizer state
(`optax.inject_hyperparams`), read by the compiled step as values: moving the cooldown does not
recompile, and a checkpoint holds it. Only wsd wraps its optimizer so; every other schedule keeps
the optimizer state layout runs have saved.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from errors import ConfigError
from train.sharding import path_to_string

OPTIMIZERS = ('adamw', 'adam', 'muon', 'schedule_free_adamw', 'lion', 'adafactor')
SCHEDULES = ('constant', 'cosine', 'linear', 'rsqrt', 'wsd')
DECAY_SHAPES = ('linear', '1-sqrt')
COOLDOWN_KEYS = ('cooldown_start', 'cooldown_steps')  # wsd's hyperparameters in the optimizer state

# Which parameters Muon orthogonalises, in one place: the first rule whose pattern is found in a
# parameter's path ('a/b/kernel', train/sharding.py `path_to_string`) decides; a path that no rule
# matches goes to AdamW. Muon takes only matrices, [in, out] with both sides above 1, or stacks of
# them ([layers, in, out] under GPT's `scan_layers`, [experts, in, out] in an MoE block, or both:
# each matrix is orthogonalised alone).
# The output layers go to AdamW: Muon's orthogonalised step is steepest descent in the spectral norm
# of a map between hidden activations (Jordan 2024; Bernstein & Newhouse 2024), and the logits are
# not such activations; the NanoGPT speedrun and Moonlight train embeddings and head with AdamW too.
# The expert matrices of an MoE block (models/moe.py): matrices as kernels are, stacked on [N] (and
# [layers, N] under scan_layers).
EXPERT_MATRICES = r'(^|/)mlp/(gate|up|down)$'
MUON_RULES: tuple[tuple[str, str], ...] = (
    (r'embedding$', 'adamw'),  # token, position and segment tables, GPT's untied lm_head (an Embed)
    (r'(^|/)(output|head|nsp|classifier)/kernel$', 'adamw'),  # output layers: vocabulary, class, NSP logits
    (r'(^|/)router/kernel$', 'adamw'),  # an MoE block's router: its outputs are logits too
    (r'kernel$', 'muon'),  # hidden Linear kernels (attention query/key/value/out, MLP, BERT's pooler and
                           # MLM transform, Bahdanau scores) and the RNN cells' input and recurrent kernels
    (EXPERT_MATRICES, 'muon'),  # an MoE block's experts [N, E, H] / [N, H, E]: each expert's matrix alone
)


# ============================================================================ schedules
def step_cooldown(train_config) -> tuple[int, int]:
  """wsd's (first cooldown step, cooldown steps) for a run of `train.steps`."""
  length = int(round(train_config.decay_fraction * train_config.steps))
  return train_config.steps - length, max(length, 1)


def wsd_schedule(peak, warmup: int, cooldown_start, cooldown_steps, end_fraction: float, shape: str) -> optax.Schedule:
  """Linear warmup to `peak` over `warmup` steps, constant, and from `cooldown_start` a cooldown to
  peak * end_fraction over `cooldown_steps`: linear, or '1-sqrt' (lr falls as the square root of
  the cooldown's progress p: end + (peak - end) (1 - sqrt p)). `cooldown_start` and
  `cooldown_steps` may be traced values."""
  end = peak * end_fraction

  def cooldown(count):
    progress = jnp.clip(count / cooldown_steps, 0.0, 1.0)
    return peak + (end - peak) * (jnp.sqrt(progress) if shape == '1-sqrt' else progress)

  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak), cooldown],
                              [warmup, cooldown_start])


def learning_rate_schedule(train_config, cooldown: tuple | None = None, peak: float | None = None) -> optax.Schedule:
  """The learning rate at each optimizer count (0 for the first update) of peak `lr` (or `peak`).

  constant: lr after the warmup.  cosine / linear: decays to lr * end_lr_fraction at `steps`.
  rsqrt: lr * sqrt(warmup / step), the "Noam" schedule of Attention Is All You Need
  (d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) with the d_model factor folded into lr).
  wsd: `wsd_schedule`, its cooldown (start, steps) `cooldown` (default: the last decay_fraction of `steps`).
  """
  lr = train_config.lr if peak is None else peak
  warmup, steps = train_config.warmup_steps, train_config.steps
  end = lr * train_config.end_lr_fraction
  name = train_config.schedule
  if name == 'constant':
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]) \
        if warmup else optax.constant_schedule(lr)
  if name == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end)
  if name == 'linear':
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.linear_schedule(lr, end, max(steps - warmup, 1))], [warmup])
  if name == 'rsqrt':
    warmup = max(warmup, 1)
    decay = lambda count: lr * jnp.sqrt(warmup / jnp.maximum(count + warmup, 1.0))
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])
  if name == 'wsd':
    start, length = cooldown or step_cooldown(train_config)
    return wsd_schedule(lr, warmup, start, length, train_config.end_lr_fraction, train_config.decay_shape)
  raise ConfigError(f'Unknown train.schedule {name!r}; choose one of {SCHEDULES}.')


# ============================================================================ which parameters Muon takes
def decay_mask(params) -> object:
  """True for parameters that get weight decay: matrices of Linear layers (kernels) and MoE experts.

  Biases, LayerNorm scales/offsets and embedding tables are excluded, as in GPT-2 and BERT.
  """
  def keep(path, _):
    names = [str(k.key) for k in path if hasattr(k, 'key')]  # nnx.State paths end in '.value'
    return bool(names) and (names[-1] == 'kernel' or re.search(EXPERT_MATRICES, '/'.join(names)) is not None)
  return jax.tree_util.tree_map_with_path(keep, params)


def muon_side(path: str, shape: tuple[int, ...]) -> str:
  """'muon' or 'adamw': the optimizer `MUON_RULES` give the parameter at `path` of `shape`."""
  side = next((side for pattern, side in MUON_RULES if re.search(pattern, path)), 'adamw')
  matrix = len(shape) >= 2 and min(shape[-2:]) > 1
  return 'muon' if side == 'muon' and matrix else 'adamw'


def muon_dimension_numbers(params):
  """Optax's `muon_weight_dimension_numbers` from `MUON_RULES`: for each leaf of `params` (arrays,
  shapes or a tree with Optax's masked nodes) its MuonDimensionNumbers, or None for AdamW's."""
  def numbers(path, leaf):
    if muon_side(path_to_string(path), leaf.shape) == 'adamw':
      return None
    batch = leaf.ndim - 2  # a stack of matrices: each orthogonalised alone
    return optax.contrib.MuonDimensionNumbers(reduction_axis=batch, output_axis=batch + 1)
  return jax.tree_util.tree_map_with_path(numbers, params)


def muon_split(params) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
  """{'muon': [(path, shape)], 'adamw': [(path, shape)]} of `params` (arrays or shapes)."""
  split = {'muon': [], 'adamw': []}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = path_to_string(path)
    split[muon_side(name, tuple(leaf.shape))].append((name, tuple(leaf.shape)))
  return split


def describe_split(train_config, params) -> str | None:
  """The line the trainer prints about Muon's split of `params` (None for other optimizers); a
  ConfigError when Muon would have no matrix to take."""
  if train_config.optimizer != 'muon':
    return None
  split = muon_split(params)
  if not split['muon']:
    raise ConfigError('train.optimizer=muon: this model has no hidden weight matrix for Muon (train/optim.py '
                      'MUON_RULES give all its parameters to AdamW); choose another train.optimizer.')
  count = lambda entries: sum(int(np.prod(shape)) for _, shape in entries)
  names = lambda entries: ', '.join(sorted({re.sub(r'(^|/)\d+(?=/)', r'\1*', name.rsplit('/', 1)[0])
                                            for name, _ in entries}))
  groups = {'embeddings': [], 'output layers': [], 'norms and biases': [], 'others': []}
  for name, shape in split['adamw']:
    group = ('embeddings' if re.search(MUON_RULES[0][0], name) else
             'output layers' if re.search(MUON_RULES[1][0], name) else
             'norms and biases' if name.endswith(('bias', 'scale')) else 'others')
    groups[group].append((name, shape))
  matrices = sum(int(np.prod(shape[:-2])) for _, shape in split['muon'])
  adamw = '; '.join(f'{count(entries):,} in {group}' + ('' if group == 'norms and biases' else f' ({names(entries)})')
                    for group, entries in groups.items() if entries)
  return (f'Muon takes {matrices} matrices, {count(split["muon"]):,} parameters ({names(split["muon"])}), at lr '
          f'{train_config.lr:g}; its AdamW takes {count(split["adamw"]):,} parameters, at lr '
          f'{train_config.adam_lr or train_config.lr:g}: {adamw}.')


# ============================================================================ Muon's matrices in stacks
MUON_NS_DTYPES = ('auto', 'float32', 'bfloat16')
# Newton-Schulz in bfloat16: JAX's dot algorithm that rounds both operands to bfloat16 and sums the
# products in float32, the precision of the NanoGPT speedrun's iterations. Optax's muon takes no dtype
# for them, and casting its input would not reach them: the float32 momentum promotes it back.
BF16_MATMULS = 'BF16_BF16_F32'
_OTHERS, _STACKS = 'adamw_leaves', 'muon_stacks'  # the two parts of a `MatrixStacks.stack` tree


def resolve_ns_dtype(name: str, platform: str | None = None) -> str:
  """`train.muon_ns_dtype` for `platform` ('cpu' | 'gpu' | 'tpu'; None: this process's backend):
  'auto' is 'bfloat16' on GPU and TPU, 'float32' on CPU (where runs, tests and fixtures keep their numbers)."""
  if name not in MUON_NS_DTYPES:
    raise ConfigError(f'config.train.muon_ns_dtype={name!r} is not one of {MUON_NS_DTYPES}.')
  if name == 'auto':
    return 'float32' if (platform or jax.default_backend()) == 'cpu' else 'bfloat16'
  return name


@dataclasses.dataclass(frozen=True)
class MatrixStacks:
  """Muon's matrices of a parameter tree grouped by shape: each [in, out] matrix (a [layers, in, out]
  leaf holds `layers` of them) joins the stack of its shape, so that Optax's muon runs one batched
  Newton-Schulz chain per shape instead of one per leaf. Each matrix keeps its own normalisation,
  shape scaling and weight decay: Optax treats a stack's first axis as a batch of matrices.

  `stack(tree)` of a tree shaped like the parameters is {_OTHERS: [AdamW's leaves, in tree order],
  _STACKS: {'INxOUT': [n, in, out], the matrices in tree order}}; `unstack` undoes it.
  `stacked_like` / `unstacked_like` move any tree that holds such trees (an optimizer state, whose
  moments sit at the parameters' paths) between the two layouts.
  """
  treedef: jax.tree_util.PyTreeDef
  paths: tuple[tuple, ...]  # each leaf's key path
  shapes: tuple[tuple[int, ...], ...]
  others: tuple[int, ...]  # the leaves AdamW takes (indices into `paths`)
  stacks: tuple[tuple[str, tuple[int, ...]], ...]  # ('INxOUT', the leaves whose matrices it stacks)

  @classmethod
  def of(cls, tree) -> 'MatrixStacks':
    """The stacks of `tree` (arrays or shapes), Muon's matrices chosen by `MUON_RULES`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, shapes = tuple(path for path, _ in flat), tuple(tuple(leaf.shape) for _, leaf in flat)
    others, stacks = [], {}
    for index, (path, shape) in enumerate(zip(paths, shapes)):
      if muon_side(path_to_string(path), shape) == 'muon':
        stacks.setdefault(f'{shape[-2]}x{shape[-1]}', []).append(index)
      else:
        others.append(index)
    return cls(treedef, paths, shapes, tuple(others), tuple((key, tuple(v)) for key, v in stacks.items()))

  def stack(self, tree) -> dict:
    return self.stacked_like(tree, {_OTHERS: [0] * len(self.others), _STACKS: {key: 0 for key, _ in self.stacks}})

  def unstack(self, stacked: dict):
    values = self._unstacked_values(stacked)
    return jax.tree_util.tree_unflatten(self.treedef, [values[path] for path in self.paths])

  def stacked_like(self, tree, layout):
    """`tree` in the stacked layout whose structure `layout` (a tree of any leaves) has."""
    values = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    flat, treedef = jax.tree_util.tree_flatten_with_path(layout)
    leaves = []
    for path, _ in flat:
      prefix, part, members = self._members(path)
      if part is None:
        leaves.append(values[path])
      elif part == _OTHERS:
        leaves.append(values[prefix + self.paths[members[0]]])
      else:
        leaves.append(jnp.concatenate([values[prefix + self.paths[i]].reshape(-1, *self.shapes[i][-2:])
                                       for i in members]))
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def unstacked_like(self, stacked, like):
    """`stacked` (a `stacked_like` result) back in the layout of `like`."""
    values = self._unstacked_values(stacked)
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [values[path] for path, _ in flat])

  def _unstacked_values(self, stacked) -> dict:
    """{per-leaf key path: array} of the arrays `stacked` holds."""
    values = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked)[0]:
      prefix, part, members = self._members(path)
      if part != _STACKS:
        values[path if part is None else prefix + self.paths[members[0]]] = leaf
        continue
      offset = 0
      for i in members:
        count = int(np.prod(self.shapes[i][:-2]))  # 1 for an [in, out] leaf
        values[prefix + self.paths[i]] = leaf[offset:offset + count].reshape(self.shapes[i])
        offset += count
    return values

  def _members(self, path) -> tuple[tuple, str | None, tuple[int, ...]]:
    """(the path's prefix, the part of a stacked tree it ends in or None, the leaves its array holds)."""
    if len(path) >= 2 and path[-2] == jax.tree_util.DictKey(_OTHERS):
      return path[:-2], _OTHERS, (self.others[path[-1].idx],)
    if len(path) >= 2 and path[-2] == jax.tree_util.DictKey(_STACKS):
      return path[:-2], _STACKS, dict(self.stacks)[path[-1].key]
    return path, None, ()


def _stacked_dimension_numbers(stacked: dict) -> dict:
  """Optax's `muon_weight_dimension_numbers` of a `MatrixStacks.stack` tree: each stack [n, in, out]
  is a batch of n matrices; AdamW takes the rest."""
  batch_of_matrices = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return {_OTHERS: [None for _ in stacked[_OTHERS]], _STACKS: {key: batch_of_matrices for key in stacked[_STACKS]}}


def stacked_muon(muon: Callable[..., optax.GradientTransformation], ns_dtype: str = 'float32'
                 ) -> optax.GradientTransformation:
  """Optax's muon (`muon(muon_weight_dimension_numbers=...)`: optax.contrib.muon, its other arguments
  bound) with the matrices of each shape orthogonalised as one stack (`MatrixStacks`), Newton-Schulz's
  matmuls in `ns_dtype` ('float32' | 'bfloat16': `BF16_MATMULS`).

  Its state is the per-parameter one of Optax's muon over the parameter tree (`muon_dimension_numbers`),
  which checkpoints hold and `train.sharding` places at the parameters' paths: each update stacks
  the momentum with the gradients and unstacks it with the updates.
  """
  per_leaf = muon(muon_weight_dimension_numbers=muon_dimension_numbers)
  stacked = muon(muon_weight_dimension_numbers=_stacked_dimension_numbers)

  def update(updates, state, params=None):
    stacks = MatrixStacks.of(updates)
    layout = jax.eval_shape(lambda tree: stacked.init(stacks.stack(tree)), updates)
    precision = jax.default_matmul_precision(BF16_MATMULS) if ns_dtype == 'bfloat16' else contextlib.nullcontext()
    with precision:
      new_updates, new_state = stacked.update(stacks.stack(updates), stacks.stacked_like(state, layout),
                                              None if params is None else stacks.stack(params))
    return stacks.unstack(new_updates), stacks.unstacked_like(new_state, state)

  return optax.GradientTransformation(per_leaf.init, update)


# ============================================================================ the optimizers
def _optimizer(train_config, cooldown_start=None, cooldown_steps=None, *, platform: str | None = None
               ) -> optax.GradientTransformation:
  """`train.optimizer` with its schedule, for `platform` (`make_optimizer`); wsd's cooldown (start,
  steps) may be traced values."""
  t = train_config
  cooldown = None if cooldown_start is None else (cooldown_start, cooldown_steps)
  schedule = learning_rate_schedule(t, cooldown)
  name = t.optimizer
  if name == 'adamw':
    opt = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask)
  elif name == 'adam':
    opt = optax.adam(schedule, b1=t.b1, b2=t.b2, eps=t.eps)
  elif name == 'muon':
    adam_schedule = learning_rate_schedule(t, cooldown, peak=t.adam_lr) if t.adam_lr else schedule
    opt = stacked_muon(functools.partial(
        optax.contrib.muon, schedule, beta=t.muon_momentum, eps=t.eps, weight_decay=t.weight_decay, adam_b1=t.b1,
        adam_b2=t.b2, adam_learning_rate=adam_schedule, consistent_rms=t.muon_rms_scale or None),
        resolve_ns_dtype(t.muon_ns_dtype, platform))
  elif name == 'schedule_free_adamw':
    # optax.contrib.schedule_free_adamw's own chain, with the decay mask its add_decayed_weights takes.
    base = optax.chain(optax.scale_by_rms(decay=t.b2, eps=t.eps, eps_in_sqrt=False, bias_correction=True),
                       optax.add_decayed_weights(t.weight_decay, decay_mask), optax.scale_by_learning_rate(schedule))
    opt = optax.contrib.schedule_free(base, schedule, b1=t.b1)
  elif name == 'lion':
    opt = optax.lion(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
  elif name == 'adafactor':
    decay = (lambda count: t.weight_decay * schedule(count)) if t.weight_decay else None
    opt = optax.adafactor(schedule, multiply_by_parameter_scale=False, weight_decay_rate=decay,
                          weight_decay_mask=decay_mask)
  else:
    raise ConfigError(f'Unknown train.optimizer {name!r}; choose one of {OPTIMIZERS}.')
  if t.grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(t.grad_clip), opt)
  return opt


def make_optimizer(train_config, platform: str | None = None) -> tuple[optax.GradientTransformation, Callable]:
  """(the Optax transformation, the matrices' learning rate after each step: f(step - 1) is the one
  the step-th update used, for logging), for steps compiled for `platform` ('cpu' | 'gpu' | 'tpu';
  None: this process's backend), which picks Muon's Newton-Schulz precision (`train.muon_ns_dtype`).
  wsd's transformation carries its cooldown in its state (`COOLDOWN_KEYS`, set by `with_cooldown`)."""
  schedule = learning_rate_schedule(train_config)
  if train_config.optimizer == 'schedule_free_adamw':  # it counts its updates from 1
    return _optimizer(train_config), lambda count: schedule(count + 1)
  if train_config.schedule == 'wsd':
    start, length = step_cooldown(train_config)
    inject = optax.inject_hyperparams(functools.partial(_optimizer, train_config, platform=platform))
    # int32 arrays: hyperparameters of a fixed type, as the checkpoints and `with_cooldown` hold them.
    return inject(cooldown_start=np.asarray(start, np.int32), cooldown_steps=np.asarray(length, np.int32)), schedule
  return _optimizer(train_config, platform=platform), schedule


def with_cooldown(opt_state, cooldown: tuple[int, int], shardings):
  """wsd's optimizer state `opt_state` with its cooldown set to (start, steps), each placed by its
  sharding in `shardings` (the state's); the compiled step reads them as values."""
  values = dict(zip(COOLDOWN_KEYS, cooldown))
  hyperparams = {
      name: jax.make_array_from_callback((), shardings.hyperparams[name],
                                         lambda _, v=values.get(name, value): np.asarray(v, np.int32))
      if name in values else value for name, value in opt_state.hyperparams.items()}
  return opt_state._replace(hyperparams=hyperparams)


# ============================================================================ schedule-free's averaged parameters
def _schedule_free_state(opt_state):
  states = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState))
            if isinstance(s, optax.contrib.ScheduleFreeState)]
  return states[0] if states else None


def averages(train_config) -> bool:
  """Whether the optimizer's evaluated and saved parameters are an average (`eval_params`), not the trained ones."""
  return train_config.optimizer == 'schedule_free_adamw'


def eval_params(opt_state, params):
  """The parameters to evaluate and save: schedule-free's average x = (y - (1 - b1) z) / b1 of the
  trained y and its z (`optax.contrib.schedule_free_eval_params`); `params` for any other optimizer."""
  state = _schedule_free_state(opt_state)
  return params if state is None else optax.contrib.schedule_free_eval_params(state, params)
