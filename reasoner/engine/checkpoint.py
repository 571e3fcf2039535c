"""Orbax checkpoints in the run directory: LoRA params, optimizer state, step, PRNG key and the
data iterator's state. A save is atomic (orbax writes to a temporary folder and renames it), so a
run killed mid-save leaves the previous checkpoints whole; re-running the same command resumes
from the latest finished one. A read-only `Checkpointer` (another session's output, e.g. under
/kaggle/input) never writes, deletes or creates anything in its directory.

Faults end in one line each: a checkpoint whose arrays differ from the run's is refused before
any read (naming the first that differs); one whose files cannot be read is set aside as
`corrupt-<step>` (never deleted) and the one before it restored; a save that fails (a full
disk) removes its partial folder and names the space left and the last whole checkpoint.

With several processes every process calls `save` and `restore` (orbax's multi-host path: each
process writes and reads the shards of its own devices, process 0 the metadata and the data
iterator's JSON, which is the same on every process since all draw the same global batch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re
import shutil
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from tqdm import tqdm

from reasoner.errors import (CheckpointDamaged, CheckpointError, first_line, is_write_failure,
                             root_cause, write_error)
from reasoner.engine.trainer import Trainer, checkpoint_tree
from reasoner.mesh import agreed


def _quiet_closed_loop(hook=sys.unraisablehook):
  """A failed orbax restore ends its asyncio loop while tensorstore reads are still in flight;
  each read's callback then raises "Event loop is closed" from a tensorstore thread, one
  traceback per array, after the error itself was reported. Those (and only those) are dropped."""
  def quiet(u):
    if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
      hook(u)
  return quiet


class _OrphanedFailures(logging.Filter):
  """A failed orbax write or read leaves its sibling tasks' failures unretrieved; asyncio logs
  each as "Task exception was never retrieved" with a traceback whenever the task is collected
  (for a damaged checkpoint, once per array that failed too: timing decides how many). The
  failure itself reaches the saver or `restore`, which reports it in one line: these copies of
  a write failure or of a checkpoint's damage are dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and record.getMessage().startswith(
        "Task exception was never retrieved") and (is_write_failure(exc) or _is_damage(exc)))


sys.unraisablehook = _quiet_closed_loop()
logging.getLogger("asyncio").addFilter(_OrphanedFailures())


def remove_until_gone(directory: pathlib.Path, pattern: str, quiet: float = 1.0,
                      limit: float = 30.0) -> None:
  """Removes a failed write's folders (`pattern` under `directory`) until none appears for
  `quiet` seconds: the writes of a save still in flight when its first write failed finish later
  and recreate them."""
  start = last_seen = time.monotonic()
  while time.monotonic() - last_seen < quiet and time.monotonic() - start < limit:
    for partial in pathlib.Path(directory).glob(pattern):
      shutil.rmtree(partial, ignore_errors=True)
      last_seen = time.monotonic()
    time.sleep(0.05)


