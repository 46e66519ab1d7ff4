"""The default main job (`python launch.py`): the GPT `default` preset on the built-in stdlib corpus.

See configs/gpt.py for the command and the expected result.
"""
from configs import gpt


def get_config(preset: str = 'default'):
  return gpt.get_config(preset)
