"""Which chips should sample: `python -m reasoner plan --ahead` plans the GRPO step with the
rollouts on the training chips in turn (rollout.devices: null) and a step ahead on R chips of
their own for every R that leaves the policy a mesh its batch divides, each compiled as a run
would place it (`plan.plan`), and picks the fastest. With R chips ahead a step takes the slower
of the two sides (the rollout, with the judge and teacher that score it; the log-prob forwards
and the train step) plus the LoRA's move between them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from reasoner.build import judged, taught
from reasoner.config import Config, ConfigError, check_mesh
from reasoner.mesh import mesh_shape
from reasoner.planner.plan import plan, sides, step_seconds


def splits(cfg: Config, chips: int) -> list[int]:
  """R = 1 .. chips - 1 whose remaining chips (after a judge's and a teacher's own) give the
  policy a mesh that the batch's rows divide (`check_mesh`)."""
  rest = chips - ((cfg.judge.devices or 0) if judged(cfg) else 0) - (
      (cfg.distill.devices or 0) if taught(cfg) and cfg.distill.teacher is not None else 0)
  out = []
  for r in range(1, rest):
    try:
      check_mesh(cfg, mesh_shape(cfg.mesh, rest - r)[0])
    except ConfigError:
      continue
    out.append(r)
  return out


def with_devices(cfg: Config, r: int | None) -> Config:
  """`cfg` with rollout.devices = r (and the truncated importance weights that rollouts a step
  ahead need), or in turn on the training chips (None)."""
  grpo = dataclasses.replace(cfg.grpo, sampler_is="token") if r else cfg.grpo
  return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, devices=r), grpo=grpo)


def pick(cfg: Config, topology: str, chips: int, log: Callable[[str], None] = lambda s: None
         ) -> dict[str, Any]:
  """{"plans": {R or None: the configured batch's plan}, "best": the fastest R (None: in
  turn)}; every plan compiled without the batch searches."""
  plans: dict[int | None, dict] = {}
  for r in (None, *splits(cfg, chips)):
    log(f"rollouts {'in turn' if r is None else f'a step ahead on {r} chips of their own'}:")
    plans[r] = plan(with_devices(cfg, r), topology, search=False, log=log)
  best = min(plans, key=lambda r: step_seconds(plans[r]))
  return {"plans": plans, "best": best}


def format_pick(found: dict[str, Any]) -> str:
  """A line per split: both sides, which binds, the step; then the pick."""
  lines = ["where the rollouts run (the configured batch, each split compiled):"]
  for r, report in found["plans"].items():
    t = sides(report)
    name = "in turn on the training chips" if r is None else f"{r} chips ahead"
    binds = ("both, one after the other" if r is None else
             "the rollout" if t["rollout"] >= t["train"] else "the training")
    lines.append(f"  {name:30s} rollout {t['rollout'] * 1e3:7.1f} ms (layout "
                 f"{report['rollout'].layout or 'configured'}), training "
                 f"{t['train'] * 1e3:7.1f} ms"
                 + (f", LoRA move {t['transfer'] * 1e3:.2f} ms" if "transfer" in t else "")
                 + f": step {step_seconds(report) * 1e3:7.1f} ms, bound by {binds}")
  best = found["best"]
  lines.append("fastest: " + ("rollouts in turn (rollout.devices: null)" if best is None else
                              f"rollout.devices: {best}"))
  return "\n".join(lines)
