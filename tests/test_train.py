"""One GRPO step on the tiny model: LoRA moves, base weights do not (bit for bit), sharded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import shard_fraction, tiny_config
from reasoner import mesh as mesh_lib
from reasoner.build import build
from reasoner.models.prompt import completion_hidden, prompt_copies
from reasoner.objectives.grpo import rollout
from reasoner.engine.sampler import Sampler
from reasoner.objectives.grpo import GRPOTrainer as Trainer

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("rollout.num_generations=4", "train.batch_size=2"))


def test_parameters_are_born_sharded_over_eight_devices(setup):
  assert setup.mesh.devices.size == 8
  emb = setup.base["embedder"]["input_embedding"].get_value()
  assert shard_fraction(emb) == pytest.approx(1 / 8)
  kernel = setup.base["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value()
  assert shard_fraction(kernel) == pytest.approx(1 / 8)
  assert len(jax.tree.leaves(setup.lora)) > 0


def test_step_moves_lora_and_leaves_base_bit_identical(setup):
  trainer = Trainer.for_run(setup.graphdef, setup.base, setup.cfg)
  sampler = Sampler.for_run(setup)
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


def dense_completion_logprobs(model, prompt, prompt_valid, completion, completion_mask,
                              temperature=1.0, full=False):
  """Reference: every row's whole sequence through the model (Tunix's attention, left to
  autodiff), full [R, T, V] log-softmax of the logits / temperature; the completion tokens'
  [R, N], or (`full`) every completion position's [R, N, V]."""
  from reasoner.engine import heads
  from reasoner.models.cache import causal_mask, positions_from_mask

  g = completion.shape[0] // prompt.shape[0]
  tokens = jnp.concatenate([jnp.repeat(prompt, g, 0), completion], 1)
  valid = jnp.concatenate([jnp.repeat(prompt_valid, g, 0), completion_mask], 1)
  h, _ = model.hidden_states(tokens[:, :-1], positions_from_mask(valid[:, :-1]), None,
                             causal_mask(valid[:, :-1]), tunix_attention=True)
  z = jax.nn.log_softmax(heads.logits(h, model.embedding()) / temperature, -1)
  n = completion.shape[1]
  if full:
    return z[:, -n:]
  return jnp.take_along_axis(z[:, -n:], completion[..., None], -1)[..., 0]


# The same, jitted for the tests that call it eagerly: eager ops over 8 fake devices, each its own
# rendezvous, aborted XLA:CPU on a loaded machine.
dense_logprobs = nnx.jit(dense_completion_logprobs, static_argnames=("temperature", "full"))


@pytest.fixture(scope="module")
def setup6():  # six layers: Gemma 3's pattern gives five sliding-window layers, then a global one
  return build(tiny_config("model.tiny_layers=6", "rollout.num_generations=4",
                           "train.batch_size=2"))


# None: no window; 7: it binds inside the sequences (6 + 5 tokens), the shared prompt with each
# sliding layer's own mask; 4: a prompt as long as the window, one full forward per row. The
# window of 7 on two layers repeats what six layers cover (their first five slide): make soak.
@pytest.mark.parametrize("window,layers", [(None, 2), pytest.param(7, 2, marks=pytest.mark.extended),
                                           (7, 6), (4, 2)])
