"""The vocabulary head, in chunks: no [batch, seq, vocab] array exists, forward or backward.

Gemma's vocabulary is 262,144: for 16 sequences of 1,024 tokens the float32 logits alone are
17 GB. Every head here flattens the tokens and scans over chunks of them.

Layout (`plan_layout`). The [B, T] tokens are cut so that each scan step takes `chunk` tokens
from every data-parallel shard: a [K, shards * chunk, ...] stack whose middle axis is sharded
over 'fsdp'. A chip then holds one [chunk, V / tp] float32 logits block at a time, whatever
the batch: a fixed number of tokens per chip. By default `chunk` keeps that block at 256 MiB
(256 tokens for V = 262,144), and at most `STEP_ROWS` / shards tokens per shard where shards
feed each step (64 on fsdp = 8: a 64 MiB block, still a 512-row matmul a step: larger blocks cost
the batch that fits a chip); `train.head_chunk` overrides
it. In the two log-prob heads the vocabulary is split across the chips instead of the tokens
(`_vocab_parallel`): each step gathers the step's [shards * chunk, D] hidden states and each
chip takes a [shards * chunk, V / (fsdp * tp)] block (the same bytes) against its own slice of
the table, so no chip ever holds the whole [V, D] embedding.

Heads:
- `fused_token_loss`: the training head. The loss, per-token log-probs and entropies, with the
  gradients for the hidden states and (when it is trained) the tied embedding computed in the
  same scan, so each chunk's logits are computed exactly once.
- `fused_sequence_loss`: a loss of each row's sequence log-prob (preference pairs), its
  gradient fused the same way in one pass.
- `token_logprobs`: log-probs and entropies only (old and reference policies). Forward only
  in the trainer; differentiable through remat (the logits twice) for other uses.
The sampler's head, the top-k of each decoded row over the vocabulary, is `engine.topk`.

The fused gradient. The loss is L = sum_i w_i f(logp_i, a_i): a per-token function f (the
GRPO clipped surrogate + KL, `grpo.token_loss`) of the target log-prob, with weights w (the
aggregation, `grpo.token_weights`) and per-token data a (old/ref log-probs, advantages). With
z = E h / T the logits at the sampling temperature T, p = softmax(z) and y the target,
    dL/dz_iv = c_i (1[v = y_i] - p_iv),   c_i = w_i f'(logp_i)
so dL/d(E h) = dL/dz / T, and with Gemma 2's soft cap z T = s tanh(u / s), dL/du = dL/dz / T
(1 - (z T / s)^2). Since f, w and a
are known in the forward pass, the forward scan forms G = dL/du per chunk right after the
logits and computes dh = G E and dE += G^T h there; the custom_vjp's backward only scales them
by the incoming (scalar) cotangent.

Why this variant (Liger-style) and not storing the log-normaliser and recomputing the logits in
the backward (Cut-Cross-Entropy, or remat): the latter accepts any downstream use of logp but
computes every chunk's logits twice, 4 vocabulary matmuls per chunk against the dense path's 3
(1.33x the head's FLOPs). Fused, the
head costs what the dense path costs (3 matmuls, 2 when the embedding is frozen) at chunked
memory. The price: the loss must be a per-token function of logp fixed at the call; the
returned logp and entropy carry no gradient (stop-gradient). Residuals are dh [B*T, D] in the
hidden dtype and, only when the embedding is differentiated, dE [V, D] in its dtype.
A forward-only call (no jax.grad) runs the primal scan: one matmul per chunk, no gradients.

Vocabulary chunks are not used in the two log-prob heads: dE for a vocabulary block needs each
token's final log-normaliser, so a single pass over vocabulary blocks cannot give it (an
online-softmax pass could give dh only), and a [chunk, V / tp] block per chip is already
bounded. `topk.vocab_topk` takes an optional `vocab_chunk` (an online log-sum-exp and a running
top-k).

Precision: logits accumulate in float32 (preferred_element_type); G is cast to the embedding's
dtype for the two gradient matmuls (float32 accumulation), as the MXU takes bf16 operands;
dE accumulates across chunks in float32 and is cast to the embedding's dtype once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner import mesh as mesh_lib

LOGITS_BUDGET = 256 * 2**20  # bytes of one float32 [chunk, V / tp] logits block per chip
STEP_ROWS = 512  # tokens a step takes from all shards together, at most (when several feed it)
TokenFn = Callable[..., jax.Array]  # (logp [C], *args [C]) -> per-token loss [C], elementwise


def logits(hidden: jax.Array, embedding: jax.Array, softcap: float | None = None,
           temperature: float = 1.0) -> jax.Array:
  """[..., D] x [V, D] -> [..., V] float32, with Gemma 2's final soft cap when given, divided
  by the sampling temperature (the distribution softmax(z / T) that rollouts draw from)."""
  out = jnp.einsum("...d,vd->...v", hidden, embedding, preferred_element_type=jnp.float32)
  if softcap is not None:
    out = jnp.tanh(out / softcap) * softcap
  return out if temperature == 1.0 else out / temperature


# ----------------------------------------------------------------------------------- layout

@dataclasses.dataclass(frozen=True)
class Layout:
  """[B, T] tokens as `chunks` scan steps of `shards` x `chunk` tokens (padded at the end)."""

  chunk: int  # tokens per shard per step
  chunks: int  # scan length K
  shards: int  # data-parallel shards feeding every step
  mesh: Mesh | None = None  # set: chunks are constrained to P(None, 'fsdp')

  def constrain(self, x: jax.Array, *spec: Any) -> jax.Array:
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))


def auto_chunk(vocab: int, tp: int = 1, budget: int = LOGITS_BUDGET, shards: int = 1) -> int:
  """Tokens per chip per step: one float32 [chunk, vocab / tp] block is at most `budget` bytes,
  and `shards` > 1 shards feed a step at most `STEP_ROWS` tokens together. (On one device the
  cap stays off: on a CPU, 64-token steps made the fused head 1.5x slower than 256-token ones.)"""
  chunk = max(8, budget // (4 * max(1, vocab // tp)))
  return chunk if shards == 1 else max(8, min(chunk, STEP_ROWS // shards))


def plan_layout(rows: int, positions: int, vocab: int, *, mesh: Mesh | None = None,
                chunk: int | None = None) -> Layout:
  """Chooses the chunking for [rows, positions] tokens from the shapes and the mesh.

  Rows split over 'fsdp' when they divide evenly (as `mesh.put_batch` places them); `chunk`
  (tokens per shard per step) defaults to `auto_chunk`, then is balanced over the steps so the
  padding is under one token per step (plus under 8 per step when rounded to sublanes).
  """
  fsdp = int(mesh.shape.get("fsdp", 1)) if mesh is not None else 1
  tp = int(mesh.shape.get("tp", 1)) if mesh is not None else 1
  shards = fsdp if rows % fsdp == 0 else 1
  per_shard = max(1, rows * positions // shards)
  want = chunk if chunk is not None else auto_chunk(vocab, tp if vocab % tp == 0 else 1,
                                                    shards=shards)
  k = -(-per_shard // max(1, min(want, per_shard)))
  c = -(-per_shard // k)
  if chunk is None and c > 8:
    c = -(-c // 8) * 8  # sublane-aligned blocks
  return Layout(chunk=c, chunks=k, shards=shards, mesh=mesh if shards > 1 else None)


def to_chunks(x: jax.Array, lay: Layout) -> jax.Array:
  """[B, T, ...] -> [K, shards * chunk, ...]; each shard's tokens stay on that shard."""
  b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
  s, k, c = lay.shards, lay.chunks, lay.chunk
  x = x.reshape(s, b * t // s, *rest)
  x = jnp.pad(x, [(0, 0), (0, k * c - b * t // s)] + [(0, 0)] * len(rest))
  x = x.reshape(s, k, c, *rest).swapaxes(0, 1).reshape(k, s * c, *rest)
  return lay.constrain(x, None, "fsdp", *([None] * len(rest)))


def from_chunks(y: jax.Array, lay: Layout, b: int, t: int) -> jax.Array:
  """Inverse of `to_chunks`: [K, shards * chunk, ...] -> [B, T, ...] (padding dropped)."""
  s, k, c, rest = lay.shards, lay.chunks, lay.chunk, y.shape[2:]
  y = y.reshape(k, s, c, *rest).swapaxes(0, 1).reshape(s, k * c, *rest)
  return y[:, :b * t // s].reshape(b, t, *rest)


def _gathered(embedding: jax.Array, lay: Layout) -> jax.Array:
  """The embedding whole along D on every chip (vocabulary still split over 'tp'), once,
  outside the scan: the logits contract over D, so a D-sharded block would need a reduction."""
  return lay.constrain(embedding, mesh_lib.vocab_axis(lay.mesh, embedding.shape[0]), None)


def _vocab_axes(lay: Layout, vocab: int) -> tuple[str, ...]:
  return mesh_lib.vocab_axes(lay.mesh, vocab, lay.shards)


def _vocab_parallel(embedding: jax.Array, lay: Layout) -> jax.Array:
  """The log-prob heads' embedding: each chip holds a slice of the vocabulary, whole along D
  (an all-to-all of the fsdp-sharded table, [V / 8, D] a chip), and each scan step gathers the
  step's hidden states from every shard instead: [shards * chunk, D] a step against a whole
  [V, D] table. Gemma3-1B, fsdp = 8: 72 MiB instead of 576 MiB (plus a copy) held a chip, and
  4.7 + 9.4 MB moved a step (hidden states gathered, dh reduce-scattered) instead of the
  table once. The log-normaliser, target logit and entropy become [shards * chunk]-sized
  reductions across chips."""
  return lay.constrain(embedding, _vocab_axes(lay, embedding.shape[0]) or None, None)


def _layout(hidden: jax.Array, embedding: jax.Array, mesh: Mesh | None,
            chunk: int | None) -> Layout:
  return plan_layout(hidden.shape[0], hidden.shape[1], embedding.shape[0], mesh=mesh,
                     chunk=chunk)


# ------------------------------------------------------------------------- one chunk's stats

class _Chunk(NamedTuple):
  z: jax.Array  # [C, V] float32 logits (soft-capped)
  p: jax.Array  # [C, V] softmax
  hit: jax.Array  # [C, V] bool, v == target
  logp: jax.Array  # [C] log p(target)
  entropy: jax.Array  # [C]
  lse: jax.Array  # [C] the log-normaliser


def _chunk_stats(h: jax.Array, emb: jax.Array, y: jax.Array, softcap: float | None,
                 lay: Layout, temperature: float = 1.0) -> _Chunk:
  """Logits once, one exp pass for the normaliser, the softmax and the entropy.

  The target is picked by comparison with an iota, not a gather, so a vocabulary split across
  chips (`_vocab_parallel`) needs only [C]-sized reductions across them."""
  z = logits(h.astype(emb.dtype), emb, softcap, temperature)
  vocab = _vocab_axes(lay, emb.shape[0])
  z = lay.constrain(z, None if "fsdp" in vocab else "fsdp", vocab or None)
  m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  e = jnp.exp(z - m)
  total = jnp.sum(e, axis=-1, keepdims=True)
  lse = (m + jnp.log(total))[:, 0]
  hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == y[:, None]
  logp = jnp.sum(jnp.where(hit, z, 0.0), axis=-1) - lse
  p = e / total
  entropy = jax.lax.stop_gradient(lse - jnp.sum(p * z, axis=-1))
  return _Chunk(z, p, hit, logp, entropy, lse)


# ------------------------------------------------------------------------------ log-probs

def token_logprobs(
    hidden: jax.Array,  # [B, T, D]
    embedding: jax.Array,  # [V, D]
    targets: jax.Array,  # [B, T] int
    *,
    chunk: int | None = None,  # tokens per shard per step (None: `auto_chunk`)
    mesh: Mesh | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,  # of softmax(z / T): the sampling distribution's log-probs
) -> tuple[jax.Array, jax.Array]:  # log p(target) [B, T], entropy [B, T], float32
  """Per-token log-probabilities of `targets` and each position's entropy (a stop-gradient).

  Peak memory: a few [chunk, V / tp] float32 blocks per chip plus the hidden states. Forward:
  one logits matmul per chunk. Gradients (of logp) rematerialise each chunk's logits: 4
  matmuls; the trainer differentiates `fused_token_loss` instead (3, or 2 with a frozen
  embedding).
  """
  b, t, _ = hidden.shape
  lay = _layout(hidden, embedding, mesh, chunk)
  emb = _vocab_parallel(embedding, lay)

  @jax.checkpoint
  def body(carry, xs):
    st = _chunk_stats(xs[0], emb, xs[1], softcap, lay, temperature)
    return carry, (st.logp, st.entropy)

  _, (logp, ent) = jax.lax.scan(body, None, (to_chunks(hidden, lay), to_chunks(targets, lay)))
  return from_chunks(logp, lay, b, t), from_chunks(ent, lay, b, t)


# ----------------------------------------------------------------------------- fused loss

@dataclasses.dataclass(frozen=True)
class _Static:
  token_fn: TokenFn
  softcap: float | None
  lay: Layout
  temperature: float = 1.0


def _soft_target(ch: _Chunk, ids: jax.Array, q: jax.Array,
                 split: bool) -> tuple[jax.Array, jax.Array]:
  """A chunk's cross-entropy against a target distribution given by its top entries, ids and
  (weighted) probabilities q [C, k]: (-sum_j q_j log p(ids_j) [C], its dL/dz [C, V] =
  p sum_j q_j - q on the ids). Where the vocabulary is `split` over chips the ids are picked by
  comparison with an iota, as the target is (`_chunk_stats`): no scatter across chips, k passes
  over the block; on one chip, a scatter (a third of the comparisons' time, k = 16, CPU)."""
  if split:
    iota = jax.lax.broadcasted_iota(jnp.int32, ch.z.shape, 1)
    dense = jnp.zeros_like(ch.z)
    for j in range(ids.shape[-1]):
      dense = dense + jnp.where(iota == ids[:, j:j + 1], q[:, j:j + 1], 0.0)
  else:
    rows = jnp.arange(ids.shape[0])[:, None]
    dense = jnp.zeros_like(ch.z).at[rows, ids].add(q)
  mass = jnp.sum(q, axis=-1)
  ce = mass * ch.lse - jnp.sum(dense * ch.z, axis=-1)
  return ce, ch.p * mass[:, None] - dense


def _fused_scan(st: _Static, h, emb, y, w, args, soft, want_dh: bool, want_de: bool):
  """Chunks [K, C', ...] -> loss, (logp, entropy[, dh]) [K, C', ...], dE [V, D] float32 or 0.
  `soft`: () or (ids, q) [K, C', k], a target distribution's cross-entropy added to the loss."""
  v, d = emb.shape
  de0 = jnp.zeros((v, d), jnp.float32) if want_de else jnp.zeros((), jnp.float32)
  if want_de:
    vocab = _vocab_axes(st.lay, v)
    split_d = "fsdp" if d % st.lay.shards == 0 and "fsdp" not in vocab else None
    de0 = st.lay.constrain(de0, vocab or None, split_d)

  def body(carry, xs):
    loss, de = carry
    h_c, y_c, w_c, a_c, soft_c = xs
    ch = _chunk_stats(h_c, emb, y_c, st.softcap, st.lay, st.temperature)
    tok, pull = jax.vjp(lambda lp: st.token_fn(lp, *a_c), ch.logp)
    loss = loss + jnp.sum(w_c * tok)
    if soft_c:
      ce, dz_soft = _soft_target(ch, *soft_c, bool(_vocab_axes(st.lay, v)))
      loss = loss + jnp.sum(ce)
    out = (ch.logp, ch.entropy)
    if want_dh or want_de:
      (c,) = pull(w_c.astype(tok.dtype))  # c_i = w_i f'(logp_i)
      dz = jnp.where(ch.hit, c[:, None], 0.0) - ch.p * c[:, None]  # dL/dz
      if soft_c:
        dz = dz + dz_soft
      if st.temperature != 1.0:
        dz = dz / st.temperature  # through z / T
      if st.softcap is not None:  # through s tanh(u / s), whose value is z T
        dz = dz * (1.0 - jnp.square(ch.z * st.temperature / st.softcap))
      dz = dz.astype(emb.dtype)
      if want_dh:
        dh = jnp.einsum("cv,vd->cd", dz, emb, preferred_element_type=jnp.float32)
        out = out + (st.lay.constrain(dh.astype(h_c.dtype), "fsdp", None),)
      if want_de:
        de = de + jnp.einsum("cv,cd->vd", dz, h_c.astype(emb.dtype),
                             preferred_element_type=jnp.float32)
    return (loss, de), out

  (loss, de), outs = jax.lax.scan(body, (jnp.zeros((), jnp.float32), de0),
                                  (h, y, w, args, soft))
  return loss, outs, de


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(st: _Static, h, emb, y, w, args, soft):
  loss, (logp, ent), _ = _fused_scan(st, h, emb, y, w, args, soft, False, False)
  return loss, logp, ent


def _fused_fwd(st: _Static, h, emb, y, w, args, soft):
  want_dh, want_de = h.perturbed, emb.perturbed
  args, soft = jax.tree.map(lambda a: a.value, (args, soft))
  loss, outs, de = _fused_scan(st, h.value, emb.value, y.value, w.value, args, soft, want_dh,
                               want_de)
  dh = outs[2] if want_dh else None
  de = de.astype(emb.value.dtype) if want_de else None
  return (loss, outs[0], outs[1]), (dh, de)


def _fused_bwd(st: _Static, res, cts):
  dh, de = res
  ct = cts[0]
  if isinstance(ct, SymbolicZero):
    return None, None, None, None, None, None
  scale = lambda x: None if x is None else (x.astype(jnp.float32) * ct).astype(x.dtype)
  return scale(dh), scale(de), None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def fused_token_loss(
    hidden: jax.Array,  # [B, T, D]
    embedding: jax.Array,  # [V, D], tied
    targets: jax.Array,  # [B, T] int
    weights: jax.Array,  # [B, T] float: L = sum(weights * token_fn(logp, *token_args))
    token_fn: TokenFn,  # elementwise per-token loss, e.g. partial(grpo.token_loss, ...)
    token_args: tuple[jax.Array, ...],  # [B, T] each, the per-token data token_fn takes
    *,
    chunk: int | None = None,
    mesh: Mesh | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,  # of softmax(z / T), as in `token_logprobs`
    soft: tuple[jax.Array, jax.Array] | None = None,  # ids [B, T, k] int, q [B, T, k] float
) -> tuple[jax.Array, jax.Array, jax.Array]:  # loss [], logp [B, T], entropy [B, T] (float32)
  """The weighted per-token loss of the targets' log-probs, its gradients fused (module doc).
  `soft` adds each position's cross-entropy against a target distribution given by its top
  entries, -sum_j q_j log p(ids_j) with q already weighted (a teacher's top-k, distillation's):
  dL/dz = p sum_j q_j - q on the ids, fused the same way.

  Gradients reach `hidden` and (if differentiated) `embedding` only through the loss; logp and
  entropy are stop-gradient outputs, and weights / token_args get no gradient. Peak memory:
  a few [chunk, V / tp] float32 blocks per chip, plus dh [B*T, D] (and dE [V, D]) held for
  the backward pass.
  """
  b, t, _ = hidden.shape
  lay = _layout(hidden, embedding, mesh, chunk)
  st = _Static(token_fn=token_fn, softcap=softcap, lay=lay, temperature=temperature)
  args = tuple(to_chunks(a.astype(jnp.float32), lay) for a in token_args)
  soft = () if soft is None else (to_chunks(soft[0].astype(jnp.int32), lay),
                                   to_chunks(soft[1].astype(jnp.float32), lay))
  loss, logp, ent = _fused(st, to_chunks(hidden, lay), _vocab_parallel(embedding, lay),
                           to_chunks(targets, lay), to_chunks(weights.astype(jnp.float32), lay),
                           args, soft)
  unchunk = lambda x: jax.lax.stop_gradient(from_chunks(x, lay, b, t))
  return loss, unchunk(logp), unchunk(ent)


# -------------------------------------------------------------------- fused sequence loss

SeqFn = Callable[..., jax.Array]  # (S [B], *row_args [B]) -> scalar loss


def _identity(logp: jax.Array) -> jax.Array:
  return logp


@dataclasses.dataclass(frozen=True)
class _SeqStatic:
  seq_fn: SeqFn
  tokens: _Static  # the per-token scan, with f(logp) = logp
  b: int
  t: int


def _sums(st: _SeqStatic, logp, w) -> jax.Array:  # [K, C'] chunks -> S [B]
  lay = st.tokens.lay
  return jnp.sum(from_chunks(logp * w, lay, st.b, st.t), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_seq(st: _SeqStatic, h, emb, y, w, args):
  _, (logp, ent), _ = _fused_scan(st.tokens, h, emb, y, w, (), (), False, False)
  s = _sums(st, logp, w)
  return st.seq_fn(s, *args), s, logp, ent


def _fused_seq_fwd(st: _SeqStatic, h, emb, y, w, args):
  if emb.perturbed:
    raise NotImplementedError("fused_sequence_loss: the embedding must be frozen (a row's "
                              "coefficient is known only after the scan, and dE mixes rows)")
  args = jax.tree.map(lambda a: a.value, args)
  # dh of sum(w * logp) per token (c_i = w_i), then each row's dL/dS once the scan is done
  _, outs, _ = _fused_scan(st.tokens, h.value, emb.value, y.value, w.value, (), (),
                           h.perturbed, False)
  s = _sums(st, outs[0], w.value)
  loss, pull = jax.vjp(lambda s: st.seq_fn(s, *args), s)
  dh = None
  if h.perturbed:
    (c,) = pull(jnp.ones((), loss.dtype))  # [B] dL/dS
    c = to_chunks(jnp.broadcast_to(c[:, None], (st.b, st.t)), st.tokens.lay)
    dh = (outs[2].astype(jnp.float32) * c[..., None]).astype(h.value.dtype)
  return (loss, s, outs[0], outs[1]), dh


def _fused_seq_bwd(st: _SeqStatic, dh, cts):
  ct = cts[0]
  if isinstance(ct, SymbolicZero) or dh is None:
    return None, None, None, None, None
  return (dh.astype(jnp.float32) * ct).astype(dh.dtype), None, None, None, None


_fused_seq.defvjp(_fused_seq_fwd, _fused_seq_bwd, symbolic_zeros=True)


def fused_sequence_loss(
    hidden: jax.Array,  # [B, T, D]
    embedding: jax.Array,  # [V, D], tied and frozen
    targets: jax.Array,  # [B, T] int
    weights: jax.Array,  # [B, T] float: S_b = sum_t weights[b, t] * logp[b, t]
    seq_fn: SeqFn,  # L = seq_fn(S, *seq_args): a scalar function of every row's S
    seq_args: tuple[jax.Array, ...],  # [B] each, the per-row data seq_fn takes
    *,
    chunk: int | None = None,
    mesh: Mesh | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # loss, S [B], logp, entropy [B, T]
  """A loss of each row's weighted sum of target log-probs (a sequence log-prob: DPO, SimPO,
  ORPO pair two rows' sums), its gradient fused as `fused_token_loss`'s: dL/dlogp_bt =
  dL/dS_b * w_bt, and since every token of a row shares dL/dS_b, the scan forms each token's
  dh for the coefficient w alone and scales it by its row's dL/dS once the scan has all of S.
  Exact, in one pass of 2 vocabulary matmuls a chunk (logits and dh); the embedding must be
  frozen (dE would need the coefficients inside the scan). S, logp and entropy carry no
  gradient; weights and seq_args get none.
  """
  b, t, _ = hidden.shape
  lay = _layout(hidden, embedding, mesh, chunk)
  st = _SeqStatic(seq_fn, _Static(_identity, softcap, lay, temperature), b, t)
  loss, s, logp, ent = _fused_seq(st, to_chunks(hidden, lay), _vocab_parallel(embedding, lay),
                                  to_chunks(targets, lay),
                                  to_chunks(weights.astype(jnp.float32), lay),
                                  tuple(a.astype(jnp.float32) for a in seq_args))
  unchunk = lambda x: jax.lax.stop_gradient(from_chunks(x, lay, b, t))
  return loss, jax.lax.stop_gradient(s), unchunk(logp), unchunk(ent)
