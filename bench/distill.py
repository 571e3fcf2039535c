"""On-policy distillation against GRPO on the same prompt, per rollout token, side by side.

    make bench BENCH=distill        (python -m bench distill; about 55 minutes on 2 cores,
                                     20 of them making the teacher)

The teacher: `make sft`'s result (SFT, then GRPO from it, on the plain prompt), made here first
unless DISTILL_TEACHER names such a run. The student: a fresh LoRA on the plain prompt, where
the base model scores 0.000 (it has never seen the answer format). Two runs of 16 steps of 16
prompts x 4 from it, two clipped passes a rollout (configs/embedded_distill.yaml), each a
subprocess, one after the other, evaluated greedily on 256 held-out problems every 4 steps:
- distillation: the teacher (the same base weights under its LoRA) scores every sampled token,
  and its 16 likeliest tokens at each position are soft targets (`distill.topk`);
- GRPO on the same prompt, rollouts, passes and optimizer: the run's rewards alone.
A rollout token is a completion token the sampler generated (`rollout_tokens`).

Goals (issue 35): distillation reaches at least 90% of the teacher's held-out mean reward in at
most 16 steps, with fewer rollout tokens than GRPO needs to reach the same score.
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
from bench.stages import stats

CONFIG = "configs/embedded_distill.yaml"
STEPS = 16
EVAL = ["data.num_eval=256", "eval.batch_size=64", f"train.steps={STEPS}", "train.eval_every=4",
        "train.checkpoint_every=1000"]
SFT = ["data.num_eval=256", "eval.batch_size=64"]


def reasoner(*args: str) -> float:
  t = time.perf_counter()
  subprocess.run([sys.executable, "-m", "reasoner", *args], check=True)
  return time.perf_counter() - t


def teacher(root: pathlib.Path) -> tuple[pathlib.Path, float]:
  """`make sft`'s two stages under `root` (or DISTILL_TEACHER): the teacher run, seconds."""
  if os.environ.get("DISTILL_TEACHER"):
    return pathlib.Path(os.environ["DISTILL_TEACHER"]), 0.0
  t = reasoner("sft", "--config", "configs/embedded_sft.yaml", f"train.run_dir={root}", *SFT)
  t += reasoner("train", "--config", "configs/embedded.yaml", f"lora.init_from={root}/embedded_sft",
                "data.template=plain", "train.run_name=embedded_sft_grpo", f"train.run_dir={root}",
                "rollout.temperature=1.0", "grpo.dynamic_sampling=true",
                "grpo.max_sample_batches=2", "train.eval_before=false", *SFT)
  return root / "embedded_sft_grpo", t


def curve(run_dir: pathlib.Path) -> list[dict]:
  """[{step, rollout_tokens (cumulative), held_out, standard_error}] at each evaluation."""
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  tokens, total = {0: 0}, 0
  for r in rows:
    if "rollout_tokens" in r:
      total += r["rollout_tokens"]
      tokens[r["step"]] = total
  samples = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
  out = []
  for r in rows:
    if "eval/mean_reward" in r:
      rewards = [s["reward"] for s in samples if s["tag"].startswith("eval-")
                 and s["step"] == r["step"]]
      out.append({"step": r["step"], "rollout_tokens": tokens.get(r["step"], 0),
                  "held_out": r["eval/mean_reward"],
                  "standard_error": stats(rewards)["standard_error"]})
  return out


def reached(points: list[dict], score: float) -> int | None:
  """Rollout tokens at the first evaluation at or above `score` (None: never)."""
  return next((p["rollout_tokens"] for p in points if p["held_out"] >= score), None)


def main() -> None:
  root = pathlib.Path(os.environ.get("DISTILL_DIR") or tempfile.mkdtemp(prefix="distill-"))
  teacher_run, teacher_s = teacher(root)
  score = _teacher_score(teacher_run)
  seconds = {"teacher": teacher_s}
  seconds["distill"] = reasoner("distill", "--config", CONFIG, f"train.run_dir={root}",
                                "train.run_name=distill", f"distill.teacher_lora={teacher_run}",
                                *EVAL)
  seconds["grpo"] = reasoner("train", "--config", CONFIG, f"train.run_dir={root}",
                             "train.run_name=grpo", *EVAL)
  curves = {k: curve(root / k) for k in ("distill", "grpo")}
  target = 0.9 * score["mean_reward"]
  best = max(p["held_out"] for p in curves["distill"])
  ours, theirs = reached(curves["distill"], target), reached(curves["grpo"], target)
  grpo_budget = curves["grpo"][-1]["rollout_tokens"]
  figures = {"teacher": score, "target": target, "curves": curves, "seconds": seconds,
             "distill_tokens_to_target": ours, "grpo_tokens_to_target": theirs,
             "grpo_rollout_tokens": grpo_budget}
  goals = [common.goal(f"distillation's best held-out mean reward in {STEPS} steps, at least "
                       "90% of the teacher's", best, target, at_most=False),
           common.goal("rollout tokens for distillation to reach it (null: not in this run), "
                       "fewer than GRPO's (GRPO never reaching it: its whole run's tokens, a "
                       "lower bound)", ours,
                       theirs if theirs is not None else grpo_budget + 1)]
  path = common.write("distill", figures, {"grpo": curves["grpo"]}, goals, runs=str(root),
                      commands="make distill; the control: python -m reasoner train --config "
                      f"{CONFIG}")
  print(json.dumps({k: v for k, v in figures.items() if k != "curves"}, indent=1))
  print(f"wrote {path}")


def _teacher_score(run_dir: pathlib.Path) -> dict:
  """The teacher's mean reward and its standard error on the 256 held-out problems: its run's
  last evaluation where that had them (the teacher made here), else evaluated now."""
  rows = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
  rows = [r for r in rows if r["tag"].startswith("eval-")]
  last = max((r["step"], r["tag"]) for r in rows)
  rewards = [r["reward"] for r in rows if (r["step"], r["tag"]) == last]
  if len(rewards) != 256:
    from reasoner import evaluation  # the run's LoRA on the student's held-out problems
    from reasoner.build import build
    from reasoner.config import load_config
    from reasoner.engine.checkpoint import restore_lora
    from reasoner.engine.sampler import Sampler

    cfg = load_config(CONFIG, [f"train.run_dir={run_dir.parent}", f"train.run_name={run_dir.name}",
                               "data.num_eval=256", "eval.batch_size=64"])
    setup = build(cfg)
    result, rows = evaluation.evaluate(setup, Sampler.for_run(setup), restore_lora(setup)[0],
                                       setup.eval_records)
    rewards = [r["reward"] for r in rows]
  return stats(rewards)