def test_shared_prompt_logprobs_and_grads_match_dense(request, window, layers):
  import dataclasses

  from reasoner.models.gemma import _sliding
  from reasoner.engine.trainer import completion_logprobs

  setup = request.getfixturevalue("setup" if layers == 2 else "setup6")
  # The layers that take the windowed mask: Gemma 3's pattern, five sliding-window, one global.
  expected = [True, True] if layers == 2 else [True] * 5 + [False]
  assert [_sliding(x) for x in setup.model(setup.lora).layers] == expected
  model = setup.model(jax.tree.map(lambda x: x + 0.05, setup.lora))
  if window is not None:
    model.config = dataclasses.replace(model.config, sliding_window_size=window)
    for layer in model.layers:  # what Tunix's attention reads
      layer.attn.sliding_window_size = window
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, 200, (2, 6)), jnp.int32)
  prompt_valid = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
  completion = jnp.asarray(rng.integers(3, 200, (6, 5)), jnp.int32)
  cmask = jnp.asarray(np.arange(5)[None] < np.array([5, 3, 1, 5, 4, 2])[:, None])
  ours = nnx.jit(completion_logprobs)(model, prompt, prompt_valid, completion, cmask)[0]
  w = jnp.where(cmask, 1.0, 0.0)

  # nnx's grad, as the trainer's: Gemma 3's layers run under nnx.remat. Jitted: eager ops over
  # 8 fake devices aborted XLA:CPU (a fresh clone's suite, nothing else running).
  @functools.partial(nnx.jit, static_argnums=0)
  def loss(fn, model):
    f = lambda m: jnp.sum(fn(m, prompt, prompt_valid, completion, cmask) * w)
    return nnx.grad(f, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)

  grads = loss(lambda *a: completion_logprobs(*a)[0], model)
  # The reference in float64: at one token of the six-layer model the float32 dense forward is
  # itself 4e-3 off in the hidden state (ours 4e-4), and 0.2% off in the gradients.
  with jax.enable_x64(True):
    g, state = nnx.split(model)
    wide = nnx.merge(g, jax.tree.map(lambda x: x.astype(jnp.float64)
                                     if jnp.issubdtype(x.dtype, jnp.floating) else x, state))
    ref = np.asarray(dense_logprobs(wide, prompt, prompt_valid, completion, cmask))
    ref_grads = jax.tree.map(np.asarray, loss(dense_completion_logprobs, wide))
  np.testing.assert_allclose(np.asarray(ours)[np.asarray(cmask)],
                             np.asarray(ref)[np.asarray(cmask)], rtol=1e-5, atol=1e-5)
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref_grads))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-4 * scale)


def random_batch(setup, prompts: int, g: int, seed: int = 0):
  """A training batch of random tokens: ragged prompts and completions, distinct advantages."""
  from reasoner.objectives.grpo import Batch

  rng = np.random.default_rng(seed)
  p, n, rows = 6, 5, prompts * g
  prompt_valid = np.arange(p)[None] >= rng.integers(0, 3, (prompts, 1))  # left-padded
  cmask = np.arange(n)[None] < rng.integers(1, n + 1, (rows, 1))
  host = dict(prompt=rng.integers(3, 200, (prompts, p)), prompt_valid=prompt_valid,
              completion=rng.integers(3, 200, (rows, n)), completion_mask=cmask,
              advantages=rng.normal(size=rows), old_logp=-5.5 + 0.3 * rng.normal(size=(rows, n)),
              ref_logp=-5.5 + 0.3 * rng.normal(size=(rows, n)),
              sampler_logp=-5.5 + 0.3 * rng.normal(size=(rows, n)))
  host = {k: v.astype(np.int32 if k in ("prompt", "completion") else
                      bool if "valid" in k or "mask" in k else np.float32)
          for k, v in host.items()}
  return Batch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()})


