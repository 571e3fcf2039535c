import sys
import types

import numpy as np
import pytest

from reasoner.rewards import builtin as rewards, scoring
from reasoner.config import ConfigError, RewardSpec


GOOD = "<reasoning>3 + 4 = 7</reasoning>\n<answer>7</answer>"


def test_format_exact_and_partial():
  comps = [GOOD, "<reasoning>x</reasoning><answer>7", "7", GOOD + " trailing"]
  assert rewards.format_exact([], comps) == [1.0, 0.0, 0.0, 0.0]
  assert rewards.format_partial([], comps) == [1.0, 0.75, 0.0, 1.0]


def test_correct_numbers_and_math_verify():
  comps = [GOOD, "<reasoning>r</reasoning><answer>7.0</answer>",
           "<reasoning>r</reasoning><answer>1,000</answer>",
           "<reasoning>r</reasoning><answer>\\frac{1}{2}</answer>",
           "<reasoning>r</reasoning><answer>8</answer>", "7"]
  refs = ["7", "7", "1000", "0.5", "7", "7"]
  assert rewards.correct([], comps, answer=refs) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_weighted_total_is_normalised():
  r = scoring.Rewards([RewardSpec(fn="format_exact", weight=1.0),
                       RewardSpec(fn="correct", weight=3.0)])
  total, per = r(["p", "p"], [GOOD, "<reasoning>r</reasoning><answer>5</answer>"],
                 answer=["7", "7"])
  np.testing.assert_allclose(total, [1.0, 0.25])
  assert set(per) == {"format_exact", "correct"}


def test_user_function_by_module_path_and_its_errors():
  mod = types.ModuleType("my_rewards")
  mod.length = lambda prompts, completions, **kw: [min(1.0, len(c) / 10) for c in completions]
  mod.broken = lambda prompts, completions, **kw: 1 / 0
  sys.modules["my_rewards"] = mod
  r = scoring.Rewards([RewardSpec(fn="my_rewards:length")])
  np.testing.assert_allclose(r(["p"], ["12345"])[0], [0.5])
  with pytest.raises(scoring.RewardError, match="'my_rewards:broken' raised ZeroDivisionError"):
    scoring.Rewards([RewardSpec(fn="my_rewards:broken")])(["p"], ["c"])
  with pytest.raises(ConfigError, match="has no function 'nope'"):
    scoring.Rewards([RewardSpec(fn="my_rewards:nope")])
  with pytest.raises(ConfigError, match="cannot import module 'not_a_module_xyz'"):
    scoring.Rewards([RewardSpec(fn="not_a_module_xyz:f")])


def test_a_reward_routed_by_category_reaches_only_its_rows():
  """Each reward sees only the rows of its categories, and a row's total is the weighted mean
  of the rewards that score it (by hand below); per reward, NaN where it does not score."""
  seen = {}
  mod = types.ModuleType("routed_rewards")

  def record(name, value):
    def fn(prompts, completions, answer, category, **_):
      seen[name] = list(zip(completions, category))
      return [value] * len(completions)
    return fn

  mod.half, mod.one = record("half", 0.5), record("one", 1.0)
  sys.modules["routed_rewards"] = mod
  r = scoring.Rewards([RewardSpec(fn="routed_rewards:half", weight=1.0, categories=("math",)),
                       RewardSpec(fn="routed_rewards:one", weight=3.0,
                                  categories=("math", "essay")),
                       RewardSpec(fn="format_exact", weight=4.0)])
  cats = ["math", "essay", "poem", "math"]
  total, per_fn = r(["p"] * 4, ["a", "b", GOOD, "d"], answer=["1", None, None, "2"],
                    category=cats)
  assert seen["half"] == [("a", "math"), ("d", "math")]
  assert seen["one"] == [("a", "math"), ("b", "essay"), ("d", "math")]
  np.testing.assert_allclose(total, [(0.5 * 1 + 1 * 3 + 0 * 4) / 8, (1 * 3 + 0 * 4) / 7, 1.0,
                                     (0.5 * 1 + 1 * 3 + 0 * 4) / 8], rtol=1e-6)
  np.testing.assert_array_equal(np.isnan(per_fn["routed_rewards:half"]), [0, 1, 1, 0])


def test_records_no_reward_scores_or_without_a_needed_answer_are_one_line():
  r = scoring.Rewards([RewardSpec(fn="correct", categories=("math",)),
                       RewardSpec(fn="repetition", categories=("poem",))])
  r.check([{"question": "q", "answer": "1", "category": "math"},
           {"question": "q", "answer": None, "category": "poem"}], "the training data")
  with pytest.raises(ConfigError, match=r"no reward scores category 'essay' \(the held-out "
                                        r"data, record 1\)"):
    r.check([{"answer": "1", "category": "math"}, {"answer": "x", "category": "essay"}],
            "the held-out data")
  with pytest.raises(scoring.DataError, match=r"record 0 \(category 'math'\) has no reference "
                                              r"answer .* which reward 'correct' needs"):
    r.check([{"answer": None, "category": "math"}], "the training data")
  with pytest.raises(ConfigError, match="appears twice for the same categories"):
    scoring.Rewards([RewardSpec(fn="correct"), RewardSpec(fn="correct")])
  with pytest.raises(ConfigError, match="rewards\\[\\].categories"):
    RewardSpec(fn="correct", categories=())


