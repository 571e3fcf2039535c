"""On-policy distillation (Agarwal et al. 2024, GKD; Lu and Thinking Machines 2025): the student
(the policy) samples, a teacher scores every sampled token, and the per-token reverse KL

    A_t = kl_coef * (log pi_teacher(y_t) - log pi_student(y_t))   [+ reward_weight * A_group]

is each token's advantage in GRPO's clipped objective (`objectives.grpo`; in one pass the ratio
is 1, so the gradient is -A_t grad log pi_student(y_t), token-mean; `grpo.num_iterations` > 1
takes mu clipped passes on each rollout, pi_old from the trainer's own forward, as GRPO does). A
sampled token the teacher finds likelier than the student is pushed up, one it finds unlikely
down: a dense signal where a reward says one number a completion. The student's log-probs are
the sampler's (of the distribution it drew from); the teacher's come from one batched forward
over prompt + completion on its own devices (`engine.teacher`), at the same temperature. With
`distill.reward_weight` > 0 the run's rewards add their group advantage to every token of a row.

Logged: distill/reverse_kl (the token mean of log pi_student - log pi_teacher, the quantity
minimised), distill/teacher_logp, teacher_s (its forward's seconds), and the rollouts' rewards
as GRPO logs them.

With `distill.topk` = k the teacher also returns its k likeliest tokens at every sampled
position, and the loss adds topk_coef x the cross-entropy of the student's distribution against
them (renormalised over the k; GKD's forward KL on the student's own prefixes, Agarwal et al.
2024), aggregated as the policy loss is, through the same fused head (`heads.fused_token_loss`'s
soft targets): every position is taught the teacher's preferences over its likely tokens, not
only the one the student happened to draw. 2k numbers a token cross from the teacher. Logged:
distill/topk_mass, the teacher's probability the k tokens hold.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from reasoner.engine import metrics as metrics_lib, rollout as rollout_lib, teacher as teacher_lib
from reasoner.engine.trainer import Stage
from reasoner.objectives import grpo


def token_advantages(student: np.ndarray, teacher: np.ndarray, mask: np.ndarray,
                     rewards: np.ndarray, g: int, kl_coef: float, reward_weight: float,
                     scale_rewards: bool = True, ddof: int = 0) -> np.ndarray:
  """[R, N] advantages: kl_coef (teacher - student) on the sampled tokens, plus reward_weight
  times each row's group advantage of `rewards` [R] (G rows a group); 0 off the mask."""
  adv = kl_coef * (teacher - student)
  if reward_weight:
    group = np.asarray(grpo.group_advantages(jnp.asarray(rewards), g, scale_rewards, ddof=ddof))
    adv = adv + reward_weight * group[:, None]
  return np.where(mask, adv, 0.0).astype(np.float32)


def soft_targets(logq: np.ndarray, ids: np.ndarray, mask: np.ndarray, coef: float) -> dict:
  """The batch's soft targets from a teacher's top-k [R, N, k]: its probabilities renormalised
  over the k, times `coef`, 0 off the mask (the trainer weights them as the policy loss)."""
  q = np.exp(logq - logq.max(-1, keepdims=True))
  q = coef * q / q.sum(-1, keepdims=True) * mask[..., None]
  return {"soft_ids": ids.astype(np.int32), "soft_q": q.astype(np.float32)}


def draw(setup, sampler, lora, data, step: int, key: jax.Array) -> tuple:
  """G samples of the next prompts by the student (`lora`), the teacher's log-probs of their
  tokens (and its top-k), the per-token advantages: (the rollout, soft targets, metrics)."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  groups = rollout_lib.sample_round(setup, sampler, lora, next(data), key)
  curriculum = rollout_lib.observe(data, step, [groups])
  b = len(groups.records)
  chosen, trained = [(groups, i) for i in range(b)], [True] * b
  host, rewards = rollout_lib.assemble(chosen, g, trained, setup.tokenizer.pad_id,
                                       cfg.grpo.mask_truncated_completions)
  t1 = time.perf_counter()
  comps = groups.comps  # the teacher scores every sampled token, masked or not
  batch_in = (host["prompt"], host["prompt_valid"], comps.tokens, comps.mask)
  soft, extra = {}, {}
  if cfg.distill.topk:  # one forward: the sampled tokens' log-probs and the top-k
    teacher, logq, ids = setup.teacher.topk(*batch_in, cfg.distill.topk)
    soft = soft_targets(logq, ids, host["completion_mask"], cfg.distill.topk_coef)
    extra["distill/topk_mass"] = float((np.exp(logq).sum(-1) * comps.mask).sum() /
                                       comps.mask.sum())
  else:
    teacher = setup.teacher.logprobs(*batch_in)
  teacher_s = time.perf_counter() - t1
  student, mask = host["sampler_logp"], host["completion_mask"]
  adv = token_advantages(student, teacher, mask, rewards, g, cfg.distill.kl_coef,
                         cfg.distill.reward_weight, cfg.grpo.scale_rewards,
                         1 if cfg.grpo.advantage_std == "sample" else 0)
  r = rollout_lib.Rollout(host, rewards, [groups], chosen, trained)
  on = comps.mask
  return r, adv, soft, {
      **rollout_lib.metrics(r), **curriculum,
      "distill/reverse_kl": float(((comps.logprobs - teacher) * on).sum() / on.sum()),
      "distill/teacher_logp": float((teacher * on).sum() / on.sum()), **extra,
      "teacher_s": teacher_s, "tokens": rollout_lib.tokens(r, g),
      "samples": rollout_lib.samples(r, g)}


def learn(setup, trainer: grpo.GRPOTrainer, state, drawn: tuple, step: int) -> tuple:
  """One update (mu passes) on a drawn rollout's per-token advantages: (state, metrics)."""
  r, adv, soft, metrics = drawn
  batch = grpo.batch_from_rollout(setup, trainer, state.lora, r, advantages=adv, **soft)
  state, pending = grpo.passes(setup, trainer, state, batch)
  return state, {**metrics, **grpo.settled(pending, step)}


def distill_step(setup, sampler, trainer: grpo.GRPOTrainer, state, data, step: int):
  """G samples of the next prompts by the student, the teacher's log-probs of their tokens, one
  update on the per-token advantages: (state, metrics)."""
  t0 = time.perf_counter()
  drawn = draw(setup, sampler, state.lora, data, step, jax.random.fold_in(state.key, step))
  state, metrics = learn(setup, trainer, state, drawn, step)
  return state, metrics_lib.timed(metrics, time.perf_counter() - t0)


def check(cfg, records: list[dict], where: str) -> None:
  """The teacher (`distill.*`), before any model loads (`engine.teacher.check`)."""
  teacher_lib.check(cfg)


STAGE = Stage("distill", grpo.GRPOTrainer, grpo.STAGE.batches, distill_step, check,
              needs_teacher=True, draw=draw, learn=learn)