@pytest.mark.parametrize("agg", ["token-mean", "sequence-mean-token-mean"])
def test_micro_batches_give_the_one_pass_step(setup, agg):
  """Gradient accumulation over 2 and 4 micro-batches: the same loss, gradients, metrics and
  log-probs as one pass over the 4-prompt batch (the loss normalisation is the whole batch's)."""
  import dataclasses

  from reasoner.objectives import grpo

  cfg = setup.cfg
  batch = random_batch(setup, prompts=4, g=4)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)  # B != 0, so every LoRA weight has a grad
  weights = grpo.token_weights(batch.completion_mask, agg)
  results = {}
  # four micro-batches of one prompt once; the other aggregation's split is the same scan
  micros = (2, 1) if agg == "token-mean" else (2,)
  for micro in (None, *micros):
    c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=4,
                                                           micro_batch=micro),
                            grpo=dataclasses.replace(cfg.grpo, beta=0.04, loss_agg=agg))
    trainer = Trainer.for_run(setup.graphdef, setup.base, c)
    k = trainer.micro_steps(4)
    assert k == (4 // micro if micro else 1)
    seq = jnp.zeros(batch.advantages.shape)
    grads = jax.jit(lambda b, l, x, w: trainer._in_micro_batches(  # ((loss, grads), rows)
        lambda p, m: trainer._grads(*p, *m), (b, l), (x, w, seq), (jnp.zeros(()), l))[0][1])(
            setup.base, lora, batch, weights)
    logp = trainer.logprobs(lora, *batch[:4])
    state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
    state, m = trainer.train_step(state, batch)
    assert int(state.step) == 1
    results[micro] = (np.asarray(logp), jax.tree.map(np.asarray, grads),
                      {k: float(v) for k, v in m.items()})
  ref_logp, ref_grads, ref_m = results[None]
  assert ref_m["grad_norm"] > 0 and ref_m["kl"] > 0
  mask = np.asarray(batch.completion_mask)
  for micro in micros:
    logp, grads, m = results[micro]
    np.testing.assert_allclose(logp[mask], ref_logp[mask], rtol=1e-5, atol=1e-5)
    assert m.keys() == ref_m.keys()
    for k in m:  # float32 sums in another order: gradients agree to ~1e-4 of their size
      np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-3, atol=1e-6, err_msg=k)
    scale = max(np.abs(b).max() for b in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("overrides", [
    # GSPO off-policy: its row ratios from a forward pass before the fused one
    ("grpo.num_iterations=2", "grpo.importance_sampling=sequence", "grpo.beta=0.04"),
    # the sampling temperature's log-probs, sampler IS, k1, Tunix's sum-norm, micro-batches
    ("rollout.temperature=0.7", "grpo.sampler_is=token", "grpo.sampler_is_cap=1.2",
     "grpo.kl_estimator=k1", "grpo.beta=0.04", "grpo.loss_agg=sequence-mean-token-scale",
     "train.micro_batch=2"),
])
def test_step_loss_and_metrics_equal_the_dense_objective(setup, overrides):
  """The train step's loss and metrics against `grpo.policy_loss` over log-probs from a dense
  forward of the whole sequences (the logits / T of the configured temperature)."""
  from reasoner.objectives import grpo

  cfg = tiny_config("rollout.num_generations=4", "train.batch_size=4", *overrides)
  batch = random_batch(setup, prompts=4, g=4, seed=3)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)
  trainer = Trainer.for_run(setup.graphdef, setup.base, cfg)
  t = grpo.logprob_temperature(cfg)
  assert trainer.temperature == t == (0.7 if "rollout.temperature=0.7" in overrides else 1.0)
  model = nnx.merge(setup.graphdef, lora, setup.base)
  logp = dense_logprobs(model, *batch[:4], temperature=t)
  want, want_m = grpo.policy_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages,
                                  batch.completion_mask, obj=trainer.obj,
                                  loss_agg=cfg.grpo.loss_agg, sampler_logp=batch.sampler_logp)
  np.testing.assert_allclose(np.asarray(trainer.logprobs(lora, *batch[:4]))[
      np.asarray(batch.completion_mask)], np.asarray(logp)[np.asarray(batch.completion_mask)],
                             rtol=1e-5, atol=1e-5)
  state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
  _, m = trainer.train_step(state, batch)
  assert float(m["loss"]) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
  for k, v in want_m.items():
    assert float(m[k]) == pytest.approx(float(v), rel=1e-4, abs=1e-6), k
  assert float(want_m["sampler_mismatch_mean"]) > 0


def test_micro_batch_must_divide_the_batch(setup):
  import dataclasses

  from reasoner.config import ConfigError

  with pytest.raises(ConfigError, match=r"'train.micro_batch' = 3: expected a divisor of "
                                        r"train.batch_size \(4\)"):
    tiny_config("train.batch_size=4", "train.micro_batch=3")
  cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(setup.cfg.train, batch_size=4,
                                                                 micro_batch=2))
  trainer = Trainer.for_run(setup.graphdef, setup.base, cfg)
  with pytest.raises(ValueError, match="a batch of 3 prompts does not split into micro-batches "
                                       "of train.micro_batch = 2"):
    trainer.micro_steps(3)


def test_pinned_residual_stream_changes_no_value(setup):
  """hidden_states(..., mesh): the residual stream held as rows over 'fsdp' between layers;
  the same values as unpinned, and the result comes out split by rows."""

  batch = random_batch(setup, prompts=4, g=4)
  model_args = (setup.graphdef, setup.lora, setup.base)
  f = lambda mesh: jax.jit(lambda *s: completion_hidden(nnx.merge(*s), *batch[:4], mesh))
  pinned, free = f(setup.mesh)(*model_args), f(None)(*model_args)
  np.testing.assert_allclose(np.asarray(pinned), np.asarray(free), rtol=1e-5, atol=1e-5)
  assert pinned.sharding.spec[0] == "fsdp"
  assert shard_fraction(pinned) == pytest.approx(1 / 8)



def test_prompt_copies_put_each_prompt_on_the_chips_of_its_rows():
  """(prompts, G) -> copies on fsdp = 8: every chip runs only its own rows' prompts."""
  from jax.sharding import Mesh

  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8, 1), mesh_lib.AXES)
  cases = {(4, 8): 2, (8, 8): 1, (16, 4): 1, (1, 8): 8, (2, 4): 4, (3, 8): 8, (3, 4): 1}
  assert {k: prompt_copies(mesh, *k) for k in cases} == cases
  assert prompt_copies(None, 4, 8) == 1
