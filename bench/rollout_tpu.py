"""The rollout step on a v5e-8 in each decode layout, compiled ahead of time (no TPU needed).

    make bench BENCH=rollout_tpu      (needs libtpu: pip install '.[tpu]')

The gemma3_1b preset (256 prompt + 768 new tokens, G = 8, top-k 64, top-p 0.95) for 4 and 16
prompts, `Sampler.generate` compiled for v5e:2x4 by libtpu in every `rollout.layout`: 'train'
(the training mesh and placement, fsdp 8), 'replicated' (each chip the whole model and its own
rows) and 'tp2', 'tp4', 'tp8' (Megatron-style over 2, 4, 8 chips, rows over the rest). For each:
per-chip memory, HBM bytes, collectives (count and bytes a decoded token, from the compiled
HLO, `hlo.analyse`), the HBM-, interconnect- and FLOP-bound times of the whole rollout
(`plan.StepPlan.times`: loop bodies once per trip, max_new_tokens trips, a ring latency +
bandwidth model), which binds, and which layout `auto` picks (`layout_lib.decode_layout`).

Beside them, Tunix 0.1.7's sampler (`tunix.generate.sampler.Sampler`) on the same model, LoRA,
shapes and sampling, compiled for the same chips as fsdp x tp meshes with Tunix's default
partition rules, read by the same planner (`tunix_rollout`).
"""

from __future__ import annotations

import os

from bench import common

LAYOUTS = ("train", "replicated", "tp2", "tp4", "tp8")
# Tunix's meshes (fsdp, tp): the training mesh of the preset (rollout on the actor's mesh, as
# Tunix's RL cluster does by default), 2 x 4 (Tunix's GRPO examples' tensor-parallel width
# on a v5e-8) and all eight chips tensor-parallel.
TUNIX_MESHES = ((8, 1), (2, 4), (1, 8))
PROMPTS = tuple(int(b) for b in os.environ.get("ROLLOUT_TPU_PROMPTS", "4,16").split(","))


