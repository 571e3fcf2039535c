"""The errors a user sees: each says in one line what is wrong and, where it can, what to do.
The CLI catches `UserError` in one place and prints it (exit 2); `--debug` shows the traceback.
Anything else is a bug and keeps its traceback."""


class UserError(Exception):
  """Bad input or a fault outside the program (a file, a disk, the network): one line."""


class ConfigError(UserError, ValueError):
  """A configuration value is missing, unknown, of the wrong type or impossible."""


class DataError(UserError, ValueError):
  """A dataset cannot be found, read or understood."""


class RewardError(UserError, RuntimeError):
  """A reward function raised or returned something unusable."""


class CheckpointError(ConfigError):
  """A checkpoint cannot be found, read or written, or does not fit this run."""


class CheckpointDamaged(CheckpointError):
  """A checkpoint's files cannot be read (a partial copy, a disk that failed while flushing)."""
