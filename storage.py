"""Files of a run, on local disk or in Google Cloud Storage, through `etils.epath`.

Every file a workdir holds (config.json, model.json, tokenizer files, metrics, TensorBoard
events, pictures, predictions, exports, sweep tables) is read and written through `path()`, so
`--workdir=gs://bucket/run` works wherever a local directory does; Orbax writes the checkpoints
through epath and TensorStore. Without TensorFlow, epath reaches gs:// through `gcsfs`.

Real GCS needs Application Default Credentials, an emulator the variables of
`emulator_environment(url)` (docs/accelerators.md 'Cloud workdirs').

Writes that must never be seen half-done use `write_atomically`: on local disk the file is
written aside and renamed; a GCS object is complete or absent by itself (an upload becomes
visible only when it finishes), so it is written in place.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile

from etils import epath

from errors import UserError

REMOTE_PREFIXES = ('gs://',)


class StorageError(UserError):
  """A cloud location that cannot be reached: no gcsfs, no credentials, a half-set emulator."""


def is_remote(location: str | os.PathLike) -> bool:
  return os.fspath(location).startswith(REMOTE_PREFIXES)


def path(location: str | os.PathLike) -> epath.Path:
  """`location` (a local path or gs://bucket/...) as an `epath.Path`; the first gs:// one of a
  process checks that gcsfs and credentials are there (StorageError otherwise)."""
  if is_remote(location):
    check_gcs_access()
  return epath.Path(location)


def emulator_environment(url: str) -> dict[str, str]:
  """The variables pointing every GCS client at a storage emulator serving `url` (http://host:port):
  gcsfs (STORAGE_EMULATOR_HOST; without the bucket-layout lookup over gRPC that an emulator does not
  serve), and TensorStore, which writes the checkpoint arrays (its own endpoint and a dummy token)."""
  return {'STORAGE_EMULATOR_HOST': url, 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
          'TENSORSTORE_GCS_HTTP_URL': url, 'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator'}


@functools.cache
def check_gcs_access() -> None:
  try:
    import gcsfs  # noqa: F401 - epath's gs:// backend without TensorFlow
  except ImportError as e:
    raise StorageError(f'A gs:// path needs gcsfs ({e}); pip install -r requirements.txt.') from None
  emulator = os.environ.get('STORAGE_EMULATOR_HOST')
  if emulator:
    expected = emulator_environment(emulator)
    unset = [f'{k}={v}' for k, v in expected.items() if not os.environ.get(k) or
             (k == 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT' and os.environ[k].lower() not in ('false', '0'))]
    if unset:
      raise StorageError(f'STORAGE_EMULATOR_HOST={emulator} is set but not {", ".join(unset)}: set them too, so that '
                         f'TensorStore (checkpoints) and gcsfs (other files) both use it '
                         f'(docs/accelerators.md, Cloud workdirs).')
    return
  import google.auth
  import google.auth.exceptions
  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError as e:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise StorageError(f'No Google Cloud credentials for gs:// ({first_line}); run `gcloud auth '
                       f'application-default login` or set GOOGLE_APPLICATION_CREDENTIALS=<key.json>.') from None


def write_atomically(location: str | os.PathLike, data: str | bytes) -> None:
  """Write `data` so that readers find the old file, no file, or the whole new one."""
  target = path(location)
  if is_remote(location):
    target.write_bytes(data) if isinstance(data, bytes) else target.write_text(data)
    return
  aside = target.with_name(f'{target.name}.{os.getpid()}.tmp')
  try:
    aside.write_bytes(data) if isinstance(data, bytes) else aside.write_text(data)
    os.replace(aside, target)
  except BaseException:  # a full disk or an interrupt: no half-written file left beside the target
    aside.unlink(missing_ok=True)
    raise


class LocalMirror:
  """A local directory standing in for `directory`, for writers that need a real file: appending
  to metrics.jsonl, tensorboardX's event files, jax.profiler's traces.

  A local `directory` is its own mirror. A remote one gets a temporary directory; `upload()` copies
  the files changed since the last upload into `directory`, and `close()` uploads and removes it.
  """

  def __init__(self, directory: str, fetch: tuple[str, ...] = ()):
    """`fetch`: names of files that `directory` may already hold, copied down so that appends continue them."""
    self.remote = path(directory) if is_remote(directory) else None
    self.local = directory if self.remote is None else tempfile.mkdtemp(prefix='workdir-mirror-')
    self._uploaded = {}  # relative path -> (size, mtime) at its last upload
    for name in fetch if self.remote is not None else ():
      if (self.remote / name).exists():
        os.makedirs(os.path.dirname(os.path.join(self.local, name)), exist_ok=True)
        with open(os.path.join(self.local, name), 'wb') as f:
          f.write((self.remote / name).read_bytes())
        self._uploaded[name] = self._signature(name)

  def _signature(self, relative: str) -> tuple[int, int]:
    status = os.stat(os.path.join(self.local, relative))
    return status.st_size, status.st_mtime_ns

  def upload(self) -> None:
    if self.remote is None:
      return
    for root, _, names in os.walk(self.local):
      for name in names:
        relative = os.path.relpath(os.path.join(root, name), self.local)
        signature = self._signature(relative)
        if self._uploaded.get(relative) != signature:
          with open(os.path.join(self.local, relative), 'rb') as f:
            (self.remote / relative).write_bytes(f.read())
          self._uploaded[relative] = signature

  def close(self) -> None:
    if self.remote is None:
      return
    self.upload()
    shutil.rmtree(self.local, ignore_errors=True)


def save_png(figure, location: str | os.PathLike, dpi: int) -> None:
  """Save a matplotlib figure as a PNG file at `location`."""
  with path(location).open('wb') as f:
    figure.savefig(f, format='png', dpi=dpi)
