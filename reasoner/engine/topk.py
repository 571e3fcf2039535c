"""The top-k heads. The sampler's: the top-k logits and ids of [rows, D] hidden states over the
vocabulary and the log-normaliser, at each decoding step; over vocabulary blocks where asked (no
[rows, V] array), and split over the 'tp' chips of a decode layout (only the candidates cross
chips). A teacher's: the top-k log-probs at every position of [B, T] tokens (`token_topk`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner import mesh as mesh_lib
from reasoner.engine import heads
from reasoner.engine.heads import logits

def _merge_topk(vals, idx, new_vals, new_idx, k: int):
  both_v = jnp.concatenate([vals, new_vals], axis=-1)
  both_i = jnp.concatenate([idx, new_idx], axis=-1)
  top, pos = jax.lax.top_k(both_v, k)
  return top, jnp.take_along_axis(both_i, pos, axis=-1)


def exact_topk(z: jax.Array, k: int, group: int = 64) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis in two stages. The k groups of `group` entries with the
  largest maxima hold all k largest entries (a group holding one has a maximum at least the
  k-th largest value, and at most k groups do), so the second stage picks from k * group
  candidates instead of the whole axis: one max pass over z instead of a top-k over it
  (0.06 s against 0.12 s for [128, 262,144] with its log-sum-exp on the 2-core CPU). Same
  values as `lax.top_k`; among exactly equal values the ids may come in another order. Plain
  `lax.top_k` where the axis is not a multiple of `group` or has fewer than 4k groups."""
  n = z.shape[-1]
  if n % group or n // group < 4 * k:
    vals, ids = jax.lax.top_k(z, k)
    return vals, ids.astype(jnp.int32)
  grouped = z.reshape(*z.shape[:-1], n // group, group)
  _, top_groups = jax.lax.top_k(jnp.max(grouped, axis=-1), k)  # [..., k]
  cand = jnp.take_along_axis(grouped, top_groups[..., None], axis=-2).reshape(*z.shape[:-1], -1)
  vals, pos = jax.lax.top_k(cand, k)
  ids = jnp.take_along_axis(top_groups, pos // group, axis=-1) * group + pos % group
  return vals, ids.astype(jnp.int32)


def vocab_topk(h: jax.Array, emb: jax.Array, k: int, vocab_chunk: int | None,
               softcap: float | None = None, temperature: float = 1.0,
               normaliser: bool = True):
  """[C, D] -> top-k logits / T (descending), their ids, log-sum-exp of logits / T; over
  vocabulary blocks of `vocab_chunk` rows when asked (a running top-k and an online
  log-sum-exp), so no [C, V] array is formed. The sampler's head at each decoding step.
  `normaliser` False: zeros for the log-sum-exp, which is not computed (a greedy decode that
  returns no log-probs: the exp and max over every logit were 4% of an evaluation's decode)."""
  v = emb.shape[0]
  if vocab_chunk is None or vocab_chunk >= v:
    z = logits(h.astype(emb.dtype), emb, softcap, temperature)
    vals, idx = exact_topk(z, k)
    if not normaliser:
      return vals, idx, jnp.zeros(z.shape[:1], jnp.float32)
    # Its own max pass, not vals[..., 0] (the same value): on XLA:CPU the log-sum-exp that
    # waits on the top-k made the head 1.3-1.6x slower (32 and 128 rows of 262,144).
    m = jnp.max(z, axis=-1)
    return vals, idx, m + jnp.log(jnp.sum(jnp.exp(z - m[..., None]), axis=-1))
  nb = -(-v // vocab_chunk)
  blocks = jnp.pad(emb, ((0, nb * vocab_chunk - v), (0, 0))).reshape(nb, vocab_chunk, -1)

  def body(carry, xs):
    vals, idx, m, s = carry
    e_b, j = xs
    z = logits(h.astype(emb.dtype), e_b, softcap, temperature)
    ids = j * vocab_chunk + jnp.arange(vocab_chunk, dtype=jnp.int32)
    z = jnp.where(ids[None] < v, z, -jnp.inf)  # padding rows never win
    bv, bi = exact_topk(z, min(k, vocab_chunk))
    vals, idx = _merge_topk(vals, idx, bv, ids[bi], k)
    if not normaliser:
      return (vals, idx, m, s), None
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))  # as in one block
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
    return (vals, idx, m_new, s), None

  c = h.shape[0]
  init = (jnp.full((c, k), -jnp.inf, jnp.float32), jnp.zeros((c, k), jnp.int32),
          jnp.full((c,), -jnp.inf, jnp.float32), jnp.zeros((c,), jnp.float32))
  (vals, idx, m, s), _ = jax.lax.scan(body, init, (blocks, jnp.arange(nb, dtype=jnp.int32)))
  return vals, idx, (m + jnp.log(s)) if normaliser else s


def split_vocab_topk(h: jax.Array, emb: jax.Array, k: int, vocab_chunk: int | None,
                     softcap: float | None, temperature: float, mesh: Mesh,
                     axes: tuple[str, ...] = ("tp",), rows: str | None | bool = True,
                     normaliser: bool = True):
  """`vocab_topk` with the vocabulary split over the mesh's `axes` (the decode layouts'
  embedding over 'tp'): each chip scores its slice of the vocabulary for its rows and keeps its
  top-k and log-sum-exp; one all-gather over `axes` moves rows x (2k + 1) x chips numbers, never
  a vocabulary-sized array, and every chip merges them into the same top-k (chips in vocabulary
  order: ties resolve to the lower id as on one chip) and log-sum-exp. `rows`: the rows' axis
  (True: `mesh.row_axis`; None: every chip takes every row). `normaliser`: as `vocab_topk`."""
  n = math.prod(mesh.shape[a] for a in axes)
  rows = mesh_lib.row_axis(mesh, h.shape[0]) if rows is True else rows
  part = emb.shape[0] // n
  name = axes if len(axes) > 1 else axes[0]

  def local(h, e):
    vals, ids, lse = vocab_topk(h, e, k, vocab_chunk, softcap, temperature, normaliser)
    ids = ids + jax.lax.axis_index(name) * part  # ids < 2^24: exact as float32
    packed = jnp.concatenate([vals, ids.astype(jnp.float32), lse[:, None]], axis=-1)
    every = jax.lax.all_gather(packed, name, axis=1, tiled=True)  # [rows, n * (2k + 1)]
    every = every.reshape(h.shape[0], n, 2 * k + 1)
    top, pos = jax.lax.top_k(every[..., :k].reshape(h.shape[0], -1), k)
    cand = every[..., k:2 * k].reshape(h.shape[0], -1).astype(jnp.int32)
    lse = jax.nn.logsumexp(every[..., -1], -1) if normaliser else every[:, 0, -1]  # zeros
    return top, jnp.take_along_axis(cand, pos, axis=-1), lse

  return jax.shard_map(local, mesh=mesh, in_specs=(P(rows, None), P(name, None)),
                       out_specs=(P(rows, None), P(rows, None), P(rows)), check_vma=False)(h, emb)


def token_topk(hidden: jax.Array, embedding: jax.Array, k: int, *, chunk: int | None = None,
               mesh: Mesh | None = None, softcap: float | None = None,
               temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """[B, T, D] hidden states -> the top-k log-probs of softmax(logits / T) at every position
  and their ids, [B, T, k] each (descending): a teacher's distribution, cut to what crosses
  to the student (`objectives.distill`). Tokens in chunks as the log-prob heads take them
  (`heads.plan_layout`), the vocabulary split over the same chips (`mesh.vocab_axes`): each
  step's hidden states go to every chip, each keeps the top-k of its slice, and only those
  candidates cross chips (`split_vocab_topk`). No [tokens, V] array exists."""
  b, t, _ = hidden.shape
  v = embedding.shape[0]
  lay = heads.plan_layout(b, t, v, mesh=mesh, chunk=chunk)
  axes = mesh_lib.vocab_axes(mesh, v, lay.shards)
  if mesh is not None and math.prod(mesh.shape[a] for a in axes) == 1:
    axes = ()
  if axes:
    embedding = jax.lax.with_sharding_constraint(embedding, NamedSharding(mesh, P(axes, None)))

  def body(carry, h):
    if axes:
      vals, ids, lse = split_vocab_topk(h, embedding, k, None, softcap, temperature, mesh,
                                        axes, rows=None)
    else:
      vals, ids, lse = vocab_topk(h, embedding, k, None, softcap, temperature)
    return carry, (vals - lse[:, None], ids)

  _, (logq, ids) = jax.lax.scan(body, None, heads.to_chunks(hidden, lay))
  return heads.from_chunks(logq, lay, b, t), heads.from_chunks(ids, lay, b, t)
