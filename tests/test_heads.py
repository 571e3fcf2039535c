"""The chunked heads against dense float32 references, on 1 device and on 8 fake devices."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner.engine import heads, topk
from reasoner.objectives import grpo

# jitted models and heads against their references: seconds each, `make test` (not `make check`)
pytestmark = pytest.mark.slow



def objective(beta, **options):
  """Off-policy (the old log-probs given), so that the ratio and its clipping are exercised."""
  return grpo.Objective(epsilon_low=0.2, epsilon_high=0.28, beta=beta, on_policy=False,
                        **options)


def dense(h, e, y, softcap=None, temperature=1.0):
  z = jnp.einsum("btd,vd->btv", h, e)
  if softcap:
    z = jnp.tanh(z / softcap) * softcap
  z = z / temperature
  logp_all = jax.nn.log_softmax(z, -1)
  logp = jnp.take_along_axis(logp_all, y[..., None], -1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
  return logp, ent


def problem(b, t, v=97, d=16, seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  h = jax.random.normal(k[0], (b, t, d))
  e = jax.random.normal(k[1], (v, d)) * 0.5
  y = jax.random.randint(k[2], (b, t), 0, v)
  lengths = jax.random.randint(k[3], (b,), 0, t + 1).at[0].set(t)
  mask = jnp.arange(t)[None] < lengths[:, None]  # right padding: row 0 full, others any
  logp, _ = dense(h, e, y)
  old = logp + 0.3 * jax.random.normal(k[4], (b, t))  # ratios on both sides of the clip
  ref = logp + 0.3 * jax.random.normal(k[5], (b, t))
  adv = jax.random.normal(k[6], (b,))
  return h, e, y, mask, old, ref, adv


def dense_loss(h, e, y, mask, old, ref, adv, *, beta, agg, softcap, temperature=1.0,
               **options):
  logp, ent = dense(h, e, y, softcap, temperature)
  loss, _ = grpo.policy_loss(logp, old, ref, adv, mask, obj=objective(beta, **options),
                             loss_agg=agg, sampler_logp=(old + ref) / 2)
  return loss, (logp, ent)


def fused_loss(h, e, y, mask, old, ref, adv, *, beta, agg, softcap, chunk=None, mesh=None,
               temperature=1.0, soft=None, **options):
  """The trainer's use of the fused head: GSPO's row ratios from a forward pass first."""
  obj = objective(beta, **options)
  row = lambda x: jnp.broadcast_to(x[:, None], old.shape)
  seq = jnp.zeros(adv.shape)
  if obj.sequence:
    logp = jax.lax.stop_gradient(heads.token_logprobs(h, e, y, softcap=softcap,
                                                      temperature=temperature)[0])
    seq = grpo.sequence_log_ratio(logp, old, mask)
  loss, logp, ent = heads.fused_token_loss(
      h, e, y, grpo.token_weights(mask, agg), functools.partial(grpo.token_loss, obj=obj),
      (old, ref, row(adv), (old + ref) / 2, row(seq)), chunk=chunk, mesh=mesh,
      softcap=softcap, temperature=temperature, soft=soft)
  return loss, (logp, ent)


def assert_close_grads(ours, ref, rtol=1e-4):
  for a, r in zip(ours, ref):
    scale = float(jnp.max(jnp.abs(r))) or 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=rtol, atol=1e-5 * scale)


@pytest.mark.parametrize("b,t,chunk,softcap,temperature",
                         [(3, 7, 4, None, 1.0), (2, 5, 64, 30.0, 0.7), (1, 1, 3, None, 1.5)])
def test_chunked_logprobs_match_dense(b, t, chunk, softcap, temperature):
  h, e, y, *_ = problem(b, t)
  w = jax.random.normal(jax.random.key(9), (b, t))
  kw = dict(chunk=chunk, softcap=softcap, temperature=temperature)
  lp, ent = heads.token_logprobs(h, e, y, **kw)
  lp_d, ent_d = dense(h, e, y, softcap, temperature)
  np.testing.assert_allclose(lp, lp_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_d, rtol=1e-5, atol=1e-5)
  f = lambda fn: lambda h, e: jnp.sum(fn(h, e)[0] * w)  # entropy is a stop-gradient metric
  ours = jax.grad(f(lambda h, e: heads.token_logprobs(h, e, y, **kw)), argnums=(0, 1))(h, e)
  ref = jax.grad(f(lambda h, e: dense(h, e, y, softcap, temperature)), argnums=(0, 1))(h, e)
  assert_close_grads(ours, ref)


@pytest.mark.parametrize("b,t,chunk,softcap,beta,agg,options", [
    (3, 7, 4, None, 0.0, "token-mean", {}),  # 21 tokens: the last chunk is padded
    (2, 5, 3, 30.0, 0.04, "sequence-mean-token-mean", {}),  # soft cap, KL, padding
    (4, 9, None, 5.0, 0.1, "sequence-mean-token-scale", {}),  # automatic chunk, a tight cap
    (1, 1, 8, None, 0.04, "token-mean", {}),
    # the sampling temperature, through the soft cap too; GSPO; k1; sampler IS
    (3, 7, 4, 30.0, 0.04, "sequence-mean-token-sum-norm", {"temperature": 0.7}),
    (3, 6, 4, None, 0.04, "sequence-mean-token-mean", {"temperature": 1.3, "sequence": True,
                                                         "kl": "k1"}),
    (3, 5, None, 5.0, 0.0, "token-mean", {"temperature": 0.6, "sampler_is_cap": 1.2}),
])
def test_fused_loss_matches_dense(b, t, chunk, softcap, beta, agg, options):
  args = problem(b, t, seed=b + t)
  kw = dict(beta=beta, agg=agg, softcap=softcap, **options)
  (loss, (lp, ent)), grads = jax.jit(jax.value_and_grad(
      lambda h, e: fused_loss(h, e, *args[2:], chunk=chunk, **kw), argnums=(0, 1),
      has_aux=True))(*args[:2])
  (loss_d, (lp_d, ent_d)), grads_d = jax.value_and_grad(
      lambda h, e: dense_loss(h, e, *args[2:], **kw), argnums=(0, 1), has_aux=True)(*args[:2])
  np.testing.assert_allclose(loss, loss_d, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lp, lp_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_d, rtol=1e-5, atol=1e-5)
  assert_close_grads(grads, grads_d)
  assert float(jnp.abs(grads[0]).max()) > 0


def test_fused_loss_frozen_embedding_and_forward_only():
  args = problem(4, 6)
  kw = dict(beta=0.04, agg="token-mean", softcap=None)
  f = lambda h: fused_loss(h, args[1], *args[2:], chunk=5, **kw)[0]
  g = jax.grad(f)(args[0])  # the embedding is a constant: no dE is formed
  g_d = jax.grad(lambda h: dense_loss(h, args[1], *args[2:], **kw)[0])(args[0])
  assert_close_grads([g], [g_d])
  np.testing.assert_allclose(f(args[0]), dense_loss(*args, **kw)[0], rtol=1e-5)


def count_matmuls(jaxpr, vocab) -> int:
  """dot_generals with the vocabulary in an operand, through scans and other sub-jaxprs."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      n += any(vocab in getattr(x.aval, "shape", ()) for x in eqn.invars)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else [p]:
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          n += count_matmuls(inner, vocab)
  return n


