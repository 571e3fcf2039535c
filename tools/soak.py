"""A fault soak: `make soak` (not in CI; about ten minutes on 2 cores).

The tiny config trains 200 steps twice: once without a fault, once through at least 21 faults
at random points (a seeded random generator, `--seed`), each restarted with the same command
as a scheduler would: kill -9, SIGTERM, SIGINT, a damaged newest checkpoint, a full disk that
clears, a run directory that turns read-only and back, and a reward that times out. Then the
final LoRA weights and optimizer state, the data iterator's state and the metrics rows (less
their wall-clock figures) must equal the uninterrupted run's bit for bit. It prints each fault,
the steps it lost (trained again after the restart), and writes bench/results/soak.json.

The full disk and the read-only directory need a file system of their own: as root the run
lives on a small tmpfs (mounted here, removed after), filled with a ballast file until a write
fails, or remounted read-only between two processes (a mount with files open for writing
cannot turn read-only); elsewhere the read-only directory is a chmod and the full disk is left
out (printed). A reward that times out: `soak:stall` (this file, imported by the run from
tools/) sleeps while the stall file exists, past its 3 s `timeout_s`; the run stops with one
line, the file is removed and the run continues.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("kill -9", "SIGTERM", "SIGINT", "damaged checkpoint", "full disk", "read-only",
         "reward timeout")
EVERY = 5  # steps between checkpoints
CODES = {"kill -9": -9, "SIGTERM": 143, "SIGINT": 130, "damaged checkpoint": -9,
         "full disk": 2, "read-only": 2, "reward timeout": 2}


def stall(prompts, completions, **_):
  """The soak's third reward: 0 for every row, after sleeping while the stall file exists."""
  flag = pathlib.Path(os.environ["SOAK_STALL"])
  while flag.exists():
    time.sleep(0.2)
  return [0.0] * len(completions)


def command(run_dir: pathlib.Path, steps: int) -> list[str]:
  return [sys.executable, "-m", "reasoner", "train", "--config", "configs/tiny.yaml",
          f"train.run_dir={run_dir.parent}", f"train.run_name={run_dir.name}",
          f"train.steps={steps}", f"train.checkpoint_every={EVERY}", "train.keep_checkpoints=3",
          "rewards=[{fn: format_partial, weight: 0.5}, {fn: correct, weight: 0.5}, "
          "{fn: 'soak:stall', weight: 0.5, timeout_s: 3}]"]


def env(stall_file: pathlib.Path) -> dict[str, str]:
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
              JAX_PLATFORMS="cpu", SOAK_STALL=str(stall_file),
              PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]))


def rows(run: pathlib.Path) -> list[dict]:
  p = run / "metrics.jsonl"
  return [json.loads(l) for l in p.read_text().splitlines() if l] if p.exists() else []


def trained(run: pathlib.Path) -> int:
  return max((r["step"] for r in rows(run) if "loss" in r), default=0)


def checkpoints(run: pathlib.Path) -> list[int]:
  folder = run / "checkpoints"
  if not folder.exists():
    return []
  return sorted(int(c.name) for c in folder.iterdir() if c.name.isdigit())


def mount(path: pathlib.Path, size: str) -> bool:
  path.mkdir(parents=True, exist_ok=True)
  if os.geteuid() != 0:
    return False
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0


def remount(path: pathlib.Path, mode: str) -> None:
  subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, capture_output=True)


def fill(path: pathlib.Path) -> pathlib.Path:
  """Fills the file system of `path` with a ballast file until a write fails. A disk the run
  has filled already leaves none: the fault is there without it (seen once: the ballast's
  own creation refused, ENOSPC, and the soak died instead of the run)."""
  ballast = path / "ballast"
  try:
    f = open(ballast, "wb")
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    return ballast
  with f:
    try:
      while True:
        f.write(b"\0" * (1 << 16))
        f.flush()
    except OSError:
      pass
  return ballast


