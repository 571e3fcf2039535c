"""Gemma 3's one-token decode step on a slot-major KV cache ([S, B, K, H] per layer).

Tunix keeps the cache as [B, S, K, H] and writes each step's keys and values into it with a
`dynamic_update_slice` at slot `end_index`. On XLA:CPU that layout cost the 270M model most of
its decode step: the per-row attention dots run as batched dots below matmul speed, and the
update is fused into each of its consumers, each on a copy of the cache (128 rows, 192 slots:
one layer's decode call 124 ms, 102 of them attention; the 18 layers 1.7 s a step). Here the
step's keys and values go in as one contiguous [B, K, H] slab at their slot, behind an
optimization barrier so that the update happens once, in place; the same layers then took
0.8-0.9 s a step (an 8-step loop outside the sampler; the whole 4 x 8 rollout of
`make bench BENCH=rollout`, same tokens, ran 1.13x faster).

The forward is Tunix's `Attention.block` / `DecoderLayer` for one token (norms, rotary
embedding, masked logits, float32 softmax, output projection, MLP) on the layer's own modules,
so qwix's LoRA sees every projection; sliding-window layers mask keys more than their window
behind the newest slot, as Tunix's `create_sliding_window_mask` does. Gemma 2 keeps Tunix's
decode (`reasoner.sampler.generate`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

KV = tuple[jax.Array, jax.Array]  # keys, values: [S, B, K, H] each


def applies(model) -> bool:
  """Gemma 3 models (every layer Tunix's Gemma 3 `DecoderLayer`)."""
  from tunix.models.gemma3 import model as gemma3_lib

  return all(isinstance(layer, gemma3_lib.DecoderLayer) for layer in model.layers)


def slot_major(cache: dict, sharding: NamedSharding) -> dict[str, KV]:
  """Tunix's per-layer {'k', 'v': [B, S, K, H]} -> (k, v) as [S, B, K, H], placed by
  `sharding` (the sampler's `cache_spec` with its first two axes swapped)."""
  move = lambda x: jax.lax.with_sharding_constraint(jnp.swapaxes(x, 0, 1), sharding)
  return {name: (move(c["k"]), move(c["v"])) for name, c in cache.items()}


def _attention(attn, x, positions, kv: KV, slot, mask):
  """Tunix's `Attention.block` for one token per row; `mask` [B, S] the keys each row sees."""
  from tunix.models.gemma3 import model as gemma3_lib

  if attn.use_qkv_einsum:
    q, k, v = attn.qkv_einsum(x)
  else:
    q = attn.q_einsum(x)
    k, v = attn.kv_einsum(x)
  q, k = attn._query_norm(q), attn._key_norm(k)
  rope = lambda a: gemma3_lib.apply_rope(a, positions, head_dim=attn.head_dim,
                                         base_frequency=attn.rope_base_frequency,
                                         scale_factor=attn.rope_scale_factor)
  q, k = rope(q) * attn.query_pre_attn_scalar, rope(k)
  keys, values = (jax.lax.dynamic_update_slice(c, jnp.swapaxes(new, 0, 1), (slot, 0, 0, 0))
                  for c, new in zip(kv, (k, v)))
  keys, values = jax.lax.optimization_barrier((keys, values))  # one in-place update
  b, _, n, h = q.shape
  kh = keys.shape[2]
  logits = jnp.einsum("BKGH,SBKH->BKGS", q.reshape(b, kh, n // kh, h), keys)
  if attn.attn_type == gemma3_lib.AttentionType.LOCAL_SLIDING:
    mask = mask & (jnp.arange(mask.shape[1]) > slot - attn.sliding_window_size)[None]
  logits = jnp.where(mask[:, None, None, :], logits, gemma3_lib.K_MASK)
  probs = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
  encoded = jnp.einsum("BKGS,SBKH->BKGH", probs, values).reshape(b, 1, n, h)
  return (keys, values), attn.attn_vec_einsum(encoded)


def hidden_states(model, tokens: jax.Array, positions: jax.Array, cache: dict[str, KV],
                  slot: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict[str, KV]]:
  """tokens, positions [B, 1] (each row's newest token, written at cache slot `slot`); mask
  [B, 1, S] the slots each row sees, the newest included -> [B, 1, D] after the final norm,
  and the updated cache. Called through the model's `hidden_states(..., slot=)`, the method
  qwix intercepts for LoRA."""
  x = model.embedder.encode(tokens)
  new = {}
  for i, layer in enumerate(model.layers):
    name = f"layer_{i}"
    new[name], out = _attention(layer.attn, layer.pre_attention_norm(x), positions, cache[name],
                                slot, mask[:, 0])
    x = layer.post_attention_norm(out) + x
    x = layer.post_ffw_norm(layer.mlp(layer.pre_ffw_norm(x))) + x
  return model.final_norm(x), new
