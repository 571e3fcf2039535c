"""The decoder layer against Tunix's: the attention core that keeps no probabilities for the
backward, and the remat policy that keeps only named matmul outputs."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from reasoner.build import build
from reasoner.models import attention, layer
from reasoner.models.cache import causal_mask, positions_from_mask

# jitted models and heads against their references: seconds each, `make test` (not `make check`)
pytestmark = pytest.mark.slow


def _dense(q, k, v, mask):  # the same forward, left to autodiff
  probs = jax.nn.softmax(attention._logits(q, k, mask), axis=-1).astype(v.dtype)
  return jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)


def _inputs(seed=0, b=2, t=5, s=7, k=2, g=3, h=4):
  rng = np.random.default_rng(seed)
  q, kk, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
              for shape in ((b, t, k, g, h), (b, s, k, h), (b, s, k, h)))
  mask = np.arange(s)[None, None] <= np.arange(t)[None, :, None] + (s - t)  # causal, cached
  mask = mask & (np.arange(s)[None, None] >= np.array([0, 3])[:, None, None])  # left padding
  mask[1, 0] = False  # one query sees no key at all (a padded row): uniform, as Tunix's
  return q, kk, v, jnp.asarray(mask)


def test_attend_values_and_gradients_match_autodiff():
  q, k, v, mask = _inputs()
  np.testing.assert_allclose(attention.attend(q, k, v, mask), _dense(q, k, v, mask),
                             rtol=1e-6, atol=1e-6)
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, mask) * w)
  ours = jax.grad(loss(attention.attend), argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(ours, ref):
    assert float(jnp.abs(b).max()) > 1e-3
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_attend_saves_no_probabilities_for_the_backward(capsys):
  from jax.ad_checkpoint import print_saved_residuals

  q, k, v, mask = _inputs()
  probs = "f32[%s]" % ",".join(map(str, q.shape[:-1] + (k.shape[1],)))

  def saved(f):
    print_saved_residuals(lambda q, k, v: jnp.sum(f(q, k, v, mask)), q, k, v)
    return capsys.readouterr().out

  assert probs in saved(_dense)  # the test can fail: autodiff keeps [B, T, K, G, S]
  assert probs not in saved(attention.attend)


@pytest.mark.parametrize("remat", ["none", "block", "decoder"])
def test_model_with_our_attention_matches_tunix(remat):
  """The tiny Gemma 3 with LoRA (B != 0): hidden states and LoRA gradients equal Tunix's."""
  setup = build(tiny_config(f"model.remat={remat}", "model.tiny_layers=2"))
  model = setup.model(jax.tree.map(lambda x: x + 0.05, setup.lora))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 200, (4, 9)), jnp.int32)
  valid = jnp.asarray(np.arange(9)[None] >= np.array([0, 2, 4, 0])[:, None])
  w = jnp.asarray(rng.normal(size=(4, 9, model.embedding().shape[1])), jnp.float32)

  def loss(model, tunix):
    h, _ = model.hidden_states(tokens, positions_from_mask(valid), None, causal_mask(valid),
                               tunix_attention=tunix)
    return jnp.sum(jnp.where(valid[..., None], h, 0.0) * w), h

  # nnx's grad, as the trainer's: Tunix's remat is nnx.remat. Jitted: run eagerly, its many
  # small 8-device computations could miss XLA:CPU's 40 s collective rendezvous on a busy host.
  grad = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True),
                 static_argnums=1)
  (_, h), grads = grad(model, False)
  (_, h_ref), ref = grad(model, True)
  # The tiny random model amplifies rounding at a few positions: moving its LoRA weights by
  # 1e-6 (relative) moves those by up to 2e-4 on an AVX-512 host, in Tunix's path as in ours.
  np.testing.assert_allclose(np.asarray(h)[np.asarray(valid)],
                             np.asarray(h_ref)[np.asarray(valid)], rtol=1e-5, atol=1e-3)
  assert any("q_einsum" in str(p) for p, _ in nnx.to_flat_state(ref))
  # Gradients as the other dense checks compare them (float32 sums in another order): without
  # LLVM's optimisation (the suite's compile flags, tests/conftest.py) no multiply-add is
  # contracted, and 2 of 256 elements differ by 1.5e-3 of themselves; a wrong mask or position
  # moves whole gradients
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    assert float(np.abs(b).max()) > 0  # every LoRA weight, attention's included, has a gradient
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4 * scale)


