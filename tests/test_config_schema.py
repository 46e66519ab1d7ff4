"""The rules of configs/base.py, checked for every preset of every family: each validates, each
`model.*` key is a field of the family's model-config dataclass (any other is an error, never
dropped), and each default is written once (no preset entry and no get_config line repeats the
value the key would have anyway)."""
import ast
import copy
import importlib
import inspect
import json
import os
import pathlib
import shutil

import pytest

import support
from configs.base import base_config
from errors import ConfigError
from train.rundir import run_config
from train.task import task_class, task_module
from train.validation import flatten, validate_config

CASES = support.family_presets()
FAMILIES = sorted({family for family, _ in CASES})


@pytest.mark.parametrize('family, preset', CASES)
def test_every_preset_validates_and_its_model_keys_are_fields(family, preset):
  config = importlib.import_module(f'configs.{family}').get_config(preset)
  validate_config(config, num_devices=1)
  assert set(config.model) <= set(task_module(family).Task.model_config_class.__dataclass_fields__)


def test_a_model_key_the_model_config_lacks_is_an_error(monkeypatch):
  from configs import gpt
  get_config = gpt.get_config

  def with_stray_key(preset='default'):
    config = get_config(preset)
    config.model.widht = 64  # a family's own typo: its schema has it, its GPT2Config does not
    return config

  monkeypatch.setattr(gpt, 'get_config', with_stray_key)
  config = gpt.get_config('tiny')
  message = (r"^config.model.widht is not a field of GPT2Config \(models/gpt.py\), so the model would ignore it. "
             r"Did you mean 'width'\? Its fields: vocab_size, vocab_multiple, max_len, .*, moe_router_bias.$")
  with pytest.raises(ConfigError, match=message):
    validate_config(config, num_devices=1)
  with pytest.raises(ConfigError, match=message):  # and where the model config is resolved, for any caller
    task_class(config.family).resolve_model_config(config, None, vocab_size=10)


@pytest.mark.parametrize('family', FAMILIES)
def test_no_preset_entry_repeats_the_value_it_would_have_anyway(family, monkeypatch):
  module = importlib.import_module(f'configs.{family}')
  for preset, entries in getattr(module, 'PRESETS', {}).items():
    full = flatten(module.get_config(preset))
    for section, values in entries.items():
      for key in values if isinstance(values, dict) else [None]:
        without = copy.deepcopy(entries)
        if key is None:
          del without[section]
        else:
          del without[section][key]
        monkeypatch.setitem(module.PRESETS, preset, without)
        name = section if key is None else f'{section}.{key}'
        assert flatten(module.get_config(preset)) != full, f'configs/{family}.py PRESETS[{preset!r}] repeats {name}'
        monkeypatch.setitem(module.PRESETS, preset, entries)


@pytest.mark.parametrize('family', FAMILIES)
def test_get_config_sets_no_key_to_the_shared_default(family):
  shared = flatten(base_config(family))
  source = inspect.getsource(importlib.import_module(f'configs.{family}').get_config)
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Attribute):
      continue
    name = ast.unparse(node.targets[0]).removeprefix('c.')
    try:
      value = ast.literal_eval(node.value)
    except ValueError:
      continue
    assert not (name in shared and shared[name] == value and type(shared[name]) is type(value)), (
        f'configs/{family}.py get_config sets {name} = {value!r}, the default configs/base.py already gives it')


def test_a_run_saved_before_model_json_drops_model_keys_its_model_config_lost(tmp_path):
  workdir = tmp_path / 'gpt_tiny'
  shutil.copytree(os.path.join(support.REPO, 'tests', 'fixtures', 'legacy_runs', 'gpt_tiny'), workdir)
  path = pathlib.Path(workdir, 'config.json')
  saved = json.loads(path.read_text())
  saved['model']['retired_key'] = 1  # as families without attention once held model.attention
  path.write_text(json.dumps(saved))
  config, model_config = run_config(str(workdir))
  assert model_config.width == 32 and 'retired_key' not in config.model
