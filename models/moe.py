"""Mixture-of-experts feed-forward layer: a router picks k of N expert MLPs for each token.

`MoEFeedForward` replaces a Transformer block's dense MLP (GPT's `moe_experts`, models/gpt.py).
For each token x [E] the router's softmax gives probabilities p = softmax(x @ router) over the N
experts (in float32); the k most probable experts are chosen (with `router_bias`, the choice reads
p + load_bias, the weights still p), and the output is sum_j w_j * expert_{e_j}(x), w the chosen
probabilities (renormalised to sum to 1 with `norm_topk_prob`, as Mixtral and Qwen3-MoE do).
Experts are plain (act(x @ up[n]) @ down[n]) or gated (act(x @ gate[n]) * (x @ up[n]) @ down[n]),
without biases; `shared_experts` adds one always-on dense MLP of that many experts' width
(Qwen2-MoE, DeepSeek), ungated.

Two ways to compute the experts, the same function where no token is dropped:
  dropless (capacity_factor 0, the default)  the T*k token-slots sorted by expert, one grouped
      matmul per projection (`jax.lax.ragged_dot`): static shapes [T*k, ...], no [T, N, ...] tensor
      and no padding. The steps are separate functions, `route` -> `sort_by_expert` ->
      `grouped_expert_mlp` -> `unsort_and_combine`, so that expert parallelism can move the sorted
      slots between devices around `grouped_expert_mlp` (`dropless_moe` chains them on one device;
      models/moe_parallel.py runs it on each device's tokens when the mesh's expert axis splits the
      experts).
  capacity (capacity_factor > 0)  each expert takes at most C = ceil(factor * T * k / N) slots into
      a [N, C, E] buffer computed with ordinary batched matmuls (the static shapes some compilers
      want); slots past an expert's capacity are dropped (they add nothing; the token keeps its
      residual) and counted. Priority: first choices before second choices, then token order.

Balancing (Switch Transformer, Fedus et al. 2021; ST-MoE, Zoph et al. 2022; DeepSeek-V3 2024):
`load_balancing_loss` = N * sum_i f_i * P_i (f_i the fraction of token-slots routed to expert i,
P_i its mean router probability; 1 when both are even), `router_z_loss` = mean over tokens of
logsumexp(logits)^2, and the auxiliary-loss-free `load_bias`, moved after each step towards the
even load by `updated_load_bias` (never by gradients). The layer reports what these need when
`record_statistics` is set (`record_router_statistics`): nnx.capture collects a `RouterStatistics`
per layer, sown as nnx.Intermediate.

Shape legend: T tokens (batch x length, flattened), E width, H each expert's hidden width, N
experts, k experts per token, C capacity per expert.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import moe_parallel
from models.layers import ACTIVATIONS, FeedForward, GatedFeedForward

STATISTICS = 'router_statistics'  # the name each layer's RouterStatistics is sown under


class ExpertLoadBias(nnx.Variable):
  """The per-expert [N] bias of auxiliary-loss-free balancing: model state, not a parameter (no
  gradient, no optimizer state), so training carries it with the other non-parameter state."""


class Routing(NamedTuple):
  """The router's decision for T tokens."""
  weights: jax.Array  # [T, k] float32: the chosen experts' probabilities (renormalised with norm_topk_prob)
  experts: jax.Array  # [T, k] int32: the chosen experts, most probable first
  probs: jax.Array  # [T, N] float32: softmax of the router logits
  logits: jax.Array  # [T, N] float32


class Dispatch(NamedTuple):
  """The T*k token-slots sorted by expert. Slot s = j * T + t is token t's j-th choice."""
  tokens: jax.Array  # [T*k, E]: the sorted slots' token vectors, expert 0's first
  group_sizes: jax.Array  # [N] int32: slots per expert (they sum to T*k)
  order: jax.Array  # [T*k] int32: the slot at each sorted position


class ExpertWeights(NamedTuple):
  """The experts' matrices, in the compute dtype."""
  gate: jax.Array | None  # [N, E, H], gated experts only
  up: jax.Array  # [N, E, H]
  down: jax.Array  # [N, H, E]


