"""The whole GRPO step on a v5e-8 beside Tunix 0.1.7's, compiled ahead of time (no TPU needed).

    make bench BENCH=grpo_step_tpu      (needs libtpu: pip install '.[tpu]')

The gemma3_1b preset (4 prompts x G = 8, 256 prompt + 768 new tokens, beta 0.04, one pass a
rollout). Ours: `reasoner plan`'s programs (`Sampler.generate` in the layout `auto` picks, the
reference log-prob forward `Trainer._logprobs`, the train step `Trainer.step`). Tunix 0.1.7's, from
its own pieces on our model and LoRA (`build`, abstract): its `Sampler` (bench.rollout_tpu), its
reference forward `tunix.rl.common.compute_per_token_logps` (the whole sequence's logits, then
`selective_log_softmax`) and its train step (`PeftTrainer._train_step`: `nnx.value_and_grad` over
the LoRA params of `algo_core.grpo_loss_fn`, then the optimizer), each compiled for the same chips
as fsdp x tp with Tunix's partition rules, on its default mesh (the preset's training mesh, one
mesh for every role as Tunix's colocated RL cluster runs) and on each of the others rollout_tpu
tries. Tunix's `__call__` runs with our LoRA applied (`lora_in_tunix_call`); its forward and train
step with the residual stream on rows over 'fsdp' (its activation constraints on a TPU), its
sampler unpinned as rollout_tpu compiles it (pinned, its decode loop planned 668 s of HBM traffic).
Every program is read by the same planner (`hlo.analyse`: loop bodies once per trip, a collective
once per channel; HBM bytes, FLOPs, a ring model of the interconnect): the step is the sum of its
parts' bound times, a lower bound.

Each side's floor: the parts' HBM-bound and FLOP-bound times (the larger of the two for each part),
summed. Goals: issue 39's (the log-prob forward at most Tunix's, bound by HBM or FLOPs; the train
step's interconnect time at most its HBM time) and issue 37's (the train step bound by HBM or FLOPs
and at most half of 262 ms, the plan before the per-channel count; the step at most 0.6 s; at least
3x Tunix's steps a session; within 1.5x of the step's floor).

Tunix's parts on each mesh (about 10 minutes each on 2 cores) are kept in bench/.cache/ under a
hash of the sources that shape them (this file's functions that compile them,
bench/rollout_tpu.py, reasoner/, the preset, Tunix's version): a run stopped part-way (the
host's memory, a session's end) goes on from the meshes it finished. The plans are compiled, not
timed, so parts from two runs are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import pathlib
import types

from bench import common
from reasoner.chips import SESSION
from bench.rollout_tpu import TUNIX_MESHES, tunix_rollout

PROMPTS = 4
TRAIN_BEFORE_S = 0.262  # issue 37: the train step's plan before collectives counted per channel


@contextlib.contextmanager
def lora_in_tunix_call(mesh):
  """Tunix's `__call__` (embed, its layers, final norm, `Embedder.decode`: Gemma 3 has no
  softcap) taken through `hidden_states(tunix_attention=True)`, the same computation, because
  our qwix LoRA intercepts that method only (Tunix's examples have qwix intercept `__call__`):
  without it Tunix's programs run the base alone and its train step has no gradient. `mesh`
  pins the residual stream to rows over 'fsdp', which Tunix's own activation constraints do on
  a TPU under `with mesh:` and not in a plan compiled from a CPU host (as bench/head.py)."""
  from reasoner.models import gemma

  cls = gemma.classes()[2]  # our Gemma 3 (Tunix's, with `hidden_states`)
  before = cls.__call__

  def call(self, last_tokens, positions=None, cache=None, attention_mask=None, **_):
    h, new_cache = self.hidden_states(last_tokens, positions, cache, attention_mask, mesh,
                                      tunix_attention=True)
    return self.embedder.decode(h), new_cache

  cls.__call__ = call
  try:
    yield
  finally:
    cls.__call__ = before


def tunix_forward_and_train(cfg, devices, fsdp: int, tp: int, prompts: int, chip):
  """Tunix 0.1.7's reference forward and train step on fsdp x tp -> (forward, train) plans."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tunix.rl import algo_core, common as tunix_common

  from reasoner.build import build
  from reasoner.objectives.grpo import GRPOTrainer
  from reasoner.planner import plan

  g = cfg.rollout.num_generations
  rows, p, n = prompts * g, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
  plans = []
  for remat in ("none", "block"):  # Tunix's default first; block where that does not fit
    cfg_m = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, fsdp=fsdp, tp=tp,
                                                              weights="sharded"),  # Tunix's
                                model=dataclasses.replace(cfg.model, remat=remat))
    setup = build(cfg_m, abstract=True, devices=devices)
    graphdef, state = nnx.split(nnx.merge(setup.graphdef, setup.lora, setup.base))
    on_rows = NamedSharding(setup.mesh, P("fsdp"))  # Tunix shards its batch over the data axes
    arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_rows)
    prompt, completion = arr((rows, p), jnp.int32), arr((rows, n), jnp.int32)
    with lora_in_tunix_call(setup.mesh):
      forward = plan.compile_plan(tunix_common.compute_per_token_logps,
                                  (graphdef, state, prompt, completion),
                                  {"pad_id": 0, "eos_id": 1}, "logprobs", prompts, rows, chip)
    algo = types.SimpleNamespace(beta=cfg.grpo.beta, epsilon=cfg.grpo.epsilon_low,
                                 epsilon_high=cfg.grpo.epsilon_high, epsilon_c=None,
                                 loss_algo="grpo", loss_agg_mode="token-mean",
                                 temperature=cfg.rollout.temperature, kl_clamp_value=None,
                                 kl_loss_mode="low_var_kl")
    # the run's optimizer and its state's placement (ours), the same for both steps
    trainer = GRPOTrainer.for_run(setup.graphdef, setup.base, cfg_m)
    _, state, _ = trainer.abstract_inputs(setup.lora, prompts, g, p, n)
    tx = trainer.tx

    def train_step(lora, opt_state, base, example):
      model = nnx.merge(setup.graphdef, lora, base)
      loss_fn = lambda m: algo_core.grpo_loss_fn(m, example, algo, 0, 1)
      grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam),
                                   has_aux=True)
      (loss, _), grads = grad_fn(model)
      updates, opt_state = tx.update(grads, opt_state, lora)
      return optax.apply_updates(lora, updates), opt_state, loss

    example = tunix_common.TrainExample(
        prompt_ids=prompt, prompt_mask=arr((rows, p), jnp.int32), completion_ids=completion,
        completion_mask=arr((rows, n), jnp.int32), advantages=arr((rows,), jnp.float32),
        ref_per_token_logps=arr((rows, n), jnp.float32), old_per_token_logps=None)
    with lora_in_tunix_call(setup.mesh):
      train = plan.compile_plan(jax.jit(train_step, donate_argnums=(0, 1)),
                                (state.lora, state.opt_state, setup.base, example), {},
                                "train", prompts, rows, chip)
    plans.append((remat, forward, train))
    if train.fits:
      break
  remat, forward, train = plans[-1]
  return forward, train, remat


