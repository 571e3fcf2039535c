"""The vocabulary head: our fused chunked GRPO head against the dense path, side by side.

    make bench BENCH=head        (python -m bench head)

(a) Planned per-chip HBM and compiled FLOPs, Gemma3-1B (bf16), LoRA r64, L = 256 + 768,
    G = 8, fsdp = 8 on TPU v5e:2x4 (compiled ahead of time with libtpu, `reasoner.plan`), for
    each remat setting and global batch (sequences), of
      ours:  `Trainer.step` (shared-prompt forward, `models.layer` and
             `models.attention`, `heads.fused_token_loss`);
      dense: Tunix 0.1.7's step (`dense_step`): each row's whole sequence through the
             model with Tunix's layers (residual stream pinned to rows over 'fsdp', as
             ours), [rows, L - 1, V] logits in bf16, `selective_log_softmax` (float32
             log-sum-exp), then the same GRPO loss and optimizer;
      ours_micro: ours with `train.micro_batch` (gradient accumulation over micro-batches in a
             `lax.scan` inside the step) at the largest one-pass batch that fit without XLA
             rematerialising (`_micro_base`), for each larger batch of the grid.
    Batches after the first that does not fit (per step and remat) are not compiled: memory
    grows with the batch. FLOPs ratios compare with the no-remat one-pass step at the same
    batch, taken per row from the largest batch it fits when it does not fit itself.
(b) CPU wall time of head forward + backward (gradients for hidden states and embedding),
    float32, fused vs dense (and the remat-chunked `token_logprobs`), at a shape both fit.

HEAD_BATCHES (default 32,128,256: batch 8 left out, every 1B compile takes 1-15 minutes on a
2-core host, the whole grid about two hours) and HEAD_REMAT (none,block,decoder) set the grid.
The largest batch that fits is the largest grid point that fits, not a search.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp

from bench import common

BATCHES = tuple(int(b) for b in os.environ.get("HEAD_BATCHES", "32,128,256").split(","))
REMATS = tuple(os.environ.get("HEAD_REMAT", "none,block,decoder").split(","))
G, PROMPT, NEW, FSDP = 8, 256, 768, 8
OBJ = dict(epsilon_low=0.2, epsilon_high=0.28, on_policy=False)  # the head bench's objective
REPEATS = int(os.environ.get("HEAD_REPEATS", "5"))


def config(remat: str, prompts: int):
  from reasoner.config import load_config

  return load_config(common.RESULTS.parent.parent / "configs" / "gemma3_1b.yaml", [
      f"model.remat={remat}", "lora.rank=64", f"rollout.num_generations={G}",
      f"data.max_prompt_tokens={PROMPT}", f"rollout.max_new_tokens={NEW}",
      f"mesh.fsdp={FSDP}", "mesh.tp=1", f"train.batch_size={max(1, prompts)}"])


def dense_step(trainer):
  """Tunix 0.1.7's GRPO step: each row's whole sequence through the model, logits at every
  position in the model's dtype, then `tunix.rl.common.selective_log_softmax` (the target logit
  and a float32 log-sum-exp over the vocabulary)."""
  import optax
  from flax import nnx
  from tunix.rl.common import selective_log_softmax

  from reasoner.objectives import grpo
  from reasoner.models.cache import causal_mask, positions_from_mask

  g = trainer.grpo

  def step(base, state, batch):
    def loss_fn(model):
      reps = batch.completion.shape[0] // batch.prompt.shape[0]
      tokens = jnp.concatenate([jnp.repeat(batch.prompt, reps, 0), batch.completion], 1)
      valid = jnp.concatenate([jnp.repeat(batch.prompt_valid, reps, 0),
                               batch.completion_mask], 1)
      # The residual stream pinned to rows over 'fsdp', as ours is: what Tunix's own act_btd
      # constraints do on a TPU under `with mesh:` (no-ops in a plan compiled from a CPU host).
      h, _ = model.hidden_states(tokens[:, :-1], positions_from_mask(valid[:, :-1]), None,
                                 causal_mask(valid[:, :-1]), trainer.mesh,
                                 tunix_attention=True)
      z = jnp.dot(h, model.embedding().T)  # Tunix's Embedder.decode
      if model.logit_softcap is not None:
        z = jnp.tanh(z / model.logit_softcap) * model.logit_softcap
      z = z / trainer.temperature  # Tunix's compute_per_token_logps(temperature=)
      n = batch.completion.shape[1]
      logp = selective_log_softmax(z[:, -n:], batch.completion)
      return grpo.policy_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages,
                              batch.completion_mask, obj=trainer.obj, loss_agg=g.loss_agg,
                              sampler_logp=batch.sampler_logp)

    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
    (loss, aux), grads = grad_fn(nnx.merge(trainer.graphdef, state.lora, base))
    updates, opt_state = trainer.tx.update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    return state.replace(step=state.step + 1, lora=lora, opt_state=opt_state), {"loss": loss,
                                                                                 **aux}
  return step


def planned(devices, chip) -> list[dict]:
  """(a): one row per remat setting, batch and step: ours in one pass, the dense reference,
  then ours in micro-batches (`train.micro_batch`, the gradient accumulated inside the step)
  of the largest one-pass batch that fit, at each larger batch of the grid."""
  from reasoner.planner import plan
  from reasoner.build import build

  rows = []
  for remat in REMATS:
    setup = build(config(remat, FSDP), abstract=True, devices=devices[:FSDP])
    for name, loss in (("ours", None), ("dense", dense_step)):
      for batch in BATCHES:
        if not _compiled(rows, remat, name, batch, setup, chip, loss=loss)["fits"]:
          break  # memory grows with the batch
    best = _micro_base(rows, remat)
    for batch in (b for b in BATCHES if best and b > best):
      micro = plan.micro_batch_for(batch // G, best // G, G, FSDP)
      _compiled(rows, remat, "ours_micro", batch, setup, chip, micro=micro)
  return rows


def _micro_base(rows, remat) -> int:
  """The largest one-pass batch that fit without XLA's own rematerialisation (FLOPs per row
  within 5% of the smallest batch's): near the limit XLA recomputes to fit (Gemma3-1B, 128
  sequences, no remat: 1.10x)."""
  fit = [r for r in rows if (r["remat"], r["step"]) == (remat, "ours") and r["fits"]]
  if not fit:
    return 0
  per_row = min(r["tflop"] / r["batch"] for r in fit)
  return max(r["batch"] for r in fit if r["tflop"] / r["batch"] <= 1.05 * per_row)


def _compiled(rows, remat, name, batch, setup, chip, loss=None, micro=None) -> dict:
  """One row: the run's train step (`plan.train_plan`) or the reference `loss` step over the
  same abstract inputs, state donated as in `Trainer.step`."""
  from reasoner import chips
  from reasoner.planner import plan
  from reasoner.objectives.grpo import GRPOTrainer as Trainer

  t0 = time.perf_counter()
  cfg, prompts = setup.cfg, batch // G
  if loss is None:
    r = plan.train_plan(setup, prompts, chip, micro)
  else:
    trainer = Trainer.for_run(setup.graphdef, setup.base, cfg, micro_batch=micro)
    args = trainer.abstract_inputs(setup.lora, prompts, G, cfg.data.max_prompt_tokens,
                                   cfg.rollout.max_new_tokens)
    r = plan.compile_plan(jax.jit(loss(trainer), donate_argnums=(1,)), args, {}, "train",
                          prompts, batch, chip)
  rows.append({"remat": remat, "step": name, "batch": batch,
               "micro_batch": (micro or batch // G) * G, "fits": r.fits,
               "hbm_gib": r.total / chips.GiB if r.total else None,
               "needs_gib": r.needed / chips.GiB if r.needed else None,
               "tflop": r.flops / 1e12 if r.flops else None,
               "compile_s": time.perf_counter() - t0})
  print(common.table([rows[-1]]).splitlines()[-1], flush=True)
  return rows[-1]


def head_inputs(b=1, t=512, d=640, v=262_144):
  k = jax.random.split(jax.random.key(0), 6)
  h = jax.random.normal(k[0], (b, t, d)) * 0.5
  e = jax.random.normal(k[1], (v, d)) * 0.05
  y = jax.random.randint(k[2], (b, t), 0, v)
  mask = jnp.ones((b, t), bool)
  old = -12.0 + jax.random.normal(k[3], (b, t))
  adv = jax.random.normal(k[4], (b,))
  return h, e, y, mask, old, adv


def head_times() -> dict:
  """(b): best of REPEATS warm calls of jitted value_and_grad w.r.t. (hidden, embedding),
  the three heads' calls interleaved."""
  from reasoner.engine import heads
  from reasoner.objectives import grpo

  h, e, y, mask, old, adv = head_inputs()
  a = jnp.broadcast_to(adv[:, None], old.shape)
  obj = grpo.Objective(**OBJ)
  fn = functools.partial(grpo.token_loss, obj=obj)
  w = grpo.token_weights(mask, "token-mean")

  def fused(h, e):
    return heads.fused_token_loss(h, e, y, w, fn, (old, old, a, old, jnp.zeros_like(old)))[0]

  def dense(h, e):
    logp = jnp.take_along_axis(jax.nn.log_softmax(heads.logits(h, e), -1), y[..., None],
                               -1)[..., 0]
    return grpo.policy_loss(logp, old, None, adv, mask, obj=obj, loss_agg="token-mean")[0]

  def remat(h, e):
    logp, _ = heads.token_logprobs(h, e, y)
    return grpo.policy_loss(logp, old, None, adv, mask, obj=obj, loss_agg="token-mean")[0]

  out = {"shape": "B1 T512 H640 V262144 float32", "repeats": REPEATS}
  steps = {}
  for name, f in (("fused", fused), ("dense", dense), ("remat_chunked", remat)):
    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    out[f"{name}_temp_gib"] = step.lower(h, e).compile().memory_analysis().temp_size_in_bytes \
        / 2**30
    jax.block_until_ready(step(h, e))
    steps[name], out[f"{name}_s"] = step, float("inf")
  for _ in range(REPEATS):  # interleaved, so that load from other processes hits all alike
    for name, step in steps.items():
      out[f"{name}_s"] = min(out[f"{name}_s"], common.timeit(lambda: step(h, e), repeats=1))
  for name in steps:
    print(f"  head {name}: {out[f'{name}_s']:.2f} s, temporaries "
          f"{out[f'{name}_temp_gib']:.2f} GiB", flush=True)
  return out


