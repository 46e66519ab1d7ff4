"""Metrics out: TensorBoard event files (tensorboardX, no TensorFlow), `metrics.jsonl`, progress,
and optionally Weights & Biases (`logging.wandb_project`).

A run resumed from an earlier checkpoint than its last logged step drops the later lines of
metrics.jsonl and tells TensorBoard to purge them (`purge_step`), so no step appears twice. Only
process 0 writes. On a terminal a tqdm bar shows ETA, loss and tokens/s; elsewhere (CI,
log files) plain lines are printed every `log_every` steps.

A gs:// workdir: both files are written to a local mirror (a GCS object cannot be appended to, and
tensorboardX reaches GCS only through a client of its own) and uploaded through epath every
`UPLOAD_SECONDS` and on `close()`, so a crash loses at most that much of them.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import jax
import numpy as np

import storage

METRICS_FILE = 'metrics.jsonl'
UPLOAD_SECONDS = 30  # a gs:// workdir's metrics files are at most this old


def summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch and Google Cloud Storage's client where
  they are not loaded yet.

  tensorboardX imports torch when it is installed (requirements-dev.txt, for the Hugging Face
  interop) only to accept torch tensors; this module logs floats, and importing torch is slow. It
  imports google-cloud-storage (with requests, grpc, ...: slow to import, at every run's start) for
  a gs:// writer of its own, which this module never uses: a gs:// workdir's event files are
  written to a local mirror (above). A `None` entry in sys.modules makes an import raise
  ImportError, which tensorboardX treats as the package being absent; each imports normally afterwards.
  """
  absent = [name for name in ('torch', 'google.cloud.storage') if name not in sys.modules]
  sys.modules.update(dict.fromkeys(absent))
  try:
    from tensorboardX import SummaryWriter
  finally:
    for name in absent:
      del sys.modules[name]
  return SummaryWriter


def read_logged(workdir: str, names: list[str]) -> tuple[list[int], dict[str, list[float]]]:
  """(the steps of the run's metrics.jsonl rows that log every one of `names`, {name: its values at
  those steps}); ([], {}) when the run has no such row or no metrics file."""
  path = storage.path(os.path.join(workdir, METRICS_FILE))
  rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
  rows = sorted((row for row in rows if all(name in row for name in names)), key=lambda row: row['step'])
  return [row['step'] for row in rows], ({name: [row[name] for row in rows] for name in names} if rows else {})


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
  """`trim_after`: the step training resumes from; logged steps after it are dropped.
  `wandb`: {'project', 'entity', 'config', 'workdir'} to log to Weights & Biases as well."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, *, trim_after: int | None = None,
               wandb: dict | None = None):
    self.enabled = jax.process_index() == 0
    self._tb = None
    self._bar = None
    self._wandb = None
    if self.enabled:
      SummaryWriter = summary_writer_class()
      self._mirror = storage.LocalMirror(workdir, fetch=(METRICS_FILE,))
      self._uploaded_at = time.time()
      self.path = os.path.join(self._mirror.local, METRICS_FILE)
      purge_step = None
      if trim_after is not None and _trim(self.path, trim_after):
        purge_step = trim_after + 1
      self._tb = SummaryWriter(os.path.join(self._mirror.local, 'tensorboard'), purge_step=purge_step)
      if wandb:
        self._wandb = _start_wandb(**wandb)
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
    if self._wandb is not None:
      self._wandb.log({k: float(v) for k, v in scalars.items()}, step=step)
    if self._mirror.remote is not None and time.time() - self._uploaded_at >= UPLOAD_SECONDS:
      self.sync()

  def sync(self) -> None:
    """Upload what was logged to a remote workdir (nothing to do for a local one). Called before each
    checkpoint save: a resume from step S keeps the rows up to S, so they must be in the bucket before
    checkpoint S can exist, or a SIGKILL between uploads loses them (scripts/fault_soak.py)."""
    if not self.enabled or self._mirror.remote is None:
      return
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
    if self._wandb is not None:
      import wandb
      self._wandb.log({tag: wandb.Image(image)}, step=step)

  def progress(self, step: int, scalars: dict[str, float], seconds_left: float | None = None) -> None:
    """Called every `log_every` steps with the latest train scalars. `seconds_left`: the wall-clock
    budget's (train.max_minutes; None: none), whose end the eta is when it comes before the steps'."""
    if not self.enabled:
      return
    shown = {k.split('/')[-1]: f'{v:.4g}' for k, v in scalars.items() if k in ('train/loss', 'train/tokens_per_s')}
    if self._bar is not None:  # the bar's own estimate counts steps: the budget's end is shown beside it
      self._bar.n = step
      self._bar.set_postfix({**shown, **({} if seconds_left is None else {'budget_left': f'{seconds_left:.0f}s'})},
                            refresh=True)
      return
    elapsed = time.time() - self._start_time
    done = max(step - self._start_step, 1)
    eta = elapsed / done * (self._total - step)
    if seconds_left is not None:
      eta = min(eta, seconds_left)
    items = ' '.join(f'{k}={v}' for k, v in shown.items())
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
    if self._wandb is not None:
      self._wandb.finish()
    if self.enabled:
      self._mirror.close()


def _trim(path: str, after: int) -> int:
  """Drop the lines of metrics.jsonl logged after step `after`; the number dropped."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  kept = [line for line in lines if json.loads(line)['step'] <= after]
  if len(kept) < len(lines):
    with open(path + '.tmp', 'w') as f:
      f.writelines(kept)
    os.replace(path + '.tmp', path)
    print(f'Dropped the {len(lines) - len(kept)} lines of {path} logged after step {after}, the checkpoint '
          f'this run resumes from (TensorBoard purges those steps too).', flush=True)
  return len(lines) - len(kept)


def _start_wandb(project: str, entity: str | None, config: dict, workdir: str):
  """A W&B run whose id is derived from the workdir, so a resume continues the same run.
  WANDB_MODE=offline (or `wandb offline`) logs without a network."""
  try:
    import wandb
  except ImportError:
    from errors import UserError
    raise UserError('logging.wandb_project is set but wandb is not installed; pip install wandb==0.31.0 '
                    '(or drop --config.logging.wandb_project).') from None
  local = '://' not in workdir
  run_id = hashlib.sha256(os.path.abspath(workdir).encode() if local else workdir.encode()).hexdigest()[:16]
  return wandb.init(project=project, entity=entity, id=run_id, resume='allow', config=config,
                    name=os.path.basename(os.path.normpath(workdir)), dir=workdir if local else None)