class Checkpointer:
  def __init__(self, directory: pathlib.Path, keep: int, read_only: bool = False):
    self.directory = pathlib.Path(directory).absolute()
    self.read_only = read_only
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False,
                                            save_interval_steps=0) if read_only else
               ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                            enable_async_checkpointing=False))
    with _absl_errors_only() if read_only else contextlib.nullcontext():  # "... is read only"
      self._mngr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def save(self, step: int, state: Any, data_state: dict) -> None:
    """Saves whole or not at all; a failed save (a full disk, a folder gone read-only) removes
    its partial folder and raises one line naming the space left and the last whole one."""
    try:
      state, items = _items(state, ocp.args.StandardSave)
      # what orbax's writer threads log of a failed write, some of them while the partial
      # folder is removed (their writes still in flight), is held and dropped with the error
      with held_back():
        try:
          self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        **items))
          self._mngr.wait_until_finished()
        except Exception:
          if jax.process_index() == 0:
            remove_until_gone(self.directory, f"{step}.orbax-checkpoint-tmp*")
          self._mngr.reload()
          raise
    except Exception as e:
      last = max((s for s in self.all_steps() if s != step), default=None)
      raise CheckpointError(f"cannot save checkpoint {step} in {self.directory}: "
                            f"{write_error(e, self.directory)}; the last whole checkpoint is "
                            f"{last if last is not None else 'none'} (re-running resumes from "
                            f"it)") from e

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """Restores into the shardings of `target` (arrays or ShapeDtypeStructs with .sharding).
    Raises CheckpointError when the stored arrays differ from the target's, before reading any,
    and CheckpointDamaged when the files cannot be read."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    abstract, items = _items(abstract, ocp.args.StandardRestore)
    items = {k: v for k, v in items.items() if (self.directory / str(step) / k).is_dir()}
    self._check_fits(step, abstract)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(), **items))
    except Exception as e:  # orbax raises ValueError, OSError, XlaRuntimeError, ...
      # Only what the files did is damage; anything else (device memory, say) leaves it be.
      kind = CheckpointDamaged if _is_damage(e) else CheckpointError
      raise kind(f"{self.directory / str(step)} cannot be read: {first_line(e)}") from e
    return {**out["state"], **{k: out[k] for k in items}}, out["data"]

  def restore_latest(self, target: Any, log=print) -> tuple[int, Any, dict] | None:
    """(step, state, data) of the newest checkpoint that reads, or None when there is none.
    Each damaged one on the way is named in one line and, unless read-only, moved aside to
    `corrupt-<step>` (never deleted: its files may still matter to someone)."""
    for step in sorted(self.all_steps(), reverse=True):
      step = agreed(step)  # restoring is collective: every process tries the same step
      try:
        return (step, *self.restore(step, target))
      except CheckpointDamaged as e:
        aside = "" if self.read_only else f"; moved to {self._set_aside(step)}"
        log(f"checkpoint {e}{aside}")
    return None

  def _check_fits(self, step: int, abstract: Any) -> None:
    path = self.directory / str(step)
    try:
      with _absl_errors_only():  # orbax warns when a step has no _CHECKPOINT_METADATA
        stored = ocp.StandardCheckpointer().metadata(path / "state").item_metadata
    except Exception as e:
      raise CheckpointDamaged(f"{path} cannot be read: {first_line(e)}") from e
    if getattr(stored, "tree", None) is None:  # orbax logs why and returns nothing
      raise CheckpointDamaged(f"{path} cannot be read: its array metadata is unreadable")
    stored = stored.tree
    have, want = _shapes(stored), _shapes(abstract)
    for key in sorted(set(have) | set(want)):
      if have.get(key) != want.get(key):
        there, here = (f"({', '.join(map(str, d[0]))}) {d[1]}" if d else "absent"
                       for d in (have.get(key), want.get(key)))
        raise CheckpointError(f"{path} does not fit this run: {'/'.join(key)} is {there} there "
                              f"and {here} here (other model or LoRA settings?)")

  def _set_aside(self, step: int) -> pathlib.Path:
    aside = self.directory / f"corrupt-{step}"
    n = 1
    while aside.exists():
      n += 1
      aside = self.directory / f"corrupt-{step}-{n}"
    if jax.process_index() == 0:
      (self.directory / str(step)).rename(aside)
    agreed(step)  # a barrier: the others list the folder after process 0 renamed it
    self._mngr.reload()
    return aside

  def close(self) -> None:
    self._mngr.close()


# Parts of a state tree stored as items of their own, read back only where a checkpoint has
# them: the LoRA a rollout ahead samples with (`engine.ahead`), so that runs with and without
# `rollout.devices` resume from each other's checkpoints.
OPTIONAL = ("behind",)


def _items(tree: dict, arg) -> tuple[dict, dict]:
  """(the tree without its OPTIONAL parts, {part: arg(subtree)})."""
  return ({k: v for k, v in tree.items() if k not in OPTIONAL},
          {k: arg(tree[k]) for k in OPTIONAL if k in tree})


def _shapes(tree) -> dict[tuple[str, ...], tuple]:
  """{path: (shape, dtype)} with paths as names, alike for a target tree and orbax's metadata."""
  name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
  return {tuple(map(name, path)): (tuple(x.shape), str(x.dtype))
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@contextlib.contextmanager
def held_back():
  """Holds what orbax's writer threads print about an error (a traceback per thread, logged or
  raised) while the block runs: dropped when the block raises (the caller reports it in one
  line), shown when it does not."""
  records, threads, hook = [], [], threading.excepthook
  absl = logging.getLogger("absl")
  hold = logging.Filter()
  hold.filter = lambda r: records.append(r) if r.levelno >= logging.ERROR else True
  absl.addFilter(hold)
  threading.excepthook = threads.append
  try:
    yield
  finally:
    absl.removeFilter(hold)
    threading.excepthook = hook
  for r in records:
    absl.handle(r)
  for args in threads:
    hook(args)


@contextlib.contextmanager
def _absl_errors_only():
  log = logging.getLogger("absl")
  level = log.level
  log.setLevel(logging.ERROR)
  try:
    yield
  finally:
    log.setLevel(level)


# tensorstore's status codes for a file that is short, missing or garbled; JSON that is not.
_DAMAGE = re.compile(r"OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|Error reading|Error opening|corrupt|"
                     r"checksum|Expecting value|Unterminated string|Extra data")


def _is_damage(e: BaseException) -> bool:
  root = root_cause(e)
  return isinstance(root, (FileNotFoundError, json.JSONDecodeError)) or bool(
      _DAMAGE.search(str(root)))


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


def read_newest(folder: pathlib.Path, key: str, value: str, target, say) -> tuple:
  """(step, tree, data state) of the newest readable checkpoint of another run's `folder`
  (config key `key` = `value` points at it), read-only; none readable is one line."""
  ckpt = Checkpointer(folder, 1, read_only=True)
  try:
    found = ckpt.restore_latest(target, say)
  finally:
    ckpt.close()
  if found is None:
    raise CheckpointError(f"config key '{key}' = '{value}': no checkpoint in {folder} can be "
                          "read")
  return found


REFERENCE = "reference"  # beside a run's checkpoints: the LoRA it started from


def save_reference(run: pathlib.Path, lora) -> None:
  """Keeps `lora` (the LoRA lora.init_from started the run from) as `run`/reference, once:
  the reference policy of DPO and of GRPO's KL is the base under it, in every later session,
  whether or not the run it came from is still there."""
  path = pathlib.Path(run).absolute() / REFERENCE
  if path.is_dir():
    return
  try:
    with held_back():
      ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(path, args=ocp.args.StandardSave(
          lora))
  except Exception as e:
    raise CheckpointError(f"cannot save the reference LoRA in {path}: "
                          f"{write_error(e, path.parent)}") from e


def load_reference(run: pathlib.Path, like):
  """`run`'s reference LoRA placed as `like` (the run's LoRA), or None where it has none (the
  reference is then the base alone)."""
  path = pathlib.Path(run).absolute() / REFERENCE
  if not path.is_dir():
    return None
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          like)
  try:
    return ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        path, args=ocp.args.StandardRestore(abstract))
  except Exception as e:
    raise CheckpointError(f"{path} (the run's reference LoRA) cannot be read: {first_line(e)}"
                          ) from e


def restore_lora(setup, step: int | None = None):
  """(LoRA weights, step) of the run's checkpoint at `step` (default: the newest that reads,
  each unreadable one named on the way), read-only; (the initial LoRA, 0) when the run has no
  checkpoint and no step was asked for."""
  folder = setup.cfg.run_path / "checkpoints"
  ckpt = Checkpointer(folder, 1, read_only=True) if folder.is_dir() else None
  steps = ckpt.all_steps() if ckpt else []
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step}: no such checkpoint in {folder} (it has "
                          f"{', '.join(map(str, steps)) or 'none'})")
  if not steps:
    return setup.lora, 0
  trainer = Trainer.for_run(setup.graphdef, setup.base, setup.cfg)
  target = checkpoint_tree(trainer.init_state(setup.lora, jax.random.PRNGKey(0)))
  if step is not None:
    return ckpt.restore(step, target)[0]["lora"], step
  found = ckpt.restore_latest(target, lambda line: tqdm.write(line) if jax.process_index() == 0
                              else None)
  if found is None:
    raise CheckpointError(f"no checkpoint in {folder} can be read")
  return found[1]["lora"], found[0]
