"""`mesh.weights: replicated`: the base and LoRA whole on every chip; the train step equals the
sharded one's loss and update, and gathers no weights (what crosses chips: the LoRA's gradients
and the vocabulary-parallel head's hidden states)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import shard_fraction, tiny_config
from reasoner.build import build
from reasoner.objectives.grpo import GRPOTrainer as Trainer
from reasoner.planner import hlo
from test_train import random_batch

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

SETTINGS = ("rollout.num_generations=4", "train.batch_size=4", "grpo.beta=0.04")


@pytest.fixture(scope="module")
def pair():
  return {w: build(tiny_config(*SETTINGS, f"mesh.weights={w}")) for w in ("sharded",
                                                                          "replicated")}


def _step(setup):
  trainer = Trainer.for_run(setup.graphdef, setup.base, setup.cfg)
  batch = random_batch(setup, prompts=4, g=4, seed=5)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)  # every LoRA weight gets a gradient
  state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
  text = trainer.step.lower(setup.base, state, batch).compile().as_text()
  logp = trainer.logprobs(lora, *batch[:4])
  state, m = trainer.train_step(state, batch)
  return trainer, state, m, np.asarray(logp), hlo.analyse(text)


def test_replicated_weights_step_equals_the_sharded_step(pair):
  rep, shd = pair["replicated"], pair["sharded"]
  emb = rep.base["embedder"]["input_embedding"].get_value()
  assert emb.sharding.is_fully_replicated and shard_fraction(emb) == 1.0
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(rep.lora))
  for a, b in zip(jax.tree.leaves(rep.base), jax.tree.leaves(shd.base)):  # the same weights
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, s_r, m_r, logp_r, cost_r = _step(rep)
  _, s_s, m_s, logp_s, cost_s = _step(shd)
  np.testing.assert_allclose(logp_r, logp_s, rtol=1e-5, atol=1e-5)
  assert float(m_s["grad_norm"]) > 0
  for k in m_s:
    np.testing.assert_allclose(float(m_r[k]), float(m_s[k]), rtol=1e-4, atol=1e-6, err_msg=k)
  scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(s_s.lora))
  for a, b in zip(jax.tree.leaves(s_r.lora), jax.tree.leaves(s_s.lora)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale)
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(s_r.lora))
  # what crosses chips: the sharded step gathers the weights (892 KB a step on the tiny model),
  # the replicated one the head's hidden states (35 KB); both all-reduce the LoRA's gradients
  gathered = lambda c: sum(k.bytes * n for k, n in c.collectives.items() if k.kind == "all-gather")
  assert 0 < 10 * gathered(cost_r) < gathered(cost_s)
  assert 4 * cost_r.num_collectives < cost_s.num_collectives


def test_abstract_build_places_the_weights_as_the_run_does():
  devices = jax.devices()
  setup = build(tiny_config(*SETTINGS, "mesh.weights=replicated"), abstract=True,
                devices=devices)
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(setup.base))
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(setup.lora))


def test_bad_weights_value_is_one_line_naming_the_key():
  from reasoner.config import ConfigError

  with pytest.raises(ConfigError, match="mesh.weights"):
    tiny_config("mesh.weights=whole")


def test_the_replicated_decode_layout_shares_the_training_base(pair):
  """Weights whole on every chip and decoding in the replicated layout: the sampler decodes
  with the training's base arrays themselves (one copy, not two); tp2 needs a copy of its own,
  and the planner counts the copy only there."""
  from reasoner.engine.sampler import Sampler
  from reasoner.planner import plan

  setup = pair["replicated"]
  sampler = Sampler.for_run(setup, "replicated")
  kept = sampler.in_layout((setup.lora, setup.base))[1]
  assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(setup.base)))
  tp2 = Sampler.for_run(setup, "tp2").in_layout((setup.lora, setup.base))[1]
  mlp = lambda tree: [x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                      if "mlp" in jax.tree_util.keystr(path)]
  assert mlp(tp2) and not any(a is b for a, b in zip(mlp(tp2), mlp(setup.base)))  # split
  cfg = tiny_config("mesh.weights=replicated", "data.max_prompt_tokens=64")
  abstract = build(cfg, abstract=True)
  chip = plan.target("cpu")[1]
  assert plan.rollout_plan(abstract, 2, chip, "replicated").resident == 0
  assert plan.rollout_plan(abstract, 2, chip, "tp2").resident > 0


def test_auto_weights_are_whole_where_the_base_takes_a_quarter_of_a_chip_at_most():
  from reasoner.engine.layout import weights_placement

  gib = 2**30
  assert weights_placement("auto", 8, 2 * gib, 16 * gib)[0] == "replicated"  # gemma3-1b, v5e
  assert weights_placement("auto", 8, 4 * gib, 16 * gib)[0] == "replicated"  # exactly 1/4
  placed, why = weights_placement("auto", 8, 5.2 * gib, 16 * gib)  # gemma2-2b in bf16
  assert placed == "sharded" and "5.20 GiB" in why and "16.00 GiB" in why
  assert weights_placement("auto", 8, 1, None) == ("sharded",
                                                   "the chips' memory is unknown (XLA:CPU)")
  assert weights_placement("auto", 1, 1, 16 * gib)[0] == "sharded"  # one chip: the same
  assert weights_placement("replicated", 8, 9 * gib, 16 * gib)[0] == "replicated"  # as set
  assert weights_placement("sharded", 8, 1, 16 * gib)[0] == "sharded"


def test_auto_weights_resolve_in_the_run_and_the_abstract_build(monkeypatch, caplog):
  """The default (auto): sharded on XLA:CPU (no memory figure); given a chip's memory, whole
  where the base takes at most a quarter of it, in the real build (loaded into shards, then
  gathered once) as in the planner's abstract one, with the reason logged."""
  from reasoner.engine import layout

  cfg = tiny_config(*SETTINGS)
  assert cfg.mesh.weights == "auto"
  base = layout.nbytes(build(cfg, abstract=True).base)
  assert build(cfg, abstract=True).weights == "sharded"
  whole = build(cfg, abstract=True, hbm=4 * base)
  assert whole.weights == "replicated"
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(whole.base))
  assert build(cfg, abstract=True, hbm=4 * base - 1).weights == "sharded"
  monkeypatch.setattr(layout, "chip_hbm", lambda devices: 16 * 2**30)
  with caplog.at_level("INFO", logger="reasoner"):
    run = build(cfg)
  assert run.weights == "replicated" and "mesh.weights auto: replicated" in caplog.text
  emb = run.base["embedder"]["input_embedding"].get_value()
  assert emb.sharding.is_fully_replicated and shard_fraction(emb) == 1.0


