"""The model's own answers as SFT targets (rejection sampling, as RFT: Yuan et al. 2023, arXiv
2308.01825). The run's model (its newest checkpoint's LoRA, else the base) answers the training
records of one category greedily, and those it gets right, in the exact format, are written with
their completion as `response` to a JSONL file, which a mixture then reads as a source
(`{source: jsonl, path: ...}`). SFT on them beside a new skill's written responses trains a
skill the model has in its own words, not a generator's worked solutions (docs/general.md, "SFT
that fits": it kept held-out arithmetic within noise, not the retention set).

    .venv/bin/python tools/own_answers.py --config configs/embedded_general.yaml \
        --category math --num 512 --max-new-tokens 40 --out runs/own_math.jsonl \
        train.run_name=own_answers [dotted overrides: train.run_name names the run whose
        newest checkpoint answers; one without checkpoints is the base model]

Only training records are answered (the run's split, each source's held-out records never), and
only records with a reference answer can be kept. An output file that exists is refused.
"""

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reasoner.build import build  # noqa: E402
from reasoner.config import load_config  # noqa: E402
from reasoner.engine.checkpoint import restore_lora  # noqa: E402
from reasoner.engine.sampler import Sampler  # noqa: E402
from reasoner.evaluation import evaluate  # noqa: E402
from reasoner.rewards import builtin  # noqa: E402


def kept(records: list[dict], completions: list[str]) -> list[dict]:
  """Each record whose completion is exactly formatted and correct (`correct` against its
  answer), with that completion as its response; the others dropped."""
  right = builtin.accuracy(completions, [r["answer"] for r in records])
  exact = builtin.format_exact([], completions)
  return [{"question": r["question"], "answer": r["answer"], "category": r.get("category"),
           "response": c} for r, c, ok, f in zip(records, completions, right, exact)
          if ok == 1.0 and f == 1.0]


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--category", required=True, help="the training records' category, e.g. math")
  p.add_argument("--num", type=int, default=512, help="records answered (the first N)")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="an answer's budget (default eval.max_new_tokens)")
  p.add_argument("--out", required=True, help="a new JSONL file")
  p.add_argument("overrides", nargs="*")
  a = p.parse_args(argv)
  out = pathlib.Path(a.out)
  if out.exists():
    raise SystemExit(f"own_answers: {out} exists; name a new file")
  if a.num < 1:
    raise SystemExit(f"own_answers: --num {a.num}: expected a positive number of records")
  cfg = load_config(a.config, a.overrides)
  setup = build(cfg)
  records = [r for r in setup.train_records if r.get("category") == a.category
             and r.get("answer") is not None][:a.num]
  if not records:
    cats = sorted({str(r.get("category")) for r in setup.train_records})
    raise SystemExit(f"own_answers: no training record of category {a.category!r} with an "
                     f"answer (categories: {', '.join(cats)})")
  lora, step = restore_lora(setup)
  _, rows = evaluate(setup, Sampler.for_run(setup), lora, records, a.max_new_tokens)
  own = kept(records, [r["completion"] for r in rows])
  tmp = out.with_name(out.name + ".tmp")
  out.parent.mkdir(parents=True, exist_ok=True)
  with tmp.open("w") as f:
    f.writelines(json.dumps(r) + "\n" for r in own)
  os.replace(tmp, out)
  print(f"own_answers: {len(own)} of {len(records)} {a.category} records answered right by "
        f"{'checkpoint ' + str(step) if step else 'the base model'}, written to {out}")


if __name__ == "__main__":
  main(sys.argv[1:])
