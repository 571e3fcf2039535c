"""The GRPO objective by hand, and against Tunix 0.1.7's `grpo_loss_fn` on identical inputs."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoner.objectives import grpo


def test_group_advantages_by_hand():
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
  a = np.asarray(grpo.group_advantages(r, 4, scale=True, eps=0.0)[:4])
  np.testing.assert_allclose(a, [1, -1, -1, 1], rtol=1e-6)  # mean 0.5, std 0.5
  sample = np.asarray(grpo.group_advantages(r, 4, scale=True, eps=0.0, ddof=1)[:4])
  np.testing.assert_allclose(sample, np.array([1, -1, -1, 1]) * np.sqrt(3 / 4), rtol=1e-6)
  np.testing.assert_allclose(grpo.group_advantages(r, 4, scale=False)[:4], [.5, -.5, -.5, .5])
  np.testing.assert_allclose(grpo.group_advantages(r, 4)[4:], 0.0)  # equal rewards: no signal


def _loss(agg, logp, old, adv, mask, beta=0.0, ref=None, sampler=None, **options):
  obj = grpo.Objective(epsilon_low=0.2, epsilon_high=0.3, beta=beta,
                       on_policy=options.pop("on_policy", False), **options)
  arr = lambda x: None if x is None else jnp.array(x, jnp.float32)
  return grpo.policy_loss(arr(logp), arr(old), arr(ref), arr(adv), jnp.array(mask), obj=obj,
                          loss_agg=agg, sampler_logp=arr(sampler))


def test_loss_aggregations_by_hand():
  # ratio 1 everywhere: per-token loss = -A. Row 0 (A=1) has 3 tokens, row 1 (A=-2) has 1,
  # row 2 none (masked out, e.g. truncated): it counts in no normaliser.
  logp = np.zeros((3, 4))
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  adv = [1.0, -2.0, 5.0]
  expect = {"token-mean": (-1 * 3 + 2 * 1) / 4,
            "sequence-mean-token-mean": (-1 + 2) / 2,
            "sequence-mean-token-scale": (-3 + 2) / (2 * 4),
            "sequence-mean-token-sum-norm": (-3 + 2) / 2}
  assert set(expect) == set(grpo.LOSS_AGGREGATIONS)
  for agg, value in expect.items():
    assert _loss(agg, logp, logp, adv, mask)[0] == pytest.approx(value), agg


def test_clipping_by_hand():
  # ratio e^0.5 = 1.65 > 1.3: with A > 0 the clipped term 1.3 * A wins; with A < 0, 1.65 * A.
  old = np.zeros((2, 1))
  logp = np.full((2, 1), 0.5)
  loss, m = _loss("token-mean", logp, old, [1.0, -1.0], np.ones((2, 1), bool))
  assert loss == pytest.approx((-1.3 + np.exp(0.5)) / 2, rel=1e-5)
  assert m["clip_fraction"] == pytest.approx(0.5)


def test_on_policy_ratio_is_exactly_one():
  """mu = 1: pi_old is pi_theta itself (stop-gradient), whatever the sampler reported: the
  ratio is exactly 1, clipping never binds, the gradient is -A w per token; the sampler's
  distance is reported as the mismatch."""
  logp = jnp.array([[-0.5, -2.0], [-1.0, -0.1]])
  sampler = logp + jnp.array([[0.3, -0.1], [0.0, 0.2]])
  mask = jnp.ones((2, 2), bool)
  obj = grpo.Objective(epsilon_low=0.2, epsilon_high=0.3, on_policy=True)
  f = lambda lp: grpo.policy_loss(lp, sampler, None, jnp.array([2.0, -1.0]), mask, obj=obj,
                                  loss_agg="token-mean")
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
  assert float(loss) == pytest.approx((-2 * 2 + 1 * 2) / 4)
  np.testing.assert_allclose(grad, [[-0.5, -0.5], [0.25, 0.25]], rtol=1e-6)
  assert float(m["clip_fraction"]) == 0.0
  assert float(m["sampler_mismatch_mean"]) == pytest.approx(0.6 / 4, rel=1e-5)
  assert float(m["sampler_mismatch_max"]) == pytest.approx(0.3, rel=1e-5)


def test_kl_estimators_by_hand():
  logp = np.log(np.array([[0.5]]))
  ref = np.log(np.array([[0.25]]))
  k3 = 0.5 - np.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
  k1 = np.log(2.0)  # logp - ref
  for kl, value in (("k3", k3), ("k1", k1)):
    loss, m = _loss("token-mean", logp, logp, [0.0], np.ones((1, 1), bool), beta=0.1, ref=ref,
                    kl=kl)
    assert m["kl"] == pytest.approx(value, rel=1e-5)
    assert loss == pytest.approx(0.1 * value, rel=1e-5)


def test_gspo_sequence_ratio_by_hand():
  """GSPO: a row's ratio is exp(mean over its tokens of logp - old); here row 0's is
  exp((0.1 + 0.3) / 2) = 1.22 (inside the clip), row 1's exp(0.5) = 1.65 > 1.3 (clipped,
  A > 0: no gradient); each token's gradient is the row's ratio x -A w."""
  old = jnp.zeros((2, 2))
  logp = jnp.array([[0.1, 0.3], [0.5, 0.5]])
  mask = jnp.ones((2, 2), bool)
  obj = grpo.Objective(epsilon_low=0.2, epsilon_high=0.3, on_policy=False, sequence=True)
  f = lambda lp: grpo.policy_loss(lp, old, None, jnp.array([1.0, 1.0]), mask, obj=obj,
                                  loss_agg="token-mean")[0]
  loss, grad = jax.value_and_grad(f)(logp)
  s0 = np.exp(0.2)
  assert float(loss) == pytest.approx((-2 * s0 - 2 * 1.3) / 4, rel=1e-6)
  np.testing.assert_allclose(grad, [[-s0 / 4, -s0 / 4], [0.0, 0.0]], rtol=1e-6)


def test_sampler_importance_weights_by_hand():
  """Truncated IS: the policy loss of a token times min(pi_old / pi_sampler, cap)."""
  logp = old = np.zeros((1, 3))
  sampler = np.array([[0.0, 0.5, -2.0]])  # weights exp(0) = 1, exp(-0.5), exp(2) -> cap 1.5
  loss, m = _loss("token-mean", logp, old, [1.0], np.ones((1, 3), bool), sampler=sampler,
                  sampler_is_cap=1.5)
  w = np.array([1.0, np.exp(-0.5), 1.5])
  assert loss == pytest.approx(-w.mean(), rel=1e-6)
  assert m["sampler_is_weight"] == pytest.approx(w.mean(), rel=1e-6)


# ------------------------------------------------------------------ against Tunix 0.1.7

def _tunix_loss(monkeypatch, logp, logits, old, ref, adv, mask, sis, **algo):
  """Tunix's `grpo_loss_fn` with its log-prob forward replaced by the given log-probs (and
  logits, for its entropy): the loss arithmetic on the same inputs as ours."""
  from flax import nnx
  from tunix.rl import algo_core

  monkeypatch.setattr(algo_core.common, "compute_per_token_logps",
                      lambda *a, **k: (logp, logits))
  example = types.SimpleNamespace(
      prompt_ids=jnp.zeros((mask.shape[0], 1), jnp.int32), completion_ids=jnp.zeros(
          mask.shape, jnp.int32), completion_mask=mask.astype(jnp.float32), advantages=adv,
      old_per_token_logps=old, ref_per_token_logps=ref, sampler_is_weights=sis)
  config = types.SimpleNamespace(epsilon=0.2, epsilon_high=0.28, epsilon_c=None,
                                 temperature=1.0, kl_clamp_value=None, **algo)
  return algo_core.grpo_loss_fn(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), example, config, 0, 1)[0]


@pytest.mark.parametrize("agg", grpo.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("options", [
    dict(on_policy=True), dict(on_policy=False), dict(on_policy=False, sequence=True),
    dict(on_policy=True, kl="k1"), dict(on_policy=False, sampler_is_cap=1.3)])
def test_loss_and_gradient_equal_tunix(monkeypatch, agg, options):
  pytest.importorskip("tunix.rl.algo_core")
  rng = np.random.default_rng(0)
  r, n = 6, 5
  logp = jnp.asarray(-1.5 + 0.5 * rng.normal(size=(r, n)), jnp.float32)
  old = logp + jnp.asarray(0.2 * rng.normal(size=(r, n)), jnp.float32)
  ref = logp + jnp.asarray(0.3 * rng.normal(size=(r, n)), jnp.float32)
  sampler = old + jnp.asarray(0.2 * rng.normal(size=(r, n)), jnp.float32)
  mask = jnp.asarray(np.arange(n)[None] < np.array([5, 3, 1, 0, 4, 2])[:, None])  # one empty
  adv = jnp.asarray(rng.normal(size=r), jnp.float32)
  logits = jnp.asarray(rng.normal(size=(r, n, 7)), jnp.float32)
  obj = grpo.Objective(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, **options)
  ours = lambda lp: grpo.policy_loss(lp, old, ref, adv, mask, obj=obj, loss_agg=agg,
                                     sampler_logp=sampler)[0]
  sis = None
  if obj.sampler_is_cap:  # Tunix takes the weights computed upstream
    sis = grpo.sampler_is_weight(logp, old, sampler, obj)
  algo = dict(beta=0.04, loss_agg_mode=agg, kl_loss_mode={"k3": "low_var_kl", "k1": "kl"}[obj.kl],
              loss_algo="gspo-token" if obj.sequence else "grpo")
  theirs = lambda lp: _tunix_loss(monkeypatch, lp, logits, None if obj.on_policy else old, ref,
                                  adv, mask, sis, **algo)
  loss, grad = jax.value_and_grad(ours)(logp)
  loss_t, grad_t = jax.value_and_grad(theirs)(logp)
  assert float(loss) == pytest.approx(float(loss_t), rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(grad, grad_t, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(grad).max()) > 0


def test_sample_std_advantages_equal_tunix():
  pytest.importorskip("tunix.rl.algo_core")
  from tunix.rl import algo_core

  r = np.random.default_rng(1).random(12).astype(np.float32)
  np.testing.assert_allclose(grpo.group_advantages(jnp.asarray(r), 4, eps=1e-6, ddof=1),
                             algo_core.compute_advantages(r, 4), rtol=1e-5)
