"""Generated arithmetic word problems: deterministic by seed, with a disjoint held-out split;
each with a worked solution (SFT's response, a preference pair's chosen) and the same solution
with the wrong operation (the pair's rejected)."""

from __future__ import annotations

import random

NAMES = ["Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva", "Raj", "Kim"]
ITEMS = ["apples", "pens", "stickers", "books", "coins", "cards", "shells", "marbles", "cookies",
         "stamps", "blocks", "flowers"]

# (template, operation); {a} and {b} are the operands.
TEMPLATES = [
    ("{n} has {a} {x}. {p} gets {b} more. How many {x} does {n} have now?", "+"),
    ("{n} has {a} {x} and finds {b} more. How many {x} does {n} have in total?", "+"),
    ("{n} had {a} {x} and gave away {b}. How many {x} does {n} have left?", "-"),
    ("{n} has {a} {x} and loses {b} of them. How many {x} are left?", "-"),
    ("{n} has {a} bags with {b} {x} in each bag. How many {x} does {n} have?", "*"),
]
RANGES = {"easy": (1, 9, 2, 5), "medium": (1, 20, 2, 9), "hard": (10, 99, 2, 12)}


def _problem(rng: random.Random, difficulty: str) -> dict:
  lo, hi, mlo, mhi = RANGES[difficulty]
  template, op = rng.choice(TEMPLATES)
  name, item = rng.choice(NAMES), rng.choice(ITEMS)
  if op == "*":
    a, b = rng.randint(mlo, mhi), rng.randint(mlo, mhi)
  else:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "-" and b > a:
      a, b = b, a
  answer = {"+": a + b, "-": a - b, "*": a * b}[op]
  pronoun = "They" if name in ("Raj", "Kim") else ("He" if name in ("Sam", "Tom", "Leo", "Ben",
                                                                      "Max") else "She")
  question = template.format(n=name, a=a, b=b, x=item, p=pronoun)
  worked = solution(op, a, b, answer)
  return {"question": question, "answer": str(answer), "category": "math",
          "response": worked, "chosen": worked, "rejected": wrong_operation(op, a, b)}


def solution(op: str, a: int, b: int, answer: int) -> str:
  """A short worked solution in the prompts' format (SFT's target): why this operation, then
  the sum, as the few-shot examples of `prompts` do."""
  why = {"+": f"{b} more: {a} + {b} = {answer}", "-": f"{b} fewer: {a} - {b} = {answer}",
         "*": f"{a} groups of {b}: {a} * {b} = {answer}"}[op]
  return f"<reasoning>{why}</reasoning>\n<answer>{answer}</answer>"


def wrong_operation(op: str, a: int, b: int) -> str:
  """The worked solution with the wrong operation, the base model's typical mistake (it copies
  the few-shot examples' product and difference): a sum for a difference or a product, a
  difference for a sum (a preference pair's rejected response)."""
  wrong = {"+": "-", "-": "+", "*": "+"}[op]
  return solution(wrong, a, b, {"+": a + b, "-": a - b}[wrong])


def generate(num_train: int, num_eval: int, seed: int, difficulty: str = "easy"
             ) -> tuple[list[dict], list[dict]]:
  """(train, held_out): distinct questions, none shared between the two splits."""
  rng = random.Random(f"arithmetic-{seed}-{difficulty}")
  seen: set[str] = set()
  out: list[dict] = []
  attempts = 0
  while len(out) < num_train + num_eval:
    attempts += 1
    if attempts > 50 * (num_train + num_eval):
      raise ValueError(f"cannot generate {num_train + num_eval} distinct {difficulty} problems; "
                       "lower data.num_train or data.num_eval")
    p = _problem(rng, difficulty)
    if p["question"] not in seen:
      seen.add(p["question"])
      out.append({**p, "difficulty": difficulty})
  return out[:num_train], out[num_train:]
