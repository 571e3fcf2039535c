"""GRPO: group-normalised advantages and the clipped policy objective as pure functions, then
the stage: its batch, its train step (`GRPOTrainer`) and one step of the loop (`grpo_step`:
rollout, rewards, advantages, the update).

The variant: GRPO (Shao et al. 2024) with DAPO's asymmetric clipping (epsilon_low,
epsilon_high), a KL estimator to the reference policy weighted by beta (beta = 0, the default,
drops the KL and the reference forward, as DAPO and Dr. GRPO do), and mu >= 1 optimisation
passes per rollout batch. With mu = 1 the old policy is the current one, stop-gradient (the
ratio is exactly 1 and clipping never binds, as in Tunix and TRL); with mu > 1 it is the
trainer's own forward at the start of the step.

Options (`Objective`, from `config.GRPOConfig`):
- importance sampling per token (GRPO) or per sequence (GSPO, Zheng et al. 2025): the ratio of
  a row is exp(mean over its tokens of (logp - old)), its gradient each token's ("GSPO-token",
  Tunix's `gspo-token`); the same as GRPO's on the first pass.
- the KL estimator: k3 = exp(ref - logp) - (ref - logp) - 1 (Tunix's `low_var_kl`; default:
  non-negative, low variance) or k1 = logp - ref (Tunix's `kl`).
- truncated importance sampling of the sampler (Yao et al. 2025, Tunix's `sampler_is_weights`):
  each token's policy loss times min(pi_old / pi_sampler, cap), for when the sampler's numerics
  drift from the trainer's (bf16 rollouts, other kernels).

Advantages: A_i = (r_i - mean_group(r)) / (std_group(r) + eps), std over the group as a
population (default: each group's advantages then have unit mean square whatever G) or as a
sample (ddof 1, as Tunix and TRL do); `scale_rewards=False` keeps only the centring
(Dr. GRPO), which avoids up-weighting groups whose rewards barely differ.

Normalisation (`loss_agg`), with Tunix's names and meanings (rows with no completion token, e.g.
masked as truncated, count in none):
- "token-mean": sum over all completion tokens / their count (DAPO). Our default.
- "sequence-mean-token-mean": mean over rows of each row's token mean (original GRPO); biases
  towards short correct and long wrong answers.
- "sequence-mean-token-scale": sum over tokens / (rows * max_new_tokens) (Dr. GRPO): a constant
  normaliser, unbiased in length.
- "sequence-mean-token-sum-norm": sum over tokens / rows.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reasoner import mesh as mesh_lib
from reasoner.config import Config
from reasoner.data import curriculum, sources
from reasoner.engine import metrics as metrics_lib, rollout as rollout_lib
from reasoner.engine.sampler import logprob_temperature
from reasoner.engine.trainer import Stage, Trainer, TrainState, check_finite
from reasoner.models import lora as lora_lib

LOSS_AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
                     "sequence-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class Objective:
  """The per-token loss's static settings (hashable: part of the jitted step)."""

  epsilon_low: float = 0.2
  epsilon_high: float = 0.28
  beta: float = 0.0
  kl: str = "k3"  # k3 | k1
  sequence: bool = False  # GSPO's sequence-level ratio
  on_policy: bool = True  # pi_old = stop_gradient(pi_theta): one pass per rollout batch
  sampler_is_cap: float | None = None  # truncated importance sampling of the sampler

  @classmethod
  def from_config(cls, g) -> "Objective":
    """From a `config.GRPOConfig`."""
    return cls(epsilon_low=g.epsilon_low, epsilon_high=g.epsilon_high, beta=g.beta,
               kl=g.kl_estimator, sequence=g.importance_sampling == "sequence",
               on_policy=g.num_iterations == 1,
               sampler_is_cap=g.sampler_is_cap if g.sampler_is == "token" else None)