@pytest.mark.parametrize("train_embedding,expected", [(True, 3), (False, 2)])
def test_each_chunks_logits_are_computed_once(train_embedding, expected):
  h, e, y, mask, old, ref, adv = problem(4, 6, v=101)
  kw = dict(beta=0.04, agg="token-mean", softcap=30.0, chunk=5)
  argnums = (0, 1) if train_embedding else 0
  grad = jax.grad(lambda h, e: fused_loss(h, e, y, mask, old, ref, adv, **kw)[0], argnums)
  assert count_matmuls(jax.make_jaxpr(grad)(h, e).jaxpr, 101) == expected  # z, dh[, dE]
  remat = jax.grad(lambda h, e: jnp.sum(heads.token_logprobs(h, e, y, chunk=5)[0]), argnums)
  assert count_matmuls(jax.make_jaxpr(remat)(h, e).jaxpr, 101) == expected + 1  # z twice


def test_layout_is_a_fixed_number_of_tokens_per_chip():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8, 1), ("fsdp", "tp"))
  for rows in (8, 64, 256):  # 8 shards feed each step: 512 tokens together, 64 from each
    lay = heads.plan_layout(rows, 1024, 262_144, mesh=mesh)
    assert (lay.chunk, lay.shards) == (64, 8)
    assert lay.chunks == rows * 1024 // 8 // 64
  one = heads.plan_layout(4, 1024, 262_144)  # one device: the 256 MiB block, 256 tokens
  assert (one.chunk, one.shards, one.chunks) == (256, 1, 16)
  odd = heads.plan_layout(3, 7, 97, chunk=4)
  assert (odd.shards, odd.chunk, odd.chunks) == (1, 4, 6)  # balanced: 24 slots for 21 tokens
  x = jnp.arange(16 * 5 * 3).reshape(16, 5, 3)
  lay = heads.plan_layout(16, 5, 97, mesh=mesh, chunk=4)
  np.testing.assert_array_equal(heads.from_chunks(heads.to_chunks(x, lay), lay, 16, 5), x)


