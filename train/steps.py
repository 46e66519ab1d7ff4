"""The compiled steps every family trains and evaluates with: the loss is the family's `Task.loss`."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.tracing import tracer_errors_without_origin
from train import sharding
from train.state import StateSpec, TrainState
from train.task import Task


def make_train_step(task: Task, graphdef, tx: optax.GradientTransformation, grad_accum: int) -> Callable:
  """(state, batch) -> (state, (scalars, metrics)). Batch leaves are [grad_accum * micro, ...]."""

  def micro_step(params, frozen, extra, batch):
    # copy=True: fresh Variables at this trace level, so the loss may update them (RNG counts, carried RNN state).
    model = nnx.merge(graphdef, params, frozen, extra, copy=True)
    model.train()  # modules without a `deterministic` argument of their own: LoRA's adapter dropout (models/lora.py)
    with tracer_errors_without_origin():  # each dropout draw bumps an RNG count (models/tracing.py)
      loss, metrics = task.loss(model, batch, deterministic=False)
    return loss, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

  grad_fn = jax.value_and_grad(micro_step, has_aux=True)

  def accumulated(state: TrainState, batch):
    """Mean gradient and loss over `grad_accum` micro-batches, scanned so memory holds one."""
    # Strided micro-batches (micro-batch k holds rows k, k + grad_accum, ...): each device's rows of
    # the batch hold its share of every micro-batch, so no example moves between devices.
    micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]), 0, 1),
                         batch)

    def accumulate(carry, micro_batch):
      grads_sum, loss_sum, metrics_sum, extra = carry
      (loss, (metrics, extra)), grads = grad_fn(state.params, state.frozen, extra, micro_batch)
      add = lambda a, b: jax.tree.map(jnp.add, a, b)
      return (add(grads_sum, grads), loss_sum + loss, add(metrics_sum, metrics), extra), None

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    first = jax.tree.map(lambda x: x[0], micro)
    metric_shapes = jax.eval_shape(lambda: grad_fn(state.params, state.frozen, state.extra, first)[0][1][0])
    init = (zeros(state.params), jnp.zeros((), jnp.float32), zeros(metric_shapes), state.extra)
    (grads, loss, metrics, extra), _ = jax.lax.scan(accumulate, init, micro)
    return (loss / grad_accum, (metrics, extra)), jax.tree.map(lambda g: g / grad_accum, grads)

  def train_step(state: TrainState, batch):
    if grad_accum == 1:
      (loss, (metrics, extra)), grads = grad_fn(state.params, state.frozen, state.extra, batch)
    else:
      (loss, (metrics, extra)), grads = accumulated(state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = dataclasses.replace(state, params=params, extra=extra, opt_state=opt_state, step=state.step + 1)
    scalars = {'loss': loss, 'grad_norm': optax.tree.norm(grads), 'real_tokens': task.count_tokens(batch)[1]}
    return new_state, (scalars, metrics)

  return train_step


def jit_train_step(task: Task, spec: StateSpec, tx: optax.GradientTransformation, grad_accum: int):
  """`make_train_step` jitted as training runs it: state sharded by `spec`, the batch split over the
  data-parallel axes, the old state donated. Trace it inside `sharding.use_mesh(spec.mesh)`."""
  return jax.jit(make_train_step(task, spec.graphdef, tx, grad_accum),
                 in_shardings=(spec.shardings, sharding.batch_sharding(spec.mesh)),
                 out_shardings=(spec.shardings, None), donate_argnums=(0,))


def make_eval_step(task: Task, graphdef) -> Callable:
  """(params, frozen, extra, batch) -> the loss metrics of the model they make (TrainState's parts)."""
  def eval_step(params, frozen, extra, batch):
    model = nnx.merge(graphdef, params, frozen, extra)
    _, metrics = task.loss(model, batch, deterministic=True)
    return metrics
  return eval_step
