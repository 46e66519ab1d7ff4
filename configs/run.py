"""A trained run's own config (its config.json) as a config file: `--config=configs/run.py:<workdir>`.

`--mode=eval` and `--mode=predict` use it implicitly when `--config.*` overrides are given
without `--config`, so that the overrides are checked (unknown keys, types) against the run's
saved config and applied on top of it:

  printf 'a sentence\\n' | python launch.py --mode=predict --workdir=runs/bert-bbc --config.task=features --input=-
"""
import json
import os

import ml_collections

import storage
from errors import ConfigError


def get_config(workdir: str = ''):
  path = os.path.join(workdir, 'config.json')
  if not workdir or not storage.path(path).exists():
    raise ConfigError(f'{path} not found: {workdir or "(no workdir)"} is not a run directory; use '
                            f'--config=configs/run.py:<workdir of a trained run>.')
  return ml_collections.ConfigDict(json.loads(storage.path(path).read_text()))