def test_the_planner_compiles_both_placements_and_names_the_faster():
  """`python -m reasoner plan` with mesh.weights auto on a chip with a memory figure: the train
  step and the log-prob forward compiled with the weights placed both ways, and which is
  faster (here on 8 CPU devices with a v5e's figures: the replicated step gathers nothing)."""
  from reasoner.planner import plan, report as report_lib

  cfg = tiny_config(*SETTINGS, "data.max_prompt_tokens=64", "rollout.max_new_tokens=32")
  devices, chip, _ = plan.target("cpu")
  setup = build(cfg, abstract=True, devices=devices)  # XLA:CPU: no memory figure
  report = {"cfg": cfg, "train": plan.train_plan(setup, 4, chip),
            "logprobs": plan.reference_plan(setup, 4, chip),
            "weights": (setup.weights, setup.weights_why)}
  assert setup.weights == "sharded"
  plan._weights(report, cfg, devices, 16 * 2**30, chip, lambda s: None)
  assert report["weights_other"][0] == "replicated"
  other = report["weights_other"][1]
  assert other["train"].fits and other["logprobs"] is not None
  count = lambda p: sum(p.collectives.values())
  assert 4 * count(other["train"]) < count(report["train"])  # replicated: no weight gathers
  best, why = report["weights_choice"]
  seconds = {w: float(ms) for w, ms in re.findall(r"(\w+) ([\d.]+) ms", why)}
  assert set(seconds) == {"sharded", "replicated"} and best == min(seconds, key=seconds.get)
  text = "\n".join(report_lib._weights(report, chip))
  assert "training weights sharded (mesh.weights auto: the chips' memory is unknown" in text
  assert f"{best} is faster" in text and "(weights replicated)" in text
  assert ("set mesh.weights: replicated" in text) == (best == "replicated")


def test_the_zeroed_lora_is_made_on_the_chips_as_the_lora_is_placed_and_kept(pair):
  """The reference's LoRA (zeroed, each step where beta > 0 and for DPO's reference): zeros of
  the LoRA's shapes and dtypes, placed as it is (whole or sharded), made once by one program
  and kept: the next call returns the same state, and a LoRA placed otherwise gets its own."""
  from reasoner.models import lora as lora_lib

  for setup in pair.values():
    zeros = [lora_lib.zeros_like(setup.lora) for _ in range(2)]
    assert zeros[1] is zeros[0]
    for z, x in zip(jax.tree.leaves(zeros[1]), jax.tree.leaves(setup.lora)):
      assert (z.shape, z.dtype, z.sharding) == (x.shape, x.dtype, x.sharding)
      assert not np.asarray(z).any()
