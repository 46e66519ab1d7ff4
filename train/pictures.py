"""Attention heatmaps as PNG files, for any family that records attention weights, and the expert
load of a mixture-of-experts run.

`plot_attention(path, panels, ...)` draws a grid of panels (`attention_figure`), each a [queries, keys]
weight matrix with its tokens on the axes (one row per attention kind, one column per head, say).
Families pass the file paths back from `Task.evaluate` under 'images' so the trainer also logs them to
TensorBoard. `token_labels` turns ids into short readable axis labels.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

import storage


@dataclasses.dataclass
class Panel:
  weights: np.ndarray  # [queries, keys], rows sum to 1 over real keys
  query_labels: Sequence[str]  # y axis
  key_labels: Sequence[str]  # x axis
  title: str = ''
  x_label: str = 'keys'
  y_label: str = 'queries'


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
  """One readable label per id: its own decoded text (byte-level BPE pieces become words, not
  'Ġ' escapes), or the raw token for specials and pieces that do not decode alone."""
  labels = []
  for i in ids:
    text = tokenizer.decode([int(i)])
    if text and not text.strip():
      labels.append('\u2423')  # a visible space
    elif text and '\ufffd' not in text:
      labels.append(text.strip())
    else:
      labels.append(tokenizer.id_to_token(int(i)))
  return labels


def plot_attention(path: str, panels: Sequence[Sequence[Panel]], title: str = '') -> str:
  """Save a grid of heatmaps (panels[row][column]) to `path` (PNG) and return the path."""
  import matplotlib.pyplot as plt
  figure = attention_figure(panels, title)
  storage.save_png(figure, path, dpi=90)
  plt.close(figure)
  return path


def attention_figure(panels: Sequence[Sequence[Panel]], title: str = ''):
  """A matplotlib figure of a grid of heatmaps (panels[row][column]), each cell sized by its token counts."""
  import matplotlib
  matplotlib.use('Agg')  # files only, no display
  import matplotlib.pyplot as plt
  rows, columns = len(panels), max(len(row) for row in panels)
  # Size each cell by its token counts so labels stay legible for long sentences.
  cell_w = max(2.5, 0.28 * max(len(p.key_labels) for row in panels for p in row) + 1.2)
  cell_h = max(2.5, 0.28 * max(len(p.query_labels) for row in panels for p in row) + 1.2)
  figure, axes = plt.subplots(rows, columns, figsize=(cell_w * columns, cell_h * rows + 0.6), squeeze=False)
  for r, row in enumerate(panels):
    for c in range(columns):
      ax = axes[r][c]
      if c >= len(row):
        ax.axis('off')
        continue
      panel = row[c]
      ax.imshow(np.asarray(panel.weights, np.float32), cmap='viridis', vmin=0.0, vmax=1.0, aspect='auto')
      ax.set_xticks(range(len(panel.key_labels)), panel.key_labels, rotation=90, fontsize=8)
      ax.set_yticks(range(len(panel.query_labels)), panel.query_labels, fontsize=8)
      ax.set_title(panel.title, fontsize=9)
      ax.set_xlabel(panel.x_label, fontsize=8)
      if c == 0:
        ax.set_ylabel(panel.y_label, fontsize=8)
  if title:
    figure.suptitle(title, fontsize=10)
  figure.tight_layout()
  return figure


def expert_load_figure(steps: Sequence[int], blocks: Sequence[int], max_load: np.ndarray, min_load: np.ndarray,
                       title: str = ''):
  """Two heatmaps over [MoE blocks, logged steps]: each block's most and least loaded expert, as a
  multiple of an even share (1 = every expert equally loaded). max_load, min_load: [len(blocks), len(steps)].
  Returns the matplotlib figure (the caller saves and closes it)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.12 * len(steps) + 3), 2 * (1.0 + 0.3 * len(blocks)) + 0.6),
                              squeeze=False)
  every = -(-len(steps) // 12)  # at most 12 step labels
  for ax, values, name, cmap in ((axes[0][0], max_load, 'most loaded expert', 'magma'),
                                 (axes[1][0], min_load, 'least loaded expert', 'viridis')):
    image = ax.imshow(np.asarray(values, np.float32), cmap=cmap, aspect='auto', interpolation='nearest')
    figure.colorbar(image, ax=ax, label='x even share')
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=8)
    ax.set_yticks(range(len(blocks)), [f'block {b}' for b in blocks], fontsize=8)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel('step', fontsize=8)
  if title:
    figure.suptitle(title, fontsize=10)
  figure.tight_layout()
  return figure


def plot_expert_load(path: str, steps: Sequence[int], blocks: Sequence[int], max_load: np.ndarray,
                     min_load: np.ndarray, title: str = '') -> str:
  """Save `expert_load_figure` to `path` (PNG); return the path."""
  import matplotlib.pyplot as plt
  figure = expert_load_figure(steps, blocks, max_load, min_load, title)
  storage.save_png(figure, path, dpi=90)
  plt.close(figure)
  return path
