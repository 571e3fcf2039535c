"""Each prompt through the model once, its keys and values shared by its G completions: the
idea both the sampler (`prefill`, then decoding; a head that every prompt shares, such as a
few-shot header, once: `shared_head`) and the train step (`completion_hidden`, the
hidden states that predict each completion token) are built on, the judge's criteria
(`suffix_hidden`: a completion read once, its criteria's few tokens against its cache), and the
layout of prompts over the chips (`prompt_copies`, `prompt_layout`) that lets every chip find its
rows' prompt on itself. The cache these fill is `models.cache`; Gemma 3's shared decode cache
`models.decode`."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from reasoner import mesh as mesh_lib
from reasoner.models import decode, gemma
from reasoner.models import layer as layer_lib
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
            shared: bool, rows: tuple[str, ...] = ("fsdp",), head: int = 0, tail: int = 0
            ) -> tuple[jax.Array, dict | None, dict]:
  """Each prompt once through the model -> its last hidden state [B, D] and the decode cache:
  shared (`models.decode`), the prompts' keys and values and an empty cache for the B * G rows'
  N new tokens, those rows over `rows` (`mesh.decode_rows`); otherwise (Gemma 2, Tunix's
  decode) the prompt's cache repeated to its G rows, with room for N more.

  `head` (shared only; `shared_head` chooses it): every prompt's first `head` tokens are the
  same (a few-shot header), and every prompt ends within the last `tail` slots after them. The
  head then goes through the model once, not once a row (`_head_cache`), and the rows only
  their last `tail` slots: the same cache, at B x tail + head tokens instead of B x P."""
  tcfg, dtype = model.config, model.embedding().dtype
  b, p = prompt.shape
  size = p if shared else p + n
  if head and shared:
    at = p - tail  # the first slot each row runs
    hidden, cache = model.hidden_states(prompt[:, at:], positions_from_mask(prompt_mask)[:, at:],
                                        _head_cache(model, prompt, prompt_mask, head, at),
                                        causal_mask(prompt_mask, size)[:, at:])
  else:
    hidden, cache = model.hidden_states(prompt, positions_from_mask(prompt_mask),
                                        init_cache(tcfg, b, size, dtype),
                                        causal_mask(prompt_mask, size))
  if not shared:
    rep = lambda x: jnp.repeat(x, g, axis=0)
    return hidden[:, -1], None, shard_cache(jax.tree.map(rep, cache), tcfg, mesh)
  return (hidden[:, -1],
          decode.from_prefill(cache, mesh_lib.prompt_cache_sharding(tcfg.num_kv_heads, mesh)),
          decode.empty(tcfg, b * g, n, dtype,
                       mesh_lib.slot_major_sharding(tcfg.num_kv_heads, mesh, rows)))


def shared_head(ids: list[list[int]], width: int, window: int | None,
                quantum: int = 32) -> tuple[int, int]:
  """(head, tail) for `prefill` of prompts `ids` left-padded to `width`: the tokens all of them
  start with, less one (each row's last token must run), rounded down to `quantum`, and the
  slots after that the longest needs, rounded up (both rounded: few compiled shapes). (0, 0)
  where that saves nothing, or where a sliding window is narrower than the prompt (Tunix's
  prefill band counts from the query's index in the call, `attention.attention_block`)."""
  if len(ids) < 2 or (window is not None and width > window):
    return 0, 0
  head = min(common_prefix(ids), min(len(s) for s in ids) - 1) // quantum * quantum
  tail = -(-(max(len(s) for s in ids) - head) // quantum) * quantum
  return (head, tail) if head and tail < width else (0, 0)


def common_prefix(ids: list[list[int]]) -> int:
  """How many tokens every one of `ids` starts with."""
  return next((i for i, column in enumerate(zip(*ids)) if len(set(column)) > 1),
              min(len(s) for s in ids))


def _head_cache(model, prompt: jax.Array, prompt_mask: jax.Array, head: int, at: int) -> dict:
  """The cache a full prefill would hold in every row's slots before `at`: the shared head's
  keys and values, computed once (the first row's first `head` tokens), put at each row's own
  start (its left padding), zeros elsewhere; each layer's end index at `at`."""
  tcfg, dtype = model.config, model.embedding().dtype
  b, p = prompt.shape
  start = p - jnp.sum(prompt_mask, axis=1)  # [B] each row's first real slot
  tokens = jax.lax.dynamic_slice(prompt[0], (start[0],), (head,))[None]
  _, once = model.hidden_states(tokens, jnp.arange(head)[None], init_cache(tcfg, 1, head, dtype),
                                causal_mask(jnp.ones((1, head), bool)))
  j = jnp.arange(at)[None] - start[:, None]  # [B, at] the head token at each slot
  keep = ((j >= 0) & (j < head))[..., None, None]
  put = lambda x: jnp.where(keep, x[0][jnp.clip(j, 0, head - 1)], 0).astype(dtype)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, p - at), (0, 0), (0, 0)))
  return {name: {"k": pad(put(c["k"])), "v": pad(put(c["v"])),
                 "end_index": jnp.full((b,), at, jnp.int32)} for name, c in once.items()}


