"""The built-in rewards that need no model: plain `(prompts, completions, **batch) ->
list[float]`, each in [0, 1].

`format_exact`, `format_partial`, `correct` (the answer checked: numbers, LaTeX); for answers no
parser can check, `relevance` (ROUGE-L against the reference, Google's rouge-score) and
`repetition` (repeated word 4-grams); DAPO's `overlong` penalty, added to a row's total. A
reward that needs a record's reference answer says so (`needs_answer`), and the records are
checked for it before any model loads (`scoring.Rewards.check`).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Sequence

import numpy as np

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


correct.needs_answer = True  # checked against the records before any model loads


def accuracy(completions: Sequence[str], answers: Sequence[str | None]) -> np.ndarray:
  """`correct` on rows with a reference answer, NaN on rows without one (not counted)."""
  out = np.full(len(completions), np.nan, np.float32)
  rows = [j for j, a in enumerate(answers) if a is not None]
  if rows:
    out[rows] = correct([], [completions[j] for j in rows], answer=[answers[j] for j in rows])
  return out


def nan_mean(values: np.ndarray) -> float:
  """The mean of the values that are not NaN (NaN when none is)."""
  values = np.asarray(values, np.float64)
  kept = values[~np.isnan(values)]
  return float(kept.mean()) if kept.size else float("nan")


@functools.cache
def _rouge():
  from rouge_score import rouge_scorer

  return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def relevance(prompts, completions, answer: Sequence[str], **_) -> list[float]:
  """ROUGE-L F1 (stemmed; Google's rouge-score) of the completion's answer (the text inside
  <answer></answer>, else the whole completion) against the reference: a cheap lexical score
  for answers no parser can check (summaries, explanations, short essays)."""
  return [_rouge().score(str(ref), extract_answer(c) or c)["rougeL"].fmeasure
          for c, ref in zip(completions, answer)]


relevance.needs_answer = True


def repetition(prompts, completions, **_) -> list[float]:
  """The share of a completion's word 4-grams that are not repeats of an earlier one: 1 without
  repetition, towards 0 for a completion caught in a loop (1 for fewer than 4 words)."""
  out = []
  for c in completions:
    words = c.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    out.append(len(set(grams)) / len(grams) if grams else 1.0)
  return out


def overlong(lengths: np.ndarray, max_new_tokens: int, buffer: int,
             penalty: float) -> np.ndarray:
  """DAPO's soft overlong punishment, counted in tokens: 0 up to max_new_tokens - buffer, then
  linear down to -penalty at max_new_tokens (a completion cut there). Added to the reward."""
  over = np.clip(np.asarray(lengths, np.float32) - (max_new_tokens - buffer), 0.0, None)
  return (-penalty * np.minimum(over / max(buffer, 1), 1.0)).astype(np.float32)
