"""Gemma 3's attention with a core that keeps no [B, T, N, S] array for the backward.

Tunix's attention leaves its softmax probabilities to autodiff, which keeps one [B, T, N, S]
array per layer alive from the forward to the backward pass (Gemma3-1B, 4 rows x 1024 slots a
chip: 24 MiB a layer, 0.62 GiB over 26 layers, all of it at the step's peak). `attend` is a
`jax.custom_vjp` that saves only its inputs (q, k, v and the mask) and forms the probabilities
again, one layer at a time, in the backward pass (as flash attention does): one [T, S] dot per
head more (the logits), a small share of the step's FLOPs. Its forward is Tunix's, operation for
operation, activation constraints included.

`attention_block` is Tunix's `Attention.block` for calls of more than one token (training and
prefill) with that core, on the layer's own modules (qwix's LoRA still sees every projection);
`reasoner.models.layer` composes it into the decoder layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

K_MASK = -2.3819763e38  # Tunix's masked logit
# What `attention_block` names: the q, k, v projections, the core's output, the output projection
NAMES = ("attn_q", "attn_k", "attn_v", "attn_core", "attn_out")


def _logits(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
  logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k)
  return jnp.where(mask[:, :, None, None, :], logits, K_MASK)


@jax.custom_vjp
def attend(q: jax.Array,  # [B, T, K, G, H], already scaled
           k: jax.Array,  # [B, S, K, H]
           v: jax.Array,  # [B, S, K, H]
           mask: jax.Array  # [B, T, S] bool
           ) -> jax.Array:  # [B, T, K, G, H]
  probs = jax.nn.softmax(_logits(q, k, mask), axis=-1).astype(v.dtype)
  return jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)


def _attend_fwd(q, k, v, mask):
  return attend(q, k, v, mask), (q, k, v, mask)


def _attend_bwd(res, do):
  """Softmax backward in float32 from probabilities formed again: dS = P * (dP - rowsum(dP P)),
  none through masked logits (a query that sees no key has uniform P there, as in Tunix)."""
  # The barrier (with the cotangent, so nothing here runs before the backward) keeps XLA's CSE
  # from merging these logits with the forward's, which would keep those alive instead.
  q, k, v, mask, do = jax.lax.optimization_barrier((*res, do))
  f32 = jnp.float32
  p = jax.nn.softmax(_logits(q, k, mask).astype(f32), axis=-1)
  dv = jnp.einsum("BTKGS,BTKGH->BSKH", p.astype(v.dtype), do, preferred_element_type=f32)
  dp = jnp.einsum("BTKGH,BSKH->BTKGS", do, v, preferred_element_type=f32)
  ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
  ds = jnp.where(mask[:, :, None, None, :], ds, 0.0).astype(q.dtype)  # masked: no gradient
  dq = jnp.einsum("BTKGS,BSKH->BTKGH", ds, k, preferred_element_type=f32)
  dk = jnp.einsum("BTKGS,BTKGH->BSKH", ds, q, preferred_element_type=f32)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


attend.defvjp(_attend_fwd, _attend_bwd)


def attention_block(attn, x, segment_pos, cache, attn_mask):
  """Tunix 0.1.7's `gemma3.Attention.block` for T > 1, the core swapped for `attend`; the
  projections' outputs and the core's are named (`NAMES`) for the layer's remat policy."""
  from jax.ad_checkpoint import checkpoint_name
  from tunix.models.gemma3 import model as gemma3_lib

  seq_len = x.shape[1]
  if attn.use_qkv_einsum:
    q, k, v = attn.qkv_einsum(x)
  else:
    q = attn.q_einsum(x)
    k, v = attn.kv_einsum(x)
  q, k, v = (checkpoint_name(a, name) for a, name in zip((q, k, v), NAMES[:3]))
  shard = gemma3_lib.sharding_utils.shard  # no-ops outside `with mesh:`, as in Tunix
  q, k, v = (shard(a, attn.shd_config.act_btnh) for a in (q, k, v))
  q, k = attn._query_norm(q), attn._key_norm(k)
  rope = dict(head_dim=attn.head_dim, base_frequency=attn.rope_base_frequency,
              scale_factor=attn.rope_scale_factor)
  q = gemma3_lib.apply_rope(q, segment_pos, **rope) * attn.query_pre_attn_scalar
  k = gemma3_lib.apply_rope(k, segment_pos, **rope)
  if cache is not None:  # left-aligned cache: this call's keys and values go in at end_index
    start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
    v = jax.lax.dynamic_update_slice(cache["v"], v, start)
    k = jax.lax.dynamic_update_slice(cache["k"], k, start)
  if attn.attn_type == gemma3_lib.AttentionType.LOCAL_SLIDING:  # Tunix's prefill band
    ones = jnp.ones_like(attn_mask)
    w = attn.sliding_window_size
    attn_mask = attn_mask * jnp.triu(ones, 1 - w) * jnp.tril(ones, w - 1)
  b, t, n, h = q.shape
  kv = attn.num_kv_heads
  out = attend(q.reshape(b, t, kv, n // kv, h), k, v, attn_mask.astype(bool))
  out = checkpoint_name(out.reshape(b, t, n, h), NAMES[3])
  attn_output = checkpoint_name(attn.attn_vec_einsum(out), NAMES[4])
  attn_output = shard(attn_output, attn.shd_config.act_btd)
  new_cache = None if cache is None else {"v": v, "k": k,
                                          "end_index": cache["end_index"] + seq_len}
  return new_cache, attn_output
