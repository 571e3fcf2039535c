"""Each prompt through the model once, its keys and values shared by its G completions: the
idea both the sampler (`prefill`, then decoding) and the train step (`completion_hidden`, the
hidden states that predict each completion token) are built on, and the layout of prompts over
the chips (`prompt_copies`, `prompt_layout`) that lets every chip find its rows' prompt on
itself. The cache these fill is `models.cache`; Gemma 3's shared decode cache `models.decode`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from reasoner import mesh as mesh_lib
from reasoner.models import decode
from reasoner.models.cache import causal_mask, init_cache, positions_from_mask, shard_cache


def prompt_copies(mesh: Mesh | None, prompts: int, g: int) -> int:
  """Copies of each prompt to run through the model so that every chip finds the prompt of its
  own rows on itself: with rows (prompts x G) over 'fsdp' and fewer prompts than chips, a group
  spans several chips and each of them takes one copy (4 prompts of G = 8 on fsdp = 8: 2
  copies, one prompt a chip), rather than every chip running every prompt. 1 where the prompts
  already divide over 'fsdp', the rows are replicated, or the copies would not divide G."""
  if mesh is None or mesh_lib.row_axis(mesh, prompts * g) is None:
    return 1
  c = mesh.shape["fsdp"] // math.gcd(prompts, mesh.shape["fsdp"])
  return c if g % c == 0 else 1


def prompt_layout(mesh: Mesh, prompts: int, g: int) -> tuple[int, int]:
  """(copies of each prompt, padding prompts) that `Sampler.sample` runs for prompts x G rows.

  Fewer prompts than chips: each chip prefills a copy of its rows' prompt and samples G / c of
  the group (4 prompts x 8 on fsdp = 8: 8 copies x 4 rows, no row wasted). Otherwise the
  prompts are padded to a multiple of 'fsdp' with copies of the first (their rows dropped)."""
  c = prompt_copies(mesh, prompts, g)
  return c, (-prompts * c) % mesh.shape["fsdp"]


def prefill(model, mesh: Mesh, prompt: jax.Array, prompt_mask: jax.Array, g: int, n: int,
            shared: bool, rows: tuple[str, ...] = ("fsdp",)
            ) -> tuple[jax.Array, dict | None, dict]:
  """Each prompt once through the model -> its last hidden state [B, D] and the decode cache:
  shared (`models.decode`), the prompts' keys and values and an empty cache for the B * G rows'
  N new tokens, those rows over `rows` (`mesh.decode_rows`); otherwise (Gemma 2, Tunix's
  decode) the prompt's cache repeated to its G rows, with room for N more."""
  tcfg, dtype = model.config, model.embedding().dtype
  b, p = prompt.shape
  size = p if shared else p + n
  hidden, cache = model.hidden_states(prompt, positions_from_mask(prompt_mask),
                                      init_cache(tcfg, b, size, dtype),
                                      causal_mask(prompt_mask, size))
  if not shared:
    rep = lambda x: jnp.repeat(x, g, axis=0)
    return hidden[:, -1], None, shard_cache(jax.tree.map(rep, cache), tcfg, mesh)
  slots = lambda axes: mesh_lib.slot_major_sharding(tcfg.num_kv_heads, mesh, axes)
  return (hidden[:, -1], decode.from_prefill(cache, slots(("fsdp",))),
          decode.empty(tcfg, b * g, n, dtype, slots(rows)))


def completion_hidden(model, prompt, prompt_valid, completion, completion_mask,
                      mesh=None) -> jax.Array:
  """Final hidden states that predict each completion token, [B * G, N, D].

  Each prompt goes through the model once (once per chip its group spans, `prompt_copies`) and
  its KV cache is repeated to its G rows (exact: gradients flow back through the shared cache),
  so the prompt costs B (B * copies), not B * G, rows. Sliding-window layers get their own
  mask. Only a prompt as long as the window takes one full forward per row: Tunix's prefill
  band counts the window from the query's index in the call, then too narrow for the prompt.
  """
  b, p = prompt.shape
  rows, n = completion.shape
  g = rows // b
  size = p + n
  window = getattr(model.config, "sliding_window_size", None)
  if window is not None and p >= window:
    tokens = jnp.concatenate([jnp.repeat(prompt, g, 0), completion], axis=1)
    valid = jnp.concatenate([jnp.repeat(prompt_valid, g, 0), completion_mask], axis=1)
    inp, v = tokens[:, :-1], valid[:, :-1]
    hidden, _ = model.hidden_states(inp, positions_from_mask(v), None, causal_mask(v), mesh)
    return hidden[:, -n:]
  c = prompt_copies(mesh, b, g)
  prompt, prompt_valid = jnp.repeat(prompt, c, 0), jnp.repeat(prompt_valid, c, 0)
  cache = init_cache(model.config, b * c, size, model.embedding().dtype)
  h_prompt, cache = model.hidden_states(prompt, positions_from_mask(prompt_valid), cache,
                                        causal_mask(prompt_valid, size), mesh)
  rep = lambda x: jnp.repeat(x, g // c, axis=0)
  hidden = rep(h_prompt[:, -1:])  # the last prompt position predicts the first token
  if n > 1:
    cache = jax.tree.map(rep, cache)
    kv_valid = jnp.concatenate([rep(prompt_valid), completion_mask], axis=1)  # [R, size]
    q_slot = p + jnp.arange(n - 1)  # cache slots of the completion inputs
    ahead = q_slot[:, None] - jnp.arange(size)[None, :]  # query slot - key slot
    mask = (ahead >= 0)[None] & kv_valid[:, None, :]
    local = mask & (ahead < window)[None] if window is not None and size > window else None
    positions = rep(jnp.sum(prompt_valid, axis=1))[:, None] + jnp.arange(n - 1)[None]
    h_comp, _ = model.hidden_states(completion[:, :-1], positions, cache, mask, mesh,
                                    local_mask=local)
    hidden = jnp.concatenate([hidden, h_comp], axis=1)
  return hidden