def test_vocab_parallel_head_never_holds_the_whole_embedding():
  """Tokens over 'fsdp', the table stored [V, D / 8] a chip (Tunix's emb_vd): the training
  head gathers hidden states, not the table, so its per-chip temporaries stay under half the
  [V, D] table (6.3 MB against 16.8; gathering the table, as before, took 33.6 MB: it and a
  copy)."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8, 1), ("fsdp", "tp"))
  v, d, rows, t = 32_768, 128, 8, 64
  sds = lambda shape, dtype, *spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
  h, e = sds((rows, t, d), jnp.float32, "fsdp"), sds((v, d), jnp.float32, "tp", "fsdp")
  y, mask = sds((rows, t), jnp.int32, "fsdp"), sds((rows, t), bool, "fsdp")
  old = ref = sds((rows, t), jnp.float32, "fsdp")
  adv = sds((rows,), jnp.float32, "fsdp")
  grad = jax.grad(lambda h, e, *a: fused_loss(h, e, *a, beta=0.04, agg="token-mean",
                                              softcap=None, chunk=16, mesh=mesh)[0])
  compiled = jax.jit(grad).lower(h, e, y, mask, old, ref, adv).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < v * d * 4 / 2


@pytest.mark.parametrize("fsdp,tp,rows", [(8, 1, 16), (2, 4, 6), (8, 1, 6)])
def test_sharded_heads_match_dense(fsdp, tp, rows):
  """Rows over 'fsdp', the embedding's vocabulary over 'tp' and D over 'fsdp' (Tunix's
  emb_vd); (8, 1, 6): rows that do not divide fall back to one shard."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(fsdp, tp), ("fsdp", "tp"))
  h, e, y, mask, old, ref, adv = problem(rows, 11, v=96, d=16, seed=rows)
  row = lambda x: jax.device_put(x, NamedSharding(
      mesh, P("fsdp" if rows % fsdp == 0 else None, *([None] * (x.ndim - 1)))))
  hs, ys, ms, olds, refs, advs = map(row, (h, y, mask, old, ref, adv))
  es = jax.device_put(e, NamedSharding(mesh, P("tp", "fsdp")))
  kw = dict(beta=0.04, agg="token-mean", softcap=30.0)
  ours = jax.jit(jax.value_and_grad(
      lambda h, e: fused_loss(h, e, ys, ms, olds, refs, advs, chunk=4, mesh=mesh, **kw),
      argnums=(0, 1), has_aux=True))(hs, es)
  ref_out = jax.value_and_grad(lambda h, e: dense_loss(h, e, y, mask, old, ref, adv, **kw),
                               argnums=(0, 1), has_aux=True)(h, e)
  (loss, (lp, ent)), grads = ours
  (loss_d, (lp_d, ent_d)), grads_d = ref_out
  np.testing.assert_allclose(loss, loss_d, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lp, lp_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_d, rtol=1e-5, atol=1e-5)
  assert_close_grads(grads, grads_d)
  lp2, _ = jax.jit(lambda h, e: heads.token_logprobs(h, e, ys, chunk=4, mesh=mesh,
                                                     softcap=30.0))(hs, es)
  np.testing.assert_allclose(lp2, lp_d, rtol=1e-5, atol=1e-5)
  flat = lambda x: x.reshape(-1, x.shape[-1])  # the sampler's [rows, D]
  vals, ids, _ = jax.jit(lambda h, e: topk.vocab_topk(flat(h), e, 3, None))(hs, es)
  vals_d, ids_d = jax.lax.top_k(heads.logits(flat(h), e), 3)
  np.testing.assert_allclose(vals, vals_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ids, ids_d)


def teacher_topk(b, t, v, d, k, seed=3):
  """A teacher's top-k (ids, log-probs) at every position, densely, and weights q = coef x
  the top-k renormalised x each token's weight (distillation's soft targets)."""
  kh, ke = jax.random.split(jax.random.key(seed))
  th, te = jax.random.normal(kh, (b, t, d)), jax.random.normal(ke, (v, d))
  logq, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.einsum("btd,vd->btv", th, te), -1), k)
  return th, te, logq, ids


def soft_dense(h, e, ids, q, softcap, temperature):
  z = jnp.einsum("btd,vd->btv", h, e)
  z = (jnp.tanh(z / softcap) * softcap if softcap else z) / temperature
  return -jnp.sum(q * jnp.take_along_axis(jax.nn.log_softmax(z, -1), ids, -1))


@pytest.mark.parametrize("fsdp,tp,rows,chunk,softcap,temperature", [
    (1, 1, 3, 4, None, 1.0), (1, 1, 2, None, 30.0, 0.7), (8, 1, 16, 4, 30.0, 1.0),
    (2, 4, 6, 4, None, 0.8)])