class RouterStatistics(NamedTuple):
  """What one MoE layer's forward reports (leaves gain a leading [layers] axis when stacked)."""
  load: jax.Array  # [N] float32: token-slots routed to each expert (before any capacity drop)
  load_balancing_loss: jax.Array  # [] float32: N * sum_i f_i P_i
  z_loss: jax.Array  # [] float32: mean logsumexp(logits)^2
  dropped: jax.Array  # [] float32: token-slots dropped over capacity (0 when dropless)


# ------------------------------------------------------------------------------------------ routing
def route(logits: jax.Array, top_k: int, *, norm_topk_prob: bool = True, load_bias: jax.Array | None = None
          ) -> Routing:
  """[T, N] router logits -> the k experts of each token and their weights.

  `load_bias` [N] (auxiliary-loss-free balancing) shifts which experts are chosen, not their weights.
  """
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  scores = probs if load_bias is None else probs + jax.lax.stop_gradient(load_bias)
  # A stable sort, not jax.lax.top_k (the same choice, ties to the lower index): XLA's TopK custom call is not
  # split by batch, so on a mesh every device gathered the global [T, N] scores first.
  experts = jnp.argsort(-scores, axis=-1, stable=True)[..., :top_k]
  weights = jnp.take_along_axis(probs, experts, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(weights, experts.astype(jnp.int32), probs, logits)


def expert_load(experts: jax.Array, num_experts: int) -> jax.Array:
  """[T, k] chosen experts -> [N] float32 count of token-slots per expert."""
  return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.float32)


def load_balancing_loss(load: jax.Array, probs: jax.Array) -> jax.Array:
  """Switch Transformer's auxiliary loss N * sum_i f_i * P_i: f = load / load.sum() [N] (constant: the
  counts carry no gradient), P [N] the mean over tokens of the router probabilities probs [T, N].
  1 for an even routing; N when every slot goes to the one expert that holds all probability."""
  fraction = load / jnp.sum(load)
  return probs.shape[-1] * jnp.sum(fraction * jnp.mean(probs, axis=0))


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss: mean over tokens of logsumexp(logits [T, N])^2, which keeps logits small."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def updated_load_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free update: bias_i += rate * sign(mean load - load_i), so an
  overloaded expert is chosen less and an idle one more. bias, load: [..., N] (a leading layers axis allowed)."""
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


# ----------------------------------------------------------------------------------------- dropless
def sort_by_expert(tokens: jax.Array, experts: jax.Array, num_experts: int) -> Dispatch:
  """Each token [T, E] copied once per choice (experts [T, k]) and the T*k slots sorted by expert
  (a stable sort: within an expert, first choices before second choices, then token order)."""
  num_tokens = experts.shape[0]
  slot_experts = experts.T.reshape(-1)  # [k*T], slot s = j * T + t
  order = jnp.argsort(slot_experts, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(slot_experts, length=num_experts).astype(jnp.int32)
  return Dispatch(jnp.take(tokens, order % num_tokens, axis=0), group_sizes, order)


def _expert_mlp(project: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, weights: ExpertWeights,
                activation: str) -> jax.Array:
  """act(x @ gate) * (x @ up) @ down, or act(x @ up) @ down, with `project(x, w)` each expert's matmul."""
  act = ACTIVATIONS[activation]
  up = project(x, weights.up)
  hidden = act(up) if weights.gate is None else act(project(x, weights.gate)) * up
  return project(hidden, weights.down)


def grouped_expert_mlp(sorted_tokens: jax.Array, group_sizes: jax.Array, weights: ExpertWeights,
                       activation: str) -> jax.Array:
  """[M, E] slots sorted by expert, group_sizes [N] (summing to M) -> [M, E]: each group of rows through
  its expert, one `ragged_dot` (grouped matmul) per projection. N may be a device's share of the
  experts, as long as group_sizes and weights agree."""
  project = lambda x, w: jax.lax.ragged_dot(x, w, group_sizes)
  return _expert_mlp(project, sorted_tokens, weights, activation)