def tunix_rollout(cfg, devices, fsdp: int, tp: int, prompts: int, chip):
  """Tunix 0.1.7's `Sampler` (its prefill, then its `lax.while_loop` decode, each jitted as
  `Sampler.__call__` runs them) compiled for `devices` as fsdp x tp with Tunix's default
  partition rules, on our model and LoRA (`build`, abstract) with the run's shapes and sampling:
  prompts x G rows, each prefilled (Tunix's GRPO repeats a prompt G times), a cache of prompt +
  new slots, top-k then top-p, log-probs kept. Its state is built as Tunix builds it
  (`init_sample_state`, uncommitted arrays, so XLA places them); the decode takes the
  prefill's output placement. Its loop runs to a step count held in the state, unknown to the
  planner: the rollout counts the prefill and the loop's body max_new_tokens times.
  -> (the rollout's StepPlan, the per-chip bytes of the larger of the two programs)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tunix.generate import sampler as tunix_sampler

  from reasoner.planner import hlo, plan
  from reasoner.build import build
  from reasoner.engine.sampler import SamplingConfig

  # remat off: nnx.remat inside Tunix's decode loop fails to trace (flax TraceContextError)
  cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=fsdp, tp=tp,
                                                          weights="sharded"),  # Tunix's
                            model=dataclasses.replace(cfg.model, remat="none"))
  setup = build(cfg, abstract=True, devices=devices)
  t, r = setup.spec.tunix_config, cfg.rollout
  p, n, rows = cfg.data.max_prompt_tokens, r.max_new_tokens, prompts * r.num_generations

  class Tokenizer:  # what Tunix's TokenizerAdapter asks of a tokenizer; ids only here
    pad_id, eos_id, bos_id = (lambda self: 0), (lambda self: 1), (lambda self: 2)
    encode, decode = (lambda self, s: [2]), (lambda self, ids: "")

  sampler = tunix_sampler.Sampler(nnx.merge(setup.graphdef, setup.lora, setup.base), Tokenizer(),
                                  tunix_sampler.CacheConfig(p + n, t.num_layers, t.num_kv_heads,
                                                            t.head_dim))
  sampler.eos_ids = jnp.array(SamplingConfig.for_run(cfg, setup.tokenizer, False).stop_ids)
  with jax.default_device(jax.devices("cpu")[0]):  # shapes only; Tunix builds it eagerly
    state = sampler.init_sample_state(
        jnp.ones((rows, p), jnp.int32), total_sampling_steps=p + n, include_logits=False,
        forbidden_token_ids=None, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        seed=jax.random.PRNGKey(0), beam_size=None, include_logprobs=True)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
  params, name = sampler._flattened_transformer_state, f"fsdp{fsdp} x tp{tp}"
  try:
    prefill = sampler._compiled_prefill_fn.lower(params, state, None, echo=False).compile()
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         prefill.output_shardings)
    decode = sampler._compiled_decode_fn.lower(params, state).compile()
  except Exception as e:  # out of HBM: a row that does not fit; anything else raises
    return plan.out_of_memory(e, plan.StepPlan("rollout", prompts, rows, fits=False,
                                               layout=name)), 0
  body = max((b for _, b in hlo.analyse(decode.as_text()).loops), key=lambda b: b.bytes)
  cost = hlo.analyse(prefill.as_text()).add(body, n)
  out = plan.StepPlan("rollout", prompts, rows, flops=cost.flops, bytes=cost.bytes,
                      collectives=cost.collectives, token=body, layout=name)
  mem = max(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes for m in (prefill.memory_analysis(),
                                              decode.memory_analysis()))
  return out, mem


def _row(prompts: int, layout: str, r, total: int, chip) -> dict:
  if not r.fits:  # out of HBM: what the compiler said it needed
    return {"prompts": prompts, "layout": layout, "GiB/chip": r.needed / 2**30, "fits": False,
            "note": r.note}
  t, tok = r.times(chip), r.token
  return {"prompts": prompts, "layout": layout, "GiB/chip": total / 2**30,
          "fits": total <= chip.hbm,
          "coll/token": tok.num_collectives if tok else 0.0,
          "coll KiB/token": sum(c.bytes * n for c, n in tok.collectives.items()) / 1024
          if tok else 0.0,
          "largest coll KiB": max((c.bytes for c in tok.collectives), default=0) / 1024
          if tok else 0.0,
          "HBM GiB": r.bytes / 2**30, "HBM s": t["HBM"], "ICI s": t["interconnect"],
          "FLOP s": t["FLOPs"], "est s": r.seconds(chip), "bound": r.bound(chip)}


def main() -> None:
  from reasoner.engine import layout as layout_lib
  from reasoner.planner import plan
  from reasoner.build import build
  from reasoner.config import load_config

  devices, chip, method = plan.target("v5e:2x4")
  if devices is None:
    raise SystemExit(f"error: {method}")
  rows, tunix, goals = [], [], []
  for prompts in PROMPTS:
    cfg = load_config("configs/gemma3_1b.yaml", [f"train.batch_size={prompts}"])
    setup = build(cfg, abstract=True, devices=devices, hbm=chip.hbm)
    auto = layout_lib.decode_layout(setup, chip.hbm, chip)
    layers = setup.spec.num_layers
    vocab = setup.spec.tunix_config.num_embed
    for layout in LAYOUTS:
      print(f"  {prompts} prompts x 8, layout {layout} ...", flush=True)
      r = plan.rollout_plan(setup, prompts, chip, layout)
      rows.append(_row(prompts, layout + (" (auto)" if layout == auto else ""), r, r.total,
                       chip))
    for fsdp, tp in TUNIX_MESHES:
      print(f"  {prompts} prompts x 8, Tunix 0.1.7 on fsdp {fsdp} x tp {tp} ...", flush=True)
      r, total = tunix_rollout(cfg, devices, fsdp, tp, prompts, chip)
      tunix.append(_row(prompts, f"Tunix 0.1.7 {r.layout}", r, total, chip))
    by = {r["layout"].split()[0]: r for r in rows if r["prompts"] == prompts}
    chosen = by[auto]
    best = min((r for r in tunix if r["prompts"] == prompts and r["fits"]),
               key=lambda r: r["est s"])
    goals += [
        common.goal(f"{prompts} prompts: collectives a decoded token, {auto} (auto)",
                    chosen["coll/token"], 2 * layers + 2),
        common.goal(f"{prompts} prompts: largest collective a token, {auto} (KiB; at most "
                    f"one row's f32 logits; the training layout's are {prompts * 8} rows')",
                    chosen["largest coll KiB"], vocab * 4 / 1024),
        common.goal(f"{prompts} prompts: planned rollout, {auto} / train layout",
                    chosen["est s"] / by["train"]["est s"], 0.4),
        common.goal(f"{prompts} prompts: planned rollout, {auto} / {best['layout']} (Tunix's "
                    "fastest mesh)", chosen["est s"] / best["est s"], 0.5)]
  print(common.table(rows + [r for r in tunix if r["fits"]]))
  for r in tunix:
    if not r["fits"]:
      print(f"  {r['prompts']} prompts, {r['layout']}: does not fit ({r['note']})")
  path = common.write("rollout_tpu", {"rows": rows}, {"rows": tunix}, goals,
                      topology="v5e:2x4", method=method, chip=chip.name, ici_bytes_per_s=chip.ici,
                      hop_seconds=chip.hop)
  print(f"wrote {path}")
  for g in goals:
    print(f"  goal {'MET' if g['met'] else 'NOT MET'}: {g['name']}: {g['value']:.3g} "
          f"(target {g['direction'].replace('_', ' ')} {g['target']})")
