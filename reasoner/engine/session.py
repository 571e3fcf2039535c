"""The session's clock and places: when this process started, when it must stop, where to write,
where compiled programs are kept.

A Kaggle TPU session ends 9 hours after it starts, and whatever has not been saved by then is
lost. `train.deadline` names that end (a duration from this process's start, `8h45m`, or an
ISO time); the loop asks `Clock.stop_before_next_step` before each step, with a reserve for the
final checkpoint, evaluation and export measured from this run's own timings (`Clock.measured`),
not guessed. Kaggle specifics are detected, never assumed: the same code runs anywhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import socket
import time

from reasoner.errors import ConfigError

def duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  h, rest = divmod(seconds, 3600)
  return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class Clock:
  """Step, evaluation, save and load times of this run, and the deadline they are held to."""

  def __init__(self, deadline: float | None, checkpoint_minutes: float | None):
    self.deadline = deadline
    self.interval = None if checkpoint_minutes is None else checkpoint_minutes * 60
    self.last_save = time.time()
    self.times: dict[str, float] = {}  # longest seen: step, eval, save, load
    self._steps: list[float] = []

  def measured(self, what: str, seconds: float) -> None:
    if what == "step":  # the first step of a process compiles: the longest of the others
      self._steps.append(seconds)
      self.times["step"] = max(self._steps[1:] or self._steps)
      return
    self.times[what] = max(seconds, self.times.get(what, 0.0))
    if what == "save":
      self.last_save = time.time()

  def estimated(self, what: str, seconds: float) -> None:
    """A stand-in for a time not measured yet (the latest estimate, not the longest)."""
    self.times[f"{what}_estimate"] = seconds

  @contextlib.contextmanager
  def timed(self, what: str):
    t0 = time.time()
    yield
    self.measured(what, time.time() - t0)

  def reserve(self, eval_after: bool) -> float:
    """Seconds kept after the last step: the final save, the evaluation after training (as long
    as the one before it or, if none was timed, a rollout scaled to the evaluation's tokens)
    and an export (writing what loading read: as long as the load)."""
    t = self.times
    evaluation = t.get("eval", t.get("eval_estimate", 0.0)) if eval_after else 0.0
    return t.get("save", 0.0) + evaluation + t.get("load", 0.0)

  def left(self) -> float:
    return float("inf") if self.deadline is None else self.deadline - time.time()

  def stop_before_next_step(self, eval_after: bool) -> bool:
    """True when the next step (as long as the longest so far) would leave too little time."""
    if self.deadline is None:
      return False
    return self.times.get("step", 0.0) + self.reserve(eval_after) > self.left()

  def save_due(self) -> bool:
    return self.interval is not None and time.time() - self.last_save >= self.interval


# ------------------------------------------------------------------------------ places

def on_kaggle() -> bool:
  """A Kaggle notebook session (Kaggle sets this variable in every kernel)."""
  return "KAGGLE_KERNEL_RUN_TYPE" in os.environ


def writable_root() -> pathlib.Path:
  """Where a run writes: /kaggle/working on Kaggle (/kaggle/input is read-only), else here."""
  return pathlib.Path("/kaggle/working") if on_kaggle() else pathlib.Path.cwd()


_claimed: dict[str, int] = {}  # run directory -> the open lock file this process holds


def claim(run: pathlib.Path) -> None:
  """Takes `run`/.lock for this process, so that two sessions (a notebook and a terminal, two
  terminals) never write one run's checkpoints and logs at once. An flock: the kernel drops it
  when the process ends, even by kill -9, so no stale lock outlives a crash. Claiming a run
  this process already holds (a notebook cell run again) is a no-op."""
  key = str(run.absolute())
  if key in _claimed:
    return
  fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
    os.close(fd)
    raise ConfigError(f"run {run} is in use by {holder}; wait for it to end, or use another "
                      "train.run_name") from None
  except OSError:  # a filesystem without locks: run unguarded rather than not at all
    os.close(fd)
    return
  os.ftruncate(fd, 0)
  os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
  _claimed[key] = fd


def release(run: pathlib.Path) -> None:
  fd = _claimed.pop(str(run.absolute()), None)
  if fd is not None:
    os.close(fd)


COMPILE_CACHE_BYTES = 4 << 30  # the compile cache's size; the least recently used go first


def compile_cache(path: str | None, log=print, min_seconds: float = 1.0) -> str | None:
  """Keeps this process's compiled programs in `path` (`train.compile_cache`), so that a later
  process compiling the same program (a resumed session, the next stage, the same command
  again) reads it instead: JAX's persistent compilation cache, keyed by the program, the
  compiler's version and flags and the devices. Only programs that took `min_seconds` or more
  to compile are kept, at most `COMPILE_CACHE_BYTES` (under its file lock: no process reads an
  entry another is writing). A cache already set (JAX_COMPILATION_CACHE_DIR, the test suite's)
  is left as it is. JAX runs what it finds there: a folder others can write is refused.
  Returns the folder in use, or None."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc

  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  if path is None:
    return None
  folder = pathlib.Path(path).expanduser()
  try:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = folder.stat().st_mode
    if not os.access(folder, os.W_OK):
      raise PermissionError(f"{folder} is not writable")
  except OSError as e:
    log(f"compile cache: off ({e}); train.compile_cache names another folder, or null")
    return None
  if mode & 0o022:
    log(f"compile cache: off ({folder} is writable by other users, and JAX runs what it "
        "finds there); chmod go-w it, or name another in train.compile_cache")
    return None
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
  jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
  cc.set_cache_dir(str(folder))
  cc.reset_cache()  # a cache looked for (and found unset) by an earlier compile looks again
  return str(folder)
