"""What every benchmark shares: the machine description, timing, and the results file."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import subprocess
import tempfile
import time
from typing import Any, Callable

RESULTS = pathlib.Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
  import jax

  devices = jax.devices()
  cpu = platform.processor() or platform.machine()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
          "backend": jax.default_backend(), "devices": len(devices),
          "device_kind": devices[0].device_kind, "jax": jax.__version__}


def goal(name: str, value: float | None, target: float, at_most: bool = True) -> dict[str, Any]:
  """One goal of the issue: met when value <= target (at_most) or value >= target; a value of
  None (never reached) is not met."""
  met = value is not None and (value <= target if at_most else value >= target)
  return {"name": name, "value": value, "target": target,
          "direction": "at_most" if at_most else "at_least", "met": bool(met)}


def timeit(fn: Callable[[], Any], repeats: int = 3) -> float:
  """Best wall time of `repeats` calls (seconds); results are blocked on."""
  import jax

  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def write(name: str, figures: dict[str, Any], reference: dict[str, Any],
          goals: list[dict[str, Any]], **extra: Any) -> pathlib.Path:
  """bench/results/<name>.json: our figures, the reference's, the machine, the goals."""
  RESULTS.mkdir(parents=True, exist_ok=True)
  path = RESULTS / f"{name}.json"
  doc = {"name": name, "machine": machine(), "figures": figures, "reference": reference,
         "goals": goals, **extra}
  path.write_text(json.dumps(doc, indent=2) + "\n")
  return path


def table(rows: list[dict[str, Any]]) -> str:
  """A short fixed-width table of a list of flat dicts."""
  if not rows:
    return ""
  cols = list(rows[0])
  cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
  line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
  return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _fmt(v: Any) -> str:
  if isinstance(v, float):
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
  return str(v)


@contextlib.contextmanager
def worktree(commit: str, bench: str):
  """(a temporary folder, a git worktree of `commit` inside it): the code a benchmark compares
  against, run from its own `reasoner` (PYTHONPATH); removed afterwards."""
  root = RESULTS.parents[1]
  with tempfile.TemporaryDirectory(prefix=f"{bench}-") as tmp:
    tree = pathlib.Path(tmp) / "tree"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=root,
                          capture_output=True, text=True)
    if made.returncode:
      raise SystemExit(f"bench {bench}: no worktree at {commit} (it needs the git history): "
                       f"{made.stderr.strip()}")
    try:
      yield pathlib.Path(tmp), tree
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root,
                     capture_output=True)
