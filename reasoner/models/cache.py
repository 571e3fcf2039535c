"""The KV cache of Tunix's Gemma layers as the sampler and the train step use it: its arrays,
masks and positions over left-padded rows, its sharding (rows over 'fsdp', KV heads over 'tp'
where they divide) and its bytes a chip. Gemma 3's shared-prompt, slot-major decode cache is
`models.decode.Cache`; its sharding is `slot_major_sharding` here."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """[B, T] bool -> [B, T] positions counting only real tokens (left padding gets 0)."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(valid: jax.Array, cache_len: int | None = None) -> jax.Array:
  """[B, T] -> [B, T, S]: query i sees key j <= i where key j is a real token."""
  t = valid.shape[1]
  s = cache_len or t
  causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None]
  keys = jnp.pad(valid, ((0, 0), (0, s - t)))
  return causal[None] & keys[:, None, :]


def init_cache(spec_cfg: Any, batch: int, size: int, dtype) -> dict:
  shape = (batch, size, spec_cfg.num_kv_heads, spec_cfg.head_dim)
  return {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                         "end_index": jnp.zeros((batch,), jnp.int32)}
          for i in range(spec_cfg.num_layers)}


def cache_spec(spec_cfg: Any, mesh: Mesh) -> P:
  """KV cache [rows, slots, kv_heads, head_dim]: rows over 'fsdp', heads over 'tp' where they
  divide (Gemma 3 1B has a single KV head: it is then replicated over 'tp')."""
  tp = mesh.shape["tp"]
  return P("fsdp", None, "tp" if tp > 1 and spec_cfg.num_kv_heads % tp == 0 else None, None)


def kv_cache_bytes(spec_cfg: Any, prompts: int, g: int, prompt_len: int, new_tokens: int,
                   dtype, mesh: Mesh, shared: bool) -> int:
  """Bytes of KV cache one chip holds for a rollout of `prompts` x `g` rows (`prompts` a
  multiple of 'fsdp'), as the sampler lays it out: shared (Gemma 3, `decode.Cache`), each
  prompt's slots once and each row's new slots; otherwise (Gemma 2, Tunix's cache) each row's
  prompt and new slots and an int32 end_index. The planner's compiled figure must agree."""
  heads_per_chip = spec_cfg.num_kv_heads
  if cache_spec(spec_cfg, mesh)[2] == "tp":
    heads_per_chip //= mesh.shape["tp"]
  per_slot = 2 * heads_per_chip * spec_cfg.head_dim * jnp.dtype(dtype).itemsize
  b = -(-prompts // mesh.shape["fsdp"])  # prompts per chip
  if shared:
    return spec_cfg.num_layers * (b * prompt_len + b * g * new_tokens) * per_slot
  return spec_cfg.num_layers * b * g * ((prompt_len + new_tokens) * per_slot + 4)


def slot_major_sharding(spec_cfg: Any, mesh: Mesh) -> NamedSharding:
  """`cache_spec` for Gemma 3's slot-major decode cache ([slots, rows, K, H], `models.decode`):
  its prompt part splits prompts over 'fsdp', its new part rows (grouped by prompt)."""
  rows, slots, *rest = cache_spec(spec_cfg, mesh)
  return NamedSharding(mesh, P(slots, rows, *rest))


def shard_cache(cache: dict, spec_cfg: Any, mesh: Mesh) -> dict:
  kv = NamedSharding(mesh, cache_spec(spec_cfg, mesh))
  rows = NamedSharding(mesh, P("fsdp"))
  return {name: {"k": jax.lax.with_sharding_constraint(c["k"], kv),
                 "v": jax.lax.with_sharding_constraint(c["v"], kv),
                 "end_index": jax.lax.with_sharding_constraint(c["end_index"], rows)}
          for name, c in cache.items()}
