"""Reward functions: plain `(prompts, completions, **batch) -> list[float]`, each in [0, 1].

Built-ins: `format_exact`, `format_partial`, `correct` (the answer checked: numbers, LaTeX);
for answers no parser can check, `relevance` (ROUGE-L against the reference, Google's
rouge-score) and `repetition` (repeated word 4-grams); `judge`, a model's grade
(reasoner/judge.py, bound to the run's model by `build`). Any other function is referenced as
'module:function'. `batch` holds per-completion fields: `question` (the record's, unrendered),
`answer` (the reference, or None) and `category`.

Each reward scores the rows of its `categories` (rewards[].categories; all rows by default): a
row's total is the weighted mean of the rewards that score it, so it stays on a 0-1 scale
whatever the weights, and a math row can be scored by `correct` while an essay is scored by
`relevance`. User functions of a batch run concurrently in threads (slow ones, e.g. a remote
judge, overlap), the built-ins in the calling thread (math-verify's timeouts need the main
thread's signals).
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import math
import re
from typing import Callable, Sequence

import numpy as np

from reasoner.config import RewardSpec
from reasoner.errors import ConfigError, DataError, RewardError

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


def unbound_judge(prompts, completions, **_) -> list[float]:
  raise RewardError("the judge reward has no model: build() binds it (Rewards.bind)")


BUILTIN: dict[str, RewardFn] = {"format_exact": format_exact, "format_partial": format_partial,
                                "correct": correct, "relevance": relevance,
                                "repetition": repetition, "judge": unbound_judge}


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
  """The configured reward functions: their weights, the categories each scores, and the
  scoring of a batch (`__call__`)."""

  def __init__(self, specs: Sequence[RewardSpec], workers: int = 8):
    self.specs = list(specs)
    total = sum(s.weight for s in specs)
    # a name per reward: the function's, with its categories where it appears more than once
    count = lambda fn: sum(s.fn == fn for s in specs)
    self.names = [s.fn if count(s.fn) == 1 else f"{s.fn}[{'+'.join(s.categories or ['all'])}]"
                  for s in specs]
    if len(set(self.names)) < len(self.names):
      raise ConfigError(f"config key 'rewards' = {[s.fn for s in specs]}: a function appears "
                        "twice for the same categories")
    self.fns = [resolve(s.fn) for s in specs]
    self.weights = np.asarray([s.weight / total for s in specs], np.float32)
    self.workers = workers

  def bind(self, name: str, fn: RewardFn) -> None:
    """Replaces built-in `name` (the judge, once its model is loaded) by `fn`."""
    self.fns = [fn if s.fn == name else f for s, f in zip(self.specs, self.fns)]

  def _scores(self, k: int, category: str | None) -> bool:
    cats = self.specs[k].categories
    return cats is None or category in cats

  def check(self, records: Sequence[dict], where: str) -> None:
    """One line, before any model loads, for a record that no reward scores (a category no
    reward names) or that a reward needing a reference answer scores without one."""
    for i, r in enumerate(records):
      cat = r.get("category")
      scoring = [k for k in range(len(self.fns)) if self._scores(k, cat)]
      if not scoring:
        raise ConfigError(f"config key 'rewards': no reward scores category {cat!r} ({where}, "
                          f"record {i}); name it in a reward's categories, or give one "
                          "categories: null")
      for k in scoring:
        if getattr(self.fns[k], "needs_answer", False) and r.get("answer") is None:
          raise DataError(f"{where}, record {i} (category {cat!r}) has no reference answer "
                          f"(data.answer_field), which reward '{self.names[k]}' needs")

  def _score(self, k: int, rows: list[int], prompts, completions, batch) -> np.ndarray:
    """Reward k on `rows` -> [n] values, NaN on the rows it does not score."""
    out = np.full(len(completions), np.nan, np.float32)
    if not rows:
      return out
    pick = lambda xs: [xs[j] for j in rows]
    name = self.names[k]
    try:
      values = self.fns[k](pick(prompts), pick(completions),
                           **{key: pick(v) for key, v in batch.items()})
    except Exception as e:
      raise RewardError(f"reward function '{name}' raised {type(e).__name__}: {e}") from e
    values = np.asarray(values, np.float32)
    if values.shape != (len(rows),) or not np.all(np.isfinite(values)):
      raise RewardError(f"reward function '{name}' returned {values.shape} values "
                        f"(expected {len(rows)} finite numbers)")
    out[rows] = values
    return out

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **batch
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total [n], {name: [n], NaN where it does not score}) for n completions; batch fields
    (answer, category, ...) are per completion."""
    n, prompts, completions = len(completions), list(prompts), list(completions)
    cats = list(batch.get("category") or [None] * n)
    rows = [[j for j in range(n) if self._scores(k, cats[j])] for k in range(len(self.fns))]
    score = lambda k: self._score(k, rows[k], prompts, completions, batch)
    # user functions (a judge, a remote call) in threads; the built-ins, quick, in this one:
    # math-verify's timeouts use signals, which only the main thread can set (in a worker
    # thread every answer it parses came out wrong)
    pooled = [k for k, s in enumerate(self.specs) if s.fn not in BUILTIN]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(self.workers, len(pooled)))) as pool:
      futures = {k: pool.submit(score, k) for k in pooled}
      values = [futures[k].result() if k in futures else score(k) for k in range(len(self.fns))]
    scored = np.stack([~np.isnan(v) for v in values])
    if n and not scored.any(0).all():
      j = int(np.argmin(scored.any(0)))
      raise RewardError(f"no reward scores row {j} (category {cats[j]!r})")
    weights = np.where(scored, self.weights[:, None], 0.0)
    total = (weights * np.nan_to_num(np.stack(values))).sum(0) / np.maximum(weights.sum(0), 1e-9)
    return np.asarray(total, np.float32), dict(zip(self.names, values))
