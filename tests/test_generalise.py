"""Held-out splits by wording and the retention set: whole templates held out, paired changes
with their standard errors, and the warning when a retention set falls."""

import json
import math

import numpy as np
import pytest

from conftest import ROOT, tiny_config
from reasoner.config import ConfigError
from reasoner.data import arithmetic, prompts
from reasoner.evaluation import paired_change, standard_error


def test_every_operation_has_ten_wordings_or_more():
  ops = [op for op, _ in arithmetic.TEMPLATES.values()]
  assert all(ops.count(op) >= 10 for op in "+-*")


def test_the_template_split_holds_out_whole_templates():
  train, held = arithmetic.split_templates(0)
  assert set(train).isdisjoint(held) and set(train) | set(held) == set(arithmetic.TEMPLATES)
  for op in "+-*":  # a third of each operation's wordings
    n = sum(o == op for o, _ in arithmetic.TEMPLATES.values())
    assert sum(arithmetic.TEMPLATES[k][0] == op for k in held) == n // 3
  assert set(arithmetic.FEWSHOT_TEMPLATES) <= set(train)
  # the few-shot prompt's examples are in training wordings (a held-out wording is new to it)
  shots = [q for q, _, _ in prompts.EXAMPLES]
  assert "bags with" in shots[0] and "gave away" in shots[1]

  records, held_out = arithmetic.generate(500, 256, seed=0, held_out_by="template")
  seen = {r["template"] for r in records}
  assert seen <= set(train) and {r["template"] for r in held_out} == set(held)
  assert not seen & {r["template"] for r in held_out}
  assert not {r["question"] for r in records} & {r["question"] for r in held_out}
  assert arithmetic.split_templates(1) != (train, held)  # chosen by seed


def test_held_out_kinds_are_disjoint_and_training_does_not_depend_on_them():
  a, by_template = arithmetic.held_out(300, 40, 3, "easy", "template")
  b, in_template = arithmetic.held_out(300, 90, 3, "easy", "template", "record")
  assert a == b  # the training problems do not depend on what is held out, nor how many
  trained = {r["question"] for r in a}
  assert not trained & {r["question"] for r in in_template}
  assert {r["template"] for r in in_template} <= {r["template"] for r in a}
  assert not {r["template"] for r in by_template} & {r["template"] for r in a}
  assert arithmetic.generate(300, 40, 3, "easy", "template") == (a, by_template)
  # `record` keeps one stream: the held-out problems are new questions in any wording
  r_train, r_held = arithmetic.generate(300, 40, 3)
  assert arithmetic.generate(300, 80, 3)[0] == r_train
  assert not {r["question"] for r in r_train} & {r["question"] for r in r_held}
  with pytest.raises(ValueError, match="held_out_by: template"):
    arithmetic.held_out(10, 5, 0, "easy", "record", "template")


def test_bad_held_out_configs_name_their_key():
  with pytest.raises(ConfigError, match="data.held_out_by"):
    tiny_config("data.source=jsonl", "data.path=data/general.jsonl", "data.held_out_by=template")
  with pytest.raises(ConfigError, match=r"eval.sets\[t\].held_out_by"):
    tiny_config("eval.sets=[{name: t, source: arithmetic, held_out_by: template}]")
  # files alone train, and the generator's split still names what its evaluation set holds out
  files = tiny_config("data.source=jsonl", "data.path=data/general.jsonl",
                      "data.held_out_by=template",
                      "eval.sets=[{name: t, source: arithmetic, held_out_by: template}]")
  assert files.data.held_out_by == files.eval.sets[0].held_out_by == "template"
  with pytest.raises(ConfigError, match="eval.retention_se"):
    tiny_config("eval.retention_se=0")
  with pytest.raises(ConfigError, match=r"eval.sets\[t\].max_new_tokens"):
    tiny_config("eval.sets=[{name: t, source: arithmetic, max_new_tokens: 0}]")


