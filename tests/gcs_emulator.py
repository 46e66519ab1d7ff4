"""gcp-storage-emulator as the tests run it: `python tests/gcs_emulator.py start --port=N --in-memory ...`.

One addition to the emulator: object downloads carry the `x-goog-generation` header that real GCS
sends. TensorStore (Orbax's array writer) reads an object's generation from it and revalidates
cached reads against it (`ifGenerationNotMatch`); without it the generation parses as 0 and the
next read of the same object fails with "Malformed StorageGeneration".
"""
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download_with_generation(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = obj['generation']
    response['x-goog-metageneration'] = obj['metageneration']
  except Exception:  # noqa: BLE001 - a missing object: the emulator's own download answers 404
    pass
  return _download(request, response, storage, *args, **kwargs)


objects.download = download_with_generation  # before the server module builds its routes from it

if __name__ == '__main__':
  from gcp_storage_emulator.__main__ import main
  sys.exit(main(sys.argv[1:]))
