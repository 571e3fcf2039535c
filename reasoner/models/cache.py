"""The KV cache of Tunix's Gemma layers as the sampler and the train step use it: its arrays,
masks and positions over left-padded rows, its placement and its bytes a chip. Gemma 3's
shared-prompt decode cache is `models.decode.Cache`; its sliding-window layers keep
a ring of their window's new tokens (`new_slots`). Partition rules (rows over 'fsdp', KV heads
over 'tp' where they divide) are `mesh.kv_cache_spec`, `mesh.prompt_cache_sharding` and
`mesh.slot_major_sharding`."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner.mesh import decode_rows, kv_cache_spec


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


def windows(spec_cfg: Any) -> tuple[int | None, ...]:
  """Each layer's sliding window (None: a global layer): Gemma 2's config names each layer's
  type (`attention_types`); Tunix's Gemma 3 models cycle five local layers and a global one
  (`GEMMA3_ATTENTION_PATTERN`). All global without a window size."""
  w = getattr(spec_cfg, "sliding_window_size", None)
  kinds = getattr(spec_cfg, "attention_types", None)
  if kinds is None:
    from tunix.models.gemma3 import model as gemma3_lib

    kinds = itertools.cycle(gemma3_lib.GEMMA3_ATTENTION_PATTERN)
  return tuple(w if kind.name == "LOCAL_SLIDING" and w else None
               for _, kind in zip(range(spec_cfg.num_layers), kinds))


def new_slots(spec_cfg: Any, new_tokens: int) -> tuple[int, ...]:
  """Each layer's new-token slots in Gemma 3's decode cache (`decode.Cache.new`): a sliding
  window's layer keeps a ring of min(N, window) (a new token only ever sees the window's last
  tokens), a global layer all N."""
  return tuple(min(new_tokens, w) if w else new_tokens for w in windows(spec_cfg))


def kv_cache_bytes(spec_cfg: Any, prompts: int, g: int, prompt_len: int, new_tokens: int,
                   dtype, mesh: Mesh, shared: bool, over_rows: bool = False) -> int:
  """Bytes of KV cache one chip holds for a rollout of `prompts` x `g` rows (`prompts` a
  multiple of 'fsdp'), as the sampler lays it out: shared (Gemma 3, `decode.Cache`), each
  prompt's slots once and each row's new slots (a ring of its window in a sliding-window
  layer), those rows over `decode_rows` (`over_rows`:
  `attention_over_rows`); otherwise (Gemma 2, Tunix's cache) each row's prompt and new slots
  and an int32 end_index. The planner's compiled figure must agree."""
  return sum(kv_cache_split(spec_cfg, prompts, g, prompt_len, new_tokens, dtype, mesh, shared,
                            over_rows))


def kv_cache_split(spec_cfg: Any, prompts: int, g: int, prompt_len: int, new_tokens: int,
                   dtype, mesh: Mesh, shared: bool, over_rows: bool = False) -> tuple[int, int]:
  """`kv_cache_bytes` as (global layers', sliding-window layers') bytes: in the shared layout a
  sliding-window layer holds its prompt's slots and a ring of its window (`new_slots`)."""
  heads_per_chip = spec_cfg.num_kv_heads
  if kv_cache_spec(spec_cfg.num_kv_heads, mesh)[2] == "tp":
    heads_per_chip //= mesh.shape["tp"]
  per_slot = 2 * heads_per_chip * spec_cfg.head_dim * jnp.dtype(dtype).itemsize
  b = -(-prompts // mesh.shape["fsdp"])  # prompts per chip
  out = [0, 0]
  if shared:
    rows = b * g // (mesh.shape["tp"] if "tp" in decode_rows(mesh, b * mesh.shape["fsdp"] * g,
                                                             g, over_rows) else 1)
    for w, n in zip(windows(spec_cfg), new_slots(spec_cfg, new_tokens)):
      out[w is not None] += (b * prompt_len + rows * n) * per_slot
    return out[0], out[1]
  for w in windows(spec_cfg):  # Tunix's cache: every layer the whole sequence
    out[w is not None] += b * g * ((prompt_len + new_tokens) * per_slot + 4)
  return out[0], out[1]


def shard_cache(cache: dict, spec_cfg: Any, mesh: Mesh) -> dict:
  kv = NamedSharding(mesh, kv_cache_spec(spec_cfg.num_kv_heads, mesh))
  rows = NamedSharding(mesh, P(kv_cache_spec(spec_cfg.num_kv_heads, mesh)[0]))
  return {name: {"k": jax.lax.with_sharding_constraint(c["k"], kv),
                 "v": jax.lax.with_sharding_constraint(c["v"], kv),
                 "end_index": jax.lax.with_sharding_constraint(c["end_index"], rows)}
          for name, c in cache.items()}