def unsort_and_combine(expert_outputs: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
  """expert_outputs [T*k, E] in sorted order -> [T, E] = sum_j weights[t, j] * output of slot j * T + t."""
  num_tokens, top_k = weights.shape
  # The inverse permutation by a scatter of indices, so that unsorting is a gather, not a second sort.
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
  slots = jnp.take(expert_outputs, inverse, axis=0).reshape(top_k, num_tokens, -1)  # [k, T, E]
  return jnp.einsum('kte,tk->te', slots, weights.astype(slots.dtype))


def dropless_moe(tokens: jax.Array, routing: Routing, weights: ExpertWeights, activation: str,
                 grouped_mlp: Callable[..., jax.Array] = grouped_expert_mlp) -> jax.Array:
  """[T, E] -> [T, E]: every token-slot through its expert (the dropless path on one device).
  `grouped_mlp` computes the sorted slots: `grouped_expert_mlp`, or under expert parallelism the
  exchange of models/moe_parallel.py around it (then `weights` hold this device's experts only)."""
  dispatch = sort_by_expert(tokens, routing.experts, routing.probs.shape[-1])
  outputs = grouped_mlp(dispatch.tokens, dispatch.group_sizes, weights, activation)
  return unsort_and_combine(outputs, dispatch.order, routing.weights)


# ----------------------------------------------------------------------------------------- capacity
def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """C = ceil(factor * T * k / N) token-slots per expert (at least 1)."""
  return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


def capacity_positions(dispatch: Dispatch, capacity: int) -> jax.Array:
  """[T*k] row of each sorted slot in the flattened [N * C] capacity buffer: expert * C + its place
  in its expert's queue, or N * C (out of range: dropped) past the capacity."""
  group_sizes = dispatch.group_sizes
  num_experts = group_sizes.shape[0]
  sorted_experts = jnp.repeat(jnp.arange(num_experts, dtype=jnp.int32), group_sizes,
                              total_repeat_length=dispatch.order.shape[0])
  starts = jnp.cumsum(group_sizes) - group_sizes
  place = jnp.arange(dispatch.order.shape[0], dtype=jnp.int32) - starts[sorted_experts]
  return jnp.where(place < capacity, sorted_experts * capacity + place, num_experts * capacity)


def padded_expert_mlp(buffer: jax.Array, weights: ExpertWeights, activation: str) -> jax.Array:
  """[N, C, E] each expert's slots (zero rows where it has fewer than C) -> [N, C, E]."""
  project = lambda x, w: jnp.einsum('nce,neh->nch', x, w)
  return _expert_mlp(project, buffer, weights, activation)


def capacity_moe(tokens: jax.Array, routing: Routing, weights: ExpertWeights, activation: str,
                 capacity: int) -> tuple[jax.Array, jax.Array]:
  """[T, E] -> ([T, E], number of token-slots dropped): the static-shape path, `capacity` slots per expert."""
  num_experts, features = weights.up.shape[0], tokens.shape[-1]
  dispatch = sort_by_expert(tokens, routing.experts, num_experts)
  rows = capacity_positions(dispatch, capacity)
  buffer = jnp.zeros((num_experts * capacity, features), tokens.dtype).at[rows].set(dispatch.tokens, mode='drop')
  outputs = padded_expert_mlp(buffer.reshape(num_experts, capacity, features), weights, activation)
  sorted_outputs = jnp.take(outputs.reshape(-1, features), rows, axis=0, mode='fill', fill_value=0)
  dropped = jnp.sum(rows == num_experts * capacity).astype(jnp.float32)
  return unsort_and_combine(sorted_outputs, dispatch.order, routing.weights), dropped


# -------------------------------------------------------------------------------------------- layer
class MoEFeedForward(nnx.Module):
  """A router and N expert MLPs in place of a dense FFN. [B, L, E] -> [B, L, E].

  Parameters: router.kernel [E, N]; gate [N, E, H] (gated only), up [N, E, H], down [N, H, E];
  `shared` (shared_experts > 0) a FeedForward / GatedFeedForward of width shared_experts * H;
  load_bias [N] (ExpertLoadBias, read with `router_bias`). `kernel_init` draws the router, gate and
  up, `output_init` down (the residual branch's output).
  """

  def __init__(self, features: int, hidden: int, *, experts: int, top_k: int, rngs: nnx.Rngs,
               activation: str = 'gelu_tanh', gated: bool = False, shared_experts: int = 0,
               capacity_factor: float = 0.0, norm_topk_prob: bool = True, router_bias: bool = False,
               dropout: float = 0.0, use_bias: bool = True, dtype: Any = None, kernel_init=None, output_init=None):
    if not 1 <= top_k <= experts:
      raise ValueError(f'top_k={top_k} must be between 1 and experts={experts}.')
    # By default nnx.Linear's initialiser, for each expert's [E, H] or [H, E] matrix on its own.
    lecun = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    router_init = kernel_init or nnx.initializers.lecun_normal()
    kernel_init, output_init = kernel_init or lecun, output_init or lecun
    self.top_k, self.activation, self.dtype = top_k, activation, dtype
    self.capacity_factor, self.norm_topk_prob, self.router_bias = capacity_factor, norm_topk_prob, router_bias
    # float32 logits: the softmax and the top-k choice are not left to bfloat16 rounding
    self.router = nnx.Linear(features, experts, use_bias=False, dtype=jnp.float32, kernel_init=router_init, rngs=rngs)
    self.gate = nnx.Param(kernel_init(rngs.params(), (experts, features, hidden))) if gated else None
    self.up = nnx.Param(kernel_init(rngs.params(), (experts, features, hidden)))
    self.down = nnx.Param(output_init(rngs.params(), (experts, hidden, features)))
    dense = GatedFeedForward if gated else FeedForward
    self.shared = dense(features, shared_experts * hidden, activation=activation, dropout=dropout, use_bias=use_bias,
                        dtype=dtype, rngs=rngs) if shared_experts else None
    self.load_bias = ExpertLoadBias(jnp.zeros((experts,), jnp.float32))
    self.record_statistics = False

  @property
  def num_experts(self) -> int:
    return self.up.shape[0]

  def output_projections(self) -> list[nnx.Linear]:
    """The shared expert's `down` (the routed experts' `down` is a Param of its own, `output_init`)."""
    return [] if self.shared is None else [self.shared.down]

  def expert_weights(self, dtype) -> ExpertWeights:
    return ExpertWeights(None if self.gate is None else self.gate[...].astype(dtype), self.up[...].astype(dtype),
                         self.down[...].astype(dtype))

  def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
    dtype = self.dtype or x.dtype
    tokens = x.reshape(-1, x.shape[-1]).astype(dtype)  # [T, E]
    routing = route(self.router(tokens), self.top_k, norm_topk_prob=self.norm_topk_prob,
                    load_bias=self.load_bias[...] if self.router_bias else None)
    weights = self.expert_weights(dtype)
    if self.capacity_factor > 0:
      capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
      y, dropped = capacity_moe(tokens, routing, weights, self.activation, capacity)
    elif moe_parallel.splits_experts(self.num_experts):  # the mesh's expert axis splits the experts
      y = moe_parallel.expert_parallel(functools.partial(dropless_moe, activation=self.activation),
                                       grouped_expert_mlp, tokens, routing, weights)
      dropped = jnp.zeros((), jnp.float32)
    else:
      y, dropped = dropless_moe(tokens, routing, weights, self.activation), jnp.zeros((), jnp.float32)
    y = y.reshape(x.shape).astype(dtype)
    if self.shared is not None:
      y = y + self.shared(x, deterministic=deterministic)
    if self.record_statistics:
      load = expert_load(routing.experts, self.num_experts)
      self.sow(nnx.Intermediate, STATISTICS, RouterStatistics(
          load, load_balancing_loss(load, routing.probs), router_z_loss(routing.logits), dropped),
          reduce_fn=lambda _, new: new)
    return y


def record_router_statistics(model: nnx.Module, fn, *args, **kwargs) -> tuple[Any, list[tuple[str, RouterStatistics]]]:
  """Run `fn(*args, **kwargs)` with every MoEFeedForward of `model` reporting its routing.

  Returns (fn's result, [(module path 'blocks/3/mlp', RouterStatistics)] in module order); a layer
  stacked over [layers] (GPT's scan_layers) gives one entry whose leaves lead with [layers].
  """
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEFeedForward)]
  for m in layers:
    m.record_statistics = True
  try:
    result, recorded = nnx.capture(lambda _, *a, **k: fn(*a, **k), nnx.Intermediate)(model, *args, **kwargs)
  finally:
    for m in layers:
      m.record_statistics = False
  statistics = [('/'.join(map(str, path[:-1])), variable.get_value())
                for path, variable in nnx.to_flat_state(recorded) if path[-1] == STATISTICS]
  return result, statistics
