"""Every way of making batches: evaluation batches, and the training batch plans families choose.

Evaluation (`padded_batches`) must see each example exactly once, so the last batch of a split
that does not divide into batches is filled up. The fillers are copies of the split's first
example (any real example keeps every computation finite: an all-padding row can make a masked
softmax NaN, and NaN x 0 is NaN) with `example_weight` 0; every family's loss multiplies its
per-token or per-example weights by `example_weight` (train/losses.py), so a filler counts for
nothing.

Training batches are endless and full. A plan is a small frozen value with one method,
`global_batches(examples, batch_size, seed, process_index, process_count)`: this process's
rows of every global training batch, seeded and deterministic, random access (a resume restores
the grain iterator's position and reads on), global batch b the same whatever the process count.

  Shuffled       independent examples in a reshuffled order each epoch (the default), optionally
                 with per-position random draws (BERT's MLM masks)
  LengthBuckets  one example per row (a translation pair, a text to classify), windows of examples
                 sorted by length, each batch cut to one of a few bucket lengths
  Packed         several translation pairs per row (`pack_pairs`), one batch shape
  Stream         rows of one token stream walked together, for a state carried across batches

Packing comes in two kinds that compute different things, so there are two packers:
`stream_windows` cuts one contiguous token stream (documents joined by EOS, crossing window
borders: language models) into fixed windows; `pack_pairs` bin-packs whole examples, each kept
apart by segment ids (translation pairs, whose attention must not cross).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol

import grain
import numpy as np

from data.sources import DataError

EXAMPLE_WEIGHT = 'example_weight'  # float32 [B]: 1 for a real example, 0 for a filler
BATCH_WINDOW = 16  # LengthBuckets and Packed: batches made together from one window of examples
PACKED_FILL = 0.98  # share of a packed window's tokens (longer side) its examples fill on average
PACKING_SAMPLE = 4096  # examples whose lengths set how many examples a packed window takes

Example = dict[str, np.ndarray]


def padded_batches(examples: grain.MapDataset, batch_size: int, num_batches: int | None = None) -> grain.MapDataset:
  """`examples` in `num_batches` batches of `batch_size` rows (default: as few as hold them all),
  each row carrying `EXAMPLE_WEIGHT`; rows past the last example are weight-0 fillers.

  Several processes pass their own slice of a split and the same `num_batches` (from the global
  count), so every process runs the same number of eval steps."""
  count = len(examples)
  if count == 0:
    raise ValueError('padded_batches needs at least one example.')
  num_batches = -(-count // batch_size) if num_batches is None else num_batches
  if num_batches * batch_size < count:
    raise ValueError(f'{num_batches} batches of {batch_size} cannot hold {count} examples.')

  def row(i: int) -> dict[str, np.ndarray]:
    real = i < count
    example = examples[i if real else 0]
    return {**example, EXAMPLE_WEIGHT: np.float32(real)}

  return grain.MapDataset.range(num_batches * batch_size).map(row).batch(batch_size)


class BatchPlan(Protocol):
  """How a family's training examples become batches (the plans below)."""

  def global_batches(self, examples: grain.MapDataset, batch_size: int, seed: int, process_index: int,
                     process_count: int) -> grain.MapDataset:
    """This process's batch_size // process_count rows of every global batch of `batch_size`
    rows made from the whole training split `examples`: endless, seeded, random access."""