class Heads(NamedTuple):
  """Prompt heads that rows share (a few-shot header), each run through the model once:
  `tokens`, `valid` [K, H] right-padded, and each prompt's head `of` [B] (an empty head, no
  valid token, for a prompt without one). The prompt arrays then hold each prompt's own rest,
  left-padded: prompt b is its head's valid tokens, then its rest."""
  tokens: jax.Array
  valid: jax.Array
  of: jax.Array


def joined(heads: Heads, prompt: jax.Array, prompt_valid: jax.Array, packed: bool = False):
  """The whole prompts [B, H + P] of `heads` and their rests: the head's padding inside, or
  (`packed`) left-padded, as a prompt without heads lies."""
  tokens = jnp.concatenate([heads.tokens[heads.of], prompt], axis=1)
  valid = jnp.concatenate([heads.valid[heads.of], prompt_valid], axis=1)
  if not packed:
    return tokens, valid
  order = jnp.argsort(valid, axis=1, stable=True)  # the padding first, the tokens in order
  return jnp.take_along_axis(tokens, order, 1), jnp.take_along_axis(valid, order, 1)


def _heads_cache(model, heads: Heads, size: int) -> dict:
  """Each row's cache with its head's keys and values in slots [0, H) (computed once a head,
  zeros past its length), room to `size`, the end index at H."""
  tcfg, dtype = model.config, model.embedding().dtype
  k, h = heads.tokens.shape
  _, once = model.hidden_states(heads.tokens, positions_from_mask(heads.valid),
                                init_cache(tcfg, k, h, dtype), causal_mask(heads.valid))
  keep = heads.valid[heads.of][..., None, None]
  put = lambda x: jnp.pad(jnp.where(keep, x[heads.of], 0).astype(dtype),
                          ((0, 0), (0, size - h), (0, 0), (0, 0)))
  return {name: {"k": put(c["k"]), "v": put(c["v"]),
                 "end_index": jnp.full(heads.of.shape, h, jnp.int32)} for name, c in once.items()}


