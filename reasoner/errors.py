"""The errors a user sees: each says in one line what is wrong and, where it can, what to do.
The CLI catches `UserError` in one place and prints it (exit 2); `--debug` shows the traceback.
Anything else is a bug and keeps its traceback. A write the filesystem refused (a full disk, a
read-only folder) is put in words by `write_error`."""

from __future__ import annotations

import errno
import pathlib
import shutil


class UserError(Exception):
  """Bad input or a fault outside the program (a file, a disk, the network): one line."""


class ConfigError(UserError, ValueError):
  """A configuration value is missing, unknown, of the wrong type or impossible."""


class DataError(UserError, ValueError):
  """A dataset cannot be found, read or understood."""


class RewardError(UserError, RuntimeError):
  """A reward function raised or returned something unusable."""


class RewardTimeout(RewardError):
  """A reward function did not return within its `rewards[].timeout_s`."""


class RewardInterrupted(Exception):
  """A signal arrived while a reward was scoring: the step in flight is dropped (not an error:
  the loop saves and stops as for any signal)."""


class CheckpointError(ConfigError):
  """A checkpoint cannot be found, read or written, or does not fit this run."""


class CheckpointDamaged(CheckpointError):
  """A checkpoint's files cannot be read (a partial copy, a disk that failed while flushing)."""


def write_error(e: BaseException, directory: pathlib.Path) -> str:
  """What stopped a write, in words: the disk's space left, or the first line of the cause."""
  free = shutil.disk_usage(_existing(directory)).free
  root, text = root_cause(e), first_line(e)
  if getattr(root, "errno", None) == errno.ENOSPC or "No space left" in text or (
      "RESOURCE_EXHAUSTED" in text):
    return f"no space left on its disk ({_size(free)} free)"
  if getattr(root, "errno", None) in (errno.EACCES, errno.EROFS, errno.EPERM):
    return f"not writable ({root.strerror})"
  if isinstance(root, OSError) and root.strerror:
    return root.strerror
  return f"{text} ({_size(free)} free there)"


def is_write_failure(e: BaseException) -> bool:
  """Whether `e` came from the filesystem refusing a write (rather than from a bug)."""
  root = root_cause(e)
  return isinstance(root, OSError) or "RESOURCE_EXHAUSTED" in str(root) or (
      "No space left" in str(root))


def _existing(path: pathlib.Path) -> pathlib.Path:
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def _size(n: int) -> str:
  for unit in ("bytes", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
    n /= 1024


def root_cause(e: BaseException) -> BaseException:
  """The innermost cause (orbax wraps tensorstore's error, which names the file and what is
  wrong with it, in one that names only the array)."""
  while True:
    inner = e.__cause__ if e.__cause__ is not None else (
        None if e.__suppress_context__ else e.__context__)
    if inner is None:
      return e
    e = inner


def first_line(e: BaseException) -> str:
  e = root_cause(e)
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  text = (lines[0] if lines else "").split(". Truncating/padding")[0]  # orbax's advice: not ours
  return f"{type(e).__name__}: {text[:300]}"
