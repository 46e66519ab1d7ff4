"""The Pallas splash-attention kernel (TPU flash attention), run once per shard of a device mesh.

`attention` computes softmax(q k^T / sqrt(D)) v with the kernel of
jax.experimental.pallas.ops.tpu.splash_attention: causality is a static block mask and packing and
padding are segment ids, so masked blocks are skipped. Sequence lengths must be multiples of BLOCK
(`fits`). models/attention.py turns its `AttentionMask` into these arguments
(`splash_arguments`) and calls this module for `implementation='splash'`.

A Pallas kernel is opaque to XLA's partitioner, so on a multi-device mesh it runs once per shard
under `jax.shard_map`. No mesh axis is named here: the caller passes the logical axis names of its
[B, L, H, D] inputs (models/partitioning.py), the ones it constrained them with, and the active
rules resolve the batch and head names to mesh axes exactly as they did for the inputs, so the
shards the kernel runs on are the ones the inputs already sit on.

Off TPU (`interpret=True`) the kernel runs in Pallas's interpreter: the same kernel code,
block-sparsity tables and custom gradient, for tests; slow.

Shape legend: B batch, Lq / Lk query / key length, H query heads, K key/value heads (K divides H),
G = H / K query heads per key/value head, D head width.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Sequence

import jax
import jax.numpy as jnp

from models.partitioning import manual_spec

BLOCK = 128  # the kernel's default block size: sequence lengths must be multiples of it


@functools.cache
def available() -> bool:
  """Whether the installed JAX ships the Pallas splash-attention kernel."""
  try:
    return importlib.util.find_spec('jax.experimental.pallas.ops.tpu.splash_attention') is not None
  except ImportError:  # a parent package is missing
    return False


def fits(q_len: int, k_len: int) -> bool:
  """Whether the kernel takes these lengths (whole blocks) and the installed JAX has it."""
  return q_len % BLOCK == 0 and k_len % BLOCK == 0 and available()


@functools.cache
def _kernel(causal: bool, q_len: int, k_len: int, num_heads: int, interpret: bool, shared_kv: bool):
  """One kernel per static mask shape; built once (its block-sparsity tables are numpy).
  shared_kv: the multi-query kernel, whose `num_heads` query heads read one K/V head.

  Built as constants even when first asked for inside a traced function: the kernel turns its
  tables into jax arrays, which a trace would make tracers that leak into every later trace
  reading this cached kernel (UnexpectedTracerError)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # imported only where used
  block_mask = splash.CausalMask((q_len, k_len)) if causal else splash.FullMask((q_len, k_len))
  make = splash.make_splash_mqa if shared_kv else splash.make_splash_mha
  with jax.ensure_compile_time_eval():
    return make(splash.MultiHeadMask([block_mask] * num_heads), head_shards=1, q_seq_shards=1, interpret=interpret)


def _per_shard(causal: bool, grouped: bool, interpret: bool):
  """The kernel over one shard: (q, k, v, *ids) -> out, q and out [b, h, Lq, D] ([b, k, G, Lq, D]
  grouped), k and v [b, k, Lk, D], ids () or ([b, Lq], [b, Lk]) segment ids."""
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

  def run(q, k, v, *ids):
    kernel = _kernel(causal, q.shape[-2], k.shape[-2], q.shape[2] if grouped else q.shape[1], interpret,
                     shared_kv=grouped)
    segments = (lambda q_ids, k_ids: {'segment_ids': SegmentIds(q=q_ids, kv=k_ids)}) if ids else (lambda: {})
    one_row = lambda q, k, v, *ids: kernel(q, k, v, **segments(*ids))
    if grouped:  # the multi-query kernel per K/V head, the row's segment ids shared by all
      one_row = jax.vmap(one_row, in_axes=(0, 0, 0) + (None,) * len(ids))
    return jax.vmap(one_row)(q, k, v, *ids)

  return run


def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, causal: bool,
              segment_ids: tuple[jax.Array, jax.Array] | None, axes: Sequence[str | None],
              interpret: bool) -> jax.Array:
  """softmax(q k^T / sqrt(D)) v by the splash kernel.

  Args:
    query: [B, Lq, H, D]; key, value: [B, Lk, K, D]; Lq and Lk multiples of BLOCK (`fits`). With
      K < H (grouped-query attention) the multi-query kernel runs once per K/V head on its G query
      heads, so the K/V heads are never repeated.
    causal: query i sees keys 0..i only.
    segment_ids: ([B, Lq], [B, Lk]) int32, a query seeing only keys of its own id; None: all keys.
    axes: the logical names of the [B, L, H, D] dimensions of query, key and value. On a mesh the
      kernel is split over the mesh axes the active rules give the batch and head names (the
      length stays whole: each shard's kernel sees whole sequences).
    interpret: run the kernel in Pallas's interpreter (any platform but TPU).
  Returns:
    [B, Lq, H, D].
  """
  batch, q_len, num_heads, depth = query.shape
  kv_heads = key.shape[2]
  grouped = kv_heads < num_heads
  head_major = lambda x: jnp.swapaxes(x, 1, 2)  # the kernel's layout: [B, H, L, D]
  q, k, v = head_major(query / jnp.sqrt(depth).astype(query.dtype)), head_major(key), head_major(value)
  if grouped:  # [B, K, G, Lq, D]: the query heads of each K/V head together
    q = q.reshape(batch, kv_heads, num_heads // kv_heads, q_len, depth)
  args = (q, k, v) + (segment_ids or ())
  run = _per_shard(causal, grouped, interpret)
  # Split by K/V head, so a grouped query's G heads stay on the shard of the K/V head they read.
  spec = manual_spec((batch, kv_heads), (axes[0], axes[2]))
  if spec is None:  # no rules or no multi-device mesh: one kernel over everything
    out = run(*args)
  else:
    batch_axes, head_axes = spec
    heads = jax.P(batch_axes, head_axes, None, None)
    query_heads = jax.P(batch_axes, head_axes, None, None, None) if grouped else heads
    in_specs = (query_heads, heads, heads) + ((jax.P(batch_axes, None),) * 2 if segment_ids else ())
    out = jax.shard_map(run, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=query_heads,
                        check_vma=False)(*args)
  return head_major(out.reshape(batch, num_heads, q_len, depth))