# ----------------------------------------------------------------------------- independent examples
def process_rows_of_global_batches(order: grain.MapDataset, batch_size: int, process_index: int,
                                   process_count: int) -> grain.MapDataset:
  """This process's rows of each global batch of the endless example order `order`, reading only those rows.

  Global batch b holds elements [b * batch_size, (b + 1) * batch_size) of `order`, whatever the
  process count.
  """
  local = batch_size // process_count

  def row(i):
    step, offset = divmod(i, local)
    return order[step * batch_size + process_index * local + offset]

  return grain.MapDataset.range(len(order) // process_count).map(row).batch(local, drop_remainder=True)


@dataclasses.dataclass(frozen=True)
class Shuffled:
  """Independent examples: the split shuffled by `seed` and repeated (grain reshuffles every
  epoch); global batch b is positions [b * batch_size, (b + 1) * batch_size) of that order.

  `draw(example, rng) -> example`, when given, adds randomness drawn afresh at every position of
  the endless order, so each epoch draws anew (BERT's MLM masks); rng comes from
  (seed + draw_seed_offset, position).
  """
  draw: Callable[[Example, np.random.Generator], Example] | None = None
  draw_seed_offset: int = 1

  def global_batches(self, examples, batch_size, seed, process_index, process_count):
    order = examples.shuffle(seed=seed).repeat()
    if self.draw is not None:
      order = order.random_map(self.draw, seed=seed + self.draw_seed_offset)
    return process_rows_of_global_batches(order, batch_size, process_index, process_count)


# ----------------------------------------------------------------------------- windows of translation pairs
class WindowBatches(grain.MapDataset):
  """Endless batches made BATCH_WINDOW at a time: `make_batches(windows[w], rng)` turns window w (a
  stack of shuffled examples) into the BATCH_WINDOW batches w * BATCH_WINDOW, ..., in serving order.

  Random access like any MapDataset (batch i needs only window i // BATCH_WINDOW), so the
  trainer's checkpointed iterator position stays valid; every process builds the same batches.
  """

  def __init__(self, windows: grain.MapDataset, make_batches, seed: int):
    super().__init__(windows)
    self._windows, self._make_batches, self._seed = windows, make_batches, seed
    # Batches are read in order, so one loaded window serves BATCH_WINDOW consecutive batches.
    self._window_batches = functools.lru_cache(maxsize=2)(self._load_window)

  def __len__(self):
    return len(self._windows) * BATCH_WINDOW

  def _load_window(self, window_index: int) -> list[Example]:
    return self._make_batches(self._windows[window_index], np.random.default_rng((self._seed, window_index)))

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    window_index, position = divmod(index, BATCH_WINDOW)
    return self._window_batches(window_index)[position]


def _rows_of_window_batches(examples: grain.MapDataset, window: int, make_batches, batch_size: int, seed: int,
                            process_index: int, process_count: int) -> grain.MapDataset:
  """This process's rows of the global batches `make_batches` builds from windows of `window`
  shuffled examples (every process builds the same global batches and keeps its rows of each)."""
  windows = examples.shuffle(seed=seed).repeat().batch(window, drop_remainder=True)
  local = batch_size // process_count
  rows = slice(process_index * local, (process_index + 1) * local)
  return WindowBatches(windows, make_batches, seed).map(lambda batch: {k: v[rows] for k, v in batch.items()})


def bucket_lengths(seq_len: int, smallest: int) -> list[int]:
  """The padded lengths a batch may have: smallest, then powers of two and 1.5 times them (16, 24,
  32, 48, 64, 96, ...) below seq_len, then seq_len. Few shapes (7 up to 128), and a batch carries at
  most 50% padding beyond its longest example."""
  lengths, n = [], smallest
  while n < seq_len:
    lengths.append(n)
    n = n * 3 // 2 if n & (n - 1) == 0 else 2 ** n.bit_length()  # a power of two -> x1.5 -> the next power of two
  return lengths + [seq_len]


def trim(batch: Example, pad_id: int, buckets: list[int], length_fields: tuple[str, ...]) -> Example:
  """Drop trailing all-padding columns: every [B, L] array keeps the smallest bucket length that
  holds every real token (not `pad_id`) of the `length_fields`, so the compiled shapes are the
  buckets (a translation pair's source and target share one); [B] arrays stay whole."""
  used = max(int((batch[name] != pad_id).sum(axis=1).max()) for name in length_fields)
  kept = next(length for length in buckets if length >= used)
  return {name: array[:, :kept] if array.ndim == 2 else array for name, array in batch.items()}


def bucketed_batches(window: Example, rng: np.random.Generator, batch_size: int, pad_id: int,
                     buckets: list[int], length_fields: tuple[str, ...]) -> list[Example]:
  """A window of BATCH_WINDOW * batch_size examples, sorted by length (the longest of the
  `length_fields`), cut into batches of similar lengths (each trimmed to a bucket), in a seeded
  random order."""
  lengths = np.max([(window[name] != pad_id).sum(1) for name in length_fields], axis=0)
  window = {k: v[np.argsort(lengths, kind='stable')] for k, v in window.items()}
  return [trim({k: v[slot * batch_size:(slot + 1) * batch_size] for k, v in window.items()}, pad_id, buckets,
               length_fields)
          for slot in rng.permutation(BATCH_WINDOW)]


@dataclasses.dataclass(frozen=True)
class LengthBuckets:
  """One example per row, right-padded with `pad_id` to `seq_len`: a translation pair
  ({'source', 'target_in', 'target_out'} [L]) or a text to classify ({'tokens', 'segments',
  'valid'} [L], 'label' []). A window of BATCH_WINDOW * batch_size shuffled examples is sorted by
  length (real tokens of the `length_fields`) and cut into BATCH_WINDOW batches served in a seeded
  order, each trimmed to the smallest of `bucket_lengths(seq_len, smallest)` that holds its
  examples: a run has a handful of batch shapes (each distinct shape is one XLA compilation of the
  train step)."""
  pad_id: int
  seq_len: int
  smallest: int
  length_fields: tuple[str, ...] = ('source', 'target_out')

  def global_batches(self, examples, batch_size, seed, process_index, process_count):
    make_batches = functools.partial(bucketed_batches, batch_size=batch_size, pad_id=self.pad_id,
                                     buckets=bucket_lengths(self.seq_len, self.smallest),
                                     length_fields=self.length_fields)
    return _rows_of_window_batches(examples, BATCH_WINDOW * batch_size, make_batches, batch_size, seed,
                                   process_index, process_count)


# ----------------------------------------------------------------------------- packed translation pairs
# Not `stream_windows`: pairs stay whole and apart (segment ids), where an LM stream crosses borders.
def pack_pairs(examples: Example, rows: int, pad_id: int) -> tuple[Example, int]:
  """Pack padded examples several to a row, first-fit decreasing.

  Examples are placed longest first, each in the first row with room for both its source and its
  target; one that finds no room is left out. A row's examples sit one after the other, with
  segment ids 1, 2, ... in placement order; padding is segment 0.

  Args:
    examples: {'source', 'target_in', 'target_out'} [N, L] int32 arrays padded with `pad_id`.
    rows: R, the rows to fill.
  Returns:
    ({'source', 'target_in', 'target_out', 'source_segments', 'target_segments'} [R, L] int32,
    number of examples left out).
  """
  length = examples['source'].shape[1]
  source_lengths = (examples['source'] != pad_id).sum(1)
  target_lengths = (examples['target_out'] != pad_id).sum(1)
  packed = {name: np.full((rows, length), pad_id, np.int32) for name in ('source', 'target_in', 'target_out')}
  packed |= {name: np.zeros((rows, length), np.int32) for name in ('source_segments', 'target_segments')}
  source_used, target_used, count = (np.zeros(rows, np.int64) for _ in range(3))
  left_out = 0
  for i in np.argsort(-np.maximum(source_lengths, target_lengths), kind='stable'):
    s, t = source_lengths[i], target_lengths[i]
    fits = (source_used + s <= length) & (target_used + t <= length)
    row = int(fits.argmax())
    if not fits[row]:
      left_out += 1
      continue
    count[row] += 1
    for side, start, size, names in (('source', source_used[row], s, ('source',)),
                                     ('target', target_used[row], t, ('target_in', 'target_out'))):
      for name in names:
        packed[name][row, start:start + size] = examples[name][i, :size]
      packed[f'{side}_segments'][row, start:start + size] = count[row]
    source_used[row] += s
    target_used[row] += t
  return packed, left_out


def packed_batches(window: Example, rng: np.random.Generator, batch_size: int, pad_id: int) -> list[Example]:
  """A window of shuffled examples packed into BATCH_WINDOW * batch_size rows (`pack_pairs`), the
  rows in a seeded random order, cut into batches."""
  packed, _ = pack_pairs(window, BATCH_WINDOW * batch_size, pad_id)
  order = rng.permutation(BATCH_WINDOW * batch_size)
  return [{k: v[order[slot * batch_size:(slot + 1) * batch_size]] for k, v in packed.items()}
          for slot in range(BATCH_WINDOW)]


def examples_per_packed_window(examples: grain.MapDataset, rows: int, pad_id: int, seed: int) -> int:
  """How many examples to pack into `rows` rows: enough to fill PACKED_FILL of the longer side's
  tokens on average, measured on up to PACKING_SAMPLE examples of the shuffled training split.
  A window that holds more fails to place a few of its examples, which then wait for their
  next epoch's window (grain reshuffles every epoch)."""
  sample = examples.shuffle(seed=seed).batch(min(len(examples), PACKING_SAMPLE))[0]
  seq_len = sample['source'].shape[1]
  tokens = max((sample[name] != pad_id).sum(1).mean() for name in ('source', 'target_out'))
  return max(rows, int(rows * seq_len * PACKED_FILL / tokens))


@dataclasses.dataclass(frozen=True)
class Packed:
  """Several translation pairs per row, with segment ids that keep each pair's attention and
  positions its own: batches {'source', 'target_in', 'target_out', 'source_segments',
  'target_segments'} [batch_size, L], one shape for the whole run. A window of shuffled pairs,
  as many as fill PACKED_FILL of its rows on average, is packed into BATCH_WINDOW * batch_size
  rows (`pack_pairs`), served in a seeded order; the few it cannot place wait for their next epoch."""
  pad_id: int

  def global_batches(self, examples, batch_size, seed, process_index, process_count):
    window = examples_per_packed_window(examples, BATCH_WINDOW * batch_size, self.pad_id, seed)
    make_batches = functools.partial(packed_batches, batch_size=batch_size, pad_id=self.pad_id)
    return _rows_of_window_batches(examples, window, make_batches, batch_size, seed, process_index, process_count)


# ----------------------------------------------------------------------------- token streams
def stream_windows(stream: np.ndarray, seq_len: int, stride: int, max_windows: int = 0) -> np.ndarray:
  """int32 [N] -> [W, seq_len + 1] windows (inputs and shifted targets) starting every `stride`
  tokens; the tail too short for a window is dropped; at most `max_windows` (0: all).

  stride seq_len + 1: disjoint windows, every token read once (GPT); stride seq_len: each window
  starts on the last token of the one before, so every token but the first is a target once.
  """
  window = seq_len + 1
  count = (len(stream) - window) // stride + 1 if len(stream) >= window else 0
  if count == 0:
    raise DataError(f'The data has {len(stream)} tokens, fewer than one sequence of data.seq_len + 1 = {window}; '
                    f'use more text or a smaller data.seq_len.')
  count = min(count, max_windows) if max_windows else count
  return stream[np.arange(count)[:, None] * stride + np.arange(window)[None, :]]


def stream_rows(stream, num_rows: int, seq_len: int) -> list:
  """A token stream [N] (an array, or a token_cache.TokenStream) -> `num_rows` consecutive pieces of
  N // num_rows tokens (the `Stream` plan's examples), long enough for two windows at any offset.
  The pieces are slices: views of an array, lazy reads of a cache."""
  length = len(stream) // num_rows
  if length < 3 * seq_len:
    raise DataError(f'Sequential partitioning needs at least {3 * seq_len * num_rows} tokens for '
                    f'{num_rows} rows of data.seq_len={seq_len}; the data has {len(stream)}. Use more '
                    f'text or a smaller train.batch_size.')
  return [stream[row * length:(row + 1) * length] for row in range(num_rows)]


def sequential_batches(rows, seq_len: int, seed: int) -> grain.MapDataset:
  """Endless batches {'tokens' [R, seq_len + 1], 'reset' [R]} walking along every row together
  (`rows`: R sliceable rows of one length, e.g. `stream_rows`' pieces or a 2-D array).

  Pass e over the rows starts at a random offset in [0, seq_len) drawn from (seed, e), so window
  borders move between passes; its first batch has reset=True.
  """
  num_rows, length = len(rows), len(rows[0])
  per_pass = (length - seq_len) // seq_len

  def batch(index, window):
    offset = np.random.default_rng([seed, index // per_pass]).integers(seq_len)
    start = offset + window * seq_len
    return {'tokens': np.stack([np.asarray(row[start:start + seq_len + 1]) for row in rows]),
            'reset': np.full((num_rows,), window == 0)}

  return grain.MapDataset.range(per_pass).repeat().map_with_index(batch)


@dataclasses.dataclass(frozen=True)
class Stream:
  """Rows of one token stream read side by side, for a state carried from batch to batch
  (truncated backpropagation through time): `examples` are the global batch's rows,
  {'tokens': [L]} each (`stream_rows`), and batch k holds window k of every row, so row b of
  batch k + 1 continues row b of batch k (`sequential_batches`). Each process reads its own rows,
  its part of the carried state."""
  seq_len: int

  def global_batches(self, examples, batch_size, seed, process_index, process_count):
    if len(examples) != batch_size:
      raise ValueError(f'Stream batches read one example per row: {len(examples)} examples for batch_size '
                       f'{batch_size}.')
    local = batch_size // process_count
    rows = [examples[i]['tokens'] for i in range(process_index * local, (process_index + 1) * local)]
    return sequential_batches(rows, self.seq_len, seed)
