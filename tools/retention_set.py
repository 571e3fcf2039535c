"""Writes data/retention.jsonl: what a base model can already do with numbers, asked in none of
the arithmetic generator's wordings (`reasoner/data/arithmetic.py`): bare sums, differences and
products, and number sense (the next number, the larger of two, halves and doubles).

The embedded presets evaluate it before and after training (`eval.sets[].retention: true`): a
run that teaches the word problems' surface at the cost of what the model could do shows it
there. Deterministic: `python tools/retention_set.py` writes the same file every time.
"""

from __future__ import annotations

import json
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "retention.jsonl"

# (kind, wording, answer of (a, b)); a >= b is drawn for differences
ASKS = [
    ("sum", "What is {a} plus {b}?", lambda a, b: a + b),
    ("sum", "Add {a} and {b}.", lambda a, b: a + b),
    ("sum", "What is the sum of {a} and {b}?", lambda a, b: a + b),
    ("sum", "What number is {b} more than {a}?", lambda a, b: a + b),
    ("difference", "What is {a} minus {b}?", lambda a, b: a - b),
    ("difference", "Subtract {b} from {a}.", lambda a, b: a - b),
    ("difference", "What number is {b} less than {a}?", lambda a, b: a - b),
    ("difference", "What is the difference between {a} and {b}?", lambda a, b: a - b),
    ("product", "What is {a} times {b}?", lambda a, b: a * b),
    ("product", "Multiply {a} by {b}.", lambda a, b: a * b),
    ("product", "What is the product of {a} and {b}?", lambda a, b: a * b),
    ("number sense", "What number comes right after {a}?", lambda a, b: a + 1),
    ("number sense", "What number comes right before {a}?", lambda a, b: a - 1),
    ("number sense", "Which number is larger, {a} or {b}?", lambda a, b: max(a, b)),
    ("number sense", "What is double {b}?", lambda a, b: 2 * b),
    ("number sense", "What is half of {c}?", lambda a, b: b),
]


def records(n: int = 256, seed: int = 0) -> list[dict]:
  rng = random.Random(f"retention-{seed}")
  out, seen = [], set()
  while len(out) < n:
    kind, wording, fn = ASKS[len(out) % len(ASKS)]
    a, b = (rng.randint(2, 20), rng.randint(2, 20)) if kind != "product" else (
        rng.randint(2, 9), rng.randint(2, 9))
    if kind == "difference" or "before" in wording:
      a, b = max(a, b), min(a, b)
    if "larger" in wording and a == b:
      continue
    question = wording.format(a=a, b=b, c=2 * b)
    if question in seen:
      continue
    seen.add(question)
    out.append({"question": question, "answer": str(fn(a, b)), "category": "math", "kind": kind})
  return out


if __name__ == "__main__":
  OUT.write_text("".join(json.dumps(r) + "\n" for r in records()))
  print(f"wrote {OUT} ({len(records())} records)")
