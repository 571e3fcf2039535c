"""The report `python -m reasoner plan` prints: each compiled step's memory, FLOPs, bytes,
collectives and bound time, the searches, and the GRPO step's estimate."""

from __future__ import annotations

from typing import Any

from reasoner.build import judged_share
from reasoner.chips import SESSION, Chip, GiB, collective_seconds
from reasoner.planner.plan import StepPlan, judge_batches, sides, step_seconds


def _row(r: StepPlan, chip: Chip) -> str:
  rows = f"x G = {r.rows:5d} rows" if r.what != "judge" else "prompts"
  head = f"  {r.what:8s} {r.prompts:5d} {rows}" + (
      f" in {r.prompts // r.micro} micro-batches:" if 0 < r.micro < r.prompts else ":")
  if not r.fits and not r.total:
    return f"{head} does not fit: {r.note}"
  gib = lambda b: f"{b / GiB:6.2f}"
  t = r.times(chip)
  count = sum(r.collectives.values())
  token = (f"; a decoded token: {r.token.num_collectives:.0f} collectives, "
           f"{sum(c.bytes * n for c, n in r.token.collectives.items()) / 2**20:.2f} MiB"
           if r.token is not None else "")
  return (f"{head} args {gib(r.arguments)}  temp {gib(r.temporaries)}  out "
          f"{gib(r.outputs - r.aliased)}  total {gib(r.total)} GiB of {chip.hbm / GiB:.0f} "
          f"{'fits' if r.fits else 'DOES NOT FIT'}"
          + (f"; KV cache {r.kv_cache / 2**20:.1f} MiB of it (global layers "
             f"{(r.kv_cache - r.kv_local) / 2**20:.1f}, sliding-window layers "
             f"{r.kv_local / 2**20:.1f})" if r.kv_cache else "")
          + f"\n{'':11s}{r.flops / 1e12:.3g} TFLOP, {r.bytes / GiB:.3g} GiB HBM traffic, "
          f"{count:.0f} collectives{token}\n{'':11s}est. {r.seconds(chip) * 1e3:.1f} ms, bound "
          f"by {r.bound(chip)} (HBM {t['HBM'] * 1e3:.1f} ms, interconnect "
          f"{t['interconnect'] * 1e3:.1f} ms, FLOPs {t['FLOPs'] * 1e3:.1f} ms"
          + (f", {r.kernels:.0f} kernel launches {t['launch'] * 1e3:.1f} ms" if "launch" in t
             else "") + ")"
          + _collectives(r, chip))


def _collectives(r: StepPlan, chip: Chip, top: int = 4) -> str:
  """The program's collectives grouped by kind, group and size, the `top` longest by time
  (count x the ring model's time of one): what binds, without reading HLO."""
  ranked = sorted(r.collectives.items(), key=lambda cn: -cn[1] * collective_seconds(cn[0], chip))
  rows = [f"\n{'':11s}  {c.kind:18s} of {c.group} chips {c.bytes / 2**20:9.3f} MiB x "
          f"{n:6.0f} = {n * collective_seconds(c, chip) * 1e3:7.2f} ms"
          for c, n in ranked[:top] if n]
  rest = sum(n * collective_seconds(c, chip) for c, n in ranked[top:])
  more = (f"\n{'':11s}  and {len(ranked) - top} other kinds and sizes: {rest * 1e3:.2f} ms"
          if len(ranked) > top else "")
  return "".join(rows) + more


def _weights(report: dict[str, Any], chip: Chip) -> list[str]:
  """The training weights' placement and why; with `mesh.weights: auto`, the other placement's
  compiled train step and log-prob forward, and which of the two is faster."""
  if "weights" not in report:
    return []
  picked, why = report["weights"]
  lines = [f"  training weights {picked} (mesh.weights {report['cfg'].mesh.weights}: {why})"]
  if "weights_other" in report:
    other, plans = report["weights_other"]
    lines += [_row(p, chip) + f"  (weights {other})" for p in plans.values() if p is not None]
    best, seconds = report["weights_choice"]
    lines.append(f"  compiled, {seconds}: {best} is faster"
                 + ("" if best == picked else f"; set mesh.weights: {best}"))
  return lines