class Soak:
  def __init__(self, disk: pathlib.Path, steps: int, faults: int, seed: int, mounted: bool):
    self.disk, self.steps, self.mounted = disk, steps, mounted
    self.run = disk / "soak"
    self.stall_file = disk.parent / "stall"
    self.rng = random.Random(seed)
    kinds = [k for k in KINDS if mounted or k != "full disk"]
    self.plan = [kinds[i % len(kinds)] for i in range(faults)]
    self.rng.shuffle(self.plan)
    self.log: list[dict] = []
    # steps between faults, past the furthest step trained: spread over the run
    self.gap = (2, max(2, 2 * steps // max(1, faults) - 5))
    self.restarts = 0
    self.damaged: set[int] = set()  # damaged, not yet set aside by a start

  def start(self) -> subprocess.Popen:
    self.restarts += 1
    return subprocess.Popen(command(self.run, self.steps), env=env(self.stall_file), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

  def wait_for(self, proc: subprocess.Popen, step: int) -> bool:
    """Until the run has trained `step` (True) or ended (False)."""
    while proc.poll() is None:
      if trained(self.run) >= step:
        return True
      time.sleep(0.05)
    return False

  def one(self, kind: str) -> None:
    """Starts the run, injects `kind` a few steps past what it trained before, and checks the
    exit code and the line it printed."""
    before, whole = trained(self.run), self.whole()
    resume = whole[-1] if whole else 0
    at = min(self.steps - 1, max(before, resume) + self.rng.randint(*self.gap))
    if kind == "damaged checkpoint" and not whole:  # one to damage
      at = max(at, EVERY + 1)
    if kind == "read-only":  # between two processes: the run starts on a read-only directory
      self._read_only(True)
      try:
        proc = self.start()
        err = proc.communicate(timeout=600)[1]
      finally:
        self._read_only(False)
      self._check(kind, proc.returncode, err, "error: ")
      self.log.append({"fault": kind, "at_step": resume, "resumed_from": resume,
                       "steps_lost": 0})
      return
    proc = self.start()
    if not self.wait_for(proc, at):
      raise SystemExit(f"soak: the run ended before fault {kind!r} at step {at}: "
                       f"{proc.communicate()[1][-2000:]}")
    self.damaged.clear()  # this process set them aside when it started
    if kind in ("kill -9", "damaged checkpoint"):
      proc.kill()
    elif kind in ("SIGTERM", "SIGINT"):
      proc.send_signal(getattr(signal, kind))
    elif kind == "full disk":
      ballast = fill(self.disk)
    elif kind == "reward timeout":
      self.stall_file.touch()
    err = proc.communicate(timeout=600)[1]
    if kind == "full disk":
      ballast.unlink(missing_ok=True)
    self.stall_file.unlink(missing_ok=True)
    last = trained(self.run)
    if kind == "damaged checkpoint":
      newest = self.whole()[-1]
      self.damaged.add(newest)
      for f in (self.run / "checkpoints" / str(newest) / "state").glob("**/d/*"):
        f.write_bytes(b"")  # a partial copy, a disk that failed mid-flush
    self._check(kind, proc.returncode, err, {"SIGTERM": "SIGTERM: saved step",
                                            "SIGINT": "SIGINT: saved step"}.get(kind, "error: "))
    whole = self.whole()  # a damaged one is set aside by the restart: the one before resumes
    resume = whole[-1] if whole else 0
    self.log.append({"fault": kind, "at_step": last, "resumed_from": resume,
                     "steps_lost": last - resume})

  def whole(self) -> list[int]:
    """The checkpoints a restart can resume from: not those damaged since the last start."""
    return [c for c in checkpoints(self.run) if c not in self.damaged]

  def _check(self, kind: str, code: int, err: str, line: str) -> None:
    if code != CODES[kind]:
      raise SystemExit(f"soak: after {kind!r} the run exited {code}, expected {CODES[kind]}:\n"
                       f"{err[-3000:]}")
    if "Traceback" in err:
      raise SystemExit(f"soak: after {kind!r} a traceback:\n{err[-3000:]}")
    if code > 0 and not any(l.startswith(line) for l in err.splitlines()):
      raise SystemExit(f"soak: after {kind!r} no line starting {line!r}:\n{err[-3000:]}")

  def _read_only(self, on: bool) -> None:
    if self.mounted:
      remount(self.disk, "ro" if on else "rw")
    else:
      for p in [self.run, *self.run.rglob("*")]:
        p.chmod((p.stat().st_mode & ~0o222) if on else (p.stat().st_mode | 0o200))

  def finish(self) -> None:
    p = self.start()
    err = p.communicate(timeout=3600)[1]
    if p.returncode != 0:
      raise SystemExit(f"soak: the last restart exited {p.returncode}:\n{err[-3000:]}")


def compare(a: pathlib.Path, b: pathlib.Path, step: int) -> dict[str, bool]:
  """Bit-equality of the two runs' final checkpoints and metrics rows."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  sa, sb = (ocp.StandardCheckpointer().restore(r / "checkpoints" / str(step) / "state")
            for r in (a, b))
  la, lb = jax.tree.leaves(sa), jax.tree.leaves(sb)
  state = len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                     for x, y in zip(la, lb))
  data = {r: [p.read_bytes() for p in sorted((r / "checkpoints" / str(step) / "data").rglob("*"))
              if p.is_file() and p.name != "commit_success.txt"]  # that one names its folder
          for r in (a, b)}
  clean = lambda run: [{k: v for k, v in r.items() if not k.endswith("_s")}  # wall clock
                       for r in rows(run)]
  return {"lora_and_optimizer": state, "data_iterator": data[a] == data[b] and bool(data[a]),
          "metrics_rows": clean(a) == clean(b)}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--faults", type=int, default=21)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--keep", action="store_true", help="leave the two runs' directories")
  args = ap.parse_args(argv)
  os.environ.update(XLA_FLAGS="--xla_force_host_platform_device_count=2",  # as the runs saved
                    JAX_PLATFORMS="cpu")
  sys.path.insert(0, str(ROOT))
  from bench import common

  top = pathlib.Path(tempfile.mkdtemp(prefix="soak-"))
  disk = top / "disk"
  mounted = mount(disk, "48m")
  t0 = time.monotonic()
  try:
    soak = Soak(disk, args.steps, args.faults, args.seed, mounted)
    print(f"soak: {args.steps} steps of configs/tiny.yaml, {len(soak.plan)} faults "
          f"(seed {args.seed}); run directory {soak.run}"
          + ("" if mounted else " (not root: no tmpfs, so no full disk)"), flush=True)
    for i, kind in enumerate(soak.plan, 1):
      soak.one(kind)
      e = soak.log[-1]
      print(f"  fault {i:2d}: {kind:18s} at step {e['at_step']:3d}, resumed from "
            f"{e['resumed_from']:3d}, {e['steps_lost']} steps trained again", flush=True)
    soak.finish()
    faulted = time.monotonic() - t0
    print("soak: the same run without faults ...", flush=True)
    reference = top / "whole"
    p = subprocess.run(command(reference, args.steps), env=env(top / "never"), cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
      raise SystemExit(f"soak: the uninterrupted run exited {p.returncode}:\n{p.stderr[-3000:]}")
    equal = compare(soak.run, reference, args.steps)
    lost = sum(e["steps_lost"] for e in soak.log)
    for k, v in equal.items():
      print(f"  {k}: {'bit-equal' if v else 'DIFFERENT'}")
    goals = [common.goal("steps", args.steps, 200, at_most=False),
             common.goal("faults survived", len(soak.log), 20, at_most=False),
             common.goal("fault kinds", len({e['fault'] for e in soak.log}), len(KINDS),
                         at_most=False),
             *(common.goal(f"{k} bit-equal to the uninterrupted run (1 = yes)", float(v), 1.0,
                           at_most=False) for k, v in equal.items())]
    path = common.write("soak", {"faults": soak.log, "steps_trained_again": lost,
                                 "restarts": soak.restarts, "wall_s_with_faults": faulted,
                                 "equal": equal},
                        {"uninterrupted_wall_s": time.monotonic() - t0 - faulted}, goals,
                        steps=args.steps, seed=args.seed, tmpfs=mounted)
    print(f"soak: {len(soak.log)} faults survived, {lost} steps trained again; wrote {path}")
    return 0 if all(g["met"] for g in goals) else 1
  finally:
    if args.keep:
      kept = top / "kept"
      shutil.copytree(disk / "soak", kept / "soak", dirs_exist_ok=True)
      print(f"soak: the runs are in {kept / 'soak'} and {top / 'whole'}")
    if mounted:
      subprocess.run(["umount", str(disk)], capture_output=True)
    if not args.keep:
      shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
