"""Which chips should sample: `python -m reasoner plan --ahead` plans the GRPO step with the
rollouts on the training chips in turn (rollout.devices: null) and a step ahead on R chips of
their own for every R that leaves the policy a mesh its batch divides, each compiled as a run
would place it (`plan.plan`; on a TPU each side on a slice of its own, `on_slices`), and picks
the fastest. With R chips ahead a step takes the slower
of the two sides (the rollout, with the judge and teacher that score it; the log-prob forwards
and the train step) plus the LoRA's move between them."""

from __future__ import annotations

import dataclasses
import math
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


def pick(cfg: Config, topology: str, chips: int, log: Callable[[str], None] = lambda s: None,
         known: dict | None = None) -> dict[str, Any]:
  """{"plans": {R or None: the configured batch's plan}, "best": the fastest R (None: in
  turn)}; every plan compiled without the batch searches, but those `known` ({R: plan})."""
  plans: dict[int | None, dict] = dict(known or {})
  for r in (None, *splits(cfg, chips)):
    if r not in plans:
      log(f"rollouts {'in turn' if r is None else f'a step ahead on {r} chips of their own'}:")
      try:
        plans[r] = (on_slices(cfg, topology, r, chips, log) if r and ":" in topology else
                    plan(with_devices(cfg, r), topology, search=False, log=log, compare=False))
      except ConfigError as e:
        log(f"  not planned: {e}")
      if plans.get(r, True) is None:
        del plans[r]
  plans = {r: plans[r] for r in (None, *splits(cfg, chips)) if r in plans}
  best = min(plans, key=lambda r: step_seconds(plans[r]))
  return {"plans": plans, "best": best}


# TPU slices by chip count (v5e's, v5p's and v6e's smallest shapes)
SLICES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"}


def on_slices(cfg: Config, topology: str, r: int, chips: int,
              log: Callable[[str], None]) -> dict[str, Any] | None:
  """On a TPU each side is a slice of its own: the rollout planned on a topology of R chips
  and the training on one of the rest (libtpu compiles a program for a slice, not for any
  subset of one), put together as a run on `rollout.devices: r` would be; None where a side's
  chip count is no slice's or the run has a judge or teacher of its own."""
  kind, rest = topology.partition(":")[0], chips - r
  if r not in SLICES or rest not in SLICES or (judged(cfg) and cfg.judge.devices) or (
      taught(cfg) and cfg.distill.devices):
    log(f"  not planned: {r} + {rest} chips are not two {kind} slices")
    return None
  whole = with_devices(cfg, None)
  roll = plan(whole, f"{kind}:{SLICES[r]}", search=False, log=log, compare=False)
  train = roll if r == rest else plan(whole, f"{kind}:{SLICES[rest]}", search=False, log=log,
                                      compare=False)
  return {**train, "cfg": with_devices(cfg, r), "rollout": roll["rollout"],
          "transfer": train["lora_bytes"], "topology": topology, "chips": chips}


def plan_run(cfg: Config, topology: str, search: bool = True, analytic: bool = False,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
  """`plan.plan`, but a TPU run with `rollout.devices` as `on_slices` plans it."""
  if not cfg.rollout.devices or ":" not in topology or analytic:
    return plan(cfg, topology, search, analytic, log)
  chips = math.prod(int(x) for x in topology.partition(":")[2].split("x"))
  found = on_slices(cfg, topology, cfg.rollout.devices, chips, log)
  if found is None:
    raise ConfigError(f"config key 'rollout.devices' = {cfg.rollout.devices}: on {topology} "
                      f"the rollout's chips and the rest must each be a slice ("
                      f"{', '.join(map(str, SLICES))} chips)")
  return found


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
