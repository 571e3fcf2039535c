"""Reward functions: plain `(prompts, completions, **batch) -> list[float]`, each in [0, 1].

Built-ins: `format_exact`, `format_partial`, `correct`. Any other function is referenced as
'module:function'. The total reward is the weighted mean (weights normalised to sum to 1), so
it stays on a 0-1 scale whatever the weights.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Sequence

import numpy as np

from reasoner.config import RewardSpec
from reasoner.errors import ConfigError, RewardError

RewardFn = Callable[..., list[float]]

EXACT = re.compile(r"^\s*<reasoning>(?:(?!</?reasoning>|</?answer>).)+</reasoning>\s*"
                   r"<answer>\s*(?:(?!</?reasoning>|</?answer>).)+?\s*</answer>\s*$", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def format_exact(prompts, completions, **_) -> list[float]:
  """1 when the completion is exactly <reasoning>...</reasoning><answer>...</answer>."""
  return [1.0 if EXACT.match(c) else 0.0 for c in completions]


def format_partial(prompts, completions, **_) -> list[float]:
  """0.25 for each of the four tags present exactly once."""
  tags = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
  return [sum(0.25 for t in tags if c.count(t) == 1) for c in completions]


def extract_answer(completion: str) -> str | None:
  m = ANSWER.findall(completion)
  return m[-1].strip() if m else None


def _number(text: str) -> float | None:
  t = text.strip().replace(",", "").rstrip(".")
  t = re.sub(r"^\$|\s*(dollars?|\\%|%)$", "", t)
  try:
    v = float(t)
  except ValueError:
    return None
  return v if math.isfinite(v) else None


def answers_match(predicted: str, reference: str) -> bool:
  """Numbers compare by value; anything else through math-verify (LaTeX, fractions, sets)."""
  p, r = _number(predicted), _number(reference)
  if p is not None and r is not None:
    return abs(p - r) <= 1e-6 * max(1.0, abs(r))
  if not predicted.strip():
    return False
  from math_verify import parse, verify

  try:
    return bool(verify(parse(reference), parse(predicted)))
  except Exception:  # math-verify raises on unparsable input; that is a wrong answer
    return False


def correct(prompts, completions, answer: Sequence[str], **_) -> list[float]:
  """1 when the text inside <answer></answer> equals the reference answer."""
  out = []
  for c, ref in zip(completions, answer):
    pred = extract_answer(c)
    out.append(1.0 if pred is not None and answers_match(pred, str(ref)) else 0.0)
  return out


def overlong(lengths: np.ndarray, max_new_tokens: int, buffer: int,
             penalty: float) -> np.ndarray:
  """DAPO's soft overlong punishment, counted in tokens: 0 up to max_new_tokens - buffer, then
  linear down to -penalty at max_new_tokens (a completion cut there). Added to the reward."""
  over = np.clip(np.asarray(lengths, np.float32) - (max_new_tokens - buffer), 0.0, None)
  return (-penalty * np.minimum(over / max(buffer, 1), 1.0)).astype(np.float32)


BUILTIN: dict[str, RewardFn] = {"format_exact": format_exact, "format_partial": format_partial,
                                "correct": correct}


def resolve(name: str) -> RewardFn:
  """A built-in name or 'package.module:function'."""
  if name in BUILTIN:
    return BUILTIN[name]
  if ":" not in name:
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: expected a built-in "
                      f"({', '.join(BUILTIN)}) or 'module:function'")
  mod_name, fn_name = name.split(":", 1)
  try:
    mod = importlib.import_module(mod_name)
  except ImportError as e:
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: cannot import module "
                      f"'{mod_name}' ({e})") from None
  fn = getattr(mod, fn_name, None)
  if not callable(fn):
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: module '{mod_name}' has no "
                      f"function '{fn_name}'")
  return fn


class Rewards:
  """The configured reward functions with normalised weights."""

  def __init__(self, specs: Sequence[RewardSpec]):
    total = sum(s.weight for s in specs)
    self.names = [s.fn for s in specs]
    self.fns = [resolve(s.fn) for s in specs]
    self.weights = np.asarray([s.weight / total for s in specs], np.float32)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **batch
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total [n], {name: [n]}) for n completions; batch fields are per completion."""
    per_fn = {}
    for name, fn in zip(self.names, self.fns):
      try:
        values = fn(list(prompts), list(completions), **batch)
      except Exception as e:
        raise RewardError(f"reward function '{name}' raised {type(e).__name__}: {e}") from e
      values = np.asarray(values, np.float32)
      if values.shape != (len(completions),) or not np.all(np.isfinite(values)):
        raise RewardError(f"reward function '{name}' returned {values.shape} values "
                          f"(expected {len(completions)} finite numbers)")
      per_fn[name] = values
    total = sum(w * per_fn[n] for n, w in zip(self.names, self.weights))
    return np.asarray(total, np.float32), per_fn
