"""Orbax checkpoints in the run directory: LoRA params, optimizer state, step, PRNG key and the
data iterator's state. A save is atomic (orbax writes to a temporary folder and renames it), so a
run killed mid-save leaves the previous checkpoints whole; re-running the same command resumes
from the latest finished one. A read-only `Checkpointer` (another session's output, e.g. under
/kaggle/input) never writes, deletes or creates anything in its directory.

With several processes every process calls `save` and `restore` (orbax's multi-host path: each
process writes and reads the shards of its own devices, process 0 the metadata and the data
iterator's JSON, which is the same on every process since all draw the same global batch).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from reasoner.config import ConfigError


class CheckpointError(ConfigError):
  """A checkpoint cannot be found or does not fit this run (one line)."""


class Checkpointer:
  def __init__(self, directory: pathlib.Path, keep: int, read_only: bool = False):
    self.directory = pathlib.Path(directory).absolute()
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False,
                                                         save_interval_steps=0) if read_only else
               ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                            enable_async_checkpointing=False))
    quiet = logging.getLogger("absl")  # read-only: orbax warns "Given directory is read only"
    level = quiet.level
    quiet.setLevel(logging.ERROR if read_only else level)
    try:
      self._mngr = ocp.CheckpointManager(self.directory, options=options)
    finally:
      quiet.setLevel(level)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def save(self, step: int, state: Any, data_state: dict) -> None:
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  data=ocp.args.JsonSave(data_state)))
    self._mngr.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """Restores into the shardings of `target` (arrays or ShapeDtypeStructs with .sharding)."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises ValueError, OSError, XlaRuntimeError, ...
      raise CheckpointError(f"{self.directory / str(step)} does not fit this run (other model "
                            f"or LoRA settings?): {_first_line(e)}") from e
    return out["state"], out["data"]

  def close(self) -> None:
    self._mngr.close()


def _first_line(e: Exception) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  text = (lines[0] if lines else "").split(". Truncating/padding")[0]  # orbax's advice: not ours
  return f"{type(e).__name__}: {text[:300]}"


def find_checkpoints(root: str | pathlib.Path, key: str = "train.resume_from") -> pathlib.Path:
  """The checkpoints folder of a run directory: `root/checkpoints`, `root` itself, or the one
  `*/checkpoints` or `*/*/checkpoints` below it (a Kaggle input holding a copied runs/ tree)."""
  root = pathlib.Path(root).expanduser()
  if not root.is_dir():
    raise CheckpointError(f"config key '{key}' = '{root}': the directory does not exist")
  has_steps = lambda d: any(c.name.isdigit() and c.is_dir() for c in d.iterdir())
  for cand in (root / "checkpoints", root):
    if cand.is_dir() and has_steps(cand):
      return cand
  found = sorted(d for pat in ("*/checkpoints", "*/*/checkpoints") for d in root.glob(pat)
                 if d.is_dir() and has_steps(d))
  if len(found) == 1:
    return found[0]
  if found:
    raise CheckpointError(f"config key '{key}' = '{root}': several runs with checkpoints "
                          f"({', '.join(str(d.parent.relative_to(root)) for d in found)}); "
                          "point it at one of them")
  raise CheckpointError(f"config key '{key}' = '{root}': no checkpoints in it; expected a run "
                        "directory holding checkpoints/<step>/")