def test_math_verify_answers_are_scored_by_the_rewards_as_by_correct():
  """`correct` through `Rewards` (with a user function beside it, run in a thread) scores a
  LaTeX answer as `correct` does: math-verify's signal timeouts fail outside the main thread."""
  mod = types.ModuleType("beside_rewards")
  mod.one = lambda prompts, completions, **_: [1.0] * len(completions)
  sys.modules["beside_rewards"] = mod
  comps = ["<reasoning>r</reasoning><answer>\\frac{1}{2}</answer>"]
  assert rewards.correct([], comps, answer=["0.5"]) == [1.0]
  r = scoring.Rewards([RewardSpec(fn="correct"), RewardSpec(fn="beside_rewards:one")])
  assert r(["p"], comps, answer=["0.5"])[1]["correct"].tolist() == [1.0]


def test_slow_rewards_run_concurrently():
  """Two rewards that each wait 0.5 s (a remote judge) score a batch in about 0.5 s, not 1 s."""
  import time

  mod = types.ModuleType("slow_rewards")

  def slow(prompts, completions, **_):
    time.sleep(0.5)
    return [1.0] * len(completions)

  mod.a = mod.b = slow
  sys.modules["slow_rewards"] = mod
  r = scoring.Rewards([RewardSpec(fn="slow_rewards:a"), RewardSpec(fn="slow_rewards:b")])
  t = time.perf_counter()
  r(["p"], ["c"])
  assert 0.5 <= time.perf_counter() - t < 0.9


def test_relevance_is_rouge_l_and_repetition_counts_repeated_4_grams():
  """ROUGE-L F1 by hand: reference 'the cat sat on the mat', answer 'the cat on the mat': the
  longest common subsequence is 5 words, precision 5/5, recall 5/6, F1 10/11."""
  answer = "<reasoning>r</reasoning><answer>the cat on the mat</answer>"
  got = rewards.relevance([], [answer, "the cat sat on the mat"],
                          answer=["The cat sat on the mat.", "The cat sat on the mat."])
  np.testing.assert_allclose(got, [10 / 11, 1.0], rtol=1e-6)
  # a b c d a b c d: 4-grams abcd bcda cdab dabc abcd, 4 of 5 not repeats
  assert rewards.repetition([], ["a b c d a b c d", "one two three", "w x y z"]) == [0.8, 1.0,
                                                                                     1.0]


def test_routing_is_checked_against_the_data_before_any_model_loads():
  from conftest import ROOT, tiny_config
  from reasoner import build

  data = ("data.source=jsonl", f"data.path={ROOT / 'data' / 'mixed.jsonl'}", "data.num_eval=4")
  with pytest.raises(ConfigError, match="no reward scores category 'science' \\(the training"):
    build.check(tiny_config(*data, "rewards=[{fn: correct, categories: [math, code]}]"))
  with pytest.raises(scoring.DataError, match="category 'creative'.*which reward 'relevance'"):
    build.check(tiny_config(*data, "rewards=[{fn: relevance}]"))
  routed = ("rewards=[{fn: correct, categories: [math, code]}, {fn: relevance, categories: "
            "[science, summarisation]}, {fn: repetition, categories: [creative]}]")
  c = build.check(tiny_config(*data, routed))
  r, train, held_out = c.rewards, c.train, c.held_out
  assert len(train) + len(held_out) == 10 and r.names == ["correct", "relevance", "repetition"]


def test_instructions_and_tests_pass_score_their_rows_and_check_their_records():
  """The checkable rewards through `Rewards`: each record's constraints (the fraction followed)
  and tests (run in the sandbox, in a thread of its own), routed by category; a record that
  lacks what its reward needs, or carries what cannot be checked, is one line before any model
  loads."""
  r = scoring.Rewards([RewardSpec(fn="instructions", categories=("if",)),
                       RewardSpec(fn="tests_pass", categories=("code",), timeout_s=30)])
  lower = [{"kind": "change_case:english_lowercase", "args": {}},
           {"kind": "punctuation:no_comma", "args": {}}]
  records = [{"question": "q", "category": "if", "constraints": lower},
             {"question": "q", "category": "code", "tests": "assert f(2) == 4"}]
  r.check(records, "the training data")
  completions = ["<answer>all lower, with a comma</answer>",
                 "```python\ndef f(x):\n  return x * 2\n```"]
  total, per_fn = r.score(["p", "p"], completions, records)
  np.testing.assert_allclose(total, [0.5, 1.0])
  np.testing.assert_array_equal(np.isnan(per_fn["tests_pass"]), [1, 0])
  total, _ = r.score(["p", "p"], ["<answer>fine as is</answer>", "def f(x): return x"],
                     records)
  np.testing.assert_allclose(total, [1.0, 0.0])
  with pytest.raises(scoring.DataError, match=r"^the training data, record 0 \(category 'if'\) "
                                              r"has no constraints \(data.constraints_field\), "
                                              r"which reward 'instructions' needs$"):
    r.check([{"question": "q", "category": "if"}], "the training data")
  with pytest.raises(scoring.DataError, match=r"record 0.*'keywords:existance'.*did you mean "
                                              r"'keywords:existence'"):
    r.check([{"category": "if", "constraints": [{"kind": "keywords:existance",
                                                   "args": {"keywords": ["a"]}}]}], "the data")
  with pytest.raises(scoring.DataError, match=r"record 0"):
    r.check([{"category": "code", "tests": "assert f(2) =="}], "the data")
