"""The default main job (`python launch.py`): the translation Transformer's `default` preset on
the built-in `numbers_en_fr` dataset (English number words -> French).

See configs/transformer.py for the command and the expected result.
"""
from configs import transformer


def get_config(preset: str = 'default'):
  return transformer.get_config(preset)
