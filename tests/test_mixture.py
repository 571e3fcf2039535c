"""Data mixtures (`data.mixture`): sources drawn by weight, each record keeping its category,
held-out records from every source, exact resume, and bad mixtures in one line."""

import collections
import itertools

import numpy as np
import pytest

from conftest import ROOT, tiny_config
from reasoner.config import ConfigError
from reasoner.data import examples as examples_lib, sources
from reasoner.errors import DataError

MIX = ("data.mixture=[{name: arith, source: arithmetic, weight: 3, num_eval: 4}, "
       f"{{name: general, path: '{ROOT / 'data/general.jsonl'}', weight: 1, num_eval: 2, "
       "category: chat}]",)


def test_sources_keep_their_categories_and_hold_out_their_own():
  cfg = tiny_config(*MIX, "data.num_train=200").data
  train, held_out = sources.load_splits(cfg)
  counts = collections.Counter(r["source"] for r in train)
  assert counts == {"arith": 200, "general": 10}
  assert [r["source"] for r in held_out] == ["arith"] * 4 + ["general"] * 2
  general = [r for r in train if r["source"] == "general"]
  assert {r["category"] for r in general} == {"creative", "summarisation", "science", "math",
                                              "code"}  # the file's own categories
  assert {r["category"] for r in train if r["source"] == "arith"} == {"math"}
  assert not {r["question"] for r in held_out} & {r["question"] for r in train}


def test_draws_follow_the_weights_and_resume_exactly():
  """Over 800 draws the sources' shares are their weights' (grain's mix interleaves them
  exactly), the small source repeating in a new order each pass; a restored iterator draws
  the same batches."""
  cfg = tiny_config(*MIX, "data.num_train=200").data
  train, _ = sources.load_splits(cfg)
  it = sources.train_iterator(train, 8, seed=1, mixture=cfg.mixture)
  batches = [next(it) for _ in range(100)]
  drawn = [r for b in batches for r in b]
  shares = collections.Counter(r["source"] for r in drawn)
  assert shares == {"arith": 600, "general": 200}
  general = [r["question"] for r in drawn if r["source"] == "general"]
  assert len(set(general[:10])) == 10 and general[:10] != general[10:20]  # each pass reshuffled
  categories = collections.Counter(r["category"] for r in drawn)
  assert categories["math"] > 600 and categories["creative"] > 0  # each record's own category
  it = sources.train_iterator(train, 8, seed=1, mixture=cfg.mixture)
  for _ in range(37):
    next(it)
  state = it.get_state()
  again = sources.train_iterator(train, 8, seed=1, mixture=cfg.mixture)
  again.set_state(state)
  assert [next(again) for _ in range(5)] == batches[37:42]


def test_sft_epochs_draw_by_the_weights():
  """SFT's length-bucketed batches draw a mixture's examples by weight: 3 : 1 from sources of
  200 and 10 examples, not 20 : 1."""
  cfg = tiny_config(*MIX, "data.num_train=200").data
  train, _ = sources.load_splits(cfg)
  weights = sources.draw_weights(train, cfg.mixture)
  assert np.isclose(sum(weights), 4.0)
  examples = [([1] * (3 + i % 5), [2] * 4) for i in range(len(train))]
  b = examples_lib.Batches(examples, batch_size=10, seed=0, window=4, bucket=8, pad_id=0,
                           weights=weights)
  drawn = np.concatenate([b.epoch(e).ravel() for e in range(10)])
  share = np.mean([train[i]["source"] == "general" for i in drawn])
  assert abs(share - 0.25) < 0.03, share
  first = [b.epoch(0).copy()]
  b2 = examples_lib.Batches(examples, batch_size=10, seed=0, window=4, bucket=8, pad_id=0,
                            weights=weights)
  np.testing.assert_array_equal(b2.epoch(0), first[0])  # deterministic by seed


def test_the_grpo_batches_of_a_run_use_the_mixture():
  from reasoner.build import check
  from reasoner.objectives import grpo

  cfg = tiny_config(*MIX, "data.num_train=60", "train.batch_size=4",
                    "rewards=[{fn: format_exact}]")
  c = check(cfg)
  setup = type("S", (), {"train_records": c.train, "cfg": cfg})
  drawn = [r for b in itertools.islice(grpo.STAGE.batches(setup), 20) for r in b]
  assert collections.Counter(r["source"] for r in drawn) == {"arith": 60, "general": 20}


