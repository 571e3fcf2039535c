"""Gemma 3's one-token decode step on a KV cache that holds each prompt once.

Layout. `Cache.prompt` holds each prompt's keys and values once for its whole group (per
layer keys [prompts, K, H, P] and values [prompts, K, P, H], written by the prefill);
`Cache.new` holds the generated tokens' ([N, prompts * G, K, H], slot-major: slot j = each
row's j-th new token). Rows are grouped by prompt, so row r reads prompt r // G. Against the
prompt's cache repeated to the G rows this reads the prompt's keys once per group instead of G
times, and holds 1 / G of the prompt's bytes. The prompt part is batch-major because it is only
read: the attention dots take their batch axes (prompt, head) first, and slot-major it was laid
out again by XLA:CPU in every layer at every step (a copy of the whole prompt cache twice a
step, 23% of an evaluation's time).
Its keys lie transposed, [H, P] a head, so that both of its dots are plain [M, K] x [K, N]
matmuls: XLA:CPU ran the scores against keys [P, H] (contracting both operands' last axis) at
a tenth of the speed ([128 rows, 4, 256] x [128, 256, 256]: 20 ms against 2; 18 layers at every
step of an evaluation batch of 128, a quarter of its time).

Why slot-major. Tunix keeps [B, S, K, H] and writes each step with a `dynamic_update_slice` at
`end_index`; on XLA:CPU the per-row attention dots ran below matmul speed and the update was
fused into each consumer on a copy of the cache (most of a decode call's time went to
attention). Here a step's keys and values go in as one contiguous [B, K, H]
slab at their slot, behind an optimization barrier so that the update happens once, in place.

Only the filled part of `Cache.new` is read: the step picks (`lax.switch`) the shortest of a
few static spans (quarters of N) that covers its slot, so on average 5/8 of N slots instead of N.

Rings. A sliding-window layer's new part is a ring of min(N, window) slots
(`cache.new_slots`): token j goes to slot j mod ring, over the token a window older, which no
later token sees. Once the ring has wrapped every slot is read and every one is in the window;
before, the spans above. Softmax does not care in which order the keys lie. So a local layer
holds and reads at most its window however long the answer (Gemma 3 1B: five layers of six at
512 slots), and only the global layers grow with N.

Over rows. Where 'tp' cannot split the KV heads (`mesh.attention_over_rows`), attention runs
on each chip's own rows (`_over_rows`, a shard_map with no collective inside): its cache's
rows are split over every chip, not copied on each chip of a tp group, and each chip finds its
rows' prompts in the prompts its 'fsdp' block holds. The projections run on those rows with
the attention's whole weights. The residual stream stays on each chip's own rows too: the MLP
(`_mlp_over_rows`, Megatron-style over 'tp') gathers its input's rows (one all-gather) and
sends each chip its rows' shares of the down projection's sum (one all-to-all), so a layer
takes two collectives of a ring's n - 1 steps, where an all-reduce after the MLP took 2 (n - 1);
the last layer's sum is whole on each chip (an all-reduce) for the head.

The forward is Tunix's `Attention.block` / `DecoderLayer` for one token (norms, rotary
embedding, masked logits, float32 softmax, output projection, MLP) on the layer's own modules,
so qwix's LoRA sees every projection; sliding-window layers mask prompt keys more than their
window behind the newest slot, as Tunix's `create_sliding_window_mask` does (their new keys
are the ring's). Gemma 2 keeps Tunix's decode (`reasoner.sampler.generate`), a whole-sequence
cache in every layer.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner import mesh as mesh_lib
from reasoner.models.cache import new_slots

KV = tuple[jax.Array, jax.Array]  # keys, values: [B, K, H, P] and [B, K, P, H] (prompt), or
# [N, B, K, H] both (new)


class Cache(NamedTuple):
  prompt: dict[str, KV]  # keys [prompts, K, H, P], values [prompts, K, P, H] per layer: each
  # prompt once, read by its G rows
  new: dict[str, KV]  # [N, prompts * G, K, H] per layer (a ring of the window's slots in a
  # sliding-window layer): slot j mod ring = each row's j-th new token


def shares_prompt(model) -> bool:
  """Whether the model decodes with a `Cache` holding each prompt once: Gemma 3 models (every
  layer Tunix's Gemma 3 `DecoderLayer`)."""
  from tunix.models.gemma3 import model as gemma3_lib

  return all(isinstance(layer, gemma3_lib.DecoderLayer) for layer in model.layers)


def from_prefill(cache: dict, sharding: NamedSharding) -> dict[str, KV]:
  """Tunix's per-layer {'k', 'v': [B, S, K, H]} -> keys [B, K, H, S] and values [B, K, S, H],
  placed by `sharding` (`mesh.prompt_cache_sharding`): the layout the step's attention dots
  read as plain matmuls, batch axes first, so that no step lays the prompt out again."""
  move = lambda x, order: jax.lax.with_sharding_constraint(jnp.transpose(x, order), sharding)
  return {name: (move(c["k"], (0, 2, 3, 1)), move(c["v"], (0, 2, 1, 3)))
          for name, c in cache.items()}


def empty(spec_cfg: Any, rows: int, slots: int, dtype, sharding: NamedSharding) -> dict[str, KV]:
  """Zeroed `Cache.new` for `rows` rows of `slots` new tokens, born in its shards: each
  sliding-window layer a ring of its window's slots where that is fewer (`new_slots`)."""
  zeros = lambda n: jax.lax.with_sharding_constraint(
      jnp.zeros((n, rows, spec_cfg.num_kv_heads, spec_cfg.head_dim), dtype), sharding)
  return {f"layer_{i}": (zeros(n), zeros(n))
          for i, n in enumerate(new_slots(spec_cfg, slots))}


def spans(n: int, parts: int = 4) -> tuple[int, ...]:
  """The static lengths of `Cache.new` a step may read: the quarters of n (fewer if n < 4)."""
  return tuple(sorted({-(-n * (i + 1) // parts) for i in range(parts)}))


def _core(q, k, v, prompt: KV, new: KV, step, prompt_mask, window: int | None):
  """q [R, 1, N, H], k, v [R, 1, K, H] of R rows in groups of the prompts of `prompt`
  (keys [b, K, H, P], values [b, K, P, H]; prompt_mask [b, P]) -> the cache's new part with k,
  v at slot `step` (mod its length: a ring), and the attention's output [R, 1, N, H]: each row
  sees its prompt's unmasked slots (within `window` of the newest slot in sliding-window
  layers) and its new tokens <= step, all of a ring's once it has wrapped (a ring is at most
  the window long)."""
  from tunix.models.gemma3 import model as gemma3_lib

  ring = new[0].shape[0]
  if window is not None and ring > window:
    raise ValueError(f"a sliding-window layer's new-token cache has {ring} slots, more than "
                     f"its window {window}: build it with decode.empty (a ring of the window)")
  keys, values = (jax.lax.dynamic_update_slice(c, jnp.swapaxes(a, 0, 1), (step % ring, 0, 0, 0))
                  for c, a in zip(new, (k, v)))
  keys, values = jax.lax.optimization_barrier((keys, values))  # one in-place update
  pk, pv = prompt
  b, kh, p = pv.shape[:3]
  rows, _, n, h = q.shape
  g = rows // b
  q = q.reshape(b, g, kh, n // kh, h)
  seen = prompt_mask  # [b, P]; the newest slot is p + step
  if window is not None:
    seen = seen & (jnp.arange(p) > p + step - window)[None]
  # the prompt's dots as [b, K] batches of plain matmuls ([gG, H] x [H, P], then [gG, P] x
  # [P, H]) on the cache as it lies: jnp.einsum put the values first in the second and XLA:CPU
  # transposed the whole prompt cache for it, in every layer at every step
  heads = lambda a: jnp.swapaxes(a, 1, 2).reshape(b, kh, g * a.shape[3], a.shape[4])
  groups = lambda a: jnp.swapaxes(a.reshape(b, kh, g, -1, a.shape[3]), 1, 2)
  batch = ((0, 1), (0, 1))
  lp = groups(jax.lax.dot_general(heads(q), pk, (((3,), (2,)), batch)))  # [b, g, K, G, P]
  lp = jnp.where(seen[:, None, None, None, :], lp, gemma3_lib.K_MASK)

  def attend(span: int):
    def f(keys, values):
      ks, vs = (a[:span].reshape(span, b, g, kh, h) for a in (keys, values))
      fresh = jnp.arange(span) <= step  # written (a wrapped ring: every slot)
      ln = jnp.where(fresh, jnp.einsum("bgKGH,SbgKH->bgKGS", q, ks), gemma3_lib.K_MASK)
      probs = jax.nn.softmax(jnp.concatenate([lp, ln], axis=-1), axis=-1).astype(vs.dtype)
      return (groups(jax.lax.dot_general(heads(probs[..., :p]), pv, (((3,), (2,)), batch)))
              + jnp.einsum("bgKGS,SbgKH->bgKGH", probs[..., p:], vs))
    return f

  lengths = spans(ring)
  pick = jnp.searchsorted(jnp.asarray(lengths), jnp.minimum(step, ring - 1),
                          side="right")  # the shortest span past the newest slot
  encoded = jax.lax.switch(pick, [attend(s) for s in lengths], keys, values)
  return (keys, values), encoded.reshape(rows, 1, n, h)


def _over_rows(core, mesh: Mesh, g: int):
  """`core` on each chip's own rows (`mesh.decode_rows` = ('fsdp', 'tp')), no collective: a
  chip finds its rows' prompts in its 'fsdp' block's (every chip of the block holds them) at
  the slice its place in 'tp' gives."""
  rows, block = P(("fsdp", "tp")), P("fsdp")

  def local(q, k, v, prompt, new, step, prompt_mask):
    c = q.shape[0]  # this chip's rows: whole groups (c % g == 0) or one group's part
    first, count = jax.lax.axis_index("tp") * c // g, max(1, c // g)
    take = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, first, count, axis)
    return core(q, k, v, tuple(take(a, 0) for a in prompt), new, step, take(prompt_mask, 0))

  slots = lambda spec: P(None, *spec)
  return jax.shard_map(local, mesh=mesh, check_vma=False,
                       in_specs=(rows, rows, rows, (block,) * 2, (slots(rows),) * 2, P(),
                                 block),
                       out_specs=((slots(rows),) * 2, rows))


def _placed(mesh: Mesh | None, spec: P):
  """a -> a constrained to `spec` on `mesh` (unchanged without one: no attention over rows)."""
  if mesh is None:
    return lambda a: a
  return lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def _attention(attn, x, positions, prompt: KV, new: KV, step, prompt_mask, mesh: Mesh | None):
  """Tunix's `Attention.block` for one token per row: x [B, 1, D]; the row's new key and value
  go to slot `step` of `new`. With `mesh`, over each chip's own rows (`_over_rows`): the
  projections too, on the attention's whole weights; the output stays on those rows (the
  residual stream's placement, `hidden_states`)."""
  from tunix.models.gemma3 import model as gemma3_lib

  rows = _placed(mesh, P(("fsdp", "tp")))
  x = rows(x)
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
  window = (attn.sliding_window_size
            if attn.attn_type == gemma3_lib.AttentionType.LOCAL_SLIDING else None)
  core = functools.partial(_core, window=window)
  if mesh is not None:
    core = _over_rows(core, mesh, q.shape[0] // prompt[0].shape[0])
  new, encoded = core(q, k, v, prompt, new, step, prompt_mask)
  return new, rows(attn.attn_vec_einsum(encoded))


def _mlp_over_rows(layer, x: jax.Array, mesh: Mesh, last: bool) -> jax.Array:
  """The MLP half of Tunix's `DecoderLayer` (norms, `FeedForward`, residual) on x [R, 1, D]
  whose rows are split over ('fsdp', 'tp'), the MLP's kernels (and their LoRA) Megatron-style
  over 'tp' as `mesh.decode_shardings` places them: each chip gathers its tp group's rows,
  applies its share of the hidden units (qwix's LoRA included: its down projection's share is
  a share of the sum too) and receives its own rows' shares from every chip of the group (an
  all-to-all), summed in float32; the output's rows are split as x's. `last`: the sum whole on
  each chip of the group instead (one all-reduce), as the head takes it. XLA turned an
  explicit reduce-scatter (`psum_scatter`) into an all-reduce and a slice; an all-to-all it
  keeps."""
  modules = (layer.pre_ffw_norm, layer.mlp, layer.post_ffw_norm)
  graphdef, state = nnx.split(modules)
  specs = jax.tree.map(lambda s: s.spec, mesh_lib.decode_shardings(state, mesh))
  rows, tp = P(("fsdp", "tp")), mesh.shape["tp"]

  def local(state, x_rows):
    pre, mlp, post = nnx.merge(graphdef, state)
    x = jax.lax.all_gather(x_rows, "tp", axis=0, tiled=True)
    h = pre(x)
    part = mlp.down_proj(nnx.gelu(mlp.gate_proj(h)) * mlp.up_proj(h))  # this chip's share
    if last:
      return post(jax.lax.psum(part, "tp")) + x
    shares = jax.lax.all_to_all(part.reshape(tp, *x_rows.shape[:-1], part.shape[-1]), "tp",
                                0, 0)
    return post(jnp.sum(shares.astype(jnp.float32), axis=0).astype(part.dtype)) + x_rows

  return jax.shard_map(local, mesh=mesh, in_specs=(specs, rows),
                       out_specs=P("fsdp") if last else rows, check_vma=False)(state, x)


def hidden_states(model, tokens: jax.Array, positions: jax.Array, cache: Cache,
                  step: jax.Array, prompt_mask: jax.Array,
                  mesh: Mesh | None = None) -> tuple[jax.Array, Cache]:
  """tokens, positions [B, 1] (each row's `step`-th new token); prompt_mask [prompts, P] the
  prompt slots that hold real tokens -> [B, 1, D] after the final norm, and the cache with
  the step's keys and values written. Called through the model's `hidden_states(...,
  step=)`, the method qwix intercepts for LoRA. `mesh`: attention over each chip's own rows
  (the cache's new part split as `mesh.decode_rows` says, ('fsdp', 'tp'))."""
  # over rows: the residual stream on each chip's own rows, as the attention takes and leaves
  # them; the MLP half gathers them and sends each chip its rows' sums (`_mlp_over_rows`), the
  # last layer's whole on each chip of a tp group, as the head takes them (the vocabulary is
  # split over 'tp'). The token ids and their embeddings are whole there too: left to XLA, the
  # lookup took a row's ids to its chip and gathered them back, and the sampling and the loop's
  # "all done?" took a collective each.
  rows, whole = _placed(mesh, P(("fsdp", "tp"))), _placed(mesh, P("fsdp"))
  x = rows(whole(model.embedder.encode(whole(tokens))))
  new, last = {}, len(model.layers) - 1
  for i, layer in enumerate(model.layers):
    name = f"layer_{i}"
    new[name], out = _attention(layer.attn, layer.pre_attention_norm(x), positions,
                                cache.prompt[name], cache.new[name], step, prompt_mask, mesh)
    x = rows(layer.post_attention_norm(out) + x)
    if mesh is None:
      x = layer.post_ffw_norm(layer.mlp(layer.pre_ffw_norm(x))) + x
    else:
      x = _mlp_over_rows(layer, x, mesh, i == last)
  return whole(model.final_norm(x)), Cache(cache.prompt, new)