def scan_count_check() -> float:
  """Planner FLOPs of a 16-step scan over one matmul / (16 x that matmul's FLOPs): 1.0."""
  from reasoner.planner import hlo

  k, m, n, d = 16, 64, 128, 256
  f = lambda x, w: jax.lax.scan(lambda c, xi: (c + jnp.sum(xi @ w), None), 0.0, x)[0]
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((k, m, n), jnp.float32),
                              jax.ShapeDtypeStruct((n, d), jnp.float32)).compile()
  return hlo.hlo_cost(compiled.as_text())[0] / (k * 2 * m * n * d)


def summarise(rows: list[dict], hbm_gib: float) -> dict:
  """HBM ratios at batch 32, FLOPs relative to the no-remat one-pass step (ours_micro against
  ours), largest fitting batches."""
  at = {(r["remat"], r["step"], r["batch"]): r for r in rows}
  out: dict = {"hbm_ratio_at_32": {}, "largest": {}, "largest_flops_ok": {}}
  for step in ("ours", "ours_micro", "dense"):
    family = "dense" if step == "dense" else "ours"
    fit_none = [r for r in rows if (r["remat"], r["step"]) == ("none", family) and r["fits"]]
    per_row = fit_none[-1]["tflop"] / fit_none[-1]["batch"] if fit_none else None
    best, best_ok = 0, 0
    for r in rows:
      if r["step"] != step or not r["fits"]:
        continue
      same = at.get(("none", family, r["batch"]))
      base = same["tflop"] if same and same["fits"] else (per_row or 0) * r["batch"]
      r["flops_vs_no_remat"] = r["tflop"] / base if base else None
      best = max(best, r["batch"])
      if r["flops_vs_no_remat"] is not None and r["flops_vs_no_remat"] <= 1.3:
        best_ok = max(best_ok, r["batch"])
    out["largest"][step], out["largest_flops_ok"][step] = best, best_ok
  for remat in REMATS:
    ours, dense = at.get((remat, "ours", 32)), at.get((remat, "dense", 32))
    if ours and ours["fits"] and dense:  # a dense step that does not fit needs more than
      need = dense["hbm_gib"] if dense["fits"] else max(dense["needs_gib"] or 0, hbm_gib)
      out["hbm_ratio_at_32"][remat] = ours["hbm_gib"] / need  # XLA's report, or 16 GiB
  return out


