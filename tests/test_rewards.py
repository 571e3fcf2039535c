import sys
import types

import numpy as np
import pytest

from reasoner import rewards
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
  r = rewards.Rewards([RewardSpec(fn="format_exact", weight=1.0),
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
  r = rewards.Rewards([RewardSpec(fn="my_rewards:length")])
  np.testing.assert_allclose(r(["p"], ["12345"])[0], [0.5])
  with pytest.raises(rewards.RewardError, match="'my_rewards:broken' raised ZeroDivisionError"):
    rewards.Rewards([RewardSpec(fn="my_rewards:broken")])(["p"], ["c"])
  with pytest.raises(ConfigError, match="has no function 'nope'"):
    rewards.Rewards([RewardSpec(fn="my_rewards:nope")])
  with pytest.raises(ConfigError, match="cannot import module 'not_a_module_xyz'"):
    rewards.Rewards([RewardSpec(fn="not_a_module_xyz:f")])
