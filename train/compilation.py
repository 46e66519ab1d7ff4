"""Compilations: JAX's persistent compilation cache, and a count of the programs XLA built.

`enable_cache(directory)` points JAX at the persistent cache (`config.compile_cache`; '' leaves it
off), so that a resumed or repeated run loads its programs instead of compiling them again.
Programs that compile in under a second are not cached (JAX's default threshold).

`compiled(name)` counts the executables built for functions called `name` in this process (every
new input shape of a jitted function builds one), from JAX's monitoring events; `cache_summary()`
is the line the trainer logs about the persistent cache.
"""
from __future__ import annotations

import collections
import os

import jax

BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # JAX's monitoring event of one XLA compile

_compiled: collections.Counter = collections.Counter()
_cache_events = {'/jax/compilation_cache/cache_hits': 0, '/jax/compilation_cache/cache_misses': 0}
_state = {'cache_dir': '', 'listening': False}


def _on_event(event: str, **kwargs) -> None:
  if event in _cache_events:
    _cache_events[event] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == BACKEND_COMPILE_EVENT:
    _compiled[kwargs.get('fun_name', '')] += 1


def _listen() -> None:
  if not _state['listening']:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
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


def cache_summary() -> str | None:
  """'compilation cache <dir>: N hits, M compiled and stored', or None when the cache is off."""
  if not _state['cache_dir']:
    return None
  return (f'compilation cache {_state["cache_dir"]}: {_cache_events["/jax/compilation_cache/cache_hits"]} hits, '
          f'{_cache_events["/jax/compilation_cache/cache_misses"]} compiled and stored')
