"""Metrics out: TensorBoard event files (tensorboardX, no TensorFlow), `metrics.jsonl`, progress.

Only process 0 writes. On a terminal a tqdm bar shows ETA, loss and tokens/s; elsewhere (CI,
log files) plain lines are printed every `log_every` steps.

A gs:// workdir: both files are written to a local mirror (a GCS object cannot be appended to, and
tensorboardX reaches GCS only through a client of its own) and uploaded through epath every
`UPLOAD_SECONDS` and on `close()`, so a crash loses at most that much of them.
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

import storage

METRICS_FILE = 'metrics.jsonl'
UPLOAD_SECONDS = 30  # a gs:// workdir's metrics files are at most this old


def reduce_metrics(metrics: dict) -> dict[str, float]:
  """{name: (sum, count)} -> {name: sum / count}; plain scalars pass through."""
  out = {}
  for name, value in metrics.items():
    if isinstance(value, (tuple, list)):
      total, count = (float(np.asarray(v).sum()) for v in value)
      out[name] = total / max(count, 1e-9)
    else:
      out[name] = float(np.asarray(value))
  return out


class MetricWriter:

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0):
    self.enabled = jax.process_index() == 0
    self._tb = None
    self._bar = None
    if self.enabled:
      from tensorboardX import SummaryWriter
      self._mirror = storage.LocalMirror(workdir, fetch=(METRICS_FILE,))
      self._uploaded_at = time.time()
      self.path = os.path.join(self._mirror.local, METRICS_FILE)
      self._tb = SummaryWriter(os.path.join(self._mirror.local, 'tensorboard'))
      if sys.stderr.isatty():
        from tqdm import tqdm
        self._bar = tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True)
    self._total = total_steps
    self._start_time = time.time()
    self._start_step = start_step

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    with open(self.path, 'a') as f:
      f.write(json.dumps({'step': step, **{k: float(v) for k, v in scalars.items()}}) + '\n')
    if self._mirror.remote is not None and time.time() - self._uploaded_at >= UPLOAD_SECONDS:
      self._tb.flush()
      self._mirror.upload()
      self._uploaded_at = time.time()

  def write_image(self, step: int, tag: str, png_path: str) -> None:
    if not self.enabled:
      return
    import matplotlib.image
    with storage.path(png_path).open('rb') as f:
      image = matplotlib.image.imread(f, format='png')[..., :3]
    self._tb.add_image(tag, image, step, dataformats='HWC')

  def progress(self, step: int, scalars: dict[str, float]) -> None:
    """Called every `log_every` steps with the latest train scalars."""
    if not self.enabled:
      return
    shown = {k.split('/')[-1]: v for k, v in scalars.items() if k in ('train/loss', 'train/tokens_per_s')}
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix({k: f'{v:.4g}' for k, v in shown.items()}, refresh=True)
      return
    elapsed = time.time() - self._start_time
    done = max(step - self._start_step, 1)
    eta = elapsed / done * (self._total - step)
    items = ' '.join(f'{k}={v:.4g}' for k, v in shown.items())
    print(f'step {step}/{self._total} {items} eta={eta:.0f}s', flush=True)

  def log(self, message: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
      self._mirror.close()
