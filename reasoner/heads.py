"""The vocabulary head, computed in chunks so no [batch, seq, vocab] array is ever built.

Gemma's vocabulary is 262,144: for 16 sequences of 1,024 tokens the float32 logits alone are
17 GB. ``token_logprobs`` flattens the tokens, scans over chunks of `chunk` tokens and
rematerialises each chunk's logits in the backward pass, so peak memory holds
[chunk, vocab] floats (256 x 262,144 x 4 B = 268 MB) rather than [B*T, vocab].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logits(hidden: jax.Array, embedding: jax.Array, softcap: float | None = None) -> jax.Array:
  """[..., D] x [V, D] -> [..., V] float32, with Gemma 2's final soft cap when given."""
  out = jnp.einsum("...d,vd->...v", hidden, embedding, preferred_element_type=jnp.float32)
  if softcap is not None:
    out = jnp.tanh(out / softcap) * softcap
  return out


def token_logprobs(
    hidden: jax.Array,  # [B, T, D]
    embedding: jax.Array,  # [V, D]
    targets: jax.Array,  # [B, T] int
    *,
    chunk: int = 256,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # log p(target) [B, T], entropy [B, T], float32
  """Per-token log-probabilities of `targets` and the entropy of each position's distribution.

  Gradients flow through the log-probs only; the entropy is a metric (stop-gradient).

  Peak memory: about 3 x chunk x V float32 (logits, their softmax and its gradient) plus the
  [B*T, D] hidden states; compute: the dense matmul once forward, twice backward (remat).
  """
  b, t, d = hidden.shape
  n = b * t
  chunk = max(1, min(chunk, n))
  pad = (-n) % chunk
  h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
  y = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)

  @jax.checkpoint
  def one_chunk(h_c, y_c):
    z = logits(h_c, embedding, softcap)  # [chunk, V]
    zmax = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    e = jnp.exp(z - zmax)  # one exp pass serves the normaliser and the entropy
    total = jnp.sum(e, axis=-1, keepdims=True)
    lse = (zmax + jnp.log(total))[:, 0]
    logp = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0] - lse
    p = jax.lax.stop_gradient(e / total)  # entropy is reported, not differentiated
    entropy = jax.lax.stop_gradient(lse) - jnp.sum(p * jax.lax.stop_gradient(z), axis=-1)
    return logp, entropy

  def body(carry, xs):
    return carry, one_chunk(*xs)

  _, (logp, ent) = jax.lax.scan(body, None, (h, y))
  return logp.reshape(-1)[:n].reshape(b, t), ent.reshape(-1)[:n].reshape(b, t)
