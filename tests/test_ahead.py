"""Rollouts a step ahead on chips of their own (`rollout.devices`): the overlapped loop equals
a reference computed step by step with the LoRA one update behind (GRPO with a judge scoring
from the rollout's thread; distillation with its teacher on chips of its own too), the planner's
split and step, the split of the devices, and bad settings in one line.
Exact resume with a rollout in flight: tests/test_resume.py ("rollout-ahead")."""

import copy
import dataclasses
import importlib.util
import json
import types

import jax
import numpy as np
import pytest

from conftest import tiny_config
from test_judge import MIXED, RUBRIC
from reasoner import loop
from reasoner.build import split_devices
from reasoner.config import ConfigError
from reasoner.engine.checkpoint import restore_lora

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

AHEAD = ("grpo.sampler_is=token", "train.steps=3", "train.checkpoint_every=3")
PARITY = "rewards=[{fn: 'parity_reward:parity'}]"  # groups that differ: updates that do
TEACHER = ("distill.teacher={source: random, name: tiny, tokenizer: bytes, tiny_layers: 1}",
           "distill.devices=2", "rollout.devices=2")


def _by_hand(run, stale: bool):
  """The stage's halves one after another on the run's own pieces, no thread: step t samples
  with the LoRA before step t - 1's update (`stale`), or with the current one."""
  stage, state = loop.STAGES[run.stage], run.state
  start = copy.deepcopy(run.data.get_state())
  behind = state.lora
  for t in range(run.cfg.train.steps):
    lora = behind if stale else state.lora
    drawn = stage.draw(run.setup, run.sampler, lora, run.data, t,
                       jax.random.fold_in(state.key, t))
    behind = state.lora
    state, _ = stage.learn(run.setup, run.trainer, state, drawn, t)
  run.data.set_state(start)
  return state.lora


# a judge of the policy's own weights on the training chips, called from the rollout's thread
JUDGED = (*MIXED, f"judge.rubric={json.dumps(RUBRIC)}", "judge.batch_size=4", "rollout.devices=4")


# the same loop for distillation, with a teacher of its own: make soak (pytest -m extended)
@pytest.mark.parametrize("stage,extra", [("grpo", JUDGED), pytest.param(
    "distill", (PARITY, *TEACHER), marks=pytest.mark.extended)],
                         ids=["grpo-judged", "distill"])
def test_the_loop_ahead_equals_a_reference_drawn_one_update_behind(tmp_path, stage, extra):
  cfg = tiny_config(f"train.run_dir={tmp_path}", "train.run_name=ahead", *AHEAD, *extra)
  loop.train(cfg, stage=stage)
  run = loop.Run(tiny_config(f"train.run_dir={tmp_path}", "train.run_name=ref", *AHEAD, *extra),
                 stage=stage)
  assert [d.id for d in run.setup.devices.rollout] == [4, 5, 6, 7][:run.cfg.rollout.devices]
  assert {d.id for d in run.sampler.mesh.devices.flat} == {d.id for d in run.setup.devices.rollout}
  got, step = restore_lora(dataclasses.replace(run.setup, cfg=cfg))
  assert step == 3
  start = run.state.lora
  ref, fresh = _by_hand(run, stale=True), _by_hand(run, stale=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
             for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(fresh)))  # staleness is real
  assert any(not np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
             for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(start)))  # and it learned
  run.ckpt.close()


