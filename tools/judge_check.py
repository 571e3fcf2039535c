"""Can a judge be trusted? The `judge` reward (reasoner/rewards/judge.py) scores each record of
a file with a response (data/general.jsonl by default: five categories, most records with a
rubric) three ways: its own response, another question's, and junk; and compares the own
response with the other's pairwise, in both orders. The figure is `agreement`, the share of
those three calls a record the judge gets right; a run with `judge.check: true` makes the same
check at its start and stops below `judge.min_agreement` (0.75).

    .venv/bin/python tools/judge_check.py [dotted overrides, e.g. judge.model=...]
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reasoner.build import build  # noqa: E402
from reasoner.config import load_config  # noqa: E402
from reasoner.rewards.judge import agreement  # noqa: E402


def main(overrides: list[str]) -> None:
  cfg = load_config(ROOT / "configs" / "embedded.yaml", [
      "data.source=jsonl", f"data.path={ROOT / 'data' / 'general.jsonl'}", "data.num_eval=2",
      "rewards=[{fn: judge}]", "judge.max_criteria=8", *overrides])
  setup = build(cfg)
  a = agreement(setup.rewards.fns[0], setup.train_records + setup.eval_records)
  print(f"{a['n']} records: mean score of the own response {a['own']:.3f}, another question's "
        f"{a['other']:.3f}, junk {a['junk']:.3f}; the own preferred pairwise {a['pairwise']:.3f}")
  verdict = "passes" if a["agreement"] >= cfg.judge.min_agreement else "fails"
  print(f"agreement {a['agreement']:.3f}: {verdict} (judge.min_agreement = "
        f"{cfg.judge.min_agreement})")


if __name__ == "__main__":
  main(sys.argv[1:])
