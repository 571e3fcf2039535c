"""The generated instruction-following set (`reasoner.data.instructions`): deterministic by seed;
every response follows all its constraints and every rejected breaks exactly one, by the
reward's own checks; the held-out splits share no prompt with training, and hold out whole tasks
or whole combinations of constraints."""

from __future__ import annotations

import functools
import itertools
import random
import re

import pytest

from reasoner.data import instructions as data
from reasoner.rewards.checks import count_words
from reasoner.rewards.instructions import answer_text, follows, validate

KINDS = ("record", "task", "combination")


@functools.lru_cache
def held(kind: str) -> tuple[list[dict], list[dict]]:
  """2000 training records and 256 held-out ones of `kind` (seed 0): the demonstration's sizes."""
  return data.held_out(2000, 256, 0, "template", kind)


def test_deterministic_by_seed():
  a = data.generate(200, 50, seed=1)
  assert a == data.generate(200, 50, seed=1)
  assert a != data.generate(200, 50, seed=2)
  assert data.split(0) == data.split(0) and data.split(0) != data.split(1)


def test_responses_follow_every_constraint_and_rejected_break_exactly_one():
  records = held("record")[0] + [r for k in KINDS for r in held(k)[1]]
  records += data.generate(0, 300, seed=3)[1]
  broken = set()
  for r in records:
    pairs = validate(r["constraints"], r["template"])
    kinds = [k for k, _ in pairs]
    assert 1 <= len(pairs) <= 3 and len(set(kinds)) == len(kinds)
    assert not any(frozenset(p) in data.CONFLICTS for p in itertools.combinations(kinds, 2))
    assert r["combination"] == "+".join(sorted(kinds))
    assert r["template"] == f"{r['task']}|{r['combination']}"
    assert r["category"] == "instructions" and r["answer"] is None
    assert r["chosen"] == r["response"]
    for text in (r["response"], r["rejected"]):
      assert re.fullmatch(r"<reasoning>[^\n]+</reasoning>\n<answer>.+</answer>", text, re.S)
    good = [follows(k, a, answer_text(r["response"])) for k, a in pairs]
    bad = [follows(k, a, answer_text(r["rejected"])) for k, a in pairs]
    assert all(good), (r["question"], r["response"], good)
    assert sum(bad) == len(pairs) - 1, (r["question"], r["rejected"], bad)
    broken.add(kinds[bad.index(False)])
    assert count_words(r["question"]) < 60, r["question"]
    assert count_words(r["response"]) < 80, r["response"]
  assert broken == set(data.PHRASES)  # every kind is followed, and broken, somewhere


def test_template_split_holds_out_whole_tasks_and_whole_combinations():
  train_tasks, held_tasks, train_combinations, held_combinations = data.split(0)
  assert set(train_tasks).isdisjoint(held_tasks)
  assert set(train_tasks) | set(held_tasks) == set(data.TASKS)
  assert sorted(data.TASKS[t] for t in held_tasks) == sorted(data.FAMILIES)  # one of each family
  assert {data.TASKS[t] for t in train_tasks} == set(data.FAMILIES)
  assert set(train_combinations).isdisjoint(held_combinations)
  assert all("+" in c for c in held_combinations)  # every single kind trains

  train = held("record")[0]
  prompts = {r["question"] for r in train}
  assert len(prompts) == len(train) == 2000
  tasks, combinations = {r["task"] for r in train}, {r["combination"] for r in train}
  kinds = {k for c in combinations for k in c.split("+")}
  assert tasks <= set(train_tasks) and combinations <= set(train_combinations)
  assert kinds == set(data.PHRASES)
  for kind in KINDS:
    t, h = held(kind)
    assert t == train  # training does not depend on the held-out kind
    assert len(h) == len({r["question"] for r in h}) == 256  # 256 distinct prompts available
    assert not prompts & {r["question"] for r in h}

  by_record = held("record")[1]
  assert {r["task"] for r in by_record} <= set(train_tasks)
  assert {r["combination"] for r in by_record} <= set(train_combinations)
  by_task = held("task")[1]
  assert {r["task"] for r in by_task} == set(held_tasks)
  assert {r["combination"] for r in by_task} <= combinations  # combinations training saw
  by_combination = held("combination")[1]
  assert {r["task"] for r in by_combination} <= tasks
  new = {r["combination"] for r in by_combination}
  assert new <= set(held_combinations) and not new & combinations
  assert all(len(c.split("+")) > 1 and set(c.split("+")) <= kinds for c in new)
  assert len(new) > 20


