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


def token_weights(mask: jax.Array, how: str) -> jax.Array:
  """[R, N] weights w such that sum(w * x) is the `loss_agg` aggregation of per-token values x:
  every aggregation is linear in them, which is what lets the fused head take the loss's
  gradient in its forward pass (`heads.fused_token_loss`)."""
  m = mask.astype(jnp.float32)
  if how == "token-mean":
    return m / jnp.maximum(jnp.sum(m), 1.0)
  if how == "sequence-mean-token-mean":
    return m / (jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0) * m.shape[0])
  if how == "sequence-mean-token-sum-norm":
    return m / (m.shape[0] * m.shape[1])
  raise ValueError(f"unknown loss aggregation {how!r}")


def _surrogates(logp, old_logp, advantages, epsilon_low: float, epsilon_high: float):
  """(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with r = exp(logp - old_logp)."""
  ratio = jnp.exp(logp - old_logp)
  return ratio * advantages, jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages


def _k3(logp, ref_logp) -> jax.Array:
  """The k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


def token_loss(
    logp: jax.Array,  # [...] log pi_theta(token)
    old_logp: jax.Array,  # [...] log pi_old
    ref_logp: jax.Array,  # [...] log pi_ref (ignored when beta == 0)
    advantages: jax.Array,  # [...] A of each token's row, broadcast to logp's shape
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
) -> jax.Array:
  """Per-token loss, elementwise: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3,
  with r = exp(logp - old_logp) and k3 = exp(ref - logp) - (ref - logp) - 1."""
  unclipped, clipped = _surrogates(logp, old_logp, advantages, epsilon_low, epsilon_high)
  per_token = -jnp.minimum(unclipped, clipped)
  if beta > 0:
    per_token = per_token + beta * _k3(logp, ref_logp)
  return per_token


def policy_metrics(logp, old_logp, ref_logp, advantages, mask, *, epsilon_low: float,
                   epsilon_high: float, beta: float) -> dict[str, jax.Array]:
  """Token means of where clipping binds and (beta > 0) of the k3 KL; [R, N] inputs."""
  unclipped, clipped = _surrogates(logp, old_logp, advantages[:, None], epsilon_low,
                                   epsilon_high)
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  metrics = {"clip_fraction": jnp.sum((clipped < unclipped) * m) / n}  # clipping binds
  if beta > 0:
    metrics["kl"] = jnp.sum(_k3(logp, ref_logp) * m) / n
  return metrics


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
  """The clipped surrogate, negated for minimisation, plus beta * KL(pi_theta || pi_ref).

  The dense form of what the trainer computes with `heads.fused_token_loss`: the same
  `token_loss`, aggregated with the same `token_weights`."""
  ref = jnp.zeros_like(logp) if ref_logp is None else ref_logp
  eps = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta)
  per_token = token_loss(logp, old_logp, ref, jnp.broadcast_to(advantages[:, None], logp.shape),
                         **eps)
  metrics = policy_metrics(logp, old_logp, ref, advantages, mask, **eps)
  return jnp.sum(token_weights(mask, loss_agg) * per_token), metrics
