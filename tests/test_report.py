"""`python -m reasoner report RUN`: a run folder written by the project's own writers
(MetricsWriter, the manifest, evaluation's paired change) read back into plots and report.md;
no model, no training."""

from __future__ import annotations

import pathlib
import re

import pytest

from reasoner import report
from reasoner.config import config_from_dict
from reasoner.engine import manifest
from reasoner.engine.metrics import MetricsWriter
from reasoner.errors import DataError
from reasoner.evaluation import paired_change, standard_error

PNG = b"\x89PNG\r\n\x1a\n"
QUESTIONS = [("What is 2 + 3?", "5", "math"), ("Name a prime above 10.", "11", "math"),
             ("Write a line about rain.", None, "poetry"), ("Rhyme with cat.", None, "poetry")]


def _cfg(run: pathlib.Path, init_from: pathlib.Path | None = None):
  return config_from_dict({"train": {"steps": 4, "run_dir": str(run.parent),
                                     "run_name": run.name},
                           "lora": {"init_from": str(init_from) if init_from else None}})


def _rows(rewards: list[float], tag: str, categories: bool = True) -> list[dict]:
  """Held-out rows as `evaluation.evaluate` makes them."""
  return [{"question": q, "answer": a, "category": c if categories else None,
           "completion": f"{tag} answer to {q!r}: {a or 'drizzle'}", "reward": r,
           "correct": None if a is None else float(r > 0.5)}
          for (q, a, c), r in zip(QUESTIONS, rewards)]


def _result(rows: list[dict], win: float | None = None) -> dict:
  """An evaluation's result as `evaluation.evaluate` (and `win_rate`) returns it."""
  totals = [r["reward"] for r in rows]
  out = {"mean_reward": sum(totals) / len(totals), "accuracy": 0.5, "format_rate": 1.0,
         "n": len(rows), "mean_reward_se": standard_error(totals), "accuracy_se": 0.25,
         "format_rate_se": 0.0}
  cats = sorted({r["category"] for r in rows if r["category"]})
  for c in cats:
    v = [r["reward"] for r in rows if r["category"] == c]
    out[f"mean_reward/{c}"] = sum(v) / len(v)
  if win is not None:
    out.update({"win_rate": win, "win_rate_n": len(rows),
                **{f"win_rate/{c}": win for c in cats}})
  return out


def _evaluate(writer: MetricsWriter, step: int, tag: str, rows: list[dict], result: dict):
  """What `evaluation.evaluate_all` writes for the held-out split."""
  writer.samples(step, f"eval-{tag}", rows)
  writer.log(step, {f"eval/{k}": v for k, v in result.items()})


def _grpo_step(k: int, categories: bool) -> dict:
  m = {"reward/mean": 0.1 * k, "reward/std": 0.2, "reward/correct": 0.1 * k,
       "completion_length": 100.0 + k, "completion_length/stopped": 90.0 + k,
       "kl": 0.01 * k, "entropy": 1.0 - 0.1 * k, "clip_fraction": 0.02 * k,
       "step_time_s": 30.0, "tokens_per_s": 1000.0}
  if categories:
    m.update({"reward/judge": 0.2 * k, "reward/judge/math": 0.1 * k,
              "reward/judge/poetry": 0.3 * k})
  return m


def _sft_run(root: pathlib.Path) -> pathlib.Path:
  run = root / "sft"
  w = MetricsWriter(run, enabled=True)
  w.start(0)
  before, after = _rows([0.0, 0.0, 0.4, 0.2], "sft-before"), _rows([1.0, 0.0, 0.5, 0.4], "sft")
  _evaluate(w, 0, "before", before, _result(before))
  for k in (1, 2):
    w.log(k, {"loss": 2.0 / k, "padding": 0.1, "step_time_s": 10.0, "tokens_per_s": 50.0})
  _evaluate(w, 2, "after", after, _result(after))
  w.write_json("eval.json", {"before": {**_result(before), "seconds": 20.0},
                             "after": _result(after),
                             "changes": {"held-out": paired_change(before, after)}})
  w.close()
  manifest.record(_cfg(run), run, 0, [{"question": q} for q, _, _ in QUESTIONS], stage="sft")
  (run / "checkpoints" / "2").mkdir(parents=True)
  return run