def completion_hidden(model, prompt, prompt_valid, completion, completion_mask,
                      mesh=None, heads: Heads | None = None) -> jax.Array:
  """Final hidden states that predict each completion token, [B * G, N, D].

  Each prompt goes through the model once (once per chip its group spans, `prompt_copies`) and
  its KV cache is repeated to its G rows (exact: gradients flow back through the shared cache),
  so the prompt costs B (B * copies), not B * G, rows. Sliding-window layers get their own
  mask. Only a prompt as long as the window takes one full forward per row: Tunix's prefill
  band counts the window from the query's index in the call, then too narrow for the prompt.
  `heads`: the prompts are their heads' tokens, each head run once (`_heads_cache`), then each
  row's rest against it; where the whole would not fit a sliding window, the whole prompts
  left-padded, as without heads (the band counts from a query's index in the call).
  """
  b, p = prompt.shape
  rows, n = completion.shape
  g = rows // b
  window = getattr(model.config, "sliding_window_size", None)
  if heads is not None and window is not None and heads.tokens.shape[1] + p + n > window:
    (prompt, prompt_valid), heads = joined(heads, prompt, prompt_valid, packed=True), None
    p = prompt.shape[1]
  at = 0 if heads is None else heads.tokens.shape[1]  # the first slot the rows run
  size = at + p + n
  if window is not None and p >= window:
    tokens = jnp.concatenate([jnp.repeat(prompt, g, 0), completion], axis=1)
    valid = jnp.concatenate([jnp.repeat(prompt_valid, g, 0), completion_mask], axis=1)
    inp, v = tokens[:, :-1], valid[:, :-1]
    hidden, _ = model.hidden_states(inp, positions_from_mask(v), None, causal_mask(v), mesh)
    return hidden[:, -n:]
  c = prompt_copies(mesh, b, g)
  prompt, prompt_valid = jnp.repeat(prompt, c, 0), jnp.repeat(prompt_valid, c, 0)
  if heads is None:
    cache = init_cache(model.config, b * c, size, model.embedding().dtype)
  else:
    heads = heads._replace(of=jnp.repeat(heads.of, c))
    cache = _heads_cache(model, heads, size)
    prompt_valid = joined(heads, prompt, prompt_valid)[1]  # [B * c, at + p]
  h_prompt, cache = model.hidden_states(prompt, positions_from_mask(prompt_valid)[:, at:], cache,
                                        causal_mask(prompt_valid, size)[:, at:], mesh)
  rep = lambda x: jnp.repeat(x, g // c, axis=0)
  hidden = rep(h_prompt[:, -1:])  # the last prompt position predicts the first token
  if n > 1:
    cache = jax.tree.map(rep, cache)
    kv_valid = jnp.concatenate([rep(prompt_valid), completion_mask], axis=1)  # [R, size]
    q_slot = at + p + jnp.arange(n - 1)  # cache slots of the completion inputs
    ahead = q_slot[:, None] - jnp.arange(size)[None, :]  # query slot - key slot
    mask = (ahead >= 0)[None] & kv_valid[:, None, :]
    local = mask & (ahead < window)[None] if window is not None and size > window else None
    positions = rep(jnp.sum(prompt_valid, axis=1))[:, None] + jnp.arange(n - 1)[None]
    h_comp, _ = model.hidden_states(completion[:, :-1], positions, cache, mask, mesh,
                                    local_mask=local)
    hidden = jnp.concatenate([hidden, h_comp], axis=1)
  return hidden


def suffix_hidden(model, prefix, prefix_valid, suffix, lengths, mesh=None) -> jax.Array:
  """Final hidden states after each of a prefix's K suffixes, [B, K, D] float32: row b, suffix
  k, the state after the left-padded prefix [B, P] and the first `lengths[b, k]` tokens of the
  right-padded suffix [B, K, S], which predicts the next token (length 0: no suffix).

  Each prefix goes through the model once; its K suffixes then run one after another (a scan;
  a suffix no row has is skipped) against its KV cache, which is never repeated to B * K rows:
  a 12B judge's cache of 16 rows of 1K tokens is 6 GiB, repeated to 8 criteria 48 GiB. A
  sliding-window layer is given only the cache's last window - 1 prefix slots: Tunix's prefill
  band counts the window from the query's index in the call (`completion_hidden`), and so holds
  every key the window needs however long the prefix. Gemma 2's band counts from positions
  instead: with a prefix as long as its window, each suffix takes a full forward behind its
  prefix (`_behind_prefix`)."""
  b, p = prefix.shape
  s = suffix.shape[2]
  window = getattr(model.config, "sliding_window_size", None)
  start = 0 if window is None else max(0, p - window + 1)  # the sliding layers' first slot
  xs = (jnp.swapaxes(suffix, 0, 1), lengths.T)  # scanned over the K suffixes
  graphdef, state = nnx.split(model)
  # the model again inside the scan, its variables new at the scan's trace level: qwix's LoRA
  # and nnx's remat set attributes on them as they run
  inner = lambda: nnx.merge(graphdef, state, copy=True)
  if start and not layer_lib.replaces(model.layers[0], s):
    one = lambda tokens, n: _behind_prefix(inner(), prefix, prefix_valid, tokens, n, mesh)
  else:
    size = p + s
    h, cache = model.hidden_states(prefix, positions_from_mask(prefix_valid),
                                   init_cache(model.config, b, size, model.embedding().dtype),
                                   causal_mask(prefix_valid, size), mesh)
    cache = _windowed(model, cache, start)
    ahead = (p + jnp.arange(s))[:, None] - jnp.arange(size)[None, :]  # query slot - key slot
    local = None if window is None else ahead < window
    positions = jnp.sum(prefix_valid, axis=1)[:, None] + jnp.arange(s)[None]  # after the prefix

    def one(tokens, n):
      valid = jnp.arange(s)[None] < n[:, None]
      mask = (ahead >= 0)[None] & jnp.concatenate([prefix_valid, valid], axis=1)[:, None, :]
      h_suffix, _ = inner().hidden_states(
          tokens, positions, cache, mask, mesh,
          local_mask=None if local is None else (mask & local[None])[:, :, start:])
      return jnp.concatenate([h[:, -1:], h_suffix], axis=1)  # index j: after j suffix tokens

  def step(_, x):  # a suffix no row has (past every completion's criteria) is not run
    tokens, n = x
    pick = lambda: jnp.take_along_axis(one(tokens, n), n[:, None, None], axis=1)[:, 0]
    return None, jax.lax.cond(jnp.any(n > 0), lambda: pick().astype(jnp.float32),
                              lambda: jnp.zeros((b, model.config.embed_dim), jnp.float32))

  return jnp.swapaxes(jax.lax.scan(step, None, xs)[1], 0, 1)


def _windowed(model, cache: dict, start: int) -> dict:
  """The prefix's cache with each sliding-window layer's from slot `start` on (its end index
  moved with it): the keys a suffix's window reaches, at slots Tunix's band lets it see."""
  cut = lambda c: {"k": c["k"][:, start:], "v": c["v"][:, start:],
                   "end_index": c["end_index"] - start}
  return {name: cut(c) if start and gemma._sliding(model.layers[int(name.split("_")[1])]) else c
          for name, c in cache.items()}


def _behind_prefix(model, prefix, prefix_valid, tokens, n, mesh=None) -> jax.Array:
  """[B, S + 1, D]: one suffix behind its prefix in a full forward; index j: after j suffix
  tokens."""
  valid = jnp.concatenate([prefix_valid, jnp.arange(tokens.shape[1])[None] < n[:, None]], 1)
  h, _ = model.hidden_states(jnp.concatenate([prefix, tokens], axis=1),
                             positions_from_mask(valid), None, causal_mask(valid), mesh)
  return h[:, prefix.shape[1] - 1:]