def _part(r, chip) -> dict:
  t = r.times(chip)
  return {"GiB/chip": r.total / 2**30 if r.total else None, "fits": r.fits,
          "needs GiB": r.needed / 2**30 if not r.fits and r.needed else None,
          "HBM ms": 1e3 * t["HBM"], "ICI ms": 1e3 * t["interconnect"],
          "FLOP ms": 1e3 * t["FLOPs"], "est ms": 1e3 * r.seconds(chip), "bound": r.bound(chip),
          "collectives": sum(r.collectives.values()),
          "floor ms": 1e3 * max(t["HBM"], t["FLOPs"])}


def _step(name: str, parts: dict, forwards: int) -> dict:
  """A step's row: its parts (rollout, log-prob forward x forwards, train) summed."""
  est = (parts["rollout"]["est ms"] + forwards * parts["logprobs"]["est ms"]
         + parts["train"]["est ms"]) / 1e3
  floor = (parts["rollout"]["floor ms"] + forwards * parts["logprobs"]["floor ms"]
           + parts["train"]["floor ms"]) / 1e3
  return {"step": name, "est s": est, "floor s": floor, "est / floor": est / floor,
          "steps a session": int(SESSION // est),
          **{f"{k} ms": v["est ms"] for k, v in parts.items() if isinstance(v, dict)}}


def _show(name: str, parts: dict) -> None:
  print(f"  {name}:", flush=True)
  for k, v in parts.items():
    if isinstance(v, dict):
      print(f"    {k:9s} " + ", ".join(f"{a} {b:.4g}" if isinstance(b, float) else f"{a} {b}"
                                      for a, b in v.items()), flush=True)


ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "grpo_step_tpu"


def _sources_key() -> str:
  """A hash of what Tunix's plans depend on: this bench's functions that compile them,
  rollout_tpu, reasoner/, the preset and Tunix's version."""
  h = hashlib.sha256(importlib.metadata.version("google-tunix").encode())
  for fn in (lora_in_tunix_call, tunix_forward_and_train, _part):
    h.update(inspect.getsource(fn).encode())
  files = [ROOT / "bench" / "rollout_tpu.py", ROOT / "configs" / "gemma3_1b.yaml",
           *sorted((ROOT / "reasoner").rglob("*.py"))]
  for f in files:
    h.update(f.relative_to(ROOT).as_posix().encode() + f.read_bytes())
  return h.hexdigest()


def _tunix(cfg, devices, chip) -> dict:
  """Tunix 0.1.7's parts on each mesh, printed as they come (kept in CACHE, module doc)."""
  tunix, key = {}, _sources_key()
  for fsdp, tp in TUNIX_MESHES:
    name = f"fsdp {fsdp} x tp {tp}"
    kept = CACHE / f"fsdp{fsdp}_tp{tp}.json"
    old = json.loads(kept.read_text()) if kept.exists() else {}
    if old.get("key") == key:
      tunix[name] = old["parts"]
      _show(f"Tunix 0.1.7 {name} (kept from an earlier run of the same sources)", tunix[name])
      continue
    print(f"  Tunix 0.1.7 on fsdp {fsdp} x tp {tp} ...", flush=True)
    with lora_in_tunix_call(None):  # unpinned, as bench/rollout_tpu.py compiles it
      rollout, total = tunix_rollout(cfg, devices, fsdp, tp, PROMPTS, chip)
    forward, train, remat = tunix_forward_and_train(cfg, devices, fsdp, tp, PROMPTS, chip)
    tunix[name] = {"remat": remat,
                   "rollout": {**_part(rollout, chip), "GiB/chip": total / 2**30},
                   "logprobs": _part(forward, chip), "train": _part(train, chip)}
    CACHE.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"key": key, "parts": tunix[name]}, indent=1))
    _show(f"Tunix 0.1.7 {name}", tunix[name])
  return tunix


