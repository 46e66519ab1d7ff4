"""JAX's persistent compilation cache, so that a resumed or repeated run does not compile again.

`enable(directory)` points JAX at the cache (`config.compile_cache`; '' leaves it off) and counts
its hits and misses from JAX's monitoring events; `summary()` is the line the trainer logs.
Programs that compile in under a second are not cached (JAX's default threshold).
"""
from __future__ import annotations

import os

import jax

_counts = {'/jax/compilation_cache/cache_hits': 0, '/jax/compilation_cache/cache_misses': 0}
_state = {'directory': '', 'listening': False}


def _count(event: str, **kwargs) -> None:
  if event in _counts:
    _counts[event] += 1


def enable(directory: str) -> None:
  if not directory:
    return
  directory = os.path.expanduser(directory)
  if directory != _state['directory']:
    jax.config.update('jax_compilation_cache_dir', directory)
    _state['directory'] = directory
  if not _state['listening']:
    jax.monitoring.register_event_listener(_count)
    _state['listening'] = True


def summary() -> str | None:
  """'compilation cache <dir>: N hits, M misses' since `enable`, or None when it is off."""
  if not _state['directory']:
    return None
  return (f'compilation cache {_state["directory"]}: {_counts["/jax/compilation_cache/cache_hits"]} hits, '
          f'{_counts["/jax/compilation_cache/cache_misses"]} compiled and stored')
