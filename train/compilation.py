"""Compilations: JAX's persistent compilation cache, and a count of the programs XLA built.

`enable_cache(directory)` points JAX at the persistent cache (`config.compile_cache`; '' leaves it
off), so that a resumed or repeated run loads its programs instead of compiling them again.
Programs that compile in under a second are not cached (JAX's default threshold).

`compiled(name)` counts the executables built for functions called `name` in this process (every
new input shape of a jitted function builds one), from JAX's monitoring events; `cache_summary()`
is the line the trainer logs about the persistent cache. `compile_seconds()` is the wall time this
process spent tracing, lowering and compiling (or loading from the persistent cache): a run's
clock less this is its time without compilation (train.target).
"""
from __future__ import annotations

import collections
import os

import jax

# JAX's monitoring events (their names are public strings; jax.monitoring has no constants for them).
JAXPR_TRACE_EVENT = '/jax/core/compile/jaxpr_trace_duration'
JAXPR_TO_MLIR_MODULE_EVENT = '/jax/core/compile/jaxpr_to_mlir_module_duration'
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # one XLA compile

_compiled: collections.Counter = collections.Counter()
_cache_events = {'/jax/compilation_cache/cache_hits': 0, '/jax/compilation_cache/cache_misses': 0}
_state = {'cache_dir': '', 'listening': False}
# Tracing, lowering to MLIR and XLA's compile (or a persistent-cache load) of every jitted function.
_COMPILE_EVENTS = (JAXPR_TRACE_EVENT, JAXPR_TO_MLIR_MODULE_EVENT, BACKEND_COMPILE_EVENT)
# Their time spans, merged: the outermost spans so far ([start, end], in order) and the total of older ones.
_spans: list[list[float]] = []
_span_total = {'closed': 0.0}


def _on_event(event: str, **kwargs) -> None:
  if event in _cache_events:
    _cache_events[event] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == BACKEND_COMPILE_EVENT:
    _compiled[kwargs.get('fun_name', '')] += 1


def _on_span(event: str, start: float, end: float, **kwargs) -> None:
  """Merge the span of a compile event: a jit traced inside another's trace (or lowered inside its
  lowering) lies within the outer span and counts once."""
  if event not in _COMPILE_EVENTS:
    return
  while _spans and _spans[-1][1] >= start:  # inner spans end first; the outer one covers them
    inner = _spans.pop()
    start, end = min(start, inner[0]), max(end, inner[1])
  _spans.append([start, end])
  if len(_spans) > 64:  # spans this old cannot lie inside a new one
    _span_total['closed'] += _spans[0][1] - _spans[0][0]
    del _spans[0]


def _listen() -> None:
  if not _state['listening']:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_time_span_listener(_on_span)
    _state['listening'] = True


def enable_cache(directory: str) -> None:
  _listen()
  if not directory:
    return
  directory = os.path.expanduser(directory)
  if directory != _state['cache_dir']:
    jax.config.update('jax_compilation_cache_dir', directory)
    _state['cache_dir'] = directory


def compiled(name: str) -> int:
  """Executables built (or loaded from the persistent cache) for jitted functions named `name`."""
  _listen()
  return _compiled[f'jit({name})']


def compiled_total() -> int:
  """Executables built (or loaded from the persistent cache) in this process, all functions."""
  _listen()
  return sum(_compiled.values())


def compile_seconds() -> float:
  """Seconds this process has spent tracing, lowering and compiling jitted functions (spans of
  nested ones counted once), since the first call into this module."""
  _listen()
  return _span_total['closed'] + sum(end - start for start, end in _spans)


def cache_summary() -> str | None:
  """'compilation cache <dir>: N hits, M compiled and stored', or None when the cache is off."""
  if not _state['cache_dir']:
    return None
  return (f'compilation cache {_state["cache_dir"]}: {_cache_events["/jax/compilation_cache/cache_hits"]} hits, '
          f'{_cache_events["/jax/compilation_cache/cache_misses"]} compiled and stored')
