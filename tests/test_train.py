"""One GRPO step on the tiny model: LoRA moves, base weights do not (bit for bit), sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from reasoner import mesh as mesh_lib
from reasoner.build import build
from reasoner.run import rollout
from reasoner.sampler import Sampler
from reasoner.trainer import Trainer


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("rollout.num_generations=4", "train.batch_size=2"))


def test_parameters_are_born_sharded_over_eight_devices(setup):
  assert setup.mesh.devices.size == 8
  emb = setup.base["embedder"]["input_embedding"].value
  assert mesh_lib.shard_fraction(emb) == pytest.approx(1 / 8)
  kernel = setup.base["layers"][0]["mlp"]["gate_proj"]["kernel"].value
  assert mesh_lib.shard_fraction(kernel) == pytest.approx(1 / 8)
  assert len(jax.tree.leaves(setup.lora)) > 0


def test_step_moves_lora_and_leaves_base_bit_identical(setup):
  trainer = Trainer(setup.graphdef, setup.base, setup.cfg)
  sampler = Sampler(setup.graphdef, setup.tokenizer, setup.mesh, setup.cfg.data.max_prompt_tokens)
  base_before = jax.tree.map(np.asarray, setup.base)
  lora_before = jax.tree.map(np.asarray, setup.lora)
  state = trainer.init_state(jax.tree.map(jnp.copy, setup.lora), jax.random.PRNGKey(0))
  # Rewards that differ within each group so that advantages are non-zero.
  records = setup.train_records[:2]
  batch, metrics = rollout(setup, sampler, trainer, state.lora, records, jax.random.PRNGKey(1))
  batch = batch._replace(advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5] * 2))
  state, m = trainer.train_step(state, batch)
  assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
  assert int(state.step) == 1
  moved = [not np.array_equal(a, np.asarray(b))
           for a, b in zip(jax.tree.leaves(lora_before), jax.tree.leaves(state.lora))]
  assert any(moved)
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(setup.base)):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert set(metrics) >= {"reward/mean", "accuracy", "format_rate", "completion_length"}
  assert {"kl", "clip_fraction", "entropy", "loss"} <= set(m)


def dense_completion_logprobs(model, prompt, prompt_valid, completion, completion_mask):
  """Reference: every row's whole sequence through the model, full [R, T, V] log-softmax."""
  from reasoner import heads
  from reasoner.sampler import causal_mask, positions_from_mask

  g = completion.shape[0] // prompt.shape[0]
  tokens = jnp.concatenate([jnp.repeat(prompt, g, 0), completion], 1)
  valid = jnp.concatenate([jnp.repeat(prompt_valid, g, 0), completion_mask], 1)
  h, _ = model.hidden_states(tokens[:, :-1], positions_from_mask(valid[:, :-1]), None,
                             causal_mask(valid[:, :-1]))
  z = jax.nn.log_softmax(heads.logits(h, model.embedding()), -1)
  n = completion.shape[1]
  return jnp.take_along_axis(z[:, -n:], completion[..., None], -1)[..., 0]


@pytest.mark.parametrize("window", [None, 4])  # 4: the sliding window binds -> full-forward path
def test_shared_prompt_logprobs_and_grads_match_dense(setup, window):
  import dataclasses

  from reasoner.trainer import completion_logprobs

  model = setup.model(jax.tree.map(lambda x: x + 0.05, setup.lora))
  if window is not None:
    model.config = dataclasses.replace(model.config, sliding_window_size=window)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, 200, (2, 6)), jnp.int32)
  prompt_valid = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
  completion = jnp.asarray(rng.integers(3, 200, (6, 5)), jnp.int32)
  cmask = jnp.asarray(np.arange(5)[None] < np.array([5, 3, 1, 5, 4, 2])[:, None])
  ours = completion_logprobs(model, prompt, prompt_valid, completion, cmask)[0]
  ref = dense_completion_logprobs(model, prompt, prompt_valid, completion, cmask)
  np.testing.assert_allclose(np.asarray(ours)[np.asarray(cmask)],
                             np.asarray(ref)[np.asarray(cmask)], rtol=1e-5, atol=1e-5)
  if window is None:
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    w = jnp.where(cmask, 1.0, 0.0)

    def loss(fn):
      return lambda l: jnp.sum(fn(nnx.merge(graphdef, l, base), prompt, prompt_valid,
                                  completion, cmask) * w)

    g1 = jax.grad(loss(lambda *a: completion_logprobs(*a)[0]))(lora)
    g2 = jax.grad(loss(dense_completion_logprobs))(lora)
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g2))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4 * scale)