def test_paired_change_equals_its_dense_computation():
  rng = np.random.default_rng(0)
  b, a = rng.integers(0, 2, 300).astype(float), rng.integers(0, 2, 300).astype(float)
  rows = lambda v: [{"question": f"q{i}", "correct": x, "reward": 0.5 * x} for i, x in
                    enumerate(v)]
  after = rows(a)[::-1] + [{"question": "only after", "correct": 1.0, "reward": 1.0}]
  c = paired_change(rows(b), after)
  d = a - b
  assert c["metric"] == "accuracy" and c["n"] == 300
  assert c["before"] == pytest.approx(b.mean()) and c["after"] == pytest.approx(a.mean())
  assert c["change"] == pytest.approx(d.mean())
  assert c["se"] == pytest.approx(math.sqrt(((d - d.mean()) ** 2).sum() / 299 / 300))
  # rows without reference answers: the mean reward is what changes
  no_answer = lambda v: [{"question": f"q{i}", "correct": None, "reward": x}
                         for i, x in enumerate(v)]
  c = paired_change(no_answer(b), no_answer(a * 0.25))
  assert c["metric"] == "mean_reward" and c["change"] == pytest.approx((a * 0.25 - b).mean())
  assert paired_change(rows(b), [{"question": "x", "correct": 1.0, "reward": 1.0}]) is None
  # a run trained on past its end: its earlier evaluation's rows, then the latest's
  c = paired_change(rows(b), rows(1 - a) + rows(a))
  assert c["n"] == 300 and c["change"] == pytest.approx(d.mean())
  assert standard_error([1.0, float("nan"), 3.0]) == pytest.approx(1.0)
  assert math.isnan(standard_error([1.0]))


@pytest.mark.slow
def test_the_retention_set_is_evaluated_before_and_after_and_a_fall_warns(tmp_path, capsys):
  """A tiny run evaluates the held-out split (by template), the in-template set and a retention
  file before and after, with paired changes in eval.json; then, its retention rows before
  training set right (a forced regression), one more step ends with the warning line."""
  from reasoner import loop

  ret = tmp_path / "retention.jsonl"
  ret.write_text("".join(json.dumps({"question": f"What is {i} plus 1?", "answer": str(i + 1)})
                         + "\n" for i in range(6)))
  common = (f"train.run_dir={tmp_path}", "train.eval_before=true", "data.held_out_by=template",
            "eval.sets=[{name: in-template, source: arithmetic, held_out_by: record, num: 8}, "
            f"{{name: kept, source: jsonl, path: '{ret}', retention: true, "
            "max_new_tokens: 2}]")
  loop.train(tiny_config(*common, "train.steps=1"))
  run = tmp_path / "tiny"
  changes = json.loads((run / "eval.json").read_text())["changes"]
  assert set(changes) == {"held-out", "in-template", "kept"}
  assert changes["held-out"]["n"] == 8 and changes["kept"]["n"] == 6
  assert not changes["kept"].get("fell")  # the byte model is at 0 throughout: no fall
  out = capsys.readouterr()
  assert "held-out by template (8): accuracy" in out.err + out.out
  assert "warning" not in out.err + out.out

  rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
  tags = {r["tag"] for r in rows}
  assert {"eval-before", "eval-kept-before", "eval-in-template-before", "eval-after",
          "eval-kept-after"} <= tags
  # a set's own budget (2 tokens: characters, at most) beside eval.max_new_tokens (8)
  longest = lambda tag: max(len(r["completion"]) for r in rows if r["tag"] == tag)
  assert longest("eval-kept-before") <= 2 < longest("eval-in-template-before") <= 8
  forced = [{**r, "correct": 1.0} if r["tag"] == "eval-kept-before" else r for r in rows]
  (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in forced))
  loop.train(tiny_config(*common, "train.steps=2"))
  out = capsys.readouterr()
  lines = [l for l in (out.err + out.out).splitlines() if l.startswith("warning: the retention")]
  assert lines == ["warning: the retention set 'kept' fell beyond noise, accuracy 1.000 -> "
                   "0.000 (-1.000 +/- 0.000 SE, paired), more than eval.retention_se = 2 "
                   "standard errors: the run lost some of what the model could do before it"]
  assert json.loads((run / "eval.json").read_text())["changes"]["kept"]["fell"] is True


def test_the_embedded_preset_holds_out_wordings_and_names_a_retention_set():
  from reasoner.config import load_config
  from reasoner.data import sources

  cfg = load_config(ROOT / "configs" / "embedded.yaml")
  assert cfg.data.held_out_by == "template" and cfg.data.num_eval >= 256
  sets = {s.name: s for s in cfg.eval.sets}
  assert sets["retention"].retention and sets["retention"].num >= 256
  assert len(sources.load_eval_set(sets["retention"], cfg.data)) >= 256
  assert len(sources.load_eval_set(sets["in-template"], cfg.data)) >= 256
