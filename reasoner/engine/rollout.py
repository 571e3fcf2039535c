"""Rollouts: G completions sampled per prompt with the live LoRA and scored by the run's rewards,
the groups a step trains on (DAPO's dynamic sampling), and their host arrays and metrics. GRPO
turns them into advantages (`objectives.grpo`); any stage that learns from its own samples
starts here.

With `grpo.dynamic_sampling`, groups whose rewards are all equal (they carry no gradient) are
dropped and more prompts drawn, a batch at a time (one compiled shape), until the batch is full
of informative groups or `grpo.max_sample_batches` rounds were drawn; short of that, dropped
groups fill it with their loss masked out (static shapes, no recompile).
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from reasoner.data import examples, prompts as prompts_lib
from reasoner.engine.sampler import Completions, Sampler, SamplingConfig
from reasoner.rewards import builtin


class Groups(NamedTuple):
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


def sample_round(setup, sampler: Sampler, lora, records: list[dict], key: jax.Array,
                 then: Callable | None = None) -> Groups:
  """G completions of each record's prompt (`rollout.*`), scored by the run's rewards
  (`then`: `Sampler.sample`'s, called before they are detokenised and scored)."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  prompts = [prompts_lib.render_record(cfg.data.template, r) for r in records]
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  t0 = time.perf_counter()
  comps, p_tok, p_mask = sampler.sample((lora, setup.base), prompts, key, scfg, g, then)
  seconds = time.perf_counter() - t0
  prompts = [p for p in prompts for _ in range(g)]
  answers = [r["answer"] for r in records for _ in range(g)]
  t0 = time.perf_counter()
  total, per_fn = score(setup, prompts, comps.texts, records, g, comps.mask.sum(1))
  reward_s = time.perf_counter() - t0
  return Groups(list(records), comps, p_tok, p_mask, total, per_fn,
                builtin.accuracy(comps.texts, answers),
                np.asarray(builtin.format_exact(prompts, comps.texts), np.float32),
                np.ptp(total.reshape(-1, g), axis=1) > 0, seconds, reward_s)


def score(setup, prompts: list[str], texts: list[str], records: list[dict], g: int,
          lengths: np.ndarray) -> tuple[np.ndarray, dict]:
  """(total [n], per function [n]) of n completions of `lengths` tokens, G consecutive a
  record: the run's rewards, with DAPO's overlong penalty (`per_fn["overlong"]`) added where
  grpo.overlong_buffer sets one."""
  cfg, o = setup.cfg, setup.cfg.grpo
  total, per_fn = setup.rewards.score(prompts, texts, records, g)
  if o.overlong_buffer:
    per_fn["overlong"] = builtin.overlong(lengths, cfg.rollout.max_new_tokens,
                                          o.overlong_buffer, o.overlong_penalty)
    total = total + per_fn["overlong"]
  return total, per_fn


class Rollout(NamedTuple):
  """The groups a step trains on, as host arrays, and what was drawn to find them."""

  host: dict  # prompt, prompt_valid [B, P]; completion, completion_mask, sampler_logp [B*G, N]
  rewards: np.ndarray  # [B * G] each row's total reward
  rounds: list  # every Groups drawn
  chosen: list  # (Groups, index) of each of the B groups, in batch order
  trained: list  # [B] bool: False for dynamic sampling's fillers (their loss masked out)
  guided: np.ndarray | None = None  # [B] bool: the groups `guide` gave a written response


def draw(setup, sampler: Sampler, lora, records: list[dict], key: jax.Array,
         more: Callable[[], list[dict]] | None = None, then: Callable | None = None) -> Rollout:
  """A round for `records`; with `grpo.dynamic_sampling`, `more()` gives further prompts until
  the batch is full of informative groups (see the module's docstring). `then`: the first
  round's `Sampler.sample` hook."""
  cfg, g, b = setup.cfg, setup.cfg.rollout.num_generations, len(records)
  rounds = [sample_round(setup, sampler, lora, records, key, then)]
  if cfg.grpo.dynamic_sampling and more is not None:
    while (sum(r.informative.sum() for r in rounds) < b
           and len(rounds) < cfg.grpo.max_sample_batches):
      rounds.append(sample_round(setup, sampler, lora, more(),
                                 jax.random.fold_in(key, len(rounds))))
  chosen, trained = [(rounds[0], i) for i in range(b)], [True] * b
  if cfg.grpo.dynamic_sampling:  # informative groups first, then fillers that carry no loss
    ranked = sorted(((not ok, k, i) for k, r in enumerate(rounds)
                     for i, ok in enumerate(r.informative)))[:b]
    chosen = [(rounds[k], i) for _, k, i in ranked]
    trained = [not dropped for dropped, _, _ in ranked]
  host, rewards = assemble(chosen, g, trained, setup.tokenizer.pad_id,
                           cfg.grpo.mask_truncated_completions)
  guided = guide(setup, chosen, trained, host, rewards) if cfg.grpo.guidance else None
  return Rollout(host, rewards, rounds, chosen, trained, guided)


def guide(setup, chosen: list, trained: list[bool], host: dict, rewards: np.ndarray
          ) -> np.ndarray:
  """`grpo.guidance`, in place on `assemble`'s `host` and `rewards`: in each trained group whose
  best sample scores below its record's written `response` (of guidance_categories, within
  rollout.max_new_tokens with its stop token), the lowest-scoring sample becomes that response,
  scored by the run's rewards. Its sampler log-probs are 0: an on-policy loss never reads them
  (pi_old is pi_theta's, stop-gradient) and grpo.sampler_is must be off. [B] bool: the groups
  guided. The rollout's metrics stay those of the samples."""
  cfg, g, tok = setup.cfg, setup.cfg.rollout.num_generations, setup.tokenizer
  cats, n = cfg.grpo.guidance_categories, host["completion"].shape[1]
  stop = examples.stop_id(cfg.data.template, tok)
  picks = []
  for j, (r, i) in enumerate(chosen):
    rec = r.records[i]
    if trained[j] and rec.get("response") and (cats is None or rec.get("category") in cats):
      ids = [*tok.encode(rec["response"]), stop]
      if len(ids) <= n:
        picks.append((j, rec, ids))
  guided = np.zeros(len(chosen), bool)
  if not picks:
    return guided
  recs = [rec for _, rec, _ in picks]
  total, _ = score(setup, [prompts_lib.render_record(cfg.data.template, r) for r in recs],
                   [r["response"] for r in recs], recs, 1,
                   np.asarray([len(ids) for *_, ids in picks]))
  for (j, _, ids), t in zip(picks, total):
    group = rewards[j * g:(j + 1) * g]
    if t > group.max():
      k = j * g + int(np.argmin(group))
      host["completion"][k] = tok.pad_id
      host["completion"][k, :len(ids)] = ids
      host["completion_mask"][k] = np.arange(n) < len(ids)
      host["sampler_logp"][k] = 0.0
      rewards[k], guided[j] = t, True
  return guided


def assemble(chosen: list, g: int, trained: list[bool], pad_id: int,
             mask_truncated: bool) -> tuple[dict, np.ndarray]:
  """Host arrays of (round, group) picks, prompts left-padded to the widest round's width, and
  the rows' rewards. `trained[j]` False (dynamic sampling's fillers) masks group j's loss out,
  as `mask_truncated` masks rows that never stopped."""
  width = max(r.prompt.shape[1] for r, _ in chosen)
  pad = lambda x, v: np.concatenate([np.full((x.shape[0], width - x.shape[1]), v, x.dtype), x],
                                    axis=1)
  rows = lambda x, i: x[i * g:(i + 1) * g]
  cat = lambda f: np.concatenate([rows(f(r), i) for r, i in chosen])
  keep = np.repeat(np.asarray(trained, bool), g)
  if mask_truncated:
    keep = keep & cat(lambda r: r.comps.stopped)
  logp = cat(lambda r: r.comps.logprobs).astype(np.float32)
  host = {"prompt": np.stack([pad(r.prompt, pad_id)[i] for r, i in chosen]).astype(np.int32),
          "prompt_valid": np.stack([pad(r.prompt_valid, False)[i] for r, i in chosen]),
          "completion": cat(lambda r: r.comps.tokens).astype(np.int32),
          "completion_mask": cat(lambda r: r.comps.mask) & keep[:, None],
          "sampler_logp": logp}
  return host, cat(lambda r: r.total)


def metrics(rollout: Rollout) -> dict:
  """Rewards and lengths over every completion drawn this step; how many groups carried a
  gradient; timings and tokens."""
  rounds = rollout.rounds
  cat = lambda f: np.concatenate([f(r) for r in rounds])
  total = cat(lambda r: r.total)
  per_fn = {k: cat(lambda r: r.per_fn[k]) for k in rounds[0].per_fn}
  lengths = cat(lambda r: r.comps.mask.sum(1))
  stopped = cat(lambda r: r.comps.stopped)
  zero_std = cat(lambda r: ~r.informative)
  seconds = sum(r.seconds for r in rounds)
  scored = {k: v[~np.isnan(v)] for k, v in per_fn.items()}  # each reward over the rows it scores
  return {"reward/mean": float(total.mean()), "reward/std": float(total.std()),
          **{f"reward/{k}": float(v.mean()) for k, v in scored.items() if v.size},
          **{f"reward_std/{k}": float(v.std()) for k, v in scored.items() if v.size},
          "accuracy": builtin.nan_mean(cat(lambda r: r.correct)),  # rows with a reference
          "format_rate": float(cat(lambda r: r.formatted).mean()),
          "completion_length": float(lengths.mean()),
          "completion_length/min": float(lengths.min()),
          "completion_length/max": float(lengths.max()),
          "completion_length/stopped": float(lengths[stopped].mean()) if stopped.any() else 0.0,
          "truncated_rate": float(1.0 - stopped.mean()),
          "frac_reward_zero_std": float(zero_std.mean()),
          "groups_drawn": len(zero_std), "groups_trained": sum(rollout.trained),
          "refill_rounds": len(rounds) - 1, "rollout_tokens": int(lengths.sum()),
          **({} if rollout.guided is None else {"guided_groups": int(rollout.guided.sum())}),
          "rollout_tokens_per_s": float(lengths.sum() / seconds), "rollout_s": seconds,
          "reward_s": sum(r.reward_seconds for r in rounds),
          **by_category(per_fn, cat(lambda r: np.repeat(
              [x.get("category") or "" for x in r.records], len(r.total) // len(r.records))))}


def by_category(per_fn: dict[str, np.ndarray], categories: np.ndarray) -> dict[str, float]:
  """`reward/<fn>/<category>`: each reward's mean over the rows of each category it scores (a
  judge's rubric scores, category by category)."""
  out = {}
  for c in sorted(set(categories) - {""}):
    for k, v in per_fn.items():
      v = v[(categories == c) & ~np.isnan(v)]
      if v.size:
        out[f"reward/{k}/{c}"] = float(v.mean())
  return out


def observe(data, step: int, rounds: list[Groups]) -> dict[str, float]:
  """Tells the records' iterator (a curriculum's, `data.curriculum`) how step `step`'s prompts
  fared: each round's records and their rewards [B, G]; its metrics for the step's log."""
  if not hasattr(data, "observe"):
    return {}
  data.observe(step, [(r.records, r.total.reshape(len(r.records), -1)) for r in rounds])
  return data.metrics()


def tokens(rollout: Rollout, g: int) -> int:
  """Prompt and completion tokens drawn (a prompt counted for each of its G rows)."""
  return int(sum(r.prompt_valid.sum() * g + r.comps.mask.sum() for r in rollout.rounds))


def samples(rollout: Rollout, g: int) -> list[dict]:
  """Each trained group's first completion, for samples.jsonl."""
  return [{"question": r.records[i]["question"], "completion": r.comps.texts[i * g],
           "reward": float(r.total[i * g])} for r, i in rollout.chosen]
