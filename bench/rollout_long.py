"""Long answers on a v5e-8: the gemma3_1b rollout from 768 to 8,192 new tokens, its
sliding-window layers on a ring of their window against the whole-sequence cache they kept
before, compiled ahead of time by libtpu (issue 56, item 3).

    make bench BENCH=rollout_long     (needs libtpu: pip install '.[tpu]'; run it alone)
    ROLLOUT_LONG_TOKENS=768,4096 ROLLOUT_LONG_SEARCH=0 ...   (fewer lengths, no batch search)

Each length (ROLLOUT_LONG_TOKENS, default 768,1024,2048,4096,8192) at 4 prompts x 8:
`plan.rollout_plan` (`Sampler.generate` compiled for v5e:2x4 in the layout `auto` picks) gives
the KV cache a chip (global and sliding-window layers), the planned rollout (the largest of its
HBM, interconnect and FLOP bounds) and decode tokens a second a chip. The same harness runs with
BEFORE's code (a git worktree at the commit before the ring, its `reasoner` in a subprocess),
where every layer kept the whole sequence. At 4,096 tokens, each side's largest batch that fits
16 GiB a chip (`plan.largest_fitting`, compiled). Beside them, Tunix 0.1.7's `Sampler` at 1,024
and 4,096 tokens on its fastest mesh of bench/rollout_tpu.py (fsdp 2 x tp 4).

The physical floor of each: per decoded token, the chips read every weight once and the cache
the rows attend to (the sequence so far in a global layer, the window in a sliding-window one,
a prompt once for its group), shared evenly, over 819 GB/s a chip; or the FLOPs (2 x
parameters a row a token, over 197 TFLOP/s a chip), whichever is larger; the prefill adds its
FLOPs. It is the model's need, the same for both caches, never the program's own bound.

Goals (issue 56): KV at 4k at most 0.35x before's; the 4k rollout of 4 x 8 at most 0.6x
before's time; the largest batch at 4k at least 2.5x before's; the 768-token rollout at most
1.15x its physical floor.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

sys.path.append(str(pathlib.Path(__file__).parents[1]))  # run by path: `reasoner` from PYTHONPATH
from bench import common  # noqa: E402

BEFORE = "27b568a"  # the commit before 3bdc983 put the sliding-window layers on a ring
CONFIG = "configs/gemma3_1b.yaml"
TOKENS = tuple(int(t) for t in os.environ.get("ROLLOUT_LONG_TOKENS",
                                              "768,1024,2048,4096,8192").split(","))
PROMPTS, SEARCH_AT = 4, 4096
SEARCH = os.environ.get("ROLLOUT_LONG_SEARCH", "1") != "0"  # the largest batch (many compiles)


def measure(tokens: list[int], search: bool) -> dict:
  """In a subprocess (`reasoner` as PYTHONPATH gives it): each length's plan at 4 x 8, and
  with `search` the largest batch at SEARCH_AT."""
  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.planner import plan

  devices, chip, method = plan.target("v5e:2x4")
  if devices is None:
    raise SystemExit(f"error: {method}")

  def at(n: int, prompts: int):
    cfg = load_config(CONFIG, [f"rollout.max_new_tokens={n}", f"train.batch_size={prompts}"])
    setup = build(cfg, abstract=True, devices=devices, hbm=chip.hbm)
    return plan.rollout_plan(setup, prompts, chip)

  def row(r) -> dict:
    return {"fits": r.fits, "GiB/chip": (r.total if r.fits else r.needed) / 2**30,
            "kv_bytes": r.kv_cache, "kv_local_bytes": getattr(r, "kv_local", 0),
            "hbm_bytes": r.bytes, "s": r.seconds(chip) if r.fits else None,
            "times": r.times(chip) if r.fits else None,
            "collectives": {f"{c.kind} x{c.group} {c.bytes:.0f} B": n
                            for c, n in r.collectives.items()},
            "bound": r.bound(chip) if r.fits else r.note, "layout": r.layout}

  out, plans = {"lengths": {}}, {}
  for n in tokens:
    print(f"  {n} new tokens, {PROMPTS} prompts x 8 ...", flush=True)
    plans[n] = at(n, PROMPTS)
    out["lengths"][n] = row(plans[n])
  if search:
    # From the 4 x 8 plan already made, then 8 prompts: the search extrapolates the two plans'
    # memory to the HBM (a few compiles; `largest_fitting` of both sides' code).
    known = plans.get(SEARCH_AT) or at(SEARCH_AT, PROMPTS)
    print(f"  the largest batch at {SEARCH_AT} tokens ...", flush=True)
    seen = plan.largest_fitting(lambda p: known if p == PROMPTS else at(SEARCH_AT, p), PROMPTS,
                                PROMPTS, chip.hbm, cap=2048, budget=6)
    out["search"] = {p: row(r) for p, r in sorted(seen.items())}
  return out


def floor(n: int, devices, chip) -> dict:
  """The physical floor of the 4 x 8 rollout of `n` new tokens: each decode step reads every
  weight (base and LoRA) once and the keys and values each row attends to (its prompt's once
  for the group, a sliding-window layer only its window), the whole shared evenly by the chips,
  over their HBM bandwidth; or the FLOPs, if more. A layout that reads more (a weight whole on
  every chip) is above it."""
  import math

  import jax
  import jax.numpy as jnp

  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.models.cache import windows

  cfg = load_config(CONFIG, [f"rollout.max_new_tokens={n}", f"train.batch_size={PROMPTS}"])
  setup = build(cfg, abstract=True, devices=devices, hbm=chip.hbm)
  t_cfg, p = setup.spec.tunix_config, cfg.data.max_prompt_tokens
  leaves = jax.tree.leaves((setup.lora, setup.base))
  weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
  params = sum(math.prod(x.shape) for x in leaves)
  slot = 2 * t_cfg.num_kv_heads * t_cfg.head_dim * jnp.dtype(cfg.model.dtype).itemsize
  rows, chips = PROMPTS * cfg.rollout.num_generations, len(devices)

  def kv(t: int) -> int:  # bytes attended at decode step t (t new tokens so far)
    seen = lambda w, k: k if w is None else min(k, w)
    return sum(slot * (PROMPTS * seen(w, p) + rows * seen(w, t)) for w in windows(t_cfg))

  hbm = (n * weights + sum(kv(t) for t in range(1, n + 1))) / (chips * chip.bandwidth)
  flops = 2 * params * (rows * n + PROMPTS * p) / (chip.flops * chips)
  return {"s": max(hbm, flops), "hbm_s": hbm, "flops_s": flops, "weights_bytes": weights}


def tunix(n: int, devices, chip) -> dict:
  """Tunix 0.1.7's `Sampler` at `n` new tokens, 4 x 8, fsdp 2 x tp 4."""
  from bench.rollout_tpu import tunix_rollout
  from reasoner.config import load_config

  cfg = load_config(CONFIG, [f"rollout.max_new_tokens={n}", f"train.batch_size={PROMPTS}"])
  r, total = tunix_rollout(cfg, devices, 2, 4, PROMPTS, chip)
  return {"fits": r.fits, "GiB/chip": (total if r.fits else r.needed) / 2**30,
          "s": r.seconds(chip) if r.fits else None, "hbm_bytes": r.bytes}