def _grpo_run(root: pathlib.Path, init_from: pathlib.Path | None, categories: bool = True,
              judge: bool = True) -> pathlib.Path:
  """A 4-step GRPO run: evaluated before and after, step 3 logged twice (a resume)."""
  run = root / "grpo"
  before = _rows([0.2, 0.0, 0.5, 0.3], "before", categories)
  after = _rows([1.0, 1.0, 0.6, 0.3], "after", categories)
  w = MetricsWriter(run, enabled=True)
  w.start(0)
  _evaluate(w, 0, "before", before, _result(before))
  for k in (1, 2, 3):
    w.log(k, _grpo_step(k, categories))
  w.close()
  w = MetricsWriter(run, enabled=True)  # the next session: step 3 again, then 4
  w.start(3)
  w.log(3, {**_grpo_step(3, categories), "entropy": 0.55, "reward/mean": 0.33})
  w.log(4, _grpo_step(4, categories))
  done = _result(after, 0.75 if judge else None)
  _evaluate(w, 4, "after", after, done)
  w.write_json("eval.json", {"before": {**_result(before), "seconds": 40.0}, "after": done,
                             "changes": {"held-out": paired_change(before, after)}})
  w.close()
  manifest.record(_cfg(run, init_from), run, 0, [{"question": q} for q, _, _ in QUESTIONS])
  for s in (2, 4):
    (run / "checkpoints" / str(s)).mkdir(parents=True)
  return run


def test_a_run_reports_plots_the_table_completions_and_its_stages(tmp_path, capsys):
  sft = _sft_run(tmp_path)
  run = _grpo_run(tmp_path, sft)
  path = report.main(run)
  assert capsys.readouterr().out.strip() == str(path)
  assert path == run / "report" / "report.md"
  for name in ("reward.png", "reward_by_category.png", "completion_length.png", "kl.png",
               "entropy.png", "clip_fraction.png", "held_out.png"):
    data = (run / "report" / name).read_bytes()
    assert data[:8] == PNG and len(data) > 5000, name
  assert not (run / "report" / "loss.png").exists()  # a GRPO run logs no loss
  drawn = report.plot_data(run)
  assert drawn["entropy.png"] == {"entropy": [(1, pytest.approx(0.9)), (2, pytest.approx(0.8)),
                                              (3, 0.55), (4, pytest.approx(0.6))]}
  assert [s for s, _ in drawn["reward.png"]["reward/mean"]] == [1, 2, 3, 4]
  assert drawn["reward.png"]["reward/mean"][2] == (3, 0.33)  # the later row of step 3
  assert set(drawn["reward_by_category.png"]) == {"reward/judge/math", "reward/judge/poetry"}
  assert drawn["held_out.png"]["eval/mean_reward"] == [(0, 0.25), (4, pytest.approx(0.725))]

  md = path.read_text()
  eval_json = report._read_json(run / "eval.json")
  b, a, c = eval_json["before"], eval_json["after"], eval_json["changes"]["held-out"]
  assert (f"| mean reward | {b['mean_reward']:.3f} +/- {b['mean_reward_se']:.3f} | "
          f"{a['mean_reward']:.3f} +/- {a['mean_reward_se']:.3f} |") in md
  assert "| accuracy | 0.500 +/- 0.250 | 0.500 +/- 0.250 |" in md
  assert c["metric"] == "mean_reward"  # the poetry rows have no reference answer
  assert (f"| held-out | mean reward | 4 | {c['before']:.3f} | {c['after']:.3f} | "
          f"{c['change']:+.3f} +/- {c['se']:.3f} |") in md
  assert "| math | 0.100 | 1.000 | +0.900 +/- 0.100 (2 questions) |" in md
  assert "| poetry | 0.400 | 0.450 | +0.050 +/- 0.050 (2 questions) |" in md
  assert "win rate against the model before training (both orders, 4 questions): **0.750**" in md
  assert "by category: math 0.750, poetry 0.750" in md
  assert "before answer to 'Name a prime above 10.': 11" in md  # moved most: 0.0 -> 1.0
  assert "after answer to 'Name a prime above 10.': 11" in md
  assert "Rhyme with cat." not in md.split("## Completions")[1].split("## Plan")[0]  # unmoved
  assert "No plan was saved with this run" in md
  assert "Training steps: 120 s of wall time over 4 steps" in md  # step 3 once
  assert "Newest checkpoint: step 4" in md and "4 steps logged (1-4 of 4)" in md
  stages = md.split("## Stages")[1]
  assert f"1. SFT: {sft}: held-out accuracy 0.500 +/- 0.250 -> 0.500 +/- 0.250" in stages
  assert f"2. GRPO: {run} (this run): held-out accuracy" in stages
  assert f"paired mean reward {c['change']:+.3f} +/- {c['se']:.3f} SE, 4 questions" in stages
  assert "the judge's win rate 0.750" in stages