def test_the_rollouts_chips_and_bad_settings(monkeypatch):
  cfg = tiny_config("rollout.devices=3", "grpo.sampler_is=token")
  d = split_devices(cfg, jax.devices())
  assert [x.id for x in d.policy] == [0, 1, 2, 3, 4] and [x.id for x in d.rollout] == [5, 6, 7]
  assert d.judge is None and d.teacher is None
  two = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]  # a v5e:2x4's
  d = split_devices(tiny_config("rollout.devices=4", "grpo.sampler_is=token"), two)
  assert [x.id for x in d.policy] == [0, 1, 2, 3] and [x.id for x in d.rollout] == [4, 5, 6, 7]
  with pytest.raises(ConfigError, match=r"config key 'grpo.sampler_is' = 'off': expected 'token' "
                                        r"with rollout.devices = 2: rollouts drawn one update"):
    tiny_config("rollout.devices=2")
  with pytest.raises(ConfigError, match=r"'rollout.devices' = 0: expected a positive number"):
    tiny_config("rollout.devices=0", "grpo.sampler_is=token")
  with pytest.raises(ConfigError, match=r"^config key 'rollout.devices' = 8: this run has 8 "
                                        r"devices, and the policy needs at least one \(at most 7"):
    split_devices(tiny_config("rollout.devices=8", "grpo.sampler_is=token"), jax.devices())
  with monkeypatch.context() as m:
    m.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^config key 'rollout.devices' = 3: this run spans 2 "
                                          r"hosts \(processes\), and rollouts on chips of their "
                                          r"own run on one host$"):
      split_devices(cfg, jax.devices())
  with pytest.raises(ConfigError, match=r"^config key 'rollout.devices' = 2: the sft stage "
                                        r"samples no rollouts \(GRPO and distillation do\)$"):
    loop.Run(tiny_config("rollout.devices=2", "grpo.sampler_is=token"), stage="sft")


def test_the_planner_compiles_each_side_on_its_own_chips_and_adds_the_slower():
  from reasoner.build import build
  from reasoner.planner import ahead, plan, report as report_lib

  cfg = tiny_config("train.batch_size=2", "data.max_prompt_tokens=64")
  assert ahead.splits(cfg, 8) == [4, 6, 7]  # 2 x 4 rows: the policy's fsdp divides 8
  in_turn = plan.plan(cfg, "cpu", search=False)
  split = plan.plan(ahead.with_devices(cfg, 4), "cpu", search=False)
  assert split["mesh"]["fsdp"] == 4 and split["rollout"].fits
  groups = lambda r: {c.group for c in r.collectives}
  assert max(groups(in_turn["rollout"])) == 8 and max(groups(split["rollout"])) == 4
  lora = build(ahead.with_devices(cfg, 4), abstract=True).lora
  assert split["transfer"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lora)) > 0
  chip, t = split["chip"], plan.sides(split)
  assert t["train"] == pytest.approx(split["train"].seconds(chip)
                                     + split["logprobs"].seconds(chip))  # beta > 0: one forward
  assert plan.step_seconds(split) == pytest.approx(
      max(t["rollout"], t["train"]) + split["transfer"] / chip.ici)
  assert plan.step_seconds(in_turn) == pytest.approx(sum(plan.sides(in_turn).values()))
  assert "GRPO step (rollouts a step ahead on 4 chips of their own" in (
      report_lib.format_report(split))
  best = min((None, 4), key=lambda r: plan.step_seconds(in_turn if r is None else split))
  text = ahead.format_pick({"plans": {None: in_turn, 4: split}, "best": best})
  assert "in turn on the training chips" in text and "4 chips ahead" in text
  assert text.splitlines()[-1] == ("fastest: " + ("rollouts in turn (rollout.devices: null)"
                                                  if best is None else "rollout.devices: 4"))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (the tpu extra)")
def test_on_a_tpu_each_side_is_planned_on_a_slice_of_its_own():
  """v5e:2x4 split 4 + 4: the rollout and the training each compiled for a v5e:2x2 (libtpu
  lowers a program for a slice, not for any four chips of one); 2 + 6 is no pair of slices."""
  from reasoner.planner import ahead, plan

  cfg = tiny_config("train.batch_size=2", "data.max_prompt_tokens=64", "grpo.sampler_is=token")
  found = ahead.plan_run(ahead.with_devices(cfg, 4), "v5e:2x4", search=False)
  quarter = plan.plan(cfg, "v5e:2x2", search=False)
  assert found["chips"] == 8 and found["mesh"]["fsdp"] == 4 and found["cfg"].rollout.devices == 4
  assert found["rollout"].seconds(found["chip"]) == quarter["rollout"].seconds(quarter["chip"])
  assert found["train"].seconds(found["chip"]) == quarter["train"].seconds(quarter["chip"])
  assert found["transfer"] == quarter["lora_bytes"] > 0
  with pytest.raises(ConfigError, match=r"^config key 'rollout.devices' = 6: on v5e:2x4 the "
                                        r"rollout's chips and the rest must each be a slice"):
    ahead.plan_run(ahead.with_devices(cfg, 6), "v5e:2x4", search=False)
