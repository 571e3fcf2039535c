"""GRPO: group-normalised advantages and the clipped policy objective, as pure functions.

The variant: GRPO (Shao et al. 2024) with DAPO's asymmetric clipping (epsilon_low,
epsilon_high), the k3 KL estimator to the reference policy weighted by beta (beta = 0, the
default, drops the KL and the reference forward, as DAPO and Dr. GRPO do), and mu >= 1
optimisation passes per rollout batch against the rollout policy's log-probs.

Advantages: A_i = (r_i - mean_group(r)) / (std_group(r) + eps); `scale_rewards=False` keeps only
the centring (Dr. GRPO), which avoids up-weighting groups whose rewards barely differ.

Normalisation (`loss_agg`):
- "token-mean": sum over all completion tokens / their count (DAPO). Every token weighs the
  same, so long completions are not diluted. Our default.
- "sequence-mean-token-mean": mean over sequences of each sequence's token mean (original GRPO);
  biases towards short correct and long wrong answers.
- "sequence-mean-token-sum-norm": sum over tokens / (rows * max_new_tokens) (Dr. GRPO); a
  constant normaliser, unbiased in length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_size: int, scale: bool = True,
                     eps: float = 1e-4) -> jax.Array:
  """[B * G] rewards (rows grouped by prompt) -> [B * G] advantages."""
  r = rewards.reshape(-1, group_size)
  centred = r - r.mean(axis=1, keepdims=True)
  if scale:
    centred = centred / (r.std(axis=1, keepdims=True) + eps)
  return centred.reshape(-1)


def aggregate(per_token: jax.Array, mask: jax.Array, how: str) -> jax.Array:
  """[R, N] per-token values -> scalar, per `loss_agg`."""
  m = mask.astype(per_token.dtype)
  if how == "token-mean":
    return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)
  if how == "sequence-mean-token-mean":
    seq = jnp.sum(per_token * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return jnp.mean(seq)
  if how == "sequence-mean-token-sum-norm":
    return jnp.sum(per_token * m) / (per_token.shape[0] * per_token.shape[1])
  raise ValueError(f"unknown loss aggregation {how!r}")


def policy_loss(
    logp: jax.Array,  # [R, N] log pi_theta(token)
    old_logp: jax.Array,  # [R, N] log pi_old (the rollout policy)
    ref_logp: jax.Array | None,  # [R, N] log pi_ref, or None when beta == 0
    advantages: jax.Array,  # [R]
    mask: jax.Array,  # [R, N] completion tokens
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    loss_agg: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The clipped surrogate, negated for minimisation, plus beta * KL(pi_theta || pi_ref)."""
  ratio = jnp.exp(logp - old_logp)
  adv = advantages[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  metrics = {"clip_fraction": jnp.sum((clipped < unclipped) * m) / n}  # clipping binds
  if beta > 0:
    delta = ref_logp - logp
    kl = jnp.exp(delta) - delta - 1.0  # k3: unbiased, non-negative
    per_token = per_token + beta * kl
    metrics["kl"] = jnp.sum(kl * m) / n
  return aggregate(per_token, mask, loss_agg), metrics