def _saved_residuals(capsys, remat: str, tunix: bool) -> tuple[list[str], int]:
  """What autodiff keeps for the backward of one tiny layer with LoRA (weights excluded)."""
  from jax.ad_checkpoint import print_saved_residuals

  setup = build(tiny_config(f"model.remat={remat}", "model.tiny_layers=1"))
  model = setup.model(jax.tree.map(lambda x: x + 0.05, setup.lora))
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
  valid = jnp.ones((2, 7), bool)

  def loss(lora):
    m = nnx.merge(graphdef, lora, rest, copy=True)
    h, _ = m.hidden_states(jnp.ones((2, 7), jnp.int32), positions_from_mask(valid), None,
                           causal_mask(valid), tunix_attention=tunix)
    return jnp.sum(h)

  capsys.readouterr()
  print_saved_residuals(loss, lora)
  skip = ("from the argument", "from a constant", "from a literal")
  lines = capsys.readouterr().out.splitlines()
  return [l for l in lines if not any(s in l for s in skip)], model.layers[0].mlp.config.hidden_dim


def _elements(lines: list[str]) -> int:
  return sum(math.prod(map(int, re.match(r"\w+\[([\d,]*)\]", l).group(1).split(",")))
             for l in lines if not l.startswith(("f32[]", "i32[]")))


@pytest.mark.parametrize("remat", ["none", "block", "decoder"])
def test_layer_keeps_only_its_named_matmul_outputs(capsys, remat):
  """block (Tunix's `nnx.remat` on each half): ours keeps what Tunix's keeps."""
  (ours, hidden), (tunix, _) = (_saved_residuals(capsys, remat, t) for t in (False, True))
  named = {m.group(1) for l in ours if (m := re.search(r"named '(\w+)'", l))}
  if remat != "block":  # block: the norm after the MLP keeps its input, ffw_out, as Tunix's
    assert named == set(layer.SAVED[remat])
  wide = lambda lines: sum(re.match(rf"f32\[[\d,]*,{hidden}\]", l) is not None for l in lines)
  if remat == "none":
    assert wide(ours) == 2  # gate and up
    assert wide(tunix) >= 5  # the gelu's pieces too: the test can fail
    assert _elements(ours) < _elements(tunix), (ours, tunix)
  else:  # decoder: both keep only the layer's input; block: each half's inputs
    assert wide(ours) == wide(tunix) == 0 and _elements(ours) == _elements(tunix)


def _barriers(jaxpr) -> list:
  """Every optimization_barrier in a jaxpr, its sub-jaxprs (remat, custom_vjp, pjit) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      found.append(eqn)
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else (p,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _barriers(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _barriers(sub)
  return found


@pytest.mark.parametrize("remat", ["none", "block", "decoder"])
def test_each_layers_backward_waits_for_its_lora_gradients(remat, monkeypatch):
  """With block and decoder remat, past the first layer, each layer's input cotangent leaves
  its backward through one barrier with that layer's LoRA gradients (`layer.tied_gradients`);
  with no remat, and without the tie, none does."""
  setup = build(tiny_config(f"model.remat={remat}", "model.tiny_layers=3"))
  graphdef, lora, rest = nnx.split(setup.model(setup.lora), nnx.LoRAParam, ...)
  per_layer = len(jax.tree.leaves(lora["layers"][0]))
  valid = jnp.ones((2, 7), bool)
  width = setup.model(setup.lora).embedding().shape[1]

  def tied() -> int:
    def loss(lora):
      m = nnx.merge(graphdef, lora, rest, copy=True)
      h, _ = m.hidden_states(jnp.ones((2, 7), jnp.int32), positions_from_mask(valid), None,
                             causal_mask(valid))
      return jnp.sum(h)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(lora).jaxpr
    return sum(len(e.invars) == per_layer + 1 and e.invars[-1].aval.shape == (2, 7, width)
               for e in _barriers(jaxpr))

  assert per_layer >= 12  # a and b of q, kv, attention out, gate, up, down
  assert tied() == (0 if remat == "none" else 2)  # layers 1 and 2
  monkeypatch.setattr(layer, "tied_gradients", lambda layer, x, call: call(x))
  assert tied() == 0