def group_advantages(rewards: jax.Array, group_size: int, scale: bool = True,
                     eps: float = 1e-4, ddof: int = 0) -> jax.Array:
  """[B * G] rewards (rows grouped by prompt) -> [B * G] advantages; `ddof` 1: sample std."""
  r = rewards.reshape(-1, group_size)
  centred = r - r.mean(axis=1, keepdims=True)
  if scale:
    centred = centred / (r.std(axis=1, keepdims=True, ddof=ddof) + eps)
  return centred.reshape(-1)


def token_weights(mask: jax.Array, how: str) -> jax.Array:
  """[R, N] weights w such that sum(w * x) is the `loss_agg` aggregation of per-token values x:
  every aggregation is linear in them, which is what lets the fused head take the loss's
  gradient in its forward pass (`heads.fused_token_loss`)."""
  m = mask.astype(jnp.float32)
  lengths = jnp.sum(m, axis=1, keepdims=True)
  rows = jnp.maximum(jnp.sum(lengths > 0), 1).astype(jnp.float32)
  if how == "token-mean":
    return m / jnp.maximum(jnp.sum(m), 1.0)
  if how == "sequence-mean-token-mean":
    return m / (jnp.maximum(lengths, 1.0) * rows)
  if how == "sequence-mean-token-scale":
    return m / (rows * m.shape[1])
  if how == "sequence-mean-token-sum-norm":
    return m / rows
  raise ValueError(f"unknown loss aggregation {how!r}")


def sequence_log_ratio(logp, old_logp, mask) -> jax.Array:
  """[R, N] -> [R]: each row's mean of logp - old over its tokens (GSPO's log-ratio)."""
  m = mask.astype(jnp.float32)
  return jnp.sum((logp - old_logp) * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def _old(logp, old_logp, obj: Objective):
  return jax.lax.stop_gradient(logp) if obj.on_policy else old_logp


def _surrogates(logp, old_logp, advantages, seq_log_ratio, obj: Objective):
  """(r A, clip(r, 1 - eps_low, 1 + eps_high) A): r per token, or GSPO's per sequence (its
  value the row's, its gradient the token's)."""
  if obj.sequence:
    log_ratio = logp - jax.lax.stop_gradient(logp) + seq_log_ratio
  else:
    log_ratio = logp - _old(logp, old_logp, obj)
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - obj.epsilon_low, 1.0 + obj.epsilon_high)
  return ratio * advantages, clipped * advantages


