"""SFT -> preference -> GRPO against SFT -> GRPO on the medium arithmetic set, side by side.

    make bench BENCH=stages        (python -m bench stages; about 40 minutes on 2 cores)

The embedded model on `data.difficulty: medium` with the plain prompt. One SFT run
(configs/embedded_sft.yaml), then from its LoRA two branches, each stage a subprocess, one
after the other, exactly as `make prefer` runs them:
- SFT -> GRPO: `make sft`'s GRPO stage (temperature 1, dynamic sampling, 16 steps of 4 x 4);
- SFT -> preference -> GRPO: SimPO on the policy's own pairs (configs/embedded_prefer.yaml: 4
  samples a problem, a right answer against a wrong one, new every step; 16 steps of 8 pairs),
  then the same GRPO stage.
Every stage ends with the same greedy evaluation of 256 held-out problems. Standard errors:
of each mean reward (the rows' standard deviation / sqrt(256)) and of the two recipes' paired
difference (the same problems).

Goal (issue 35): the three-stage recipe's held-out mean reward at or above SFT -> GRPO's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import common

EVAL = ["data.difficulty=medium", "data.num_eval=256", "eval.batch_size=64"]
GRPO = ["data.template=plain", "train.eval_before=false", "rollout.temperature=1.0",
        "grpo.dynamic_sampling=true", "grpo.max_sample_batches=2"]


def run(root: pathlib.Path, stage: str, config: str, name: str, *overrides: str) -> float:
  """`python -m reasoner <stage>` as run `name` under `root`; its wall seconds."""
  t = time.perf_counter()
  subprocess.run([sys.executable, "-m", "reasoner", stage, "--config", config,
                  f"train.run_dir={root}", f"train.run_name={name}", *EVAL, *overrides],
                 check=True)
  return time.perf_counter() - t


def held_out(run_dir: pathlib.Path) -> list[float]:
  """The per-problem rewards of the run's last evaluation (samples.jsonl)."""
  rows = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
  rows = [r for r in rows if r["tag"].startswith("eval-")]
  last = max((r["step"], r["tag"]) for r in rows)
  return [r["reward"] for r in rows if (r["step"], r["tag"]) == last]


def stats(values: list[float]) -> dict:
  from reasoner.evaluation import standard_error

  return {"mean_reward": sum(values) / len(values), "standard_error": standard_error(values),
          "n": len(values)}


def main() -> None:
  root = pathlib.Path(os.environ.get("STAGES_DIR") or tempfile.mkdtemp(prefix="stages-"))
  seconds = {"sft": run(root, "sft", "configs/embedded_sft.yaml", "sft")}
  seconds["sft_grpo"] = run(root, "train", "configs/embedded.yaml", "sft_grpo",
                            f"lora.init_from={root / 'sft'}", *GRPO)
  seconds["prefer"] = run(root, "prefer", "configs/embedded_prefer.yaml", "prefer",
                          f"lora.init_from={root / 'sft'}")
  seconds["three"] = run(root, "train", "configs/embedded.yaml", "three",
                         f"lora.init_from={root / 'prefer'}", *GRPO)
  rewards = {k: held_out(root / k) for k in ("sft", "sft_grpo", "prefer", "three")}
  figures = {k: stats(v) for k, v in rewards.items()}
  diff = [a - b for a, b in zip(rewards["three"], rewards["sft_grpo"])]
  figures["three_minus_sft_grpo"] = {**stats(diff), "note": "paired, the same 256 problems"}
  figures["seconds"] = seconds
  three, two = figures["three"]["mean_reward"], figures["sft_grpo"]["mean_reward"]
  goals = [common.goal("three-stage held-out mean reward at or above SFT -> GRPO's (medium, "
                       "256 problems)", three, two, at_most=False)]
  path = common.write("stages", figures, {"sft_grpo": figures["sft_grpo"]}, goals,
                      runs=str(root), commands="make prefer; the control: make prefer's SFT "
                      "and GRPO stages with lora.init_from=<the SFT run>")
  print(json.dumps({k: v for k, v in figures.items() if k != "seconds"}, indent=1))
  print(f"wrote {path}")
