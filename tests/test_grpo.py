import jax.numpy as jnp
import numpy as np
import pytest

from reasoner import grpo


def test_group_advantages_by_hand():
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
  a = np.asarray(grpo.group_advantages(r, 4, scale=True, eps=0.0)[:4])
  np.testing.assert_allclose(a, [1, -1, -1, 1], rtol=1e-6)  # mean 0.5, std 0.5
  np.testing.assert_allclose(grpo.group_advantages(r, 4, scale=False)[:4], [.5, -.5, -.5, .5])
  np.testing.assert_allclose(grpo.group_advantages(r, 4)[4:], 0.0)  # equal rewards: no signal


def _loss(agg, logp, old, adv, mask, beta=0.0, ref=None):
  return grpo.policy_loss(jnp.array(logp), jnp.array(old), None if ref is None else jnp.array(ref),
                          jnp.array(adv), jnp.array(mask), epsilon_low=0.2, epsilon_high=0.3,
                          beta=beta, loss_agg=agg)


def test_loss_aggregations_by_hand():
  # ratio 1 everywhere: per-token loss = -A. Row 0 (A=1) has 3 tokens, row 1 (A=-2) has 1.
  logp = np.zeros((2, 4))
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
  adv = [1.0, -2.0]
  tok, _ = _loss("token-mean", logp, logp, adv, mask)
  assert tok == pytest.approx((-1 * 3 + 2 * 1) / 4)
  seq, _ = _loss("sequence-mean-token-mean", logp, logp, adv, mask)
  assert seq == pytest.approx((-1 + 2) / 2)
  norm, _ = _loss("sequence-mean-token-sum-norm", logp, logp, adv, mask)
  assert norm == pytest.approx((-3 + 2) / (2 * 4))


def test_clipping_by_hand():
  # ratio e^0.5 = 1.65 > 1.3: with A > 0 the clipped term 1.3 * A wins; with A < 0, 1.65 * A.
  old = np.zeros((2, 1))
  logp = np.full((2, 1), 0.5)
  loss, m = _loss("token-mean", logp, old, [1.0, -1.0], np.ones((2, 1), bool))
  assert loss == pytest.approx((-1.3 + np.exp(0.5)) / 2, rel=1e-5)
  assert m["clip_fraction"] == pytest.approx(0.5)


def test_kl_term_by_hand():
  logp = np.log(np.array([[0.5]]))
  ref = np.log(np.array([[0.25]]))
  loss, m = _loss("token-mean", logp, logp, [0.0], np.ones((1, 1), bool), beta=0.1, ref=ref)
  kl = 0.5 - np.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
  assert m["kl"] == pytest.approx(kl, rel=1e-5)
  assert loss == pytest.approx(0.1 * kl, rel=1e-5)