def kl_estimate(logp, ref_logp, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from the sampled token: k3 or k1."""
  delta = ref_logp - logp
  if estimator == "k1":
    return -delta
  return jnp.exp(delta) - delta - 1.0


def sampler_is_weight(logp, old_logp, sampler_logp, obj: Objective) -> jax.Array:
  """min(pi_old / pi_sampler, cap) per token, stop-gradient (1 when the option is off)."""
  if obj.sampler_is_cap is None:
    return jnp.ones_like(logp)
  old = jax.lax.stop_gradient(_old(logp, old_logp, obj))
  return jnp.minimum(jnp.exp(old - sampler_logp), obj.sampler_is_cap)


def token_loss(
    logp: jax.Array,  # [...] log pi_theta(token)
    old_logp: jax.Array,  # [...] log pi_old (unused on-policy)
    ref_logp: jax.Array,  # [...] log pi_ref (unused when beta == 0)
    advantages: jax.Array,  # [...] A of each token's row, broadcast to logp's shape
    sampler_logp: jax.Array,  # [...] the sampler's log-prob (for the sampler IS weight)
    seq_log_ratio: jax.Array,  # [...] GSPO's row log-ratio, stop-gradient (unused otherwise)
    *,
    obj: Objective,
) -> jax.Array:
  """Per-token loss, elementwise: -min(r A, clip(r) A) w + beta KL, with w the sampler IS
  weight (1 when off)."""
  unclipped, clipped = _surrogates(logp, old_logp, advantages, seq_log_ratio, obj)
  per_token = -jnp.minimum(unclipped, clipped) * sampler_is_weight(logp, old_logp,
                                                                  sampler_logp, obj)
  if obj.beta > 0:
    per_token = per_token + obj.beta * kl_estimate(logp, ref_logp, obj.kl)
  return per_token


def policy_metrics(logp, old_logp, ref_logp, advantages, mask, sampler_logp, seq_log_ratio, *,
                   obj: Objective) -> dict[str, jax.Array]:
  """Token means of where clipping binds, of the KL (beta > 0) and of the sampler IS weight
  (when on), and the sampler-trainer mismatch |log pi_old - log pi_sampler| (mean, max);
  [R, N] inputs, [R] seq_log_ratio, advantages [R] or per token [R, N] (distillation's)."""
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
  unclipped, clipped = _surrogates(logp, old_logp, adv, seq_log_ratio[:, None], obj)
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  mean = lambda x: jnp.sum(x * m) / n
  gap = jnp.abs(_old(logp, old_logp, obj) - sampler_logp)
  metrics = {"clip_fraction": mean(clipped < unclipped),  # clipping binds
             "sampler_mismatch_mean": mean(gap),
             "sampler_mismatch_max": jnp.max(jnp.where(mask, gap, 0.0))}
  if obj.beta > 0:
    metrics["kl"] = mean(kl_estimate(logp, ref_logp, obj.kl))
  if obj.sampler_is_cap is not None:
    metrics["sampler_is_weight"] = mean(sampler_is_weight(logp, old_logp, sampler_logp, obj))
  return metrics


def policy_loss(
    logp: jax.Array,  # [R, N] log pi_theta(token)
    old_logp: jax.Array,  # [R, N] log pi_old (unused on-policy)
    ref_logp: jax.Array | None,  # [R, N] log pi_ref, or None when beta == 0
    advantages: jax.Array,  # [R]
    mask: jax.Array,  # [R, N] completion tokens
    *,
    obj: Objective,
    loss_agg: str,
    sampler_logp: jax.Array | None = None,  # [R, N]; default old_logp
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The clipped surrogate, negated for minimisation, plus beta * KL(pi_theta || pi_ref).

  The dense form of what the trainer computes with `heads.fused_token_loss`: the same
  `token_loss`, aggregated with the same `token_weights`; GSPO's row ratio from `logp` itself
  (the trainer takes it from a forward pass before the fused one)."""
  ref = jnp.zeros_like(logp) if ref_logp is None else ref_logp
  sampler = old_logp if sampler_logp is None else sampler_logp
  seq = jax.lax.stop_gradient(sequence_log_ratio(logp, _old(logp, old_logp, obj), mask))
  row = lambda x: jnp.broadcast_to(x[:, None], logp.shape)
  per_token = token_loss(logp, old_logp, ref, row(advantages), sampler, row(seq), obj=obj)
  metrics = policy_metrics(logp, old_logp, ref, advantages, mask, sampler, seq, obj=obj)
  return jnp.sum(token_weights(mask, loss_agg) * per_token), metrics


# ------------------------------------------------------------------------------- the stage

class Batch(NamedTuple):
  prompt: jax.Array  # [B, P] left-padded prompts (each shared by its G rows)
  prompt_valid: jax.Array  # [B, P]
  completion: jax.Array  # [B * G, N] sampled tokens, rows grouped by prompt
  completion_mask: jax.Array  # [B * G, N] tokens the loss sees
  advantages: jax.Array  # [B * G], or [B * G, N] a token (distillation's)
  old_logp: jax.Array  # [B * G, N] pi_old by the trainer (mu > 1; unused when mu == 1)
  ref_logp: jax.Array  # [B * G, N] reference log-probs (zeros when beta == 0)
  sampler_logp: jax.Array  # [B * G, N] the sampler's log-probs of its tokens
  # distillation's soft targets (`distill.topk`): a teacher's top-k ids [B * G, N, k] and their
  # probabilities times distill.topk_coef [B * G, N, k]; None elsewhere
  soft_ids: jax.Array | None = None
  soft_q: jax.Array | None = None


class GRPOTrainer(Trainer):
  """`Trainer` with GRPO's objective (`token_loss`, aggregated by `token_weights`)."""

  def __init__(self, graphdef, base, grpo, optim, **kw):
    self.grpo, self.obj = grpo, Objective.from_config(grpo)
    super().__init__(graphdef, base, optim, **kw)

  @classmethod
  def for_run(cls, graphdef, base, cfg: Config, **overrides) -> "GRPOTrainer":
    """The run's trainer; `overrides` replace keyword settings (the planner's `micro_batch`)."""
    kw = dict(schedule_steps=cfg.train.steps * cfg.grpo.num_iterations,
              head_chunk=cfg.train.head_chunk, micro_batch=cfg.train.micro_batch,
              temperature=logprob_temperature(cfg))
    return cls(graphdef, base, cfg.grpo, cfg.optim, **{**kw, **overrides})

  def abstract_inputs(self, lora, prompts: int, g: int, prompt_len: int,
                      new_tokens: int, soft_k: int = 0) -> tuple:
    """(base, state, batch) of `step` as ShapeDtypeStructs placed as a run places them, for
    `prompts` x `g` rows of `prompt_len` + `new_tokens` tokens (with a teacher's top-`soft_k`
    soft targets: distillation's `distill.topk`)."""
    rows = prompts * g
    s = lambda shape, dtype: mesh_lib.batch_struct(self.mesh, shape, dtype)
    f = lambda: s((rows, new_tokens), jnp.float32)
    soft = ((s((rows, new_tokens, soft_k), jnp.int32), s((rows, new_tokens, soft_k), jnp.float32))
            if soft_k else (None, None))
    batch = Batch(s((prompts, prompt_len), jnp.int32), s((prompts, prompt_len), jnp.bool_),
                  s((rows, new_tokens), jnp.int32), s((rows, new_tokens), jnp.bool_),
                  s((rows,), jnp.float32), f(), f(), f(), *soft)
    return self.base, self.abstract_state(lora), batch

  def _grads(self, base, lora, batch: Batch, weights: jax.Array, seq_log_ratio: jax.Array):
    """((loss, LoRA gradients), (log-probs, entropy)) of one (micro-)batch; `weights` [R, N]
    hold the whole batch's loss normalisation (`token_weights`), so losses and gradients of
    micro-batches add up to the batch's; `seq_log_ratio` [R] is GSPO's (else zeros)."""
    row = lambda x: jnp.broadcast_to(x[:, None] if x.ndim == 1 else x, batch.old_logp.shape)
    soft = None if batch.soft_ids is None else (batch.soft_ids, batch.soft_q * weights[..., None])
    return self.token_loss_grads(
        base, lora, *batch[:4], weights, functools.partial(token_loss, obj=self.obj),
        (batch.old_logp, batch.ref_logp, row(batch.advantages), batch.sampler_logp,
         row(seq_log_ratio)), soft=soft)

  def _train_step(self, base, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    mask = batch.completion_mask
    weights = token_weights(mask, self.grpo.loss_agg)  # the whole batch's
    seq = jnp.zeros(batch.advantages.shape[:1], jnp.float32)
    if self.obj.sequence and not self.obj.on_policy:  # GSPO's row ratios need logp first
      now = self._completion_logprobs(base, state.lora, *batch[:4])
      seq = sequence_log_ratio(now, batch.old_logp, mask)
    like = (jnp.zeros((), jnp.float32), state.lora)
    (loss, grads), (logp, entropy) = self._in_micro_batches(
        lambda params, micro: self._grads(*params, *micro), (base, state.lora),
        (batch, weights, seq), like)
    state, metrics = self.apply(state, loss, grads)
    m = mask.astype(jnp.float32)
    return state, {**metrics, "entropy": jnp.sum(entropy * m) / jnp.maximum(jnp.sum(m), 1.0),
                   **policy_metrics(logp, batch.old_logp, batch.ref_logp, batch.advantages,
                                    mask, batch.sampler_logp, seq, obj=self.obj)}


def batch_from_rollout(setup, trainer: GRPOTrainer, lora, r: rollout_lib.Rollout,
                       advantages: np.ndarray | None = None, early: dict | None = None,
                       **extra: np.ndarray) -> Batch:
  """The rollout's groups with their advantages (the rewards' group advantages, or per-token
  `advantages` [R, N]: distillation's) and `extra` host arrays (Batch fields: distillation's
  soft targets), placed on the mesh, with `forwards`' log-probs: those `early` holds
  (`early_forwards`', dispatched before the rollout was scored) where the batch is its first
  round in order, else dispatched now."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  adv = advantages if advantages is not None else np.asarray(group_advantages(
      jnp.asarray(r.rewards), g, cfg.grpo.scale_rewards,
      ddof=1 if cfg.grpo.advantage_std == "sample" else 0))
  host = {**r.host, "advantages": adv.astype(np.float32), "old_logp": r.host["sampler_logp"],
          **extra}
  batch = {k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()}
  in_order = lambda: all(g is r.rounds[0] and j == i for i, (g, j) in enumerate(r.chosen))
  done = early if early and in_order() else forwards(setup, trainer, lora, batch)
  batch["old_logp"] = done.get("old_logp", batch["old_logp"])
  batch["ref_logp"] = done.get("ref_logp", jnp.zeros_like(batch["old_logp"]))
  return Batch(**batch)


def forwards(setup, trainer: GRPOTrainer, lora, batch: dict) -> dict:
  """The log-prob forwards of `batch`'s completions that a step needs, dispatched: pi_old's
  (mu > 1: `lora`'s) and the reference's (beta > 0: the base under the LoRA the run started
  from, `setup.reference`, or under none)."""
  cfg, out = setup.cfg, {}
  fwd = lambda lora: trainer.logprobs(lora, batch["prompt"], batch["prompt_valid"],
                                      batch["completion"], batch["completion_mask"])
  if cfg.grpo.num_iterations > 1:
    out["old_logp"] = fwd(lora)
  if cfg.grpo.beta > 0:
    out["ref_logp"] = fwd(setup.reference if setup.reference is not None
                          else lora_lib.zeros_like(lora))
  return out


def early_forwards(setup, trainer: GRPOTrainer, lora) -> tuple[Callable | None, dict]:
  """(`Sampler.sample`'s `then`, the dict it fills): `forwards` dispatched as soon as the first
  round's tokens reach the host, so that the chips run them while the host detokenises and
  scores. They need the tokens alone; a row that the batch then masks out (a truncated one, with
  `grpo.mask_truncated_completions`) gets log-probs that no loss reads. None where there is
  nothing to run, with dynamic sampling (which may reorder the batch) or with guidance (which
  may replace a row after scoring)."""
  cfg, out = setup.cfg, {}
  if (cfg.grpo.dynamic_sampling or cfg.grpo.guidance
      or (cfg.grpo.beta <= 0 and cfg.grpo.num_iterations == 1)):
    return None, out

  def then(prompt, prompt_valid, completion, completion_mask):
    host = {"prompt": prompt.astype(np.int32), "prompt_valid": prompt_valid,
            "completion": completion.astype(np.int32), "completion_mask": completion_mask}
    out.update(forwards(setup, trainer, lora,
                        {k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()}))
  return then, out


def rollout(setup, sampler, trainer: GRPOTrainer, lora, records: list[dict], key: jax.Array,
            draw=None, observe=None) -> tuple[Batch, dict]:
  """G completions per prompt of `records` sampled, scored and turned into the training batch
  (`draw()`: more records, for dynamic sampling; `observe(rollout)`: a curriculum's), and the
  rollout's metrics, with "tokens" drawn and "samples" (a completion a group)."""
  r = rollout_lib.draw(setup, sampler, lora, records, key, more=draw)
  g = setup.cfg.rollout.num_generations
  return batch_from_rollout(setup, trainer, lora, r), {
      **rollout_lib.metrics(r), **(observe(r) if observe is not None else {}),
      "tokens": rollout_lib.tokens(r, g), "samples": rollout_lib.samples(r, g)}


def draw(setup, sampler, lora, data, step: int, key: jax.Array) -> tuple:
  """Step `step`'s groups: the next batch of `data` (drawn again by dynamic sampling) sampled
  with `lora` and scored: (the rollout, its metrics on the host)."""
  r = rollout_lib.draw(setup, sampler, lora, next(data), key, more=lambda: next(data))
  return r, drawn_metrics(setup, data, step, r)


def drawn_metrics(setup, data, step: int, r: rollout_lib.Rollout) -> dict:
  """A rollout's metrics, "tokens" and "samples" (a curriculum observes its groups)."""
  g = setup.cfg.rollout.num_generations
  return {**rollout_lib.metrics(r), **rollout_lib.observe(data, step, r.rounds),
          "tokens": rollout_lib.tokens(r, g), "samples": rollout_lib.samples(r, g)}


def learn(setup, trainer: GRPOTrainer, state, drawn: tuple, step: int) -> tuple:
  """mu optimisation passes on a drawn rollout (`draw`'s), pi_old and the reference by the
  current LoRA: (state, metrics)."""
  r, metrics = drawn
  state, pending = passes(setup, trainer, state, batch_from_rollout(setup, trainer, state.lora, r))
  return state, {**metrics, **settled(pending, step)}


def grpo_step(setup, sampler, trainer: GRPOTrainer, state, data, step: int):
  """Rollout of the next batch of `data` with the live LoRA, then mu optimisation passes on it:
  (state, metrics). The host's work hides behind the chips where it can: the log-prob forwards
  run while the rollout is detokenised and scored (`early_forwards`), and the next rollout's
  LoRA is moved and the rollout's metrics taken while the passes run."""
  t0 = time.perf_counter()
  then, early = early_forwards(setup, trainer, state.lora)
  r = rollout_lib.draw(setup, sampler, state.lora, next(data),
                       jax.random.fold_in(state.key, step), more=lambda: next(data), then=then)
  state, pending = passes(setup, trainer, state,
                          batch_from_rollout(setup, trainer, state.lora, r, early=early))
  sampler.move_ahead(state.lora)  # the next rollout's LoRA, moved after this update
  metrics = {**drawn_metrics(setup, data, step, r), **settled(pending, step)}
  return state, metrics_lib.timed(metrics, time.perf_counter() - t0)


def passes(setup, trainer: GRPOTrainer, state, batch: Batch) -> tuple:
  """mu (`grpo.num_iterations`) optimisation passes on one rollout batch, dispatched: (state,
  the last pass's metrics, on the chips until `settled`)."""
  for _ in range(setup.cfg.grpo.num_iterations):
    state, metrics = trainer.train_step(state, batch)
  return state, metrics


def settled(metrics: dict, step: int) -> dict:
  """A step's metrics on the host as floats, its loss checked finite."""
  metrics = jax.device_get(metrics)
  check_finite(float(metrics["loss"]), step)
  return {k: float(v) for k, v in metrics.items()}


def _batches(setup, log=None):
  """The records' batches: the grain pipeline over the training records, or a curriculum
  (`data.curriculum`); their state checkpointed."""
  cfg = setup.cfg
  if cfg.data.curriculum is not None:
    return curriculum.Curriculum(setup.train_records, cfg.train.batch_size, cfg.train.seed,
                                 cfg.data)
  return sources.train_iterator(setup.train_records, setup.cfg.train.batch_size,
                                setup.cfg.train.seed, mixture=setup.cfg.data.mixture)


STAGE = Stage("grpo", GRPOTrainer, _batches, grpo_step, draw=draw, learn=learn)