def main() -> None:
  from reasoner.planner import plan

  root = common.RESULTS.parents[1]
  devices, chip, method = plan.target("v5e:2x4")
  if devices is None:
    raise SystemExit(f"error: {method}")
  figures = {}
  with common.worktree(BEFORE, "rollout_long") as (tmp, tree):
    for label, where in (("now", root), ("before", tree)):
      out = tmp / f"{label}.json"
      print(f"{label} ({where}):", flush=True)
      subprocess.run([sys.executable, __file__, str(out)], check=True, cwd=root,
                     env={**os.environ, "PYTHONPATH": str(where)})
      figures[label] = json.loads(out.read_text())
  rows = PROMPTS * 8
  figures["floor"] = {n: floor(n, devices, chip) for n in TOKENS}
  for side in ("now", "before"):
    for n, r in figures[side]["lengths"].items():
      n = int(n)
      if r["s"]:
        r["tokens/s/chip"] = rows * n / r["s"] / len(devices)
        r["/ floor"] = r["s"] / figures["floor"][n]["s"]
  figures["tunix"] = {n: tunix(n, devices, chip) for n in (1024, 4096) if n in TOKENS}
  now, before = figures["now"]["lengths"], figures["before"]["lengths"]
  largest = {side: max((int(p) for p, r in figures[side].get("search", {}).items()
                        if r["fits"]), default=0) for side in ("now", "before")}
  figures["largest_batch_at_4k"] = largest
  ratio = lambda a, b: a / b if a is not None and b else None
  k, goals = str(SEARCH_AT), []
  if k in now:
    goals += [common.goal("KV bytes a chip at 4k, now / before",
                          ratio(now[k]["kv_bytes"], before[k]["kv_bytes"]), 0.35),
              common.goal("4k rollout of 4 x 8, now / before", ratio(now[k]["s"],
                                                                     before[k]["s"]), 0.6),
              common.goal("largest batch at 4k, now / before",
                          ratio(largest["now"], largest["before"]), 2.5, at_most=False)]
  if "768" in now:
    goals.append(common.goal("768-token rollout / its physical floor",
                             now["768"].get("/ floor"), 1.15))
  table = [{"tokens": n, "side": side, **{c: figures[side]["lengths"][str(n)].get(c) for c in
            ("GiB/chip", "kv_bytes", "s", "bound", "tokens/s/chip", "/ floor")}}
           for n in TOKENS for side in ("now", "before")]
  print(common.table(table))
  path = common.write("rollout_long", figures, {"before": f"the sampler at {BEFORE}",
                                                "tunix": "Tunix 0.1.7 Sampler, fsdp 2 x tp 4"},
                      goals, topology="v5e:2x4", method=method, config=CONFIG)
  print(f"wrote {path}")
  for g in goals:
    value = "none" if g["value"] is None else f"{g['value']:.3g}"
    print(f"  goal {'MET' if g['met'] else 'NOT MET'}: {g['name']}: {value} "
          f"(target {g['direction'].replace('_', ' ')} {g['target']})")


if __name__ == "__main__":
  result = measure(list(TOKENS), search=SEARCH and SEARCH_AT in TOKENS)
  pathlib.Path(sys.argv[1]).write_text(json.dumps(result))
