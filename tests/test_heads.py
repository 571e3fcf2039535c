import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoner import heads


def dense(h, e, y, softcap=None):
  z = jnp.einsum("btd,vd->btv", h, e)
  if softcap:
    z = jnp.tanh(z / softcap) * softcap
  logp_all = jax.nn.log_softmax(z, -1)
  logp = jnp.take_along_axis(logp_all, y[..., None], -1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
  return logp, ent


@pytest.mark.parametrize("b,t,chunk,softcap", [(3, 7, 4, None), (2, 5, 64, 30.0), (1, 1, 3, None)])
def test_chunked_head_matches_dense(b, t, chunk, softcap):
  k = jax.random.split(jax.random.key(0), 4)
  v, d = 97, 16
  h = jax.random.normal(k[0], (b, t, d))
  e = jax.random.normal(k[1], (v, d)) * 0.5
  y = jax.random.randint(k[2], (b, t), 0, v)
  w = jax.random.normal(k[3], (b, t))
  lp, ent = heads.token_logprobs(h, e, y, chunk=chunk, softcap=softcap)
  lp_d, ent_d = dense(h, e, y, softcap)
  np.testing.assert_allclose(lp, lp_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_d, rtol=1e-5, atol=1e-5)
  f = lambda fn: lambda h, e: jnp.sum(fn(h, e)[0] * w)  # entropy is a stop-gradient metric
  ours = jax.grad(f(lambda h, e: heads.token_logprobs(h, e, y, chunk=chunk, softcap=softcap)),
                  argnums=(0, 1))(h, e)
  ref = jax.grad(f(lambda h, e: dense(h, e, y, softcap)), argnums=(0, 1))(h, e)
  for a, r in zip(ours, ref):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