def format_report(report: dict[str, Any]) -> str:
  chip, m = report["chip"], report["mesh"]
  rollout = report["rollout"]
  lines = [f"plan for {report['topology']} ({chip.name}: {chip.hbm / GiB:.0f} GiB HBM, "
           f"{chip.flops / 1e12:.0f} TFLOP/s, {chip.bandwidth / 1e9:.0f} GB/s), mesh fsdp "
           f"{m['fsdp']} x tp {m['tp']}; {report['method']}",
           "per chip; every loop body counted once per trip; time = the bound that binds "
           "(HBM bytes, collectives' latency + bandwidth, FLOPs), a lower bound",
           "configured:", _row(report["train"], chip)]
  lines += [_row(report[k], chip) for k in ("logprobs",) if k in report] + _weights(report, chip)
  lines.append(_row(rollout, chip) + (f"  (decode layout {rollout.layout})" if rollout.layout
                                       else ""))
  if rollout.resident:
    train = report["train"]
    lines.append(f"{'':11s}beside training: the base's copy in the decode layout "
                 f"{rollout.resident / GiB:.2f} GiB a chip; train step + copy "
                 f"{(train.total + rollout.resident) / GiB:.2f} GiB, rollout + the train "
                 f"step's arguments {(rollout.total + train.arguments) / GiB:.2f} GiB")
  if "rollout_train" in report:
    lines.append(_row(report["rollout_train"], chip) + "  (training layout)")
  if "judge" in report:
    n, mean, crit = (judge_batches(report), judge_batches(report, average=True),
                     report["cfg"].judge.max_criteria)
    lines.append(_row(report["judge"], chip) + f"  (on {report['judge_on']}; {n} batch"
                 f"{'es' * (n > 1)} a step at most, {mean:.2f} on average at the mixture's "
                 f"judged share {judged_share(report['cfg']):.2f}"
                 + (f", {crit} criteria a completion)" if crit else ")"))
  if "teacher" in report:
    lines.append(_row(report["teacher"], chip) + f"  (on {report['teacher_on']}; once a step)")
  for what, tried in report["tried"].items():
    best = report["largest"].get(what)
    name = "train micro-batch (one pass)" if what == "train" else "rollout batch"
    lines += [f"search ({what}):", *(_row(r, chip) for r in tried),
              f"  largest {name} that fits: "
              + (f"{best.prompts} prompts x G = {best.rows} rows" if best else "none")]
  if "micro" in report:
    r = report["micro"]
    lines += [f"with train.micro_batch={r.micro if r.micro < r.prompts else 'null'} "
              f"({r.prompts // r.micro} pass{'es' if r.micro < r.prompts else ''} per step):",
              _row(r, chip)]
  if "transfer" in report:  # rollouts a step ahead on chips of their own
    t, step = sides(report), step_seconds(report)
    lines.append(f"GRPO step (rollouts a step ahead on {report['cfg'].rollout.devices} chips of "
                 f"their own, decoding in the {rollout.layout} layout): est. {step:.3g} s, the "
                 f"slower of the rollout {t['rollout'] * 1e3:.1f} ms and the training "
                 f"{t['train'] * 1e3:.1f} ms, plus the LoRA's move {t['transfer'] * 1e3:.2f} ms: "
                 f"at most {int(SESSION // step) if step else 0} steps in a "
                 f"{SESSION // 3600}-hour session")
    return "\n".join(lines)
  for key, name in (("rollout", f"decoding in the {rollout.layout or 'configured'} layout"),
                    ("rollout_train", "decoding in the training layout")):
    if key in report:
      step = step_seconds(report, key)
      lines.append(f"GRPO step ({name}): est. {step:.3g} s (rollout + "
                   + ("log-prob forwards + " * ("logprobs" in report))
                   + ("judge + " * ("judge" in report))
                   + ("teacher + " * ("teacher" in report))
                   + f"train): at most {int(SESSION // step) if step else 0} steps in a "
                   f"{SESSION // 3600}-hour session")
  return "\n".join(lines)
