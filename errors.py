"""The one base class of user mistakes (a bad config value, missing data, a wrong workdir).

`launch.py` catches `UserError` (and only it) to print its message on one line and exit 1; every
other exception is a bug and keeps its traceback. Each layer defines its own subclasses
(`ConfigError`, `data.sources.DataError`, `train.checkpoint.CheckpointError`, ...), whose
messages name the problem and the fix. This module imports nothing, so every layer may use it.
"""


class UserError(Exception):
  """A mistake in the user's input; the message names the problem and the fix."""


class ConfigError(UserError):
  """A config key or value that cannot work (unknown key, wrong type, impossible value)."""
