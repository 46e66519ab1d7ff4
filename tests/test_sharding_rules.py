"""Every array of every preset that is large enough to shard is placed by an explicit rule of
train/sharding.py's PARTITION_RULES, never by the FSDP fallback that catches unknown names. Shapes
only (nnx.eval_shape): even llama-3.2-1b allocates nothing."""
import importlib

import jax
import numpy as np
import pytest
from flax import nnx

import support
from train import bench, sharding

# Layouts that change array shapes or names, checked for every preset of the family too.
VARIANTS = {'gpt': ({'scan_layers': True}, {'tie_embeddings': False})}
DEPTH_KEYS = ('num_layers', 'encoder_layers', 'decoder_layers')
CASES = [(family, preset, variant) for family, preset in support.family_presets()
         for variant in ({}, *VARIANTS.get(family, ()))]
IDS = [f'{family}:{preset}' + ''.join(f',{k}={v}' for k, v in variant.items()) for family, preset, variant in CASES]


def large_arrays(config) -> dict[str, tuple[int, ...]]:
  """{path: shape} of the model state's arrays of at least MIN_SHARDED_SIZE elements, the paths
  named as `sharding.state_shardings` names them (`path_to_string`)."""
  task = bench.bench_task(config, 'cpu')
  model = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(0)))
  arrays = {sharding.path_to_string(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))}
  return {path: shape for path, shape in arrays.items() if np.prod(shape) >= sharding.MIN_SHARDED_SIZE}


def preset_config(family: str, preset: str, variant: dict):
  config = support.with_overrides(importlib.import_module(f'configs.{family}').get_config(preset),
                                  {f'model.{k}': v for k, v in variant.items()})
  if not config.model.get('scan_layers'):
    # Blocks differ only in their index, and tracing a deep model's initialisation is slow (nnx's
    # RNG counter asks each traced value for its sharding, which walks the whole trace); a stacked
    # (scanned) model keeps its depth, which sets the size of its stacked arrays.
    for key in DEPTH_KEYS:
      if key in config.model:
        config.model[key] = min(config.model[key], 2)
  return config


@pytest.mark.parametrize('family, preset, variant', CASES, ids=IDS)
def test_every_large_array_has_an_explicit_rule(family, preset, variant):
  fallback = [f'{path} {shape}' for path, shape in large_arrays(preset_config(family, preset, variant)).items()
              if sharding.explicit_rule(path, shape) is None]
  assert not fallback, (f'{IDS[CASES.index((family, preset, variant))]}: no rule of train/sharding.py PARTITION_RULES '
                        f'places {"; ".join(fallback)} (the FSDP fallback would); add one.')