def test_teacher_topk_and_soft_targets_match_dense(fsdp, tp, rows, chunk, softcap, temperature):
  """Distillation's two heads: a teacher's top-k log-probs at every position (`token_topk`, the
  vocabulary split over the chips) and the student's fused loss with those soft targets added
  (`fused_token_loss(soft=...)`): loss and gradients against full logits."""
  mesh = Mesh(np.asarray(jax.devices()[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
  v, d, k = 96, 16, 5
  h, e, y, mask, old, ref, adv = problem(rows, 7, v=v, d=d, seed=rows)
  th, te, logq_d, ids_d = teacher_topk(rows, 7, v, d, k)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  split = "fsdp" if rows % fsdp == 0 else None
  logq, ids = jax.jit(lambda h, e: topk.token_topk(h, e, k, chunk=chunk, mesh=mesh))(
      put(th, split), put(te, "tp", "fsdp"))
  np.testing.assert_allclose(logq, logq_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ids, ids_d)
  w = grpo.token_weights(mask, "token-mean")
  q = 0.7 * jax.nn.softmax(logq_d, -1) * w[..., None]
  kw = dict(beta=0.04, agg="token-mean", softcap=softcap, temperature=temperature)
  args = [put(x, split) for x in (y, mask, old, ref, adv)]
  (loss, (lp, _)), grads = jax.jit(jax.value_and_grad(
      lambda h, e: fused_loss(h, e, *args, chunk=chunk, mesh=mesh,
                              soft=(put(ids_d, split), put(q, split)), **kw),
      argnums=(0, 1), has_aux=True))(put(h, split), put(e, "tp", "fsdp"))
  loss_d, grads_d = jax.value_and_grad(
      lambda h, e: (dense_loss(h, e, y, mask, old, ref, adv, **kw)[0]
                    + soft_dense(h, e, ids_d, q, softcap, temperature)), argnums=(0, 1))(h, e)
  soft_only = soft_dense(h, e, ids_d, q, softcap, temperature)
  assert float(soft_only) > 0.1 * abs(float(loss_d))  # the soft term weighs in the total
  np.testing.assert_allclose(loss, loss_d, rtol=1e-5, atol=1e-6)
  assert_close_grads(grads, grads_d)
  np.testing.assert_allclose(lp, dense(h, e, y, softcap, temperature)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab_chunk,softcap,temperature",
                         [(None, None, 1.0), (16, None, 0.7), (40, 30.0, 1.0), (40, 30.0, 0.5)])
def test_topk_matches_dense(vocab_chunk, softcap, temperature):
  h, e, *_ = problem(3, 7, v=97)
  h = h.reshape(-1, h.shape[-1])  # the sampler's [rows, D]
  vals, ids, lse = topk.vocab_topk(h, e, 5, vocab_chunk, softcap, temperature)
  z = jnp.einsum("cd,vd->cv", h, e)
  z = (jnp.tanh(z / softcap) * softcap if softcap else z) / temperature
  vals_d, ids_d = jax.lax.top_k(z, 5)
  np.testing.assert_allclose(vals, vals_d, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(ids, ids_d)
  np.testing.assert_allclose(lse, jax.nn.logsumexp(z, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n, k", [(4096, 8), (4096, 40), (1000, 5)])  # two stages, fallbacks
def test_exact_topk_equals_lax_top_k(n, k):
  z = jax.random.permutation(jax.random.key(0), jnp.arange(3 * n, dtype=jnp.float32))
  z = z.reshape(3, n)  # distinct values: the ids are unique
  vals, ids = topk.exact_topk(z, k)
  want_vals, want_ids = jax.lax.top_k(z, k)
  np.testing.assert_array_equal(vals, want_vals)
  np.testing.assert_array_equal(ids, want_ids)


@pytest.mark.parametrize("normaliser", [True, False])
def test_split_vocab_topk_matches_one_chip(normaliser):
  """The vocabulary over tp = 4 (rows over fsdp = 2): the same top-k and log-sum-exp as one
  chip's head; without the normaliser, the same top-k and zeros."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
  h, e, *_ = problem(2, 4, v=96)
  h = h.reshape(-1, h.shape[-1])
  vals, ids, lse = topk.split_vocab_topk(h, e, 5, None, 30.0, 0.7, mesh, normaliser=normaliser)
  want_vals, want_ids, want_lse = topk.vocab_topk(h, e, 5, None, 30.0, 0.7)
  np.testing.assert_allclose(vals, want_vals, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(lse, want_lse if normaliser else np.zeros(8), rtol=1e-6, atol=1e-6)
