"""The rollout step on a v5e-8 in each decode layout, compiled ahead of time (no TPU needed).

    make bench BENCH=rollout_tpu      (needs libtpu: pip install '.[tpu]')

The gemma3_1b preset (256 prompt + 768 new tokens, G = 8, top-k 64, top-p 0.95) for 4 and 16
prompts, `Sampler.generate` compiled for v5e:2x4 by libtpu in every `rollout.layout`: 'train'
(the training mesh and placement, fsdp 8), 'replicated' (each chip the whole model and its own
rows) and 'tp2', 'tp4', 'tp8' (Megatron-style over 2, 4, 8 chips, rows over the rest). For each:
per-chip memory, HBM bytes, collectives (count and bytes a decoded token, from the compiled
HLO, `hlo.analyse`), the HBM-, interconnect- and FLOP-bound times of the whole rollout
(`plan.StepPlan.times`: loop bodies once per trip, max_new_tokens trips, a ring latency +
bandwidth model), which binds, and which layout `auto` picks (`plan.decode_layout`).
"""

from __future__ import annotations

import os

from bench import common

LAYOUTS = ("train", "replicated", "tp2", "tp4", "tp8")
PROMPTS = tuple(int(b) for b in os.environ.get("ROLLOUT_TPU_PROMPTS", "4,16").split(","))


def main() -> None:
  from reasoner import plan
  from reasoner.build import build
  from reasoner.config import load_config

  devices, chip, method = plan.target("v5e:2x4")
  if devices is None:
    raise SystemExit(f"error: {method}")
  rows, goals = [], []
  for prompts in PROMPTS:
    cfg = load_config("configs/gemma3_1b.yaml", [f"train.batch_size={prompts}"])
    setup = build(cfg, abstract=True, devices=devices)
    auto = plan.decode_layout(setup, chip.hbm, chip)
    layers = setup.spec.num_layers
    vocab = setup.spec.tunix_config.num_embed
    for layout in LAYOUTS:
      print(f"  {prompts} prompts x 8, layout {layout} ...", flush=True)
      r = plan.rollout_plan(setup, prompts, chip, layout)
      t = r.times(chip)
      tok = r.token
      rows.append({
          "prompts": prompts, "layout": layout + (" (auto)" if layout == auto else ""),
          "GiB/chip": r.total / 2**30, "fits": r.fits,
          "coll/token": tok.num_collectives if tok else 0.0,
          "coll KiB/token": sum(c.bytes * n for c, n in tok.collectives.items()) / 1024
          if tok else 0.0,
          "largest coll KiB": max((c.bytes for c in tok.collectives), default=0) / 1024
          if tok else 0.0,
          "HBM GiB": r.bytes / 2**30, "HBM s": t["HBM"], "ICI s": t["interconnect"],
          "FLOP s": t["FLOPs"], "est s": r.seconds(chip), "bound": r.bound(chip)})
    by = {r["layout"].split()[0]: r for r in rows if r["prompts"] == prompts}
    chosen = by[auto]
    goals += [
        common.goal(f"{prompts} prompts: collectives a decoded token, {auto} (auto)",
                    chosen["coll/token"], 2 * layers + 2),
        common.goal(f"{prompts} prompts: largest collective a token, {auto} (KiB; a "
                    f"vocabulary-sized one is {vocab * 4 * prompts * 8 / 1024:.0f})",
                    chosen["largest coll KiB"], vocab * 2 / 1024),
        common.goal(f"{prompts} prompts: planned rollout, {auto} / train layout",
                    chosen["est s"] / by["train"]["est s"], 0.4)]
  print(common.table(rows))
  path = common.write("rollout_tpu", {"rows": rows}, {
      "tunix_0.1.7_sampler": "not compiled yet: its sampler jits its own prefill and decode "
                             "inside a Python loop over host state; see docs/LOG.md"},
      goals, topology="v5e:2x4", method=method, chip=chip.name, ici_bytes_per_s=chip.ici,
      hop_seconds=chip.hop)
  print(f"wrote {path}")
  for g in goals:
    print(f"  goal {'MET' if g['met'] else 'NOT MET'}: {g['name']}: {g['value']:.3g} "
          f"(target {g['direction'].replace('_', ' ')} {g['target']})")
