"""Does a judge tell answers apart? The `judge` reward (reasoner/rewards/judge.py) grades each
record of data/mixed.jsonl with its own response, with another question's and with junk; a
useful judge grades the first well above the other two.

    .venv/bin/python tools/judge_check.py [dotted overrides, e.g. judge.model=...]
"""

import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reasoner.build import build  # noqa: E402
from reasoner.config import load_config  # noqa: E402


def main(overrides: list[str]) -> None:
  data = ROOT / "data" / "mixed.jsonl"
  cfg = load_config(ROOT / "configs" / "embedded.yaml", [
      "data.source=jsonl", f"data.path={data}", "data.num_eval=2", "rewards=[{fn: judge}]",
      *overrides])
  judge = build(cfg).rewards.fns[0]
  records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
  questions = [r["question"] for r in records]
  answers = [r.get("answer") for r in records]
  own = [r["response"] for r in records]
  other = [records[(i + 3) % len(records)]["response"] for i in range(len(records))]
  junk = ["the the the the the the the the"] * len(records)
  for name, completions in (("own response", own), ("another question's", other),
                            ("junk", junk)):
    grades = judge(questions, completions, question=questions, answer=answers)
    print(f"{name:20s} mean grade {np.mean(grades):.3f}  per record "
          f"{np.round(grades, 2).tolist()}")


if __name__ == "__main__":
  main(sys.argv[1:])