def test_a_run_without_judge_or_categories_still_reports(tmp_path):
  run = _grpo_run(tmp_path, tmp_path / "gone", categories=False, judge=False)
  path = report.report(run)
  md = path.read_text()
  assert (run / "report" / "reward.png").read_bytes()[:8] == PNG
  assert not (run / "report" / "reward_by_category.png").exists()
  assert "win rate" not in md and "Mean reward by category" not in md
  assert "rollout reward by category" in md  # named as not logged
  assert f"lora.init_from = {tmp_path / 'gone'}: that run folder is not on this machine" in md
  assert f"1. GRPO: {run} (this run)" in md


def test_a_bare_run_reports_what_it_lacks(tmp_path):
  """metrics.jsonl alone: no eval.json, samples, manifest or checkpoints."""
  run = tmp_path / "bare"
  w = MetricsWriter(run, enabled=True)
  w.start(0)
  w.log(1, {"loss": 1.5, "padding": 0.2})
  w.close()
  md = report.report(run).read_text()
  assert (run / "report" / "loss.png").read_bytes()[:8] == PNG
  assert "No eval.json" in md and "No checkpoint in the run folder" in md
  assert "No held-out completions" in md and "not evaluated (no eval.json)" in md


def test_a_folder_without_metrics_is_one_line(tmp_path):
  with pytest.raises(DataError) as e:
    report.report(tmp_path)
  assert str(tmp_path) in str(e.value) and "no metrics.jsonl" in str(e.value)
  assert "\n" not in str(e.value)
  with pytest.raises(DataError, match="no such run folder"):
    report.report(tmp_path / "absent")


def test_a_torn_last_row_is_dropped_and_any_other_bad_row_is_one_line(tmp_path):
  """A kill mid-write cuts a run's last row short: the report reads the rows before it. A bad
  row elsewhere, or one that is not an object, is one line naming the file and the line."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
  assert report.read_rows(path) == [{"step": 1, "loss": 1.0}]
  path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.0}\n')
  with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: not valid JSON \(.+\)$"):
    report.report(tmp_path)
  path.write_text('{"step": 1, "loss": 1.0}\n"hello"\n')
  with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not a JSON object but a "
                     "string"):
    report.report(tmp_path)


def test_the_command_writes_the_report_or_says_in_one_line_why_not(tmp_path, capsys):
  """`python -m reasoner report RUN` (in-process): the report.md path on stdout; a folder that
  is not a run is one `error:` line and exit 2."""
  from reasoner import cli

  run = _grpo_run(tmp_path, None, categories=False, judge=False)
  assert cli.main(["report", str(run)]) == 0
  assert capsys.readouterr().out.strip().endswith(str(run / "report" / "report.md"))
  assert (run / "report" / "report.md").is_file()
  assert cli.main(["report", str(tmp_path / "absent")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and "no such run folder" in err[0]
