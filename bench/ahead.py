"""Rollouts a step ahead against in turn, at equal steps: what one update of staleness costs.

    make bench BENCH=ahead        (python -m bench ahead; about 20 minutes on 2 cores)

Two runs of the embedded default (`configs/embedded.yaml`, `make train`'s: 16 GRPO steps), each
in its own subprocess on two fake CPU devices, the held-out set raised to 256 problems: one
sampling in turn on the training chips, one sampling a step ahead on a chip of its own
(`rollout.devices: 1`: step t + 1's groups drawn with the LoRA from before step t's update).
Both use the truncated importance weights (`grpo.sampler_is: token`) that the second needs, so
that staleness is the only difference. The held-out mean reward after training is compared per
problem (the same 256, greedy): the difference and its paired standard error.

Goal (issue 37): the staleness costs nothing measurable: the ahead run's held-out mean reward is
no more than two standard errors below the in-turn run's. On CPU both sides share the host's
two cores, so the wall times say nothing of a TPU's; they are recorded, not compared.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import common

CONFIG = "configs/embedded.yaml"
HELD_OUT = int(os.environ.get("AHEAD_HELD_OUT", "256"))
COMMON = [f"data.num_eval={HELD_OUT}", "grpo.sampler_is=token", "train.checkpoint_every=1000"]
RUNS = {"in_turn": [], "ahead": ["rollout.devices=1", "train.eval_before=false"]}


def train(root: pathlib.Path, name: str, overrides: list[str]) -> tuple[dict, float]:
  """Runs `python -m reasoner train` on two fake devices: ({tag: [per-problem reward]} of its
  held-out evaluations, wall seconds)."""
  cmd = [sys.executable, "-m", "reasoner", "train", "--config", CONFIG,
         f"train.run_dir={root}", f"train.run_name={name}", *COMMON, *overrides]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  t = time.perf_counter()
  subprocess.run(cmd, check=True, env=env)
  rewards: dict[str, list[float]] = {}
  for line in open(root / name / "samples.jsonl"):
    row = json.loads(line)
    if row["tag"].startswith("eval-"):
      rewards.setdefault(row["tag"], []).append(row["reward"])
  steps = [json.loads(line) for line in open(root / name / "metrics.jsonl")]
  mismatch = [r["sampler_mismatch_mean"] for r in steps if "sampler_mismatch_mean" in r]
  return {"rewards": rewards, "mismatch": sum(mismatch) / len(mismatch)}, time.perf_counter() - t


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
  """mean(b - a) over the same problems and its standard error."""
  d = [y - x for x, y in zip(a, b, strict=True)]
  m = sum(d) / len(d)
  var = sum((x - m) ** 2 for x in d) / (len(d) - 1)
  return m, math.sqrt(var / len(d))


def main() -> None:
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    runs, wall = {}, {}
    for name, extra in RUNS.items():
      runs[name], wall[name] = train(root, name, extra)
  before = runs["in_turn"]["rewards"]["eval-before"]
  after = {k: v["rewards"]["eval-after"] for k, v in runs.items()}
  mean = lambda x: sum(x) / len(x)
  diff, se = paired(after["in_turn"], after["ahead"])
  figures = {"held_out": len(before), "before": mean(before),
             **{f"{k}_after": mean(v) for k, v in after.items()},
             "ahead_minus_in_turn": diff, "paired_standard_error": se,
             **{f"{k}_sampler_mismatch_mean": v["mismatch"] for k, v in runs.items()},
             **{f"{k}_wall_s": v for k, v in wall.items()}}
  print(common.table([figures]))
  path = common.write(
      "ahead", figures, {"run": "rollouts in turn on the training chips (the default)"},
      [common.goal("held-out mean reward, ahead minus in turn, in paired standard errors",
                   diff / se if se else 0.0, -2.0, at_most=False)],
      config=CONFIG, overrides=COMMON, runs=RUNS)
  print(f"wrote {path}")