def main() -> None:
  from reasoner.planner import plan

  devices, chip, method = plan.target("v5e:2x4")
  print(f"(a) {method}", flush=True)
  rows = planned(devices, chip) if devices is not None else []
  if rows:
    print(common.table(rows))
  print("(b) CPU head forward + backward", flush=True)
  report(rows, head_times(), scan_count_check(), method)


def report(rows: list[dict], times: dict, scan: float, method: str, **extra) -> None:
  """Goals and bench/results/head.json from (a)'s rows, (b)'s times and the scan check."""
  from reasoner import chips

  summary = summarise(rows, chips.CHIPS["v5e"].hbm / chips.GiB)  # the v5e:2x4 target above
  ratio = times["fused_s"] / times["dense_s"]
  goals = [common.goal(f"HBM per chip at batch 32, remat {k}: ours / dense", v, 0.6)
           for k, v in summary["hbm_ratio_at_32"].items()]
  if rows:
    goals += [
        common.goal("largest batch fitting 16 GiB with FLOPs <= 1.3x the no-remat step's",
                    max(summary["largest_flops_ok"][s] for s in ("ours", "ours_micro")), 128,
                    at_most=False),
        common.goal("largest batch fitting 16 GiB, any remat",
                    max(summary["largest"][s] for s in ("ours", "ours_micro")), 256,
                    at_most=False)]
  goals += [common.goal("fused head time / dense head time (CPU, fwd+bwd)", ratio, 1.05),
            common.goal("planner FLOPs of a 16-step scan / (16 x body FLOPs), minus 1",
                        abs(scan - 1.0), 0.0)]
  path = common.write(
      "head", {"planned": [r for r in rows if r["step"] != "dense"], "summary": summary,
               "cpu_head": times, "fused_over_dense": ratio, "scan_count_ratio": scan},
      {"planned_dense": [r for r in rows if r["step"] == "dense"]}, goals,
      method=method, batches=list(BATCHES), remat=list(REMATS),
      shapes={"model": "gemma3-1b", "lora_rank": 64, "prompt": PROMPT, "new": NEW, "G": G,
              "fsdp": FSDP, "topology": "v5e:2x4"}, **extra)
  for g in goals:
    print(f"  goal {'MET' if g['met'] else 'NOT MET'}: {g['name']}: {g['value']:.3g} "
          f"(target {g['direction'].replace('_', ' ')} {g['target']})")
  print(f"wrote {path}")