def test_bad_mixtures_fail_in_one_line():
  with pytest.raises(ConfigError, match=r"'data.mixture\[general\].weight' = 0.0: expected a "
                     "positive number"):
    tiny_config("data.mixture=[{name: general, path: x.jsonl, weight: 0}]")
  with pytest.raises(ConfigError, match=r"'data.mixture\[a\].weight' = -1.0"):
    tiny_config("data.mixture=[{name: a, source: arithmetic, weight: -1}]")
  with pytest.raises(ConfigError, match=r"'data.mixture' = \['a', 'a'\]: expected .*distinct"):
    tiny_config("data.mixture=[{name: a, source: arithmetic}, {name: a, source: gsm8k}]")
  with pytest.raises(ConfigError, match=r"'data.path' = 'x.jsonl': expected null when "
                     "data.mixture is set"):
    tiny_config("data.path=x.jsonl", "data.mixture=[{name: a, source: arithmetic}]")
  with pytest.raises(ConfigError, match=r"'data.mixture\[g\].path' = None: expected a file"):
    tiny_config("data.mixture=[{name: g, source: jsonl}]")
  with pytest.raises(DataError, match=r"'data.mixture\[g\].path' = 'missing.jsonl': the file "
                     "does not exist"):
    sources.load_splits(tiny_config("data.mixture=[{name: g, path: missing.jsonl}]").data)


def test_a_question_held_out_anywhere_leaves_every_sources_training(tmp_path):
  """A question one source of a mixture holds out leaves the other sources' training too
  (whitespace aside), a generated source's as well, and one an evaluation set asks leaves
  every source's: each source's line counts them and names what holds them out."""
  import json

  from reasoner.data import arithmetic

  def write(name, questions):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    return path

  drawn = arithmetic.generate(20, 2, 0, "easy", "record")[0][3]["question"]
  a = write("a", ["q0?", "q1?", "x2?", "q3?", "q4?", "q5?"])  # q4, q5 held out
  b = write("b", [" q5? ", "x0?", "x1?", "q4?", drawn, "x2?"])  # drawn, x2 held out
  cfg = tiny_config("data.num_train=20", "data.mixture=[{name: arith, source: arithmetic, "
                    f"num_eval: 2}}, {{name: a, path: '{a}', num_eval: 2}}, {{name: b, path: "
                    f"'{b}', num_eval: 2}}]").data
  said = []
  train, held = sources.load_splits(cfg, log=said.append,
                                    evaluated={"ret": [{"question": "q0?", "answer": "1"}]})
  mine = lambda name: [r["question"] for r in train if r["source"] == name]
  assert mine("a") == ["q1?", "q3?"] and mine("b") == ["x0?", "x1?"]
  assert drawn not in mine("arith") and len(mine("arith")) == 19
  assert [r["question"] for r in held] == [r["question"] for r in held[:2]] + [
      "q4?", "q5?", drawn, "x2?"]
  contamination = "held-out questions also in training dropped from training (contamination"
  assert said == [
      f"data: 'arith' (arithmetic): 22 generated, 1 {contamination}; held out 1 by "
      "data.mixture[b]); 19 training, 2 held out",
      f"data: 'a' (jsonl {a}): 6 read, 2 {contamination}; held out 1 by eval.sets[ret], 1 by "
      "data.mixture[b]); 2 training, 2 held out",
      f"data: 'b' (jsonl {b}): 6 read, 2 {contamination}; held out 2 by data.mixture[a]); "
      "2 training, 2 held out"]
  # a run reads its evaluation sets first: their questions never train
  from reasoner.build import check

  ret = write("ret", ["x1?", "x0?", "q3?"])
  run = tiny_config("data.source=jsonl", f"data.path={b}", "data.num_eval=2",
                    f"eval.sets=[{{name: ret, source: jsonl, path: '{ret}'}}]")
  c = check(run)
  assert [r["question"] for r in c.train] == [" q5? ", "q4?"]
  assert [r["question"] for r in c.sets["ret"]] == ["x1?", "x0?", "q3?"]
