"""Held-out reward per rollout token: dynamic sampling on against off, side by side.

    make bench BENCH=learning        (python -m bench learning; about 35 minutes on 2 cores)

Two runs of the embedded default (`configs/embedded.yaml`, `make train`'s run), each in its own
subprocess, one after the other: `grpo.dynamic_sampling` off (the default) and on (groups of
equal rewards dropped and refilled, up to `grpo.max_sample_batches` rounds a step). Both
evaluate the held-out set (64 problems, greedy) every `EVAL_EVERY` steps, over the same
number of steps; of the on run's evaluations only those within the off run's rollout tokens
count (both start from the same model: the off run's evaluation before training is the on
run's too). A rollout token is a completion token the sampler generated (`rollout_tokens` in
metrics.jsonl), counted over every round.

Goal (issue 24): the on run reaches the off run's final held-out mean reward within 0.7x the
off run's rollout tokens. Also recorded: the fraction of drawn groups that carried a gradient,
and each run's held-out curve against cumulative rollout tokens.
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

CONFIG = "configs/embedded.yaml"
STEPS = int(os.environ.get("LEARNING_STEPS", "16"))
EVAL_EVERY = int(os.environ.get("LEARNING_EVAL_EVERY", "4"))
RUNS = {"off": ["grpo.dynamic_sampling=false"], "on": ["grpo.dynamic_sampling=true"]}


def train(root: pathlib.Path, name: str, overrides: list[str]) -> tuple[list[dict], float]:
  """Runs `python -m reasoner train` and returns its metrics.jsonl rows and wall seconds."""
  cmd = [sys.executable, "-m", "reasoner", "train", "--config", CONFIG,
         f"train.run_dir={root}", f"train.run_name={name}", f"train.steps={STEPS}",
         f"train.eval_every={EVAL_EVERY}", "train.checkpoint_every=1000", *overrides]
  t = time.perf_counter()
  subprocess.run(cmd, check=True)
  rows = [json.loads(line) for line in open(root / name / "metrics.jsonl")]
  return rows, time.perf_counter() - t


def curve(rows: list[dict]) -> list[dict]:
  """[{step, rollout_tokens (cumulative), held_out}] at each evaluation (step 0: before)."""
  tokens, out = {0: 0}, []
  for r in rows:
    if "rollout_tokens" in r:
      tokens[r["step"]] = tokens[max(tokens)] + r["rollout_tokens"]
  for r in rows:
    if "eval/mean_reward" in r:
      out.append({"step": r["step"], "rollout_tokens": tokens.get(r["step"], 0),
                  "held_out": r["eval/mean_reward"]})
  return out


def steps_within(rows: list[dict], budget: int) -> int:
  """The number of steps whose cumulative rollout tokens stay within `budget`."""
  total, n = 0, 0
  for r in rows:
    if "rollout_tokens" in r:
      total += r["rollout_tokens"]
      if total > budget:
        break
      n = r["step"]
  return n


def gradient_share(rows: list[dict]) -> dict:
  """Of the groups trained on, the share that carried a gradient (rewards not all equal); of
  the groups drawn, the same; refill rounds and rollout tokens in all."""
  steps = [r for r in rows if "groups_drawn" in r]
  drawn = sum(r["groups_drawn"] for r in steps)
  informative = sum(r["groups_drawn"] * (1 - r["frac_reward_zero_std"]) for r in steps)
  batch = steps[0]["groups_drawn"] // (steps[0]["refill_rounds"] + 1) * len(steps)
  trained = sum(min(r["groups_trained"], r["groups_drawn"] * (1 - r["frac_reward_zero_std"]))
                for r in steps)
  return {"batch_groups_with_gradient": trained / batch,
          "drawn_groups_with_gradient": informative / drawn,
          "groups_drawn": drawn, "refill_rounds": sum(r["refill_rounds"] for r in steps),
          "rollout_tokens": sum(r["rollout_tokens"] for r in steps)}


def main() -> None:
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    rows, wall = {}, {}
    rows["off"], wall["off"] = train(root, "static", RUNS["off"])
    rows["on"], wall["on"] = train(root, "dynamic", RUNS["on"] + ["train.eval_before=false"])
  curves = {k: curve(v) for k, v in rows.items()}
  curves["on"] = curves["off"][:1] + curves["on"]  # the same model before training
  budget = curves["off"][-1]["rollout_tokens"]
  target = curves["off"][-1]["held_out"]
  on = [p for p in curves["on"] if p["rollout_tokens"] <= budget] or curves["on"][:1]
  reached = next((p for p in on if p["held_out"] >= target), None)
  ratio = reached["rollout_tokens"] / budget if reached else float("inf")
  stats = {k: gradient_share(v) for k, v in rows.items()}
  figures = {k: {"curve": curves[k], "wall_s": wall[k], **stats[k]} for k in rows}
  figures["on"]["steps_within_budget"] = steps_within(rows["on"], budget)
  figures.update(budget_rollout_tokens=budget, off_final_held_out=target,
                 on_held_out_within_budget=on[-1]["held_out"],
                 on_tokens_to_reach_off_final=reached and reached["rollout_tokens"])
  print(common.table([{"run": k, **p} for k in ("off", "on") for p in curves[k]]))
  print(f"off final held-out {target:.3f} at {budget} rollout tokens; on reaches it at "
        f"{ratio:.2f}x those tokens")
  print(common.table([{"run": k, **stats[k]} for k in stats]))
  path = common.write("learning", figures, {"run": "dynamic sampling off (the default)"},
                      [common.goal("rollout tokens to the off run's final held-out reward, "
                                   "on / off", ratio, 0.7)],
                      config=CONFIG, steps=STEPS, eval_every=EVAL_EVERY)
  print(f"wrote {path}")
