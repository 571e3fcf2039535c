"""`make general`'s SFT (configs/embedded_general_sft.yaml) on the file the Makefile writes
(tools/own_answers.py's, with the arguments the bench writes it with): every training record
has a response, the instructions and the own answers both train, and nothing of the four
evaluation sets, held out by the GRPO preset, is trained on. No model loads: the own answers
here are written by the test."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from bench import general as bench_general
from conftest import ROOT
from reasoner.config import load_config
from reasoner.data import sources
from reasoner.objectives import sft

SFT_PRESET, GRPO_PRESET = ROOT / "configs/embedded_general_sft.yaml", (
    ROOT / "configs/embedded_general.yaml")


def _own_path() -> str:
  """The own answers' path as the Makefile writes it."""
  return re.search(r"^OWN_ANSWERS := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_the_sft_reads_the_file_the_makefile_writes():
  cfg = load_config(SFT_PRESET)
  assert [m.path for m in cfg.data.mixture if m.source == "jsonl"] == [_own_path()]
  assert cfg.eval.sets == load_config(GRPO_PRESET).eval.sets  # the same four sets
  # the bench writes its own answers as `make general` does
  rule = (ROOT / "Makefile").read_text().split("$(OWN_ANSWERS): ")[1].split("\n\n")[0]
  assert " ".join(bench_general.OWN) in " ".join(rule.replace("\\\n", " ").split())


def test_it_trains_on_all_three_and_on_nothing_it_is_evaluated_on(tmp_path):
  grpo = load_config(GRPO_PRESET)
  train, _ = sources.load_splits(grpo.data, log=lambda _: None)
  math = [r for r in train if r["category"] == "math"][:40]  # answered as the tool keeps them
  own = tmp_path / "own.jsonl"
  own.write_text("".join(json.dumps({
      "question": r["question"], "answer": r["answer"], "category": "math",
      "response": f"<reasoning>It is {r['answer']}.</reasoning>\n<answer>{r['answer']}</answer>"})
      + "\n" for r in math))
  cfg = load_config(SFT_PRESET, [bench_general.own_mixture(str(own))])
  preset = load_config(SFT_PRESET).data.mixture
  assert [dataclasses.replace(m, path="-") for m in cfg.data.mixture] == [
      dataclasses.replace(m, path="-") for m in preset]  # the preset's, but for the path
  assert cfg.data.mixture[1].path == str(own)
  train, _ = sources.load_splits(cfg.data, log=lambda _: None)
  sft.check(cfg, train, "the training split")  # every record has a response
  assert {r["category"] for r in train} == {"instructions", "math"}
  mine = {r["question"] for r in math}
  assert sum(r["question"] in mine for r in train) == len(math) - 2  # two held out
  evaluated = {r["question"] for s in cfg.eval.sets
               for r in sources.load_eval_set(s, cfg.data, log=lambda *_: None)}
  assert len(evaluated) >= 700  # 128 + 128 + 256 + 256, a few alike across sets
  assert not evaluated & {r["question"] for r in train}


def test_the_bench_refuses_to_run_again_where_a_run_is(tmp_path, monkeypatch):
  """A run's folder already in GENERAL_DIR: a run there again would resume from its last
  checkpoint and time the resume; the bench says so in one line and runs nothing."""
  (tmp_path / "general" / "checkpoints" / "64").mkdir(parents=True)
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  monkeypatch.setenv("GENERAL_DIR", str(tmp_path))
  monkeypatch.setenv("GENERAL_RUNS", "general,seed1")
  monkeypatch.setattr(bench_general, "run", lambda *a: pytest.fail("a run started"))
  with pytest.raises(SystemExit, match=rf"GENERAL_RUNS: general already in {tmp_path}: run "
                     "there again, it would resume from its last checkpoint"):
    bench_general.main()
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
