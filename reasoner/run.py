"""One GRPO step (rollout, rewards, advantages, train_step), restoring a run's LoRA, sampling:
the pieces `reasoner.loop` runs, and what `python -m reasoner sample` runs."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from reasoner import grpo, lora as lora_lib, mesh as mesh_lib, rewards as rewards_lib
from reasoner.build import Setup, build
from reasoner.checkpoint import CheckpointError, Checkpointer
from reasoner.config import Config
from reasoner.data import prompts as prompts_lib
from reasoner.sampler import Completions, Sampler, SamplingConfig
from reasoner.trainer import Batch, Trainer, build_batch, check_finite

log = logging.getLogger("reasoner")


class _Groups(NamedTuple):
  """One sampling round on the host: B prompts x G completions, scored."""

  records: list
  comps: Completions
  prompt: np.ndarray  # [B, P] left-padded
  prompt_valid: np.ndarray
  total: np.ndarray  # [B * G] reward (overlong penalty included)
  per_fn: dict  # reward function name -> [B * G], NaN on rows it does not score
  correct: np.ndarray  # [B * G] 0/1, NaN without a reference answer
  formatted: np.ndarray  # [B * G] 0/1
  informative: np.ndarray  # [B] bool: rewards differ (else zero advantage everywhere)
  seconds: float  # sampling
  reward_seconds: float  # scoring


def _sample_round(setup: Setup, sampler: Sampler, lora, records, key) -> _Groups:
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  prompts = [prompts_lib.render(cfg.data.template, r["question"]) for r in records]
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  t0 = time.perf_counter()
  comps, p_tok, p_mask = sampler.sample((lora, setup.base), prompts, key, scfg, g)
  seconds = time.perf_counter() - t0
  rep = lambda xs: [x for x in xs for _ in range(g)]
  prompts, answers = rep(prompts), rep([r["answer"] for r in records])
  categories = rep([r.get("category") for r in records])
  t0 = time.perf_counter()
  total, per_fn = setup.rewards(prompts, comps.texts, answer=answers, category=categories,
                                question=rep([r["question"] for r in records]))
  reward_s = time.perf_counter() - t0
  o = cfg.grpo
  if o.overlong_buffer:
    per_fn["overlong"] = rewards_lib.overlong(comps.mask.sum(1), cfg.rollout.max_new_tokens,
                                              o.overlong_buffer, o.overlong_penalty)
    total = total + per_fn["overlong"]
  return _Groups(list(records), comps, p_tok, p_mask, total, per_fn,
                 rewards_lib.accuracy(comps.texts, answers),
                 np.asarray(rewards_lib.format_exact(prompts, comps.texts), np.float32),
                 np.ptp(total.reshape(-1, g), axis=1) > 0, seconds, reward_s)


def rollout(setup: Setup, sampler: Sampler, trainer: Trainer, lora, records: list[dict],
            key: jax.Array, draw=None) -> tuple[Batch, dict]:
  """Samples G completions per prompt, scores them and builds the training batch. With
  `grpo.dynamic_sampling`, groups of equal rewards are dropped and `draw()` gives more prompts
  (a batch at a time) until the batch is full of informative groups or
  `grpo.max_sample_batches` rounds were drawn; short of that, dropped groups fill it with
  their loss masked out (static shapes, no recompile)."""
  cfg, g, b = setup.cfg, setup.cfg.rollout.num_generations, len(records)
  rounds = [_sample_round(setup, sampler, lora, records, key)]
  if cfg.grpo.dynamic_sampling and draw is not None:
    while (sum(r.informative.sum() for r in rounds) < b
           and len(rounds) < cfg.grpo.max_sample_batches):
      rounds.append(_sample_round(setup, sampler, lora, draw(),
                                  jax.random.fold_in(key, len(rounds))))
  chosen, train = [(rounds[0], i) for i in range(b)], [True] * b
  if cfg.grpo.dynamic_sampling:  # informative groups first, then fillers that carry no loss
    ranked = sorted(((not ok, k, i) for k, r in enumerate(rounds)
                     for i, ok in enumerate(r.informative)))[:b]
    chosen = [(rounds[k], i) for _, k, i in ranked]
    train = [not dropped for dropped, _, _ in ranked]
  host = _assemble(cfg, chosen, g, train, setup.tokenizer.pad_id)
  batch = {k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()}
  fwd = lambda lora: trainer.logprobs(lora, batch["prompt"], batch["prompt_valid"],
                                      batch["completion"], batch["completion_mask"])
  if cfg.grpo.num_iterations > 1:  # pi_old from the trainer's own forward
    batch["old_logp"] = fwd(lora)
  batch["ref_logp"] = (fwd(lora_lib.zeros_like(lora)) if cfg.grpo.beta > 0
                       else jnp.zeros_like(batch["old_logp"]))
  metrics = _rollout_metrics(rounds, sum(train))
  metrics["tokens"] = int(sum(r.prompt_valid.sum() * g + r.comps.mask.sum() for r in rounds))
  metrics["samples"] = [{"question": r.records[i]["question"], "completion":
                         r.comps.texts[i * g], "reward": float(r.total[i * g])}
                        for r, i in chosen]
  return Batch(**batch), metrics


def _assemble(cfg: Config, chosen, g: int, train: list[bool], pad_id: int) -> dict:
  """Host arrays for the batch from (round, group) picks; prompts left-padded to the widest
  round's width. `train[j]` False (dynamic sampling's fillers) masks group j's loss out, as
  `grpo.mask_truncated_completions` masks rows that never stopped."""
  width = max(r.prompt.shape[1] for r, _ in chosen)
  pad = lambda x, v: np.concatenate([np.full((x.shape[0], width - x.shape[1]), v, x.dtype), x],
                                    axis=1)
  rows = lambda x, i: x[i * g:(i + 1) * g]
  prompt = np.stack([pad(r.prompt, pad_id)[i] for r, i in chosen])
  valid = np.stack([pad(r.prompt_valid, False)[i] for r, i in chosen])
  comps = Completions(*(np.concatenate([rows(getattr(r.comps, f), i) for r, i in chosen])
                        for f in ("tokens", "mask", "logprobs")), texts=[],
                      stopped=np.concatenate([rows(r.comps.stopped, i) for r, i in chosen]))
  total = np.concatenate([rows(r.total, i) for r, i in chosen])
  adv = np.asarray(grpo.group_advantages(
      jnp.asarray(total), g, cfg.grpo.scale_rewards,
      ddof=1 if cfg.grpo.advantage_std == "sample" else 0))
  host = build_batch(prompt, valid, comps, adv)
  keep = np.repeat(np.asarray(train, bool), g)
  if cfg.grpo.mask_truncated_completions:
    keep = keep & comps.stopped
  host["completion_mask"] = host["completion_mask"] & keep[:, None]
  return host


def _rollout_metrics(rounds: list[_Groups], kept: int) -> dict:
  """Rewards and lengths over every completion drawn this step; how many groups carried a
  gradient."""
  cat = lambda f: np.concatenate([f(r) for r in rounds])
  total = cat(lambda r: r.total)
  per_fn = {k: cat(lambda r: r.per_fn[k]) for k in rounds[0].per_fn}
  lengths = cat(lambda r: r.comps.mask.sum(1))
  stopped = cat(lambda r: r.comps.stopped)
  zero_std = cat(lambda r: ~r.informative)
  seconds = sum(r.seconds for r in rounds)
  scored = {k: v[~np.isnan(v)] for k, v in per_fn.items()}  # each reward over the rows it scores
  correct = cat(lambda r: r.correct)
  return {"reward/mean": float(total.mean()), "reward/std": float(total.std()),
          **{f"reward/{k}": float(v.mean()) for k, v in scored.items() if v.size},
          **{f"reward_std/{k}": float(v.std()) for k, v in scored.items() if v.size},
          "accuracy": rewards_lib.nan_mean(correct),  # over the rows with a reference answer
          "format_rate": float(cat(lambda r: r.formatted).mean()),
          "completion_length": float(lengths.mean()),
          "completion_length/min": float(lengths.min()),
          "completion_length/max": float(lengths.max()),
          "completion_length/stopped": float(lengths[stopped].mean()) if stopped.any() else 0.0,
          "truncated_rate": float(1.0 - stopped.mean()),
          "frac_reward_zero_std": float(zero_std.mean()),
          "groups_drawn": len(zero_std), "groups_trained": kept,
          "refill_rounds": len(rounds) - 1, "rollout_tokens": int(lengths.sum()),
          "rollout_tokens_per_s": float(lengths.sum() / seconds), "rollout_s": seconds,
          "reward_s": sum(r.reward_seconds for r in rounds)}


def checkpoint_tree(state) -> dict:
  return {"step": state.step, "lora": state.lora, "opt_state": state.opt_state, "key": state.key}


def grpo_step(setup: Setup, sampler: Sampler, trainer: Trainer, state, data, step: int):
  """Rollout of the next batch of `data` (an iterator of record batches, drawn again by
  dynamic sampling), then mu optimisation passes on it: (state, metrics)."""
  t0 = time.perf_counter()
  batch, metrics = rollout(setup, sampler, trainer, state.lora, next(data),
                           jax.random.fold_in(state.key, step), draw=lambda: next(data))
  for _ in range(setup.cfg.grpo.num_iterations):
    state, step_metrics = trainer.train_step(state, batch)
  step_metrics = jax.device_get(step_metrics)
  check_finite(float(step_metrics["loss"]), step)
  dt = time.perf_counter() - t0
  tokens = metrics.pop("tokens")  # counted on the host: the batch spans every process
  metrics.update({k: float(v) for k, v in step_metrics.items()}, step_time_s=dt,
                 tokens_per_s=float(tokens / dt))
  return state, metrics


def restore_lora(setup: Setup, step: int | None = None):
  """(LoRA weights, step) of the run's checkpoint at `step` (default: the newest that reads,
  each unreadable one named on the way), read-only; (the initial LoRA, 0) when the run has no
  checkpoint and no step was asked for."""
  folder = setup.cfg.run_path / "checkpoints"
  ckpt = Checkpointer(folder, 1, read_only=True) if folder.is_dir() else None
  steps = ckpt.all_steps() if ckpt else []
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step}: no such checkpoint in {folder} (it has "
                          f"{', '.join(map(str, steps)) or 'none'})")
  if not steps:
    return setup.lora, 0
  trainer = Trainer.for_run(setup.graphdef, setup.base, setup.cfg)
  target = checkpoint_tree(trainer.init_state(setup.lora, jax.random.PRNGKey(0)))
  if step is not None:
    return ckpt.restore(step, target)[0]["lora"], step
  found = ckpt.restore_latest(target, lambda line: tqdm.write(line) if jax.process_index() == 0
                              else None)
  if found is None:
    raise CheckpointError(f"no checkpoint in {folder} can be read")
  return found[1]["lora"], found[0]


def sample(cfg: Config, question: str, n: int) -> list[str]:
  setup = build(cfg)
  lora, _ = restore_lora(setup)
  sampler = Sampler.for_run(setup)
  prompt = prompts_lib.render(cfg.data.template, question)
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=n == 1)
  comps, _, _ = sampler.sample((lora, setup.base), [prompt], jax.random.PRNGKey(cfg.train.seed),
                               scfg, max(n, 1) if n > 1 else 1)
  return comps.texts
