"""Orbax checkpoints in the run directory: LoRA params, optimizer state, step, PRNG key and the
data iterator's state. A save is atomic (orbax writes to a temporary folder and renames it), so a
run killed mid-save leaves the previous checkpoints whole; re-running the same command resumes
from the latest finished one.

With several processes every process calls `save` and `restore` (orbax's multi-host path: each
process writes and reads the shards of its own devices, process 0 the metadata and the data
iterator's JSON, which is the same on every process since all draw the same global batch).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: pathlib.Path, keep: int):
    self.directory = pathlib.Path(directory).absolute()
    self._mngr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False))

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
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    return out["state"], out["data"]

  def close(self) -> None:
    self._mngr.close()