def _goals(ours: dict, mine: dict, tunix: dict, steps: list[dict]) -> list[dict]:
  fastest = min((s for s in steps if s["step"].startswith("Tunix")), key=lambda s: s["est s"])
  forward = tunix[fastest["step"].removeprefix("Tunix 0.1.7 ")]["logprobs"]
  default = f"Tunix 0.1.7 fsdp {TUNIX_MESHES[0][0]} x tp {TUNIX_MESHES[0][1]}"
  goals = [
      common.goal("log-prob forward planned, ours / Tunix 0.1.7's on its fastest step's mesh",
                  ours["logprobs"]["est ms"] / forward["est ms"], 1.0),
      common.goal("log-prob forward bound by HBM or FLOPs (1 = yes)",
                  float(ours["logprobs"]["bound"] != "interconnect"), 1.0, at_most=False),
      common.goal("train step: interconnect time / HBM time",
                  ours["train"]["ICI ms"] / ours["train"]["HBM ms"], 1.0),
      common.goal("train step bound by HBM or FLOPs (1 = yes)",
                  float(ours["train"]["bound"] != "interconnect"), 1.0, at_most=False),
      common.goal(f"train step planned / {TRAIN_BEFORE_S * 1e3:.0f} ms (issue 37's figure)",
                  ours["train"]["est ms"] / 1e3 / TRAIN_BEFORE_S, 0.5),
      common.goal("GRPO step at 4 x 8 planned (s)", mine["est s"], 0.6),
      common.goal(f"steps a session, ours / {fastest['step']} (Tunix's fastest that fits)",
                  mine["steps a session"] / fastest["steps a session"], 3.0, at_most=False),
      common.goal("GRPO step planned / its floor", mine["est / floor"], 1.5)]
  on_default = [s for s in steps if s["step"] == default]
  if on_default:  # Tunix's default mesh, where its step fits there
    goals.append(common.goal(f"steps a session, ours / {default} (Tunix's default)",
                             mine["steps a session"] / on_default[0]["steps a session"], 3.0,
                             at_most=False))
  return goals


def main() -> None:
  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.planner import plan

  devices, chip, method = plan.target("v5e:2x4")
  if devices is None:
    raise SystemExit(f"error: {method}")
  cfg = load_config("configs/gemma3_1b.yaml", [f"train.batch_size={PROMPTS}"])
  forwards = (cfg.grpo.beta > 0) + (cfg.grpo.num_iterations > 1)
  print("  ours: the preset's programs ...", flush=True)
  setup = build(cfg, abstract=True, devices=devices, hbm=chip.hbm)  # mesh.weights as on a v5e
  rollout = plan.rollout_plan(setup, PROMPTS, chip)  # in the layout `auto` picks
  ours = {"rollout": _part(rollout, chip),
          "logprobs": _part(plan.reference_plan(setup, PROMPTS, chip), chip),
          "train": _part(plan.train_plan(setup, PROMPTS, chip), chip)}
  name = f"ours (remat {cfg.model.remat}, weights {setup.weights}, decode {rollout.layout})"
  _show(name, ours)
  steps = [_step(name, ours, forwards)]
  tunix = _tunix(cfg, devices, chip)
  for name, parts in tunix.items():
    fits = all(v["fits"] for v in parts.values() if isinstance(v, dict))
    if fits:
      steps.append(_step(f"Tunix 0.1.7 {name}", parts, forwards))
    else:
      print(f"  Tunix 0.1.7 {name}: does not fit on 16 GiB a chip", flush=True)
  goals = _goals(ours, steps[0], tunix, steps)
  print(common.table(steps))
  path = common.write("grpo_step_tpu", {"steps": steps[:1], "parts": ours},
                      {"steps": steps[1:], "parts": tunix, "version": "google-tunix 0.1.7"},
                      goals, topology="v5e:2x4", method=method, chip=chip.name,
                      prompts=PROMPTS, generations=cfg.rollout.num_generations,
                      log_prob_forwards=forwards)
  print(f"wrote {path}")
  for g in goals:
    print(f"  goal {'MET' if g['met'] else 'NOT MET'}: {g['name']}: {g['value']:.3g} "
          f"(target {g['direction'].replace('_', ' ')} {g['target']})")
