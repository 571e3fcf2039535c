"""Curricula (`data.curriculum`): phases by a record field, prompts solved or failed by every
sample set aside and brought back, a deterministic order, exact resume, bad curricula in one
line."""

import collections

import numpy as np
import pytest

from conftest import ROOT, tiny_config
from reasoner.build import check
from reasoner.config import ConfigError
from reasoner.data import sources
from reasoner.data.curriculum import Curriculum
from reasoner.objectives import grpo

LEVELS = ("data.mixture=[{name: easy, source: arithmetic, num_eval: 2}, "
          "{name: medium, source: arithmetic, difficulty: medium, num_eval: 2}, "
          f"{{name: general, path: '{ROOT / 'data/general.jsonl'}', num_eval: 2}}]",
          "data.num_train=40", "rewards=[{fn: format_exact}]", "train.batch_size=4")
SCHEDULE = ("data.curriculum={field: difficulty, schedule: [{from_step: 0, values: [easy]}, "
            "{from_step: 3, values: [easy, medium]}, {from_step: 5, values: [medium]}]}",)


def run(cfg, steps, rewards=None, state=None):
  """`steps` steps of a curriculum over the run's records: the batches, and the iterator."""
  train, _ = sources.load_splits(cfg.data)
  it = Curriculum(train, cfg.train.batch_size, cfg.train.seed, cfg.data)
  if state is not None:
    it.set_state(state)
  out = []
  for step in range(it.step, it.step + steps):
    batch = next(it)
    out.append(batch)
    g = np.asarray([rewards(r) for r in batch]) if rewards else np.full((len(batch), 4), 0.5)
    it.observe(step, [(batch, g)])
  return out, it


def test_phases_follow_the_schedule_and_records_without_the_field_always_come():
  cfg = tiny_config(*LEVELS, *SCHEDULE)
  batches, it = run(cfg, 8)
  assert it.metrics() == {"curriculum/set_aside": 0, "curriculum/phase": 2}
  levels = [collections.Counter(r.get("difficulty", "none") for r in b) for b in batches]
  assert all(set(c) <= {"easy", "none"} for c in levels[:3])
  assert set().union(*levels[3:5]) <= {"easy", "medium", "none"} and any(
      "medium" in c for c in levels[3:5])
  assert all(set(c) <= {"medium", "none"} for c in levels[5:])
  assert any("none" in c for c in levels)  # the general prompts, in every phase
  assert grpo.STAGE.batches(type("S", (), {"cfg": cfg, "train_records": check(cfg).train})
                            ).__class__ is Curriculum


def test_solved_and_failed_prompts_are_set_aside_and_come_back(tmp_path):
  """Adaptive: prompts whose 4 rewards are all 1 (solved) or all 0 (failed) skip 3 steps, then
  return; prompts in between keep being drawn. 24 prompts, 4 a step: each comes often."""
  path = tmp_path / "q.jsonl"
  path.write_text("".join(f'{{"question": "q{i}"}}\n' for i in range(26)))
  cfg = tiny_config("data.source=jsonl", f"data.path={path}", "data.num_eval=2",
                    "rewards=[{fn: format_exact}]", "train.batch_size=4",
                    "data.curriculum={set_aside_steps: 3}")
  kind = lambda r: r["index"] % 3  # 0: always solved, 1: never, 2: half the samples
  rows = {0: [1.0] * 4, 1: [0.0] * 4, 2: [1.0, 0.0, 1.0, 0.0]}
  batches, it = run(cfg, 20, rewards=lambda r: rows[kind(r)])
  last = {}
  for step, b in enumerate(batches):
    for r in b:
      if kind(r) != 2 and r["index"] in last:
        assert step - last[r["index"]] > 3, (r["index"], last[r["index"]], step)
      last[r["index"]] = step
  assert all(until > it.step for until in it.aside.values())
  assert it.metrics()["curriculum/set_aside"] == len(it.aside) > 0
  assert {kind(r) for b in batches[3:] for r in b} == {0, 1, 2}  # they come back


def test_the_order_is_deterministic_and_resume_exact():
  cfg = tiny_config(*LEVELS, *SCHEDULE, "data.curriculum.set_aside_steps=2")
  rewards = lambda r: [1.0] * 4 if r["index"] % 2 else [0.25] * 4
  whole, _ = run(cfg, 9, rewards)
  again, _ = run(cfg, 9, rewards)
  assert whole == again
  first, it = run(cfg, 4, rewards)
  state = it.get_state()
  assert state["step"] == 4 and state["drawn"] == 4 and state["aside"]
  rest, _ = run(cfg, 5, rewards, state=state)
  assert first + rest == whole
  with pytest.raises(Exception, match="not a curriculum's"):
    it.set_state({"position": 3})


def test_bad_curricula_fail_in_one_line():
  with pytest.raises(ConfigError, match=r"'data.curriculum.field' = 'level': no record of the "
                     "training data has it"):
    check(tiny_config(*LEVELS, *(s.replace("difficulty", "level") for s in SCHEDULE)))
  with pytest.raises(ConfigError, match=r"'data.curriculum.schedule\[1\].values' = \['expert'\]"):
    check(tiny_config(*LEVELS, "data.curriculum={field: difficulty, schedule: [{from_step: 0, "
                      "values: [easy]}, {from_step: 2, values: [expert]}]}"))
  with pytest.raises(ConfigError, match=r"'data.curriculum.schedule' = \[2\]: expected phases "
                     "from step 0"):
    tiny_config("data.curriculum={field: d, schedule: [{from_step: 2, values: [a]}]}")
  with pytest.raises(ConfigError, match=r"'data.curriculum.field' = 'd': expected a field "
                     "together with a schedule"):
    tiny_config("data.curriculum={field: d}")
  with pytest.raises(ConfigError, match=r"'data.curriculum.set_aside_steps' = -1"):
    tiny_config("data.curriculum={set_aside_steps: -1}")