def test_training_records_do_not_depend_on_the_held_out_number():
  for kind in KINDS:
    assert data.held_out(300, 10, 0, "template", kind)[0] == (
        data.held_out(300, 120, 0, "template", kind)[0])
  assert data.held_out(300, 10, 0, "record")[0] == data.held_out(300, 120, 0, "record")[0]


def test_record_split_is_one_stream_over_every_task_and_combination():
  train, held_out = data.generate(1000, 300, seed=0)
  assert len(train) == 1000 and len(held_out) == 300
  assert not {r["question"] for r in train} & {r["question"] for r in held_out}
  assert {r["task"] for r in train} == {r["task"] for r in held_out} == set(data.TASKS)
  held_combinations = set(data.split(0)[3])
  assert {r["combination"] for r in train} & held_combinations
  assert {r["combination"] for r in held_out} & held_combinations


def test_impossible_requests_fail_in_one_line():
  with pytest.raises(ValueError, match="with kind 'task': expected 'template'"):
    data.held_out(10, 10, 0, "record", "task")
  with pytest.raises(ValueError, match="with kind 'wording'"):
    data.held_out(10, 10, 0, "template", "wording")
  # 20 capitals, two wordings of the question and two of the constraint: 80 prompts at most
  with pytest.raises(ValueError, match="cannot generate 200 distinct instruction prompts"):
    data._distinct(random.Random(0), 200, ["capital"], ["punctuation:no_comma"], set())


def test_the_source_and_its_eval_sets_load_from_the_config(tmp_path):
  """`data.source: instructions` and its eval sets through the config (the held-out split: new
  combinations; `held_out_by: task`, new tasks; `record`, the trained ones); a file's records
  keep their `constraints` and `tests`; `task` is one line for a source without tasks."""
  import json

  from conftest import tiny_config
  from reasoner.config import EvalSet
  from reasoner.data import sources
  from reasoner.errors import DataError

  cfg = tiny_config("data.source=instructions", "data.held_out_by=template",
                    "data.num_train=200", "data.num_eval=20",
                    "eval.sets=[{name: tasks, source: instructions, held_out_by: task, num: 20}, "
                    "{name: seen, source: instructions, held_out_by: record, num: 20}, "
                    "{name: math, source: arithmetic, held_out_by: task, num: 4}]")
  train, held_out = sources.load_splits(cfg.data)
  assert (train, held_out) == data.held_out(200, 20, 0, "template")
  combos, tasks = {r["combination"] for r in train}, {r["task"] for r in train}
  assert not {r["combination"] for r in held_out} & combos
  new_tasks = sources.load_eval_set(cfg.eval.sets[0], cfg.data)
  assert len(new_tasks) == 20 and not {r["task"] for r in new_tasks} & tasks
  seen = sources.load_eval_set(cfg.eval.sets[1], cfg.data)
  train_tasks, _, train_combos, _ = data.split(0)  # the training side (200 records use part)
  assert {r["task"] for r in seen} <= set(train_tasks)
  assert {r["combination"] for r in seen} <= set(train_combos)
  with pytest.raises(DataError, match=r"^config key 'eval.sets\[math\].held_out_by' = 'task': "
                                      "only the instructions source holds out whole tasks$"):
    sources.load_eval_set(cfg.eval.sets[2], cfg.data)
  path = tmp_path / "mine.jsonl"
  rows = [{"question": "Say hi.", "constraints": [{"kind": "punctuation:no_comma", "args": {}}]},
          {"question": "Write f.", "tests": "assert f(1) == 2"}, {"question": "Plain."}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  read = sources.load_eval_set(EvalSet(name="mine", source="jsonl", path=str(path), num=3),
                               cfg.data)
  assert read[0]["constraints"] == rows[0]["constraints"] and "tests" not in read[0]
  assert read[1]["tests"] == "assert f(1) == 2" and "constraints" not in read[2]
