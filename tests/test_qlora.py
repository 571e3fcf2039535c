"""QLoRA (`lora.base_qtype`): the frozen base kernels held quantised by qwix, dequantised in each
matmul; only the LoRA weights train, and the export merges them into the dequantised kernels.

The reference is the float model whose kernels are qwix's dequantisation of the quantised ones
(the same weights, computed densely); against the float base itself the logits differ by the
quantisation error, bounded here per type on the tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import shard_fraction, tiny_config
from reasoner import export
from reasoner.build import build
from reasoner.config import ConfigError
from test_export import TOKENS, _export_tree, _noisy, logits, lora_logits
from test_train import dense_logprobs, random_batch

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

# max |logits - float base's| / max |float base's logits| on the tiny random model with 32-input
# tiles (0.037 for int8, 0.234 for nf4 at these seeds): a bound, not a measure of quality.
TOLERANCE = {"int8": 0.05, "nf4": 0.3}
STORED = {"int8": jnp.int8, "nf4": jnp.uint4}


def _config(qtype, *more):
  return tiny_config("lora.rank=4", f"lora.base_qtype={qtype}", "lora.base_tile_size=32",
                     "rollout.num_generations=4", "train.batch_size=2", *more)


@pytest.fixture(scope="module", params=["nf4", "int8"])
def pair(request):
  """(qtype, the quantised build, the float build with qwix's dequantised kernels)."""
  q = build(_config(request.param))
  f = build(_config("none"))
  weights = export._base_weights(q.model(), q.base)
  base = nnx.from_flat_state([(p, v.replace(weights[p])) for p, v in nnx.to_flat_state(f.base)])
  return request.param, q, f, base


def test_quantised_kernels_are_stored_in_their_type_and_placed_by_their_rule(pair):
  qtype, q, f, _ = pair
  kernel = q.base["layers"][0]["mlp"]["down_proj"]["kernel"]
  values = kernel["array"]["qvalue"].get_value()
  assert values.dtype == STORED[qtype] and shard_fraction(values) == pytest.approx(1 / 8)
  float_kernel = f.base["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
  assert values.sharding.is_equivalent_to(float_kernel.sharding, values.ndim)
  emb = q.base["embedder"]["input_embedding"].get_value()  # not under lora.module_path
  assert emb.dtype == jnp.float32


def test_logits_are_the_dense_models_with_dequantised_kernels(pair):
  qtype, q, f, dequantised = pair
  lora = _noisy(q.lora)
  got = lora_logits(q.model(lora), TOKENS)
  want = lora_logits(nnx.merge(f.graphdef, lora, dequantised), TOKENS)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  full = lora_logits(nnx.merge(f.graphdef, lora, f.base), TOKENS)
  err = np.abs(got - full).max() / np.abs(full).max()
  assert 0 < err < TOLERANCE[qtype], err


def test_only_lora_trains_and_the_step_is_the_dense_objective(pair):
  from reasoner.objectives import grpo
  from reasoner.objectives.grpo import GRPOTrainer as Trainer

  _, q, f, dequantised = pair
  trainer = Trainer.for_run(q.graphdef, q.base, q.cfg)
  batch = random_batch(q, prompts=2, g=4, seed=3)
  lora = jax.tree.map(lambda x: x + 0.05, q.lora)
  logp = dense_logprobs(nnx.merge(f.graphdef, lora, dequantised), *batch[:4])
  want, _ = grpo.policy_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages,
                             batch.completion_mask, obj=trainer.obj, loss_agg=q.cfg.grpo.loss_agg,
                             sampler_logp=batch.sampler_logp)
  base_before = jax.tree.map(np.asarray, q.base)
  state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
  assert jax.tree.structure(state.lora) == jax.tree.structure(lora)
  state, m = trainer.train_step(state, batch)
  assert float(m["loss"]) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
  assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora),
                                                      jax.tree.leaves(state.lora)))
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(q.base)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_export_merges_lora_into_the_dequantised_kernels_and_loads_in_tunix(pair, tmp_path):
  from tunix.models.gemma3 import params as tunix_params

  _, q, _, _ = pair
  lora = _noisy(q.lora)
  _export_tree(q.graphdef, lora, q.base, q.cfg.lora.alpha / q.cfg.lora.rank, "gemma3",
               tmp_path / "tiny")
  tunix = tunix_params.create_model_from_checkpoint(str(tmp_path / "tiny"), q.spec.tunix_config,
                                                    dtype=jnp.float32)
  np.testing.assert_allclose(logits(tunix, TOKENS), lora_logits(q.model(lora), TOKENS),
                             rtol=1e-4, atol=1e-4)


def test_a_tile_that_does_not_divide_a_kernel_is_one_line_naming_the_key():
  with pytest.raises(ConfigError, match=r"^config key 'lora.base_tile_size' = 48: expected a "
                                        r"divisor of each quantised kernel's input size"):
    build(_config("int8", "lora.base_tile_size=48"))
