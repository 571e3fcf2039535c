"""The Kaggle notebook: its .ipynb is generated from the .py, and it runs headless to the end."""

import json

import jupytext
import nbformat
import pytest

from conftest import ROOT

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

PY, IPYNB = ROOT / "notebooks" / "grpo_kaggle.py", ROOT / "notebooks" / "grpo_kaggle.ipynb"


def _cells(nb):
  return [(c.cell_type, c.source, sorted(c.metadata.get("tags", []))) for c in nb.cells]


def test_ipynb_is_generated_from_the_py():
  """`make notebook` regenerates it (jupytext --to ipynb)."""
  assert _cells(jupytext.read(PY)) == _cells(nbformat.read(IPYNB, as_version=4)), (
      "notebooks/grpo_kaggle.ipynb differs from grpo_kaggle.py: run `make notebook`")


def test_parameters_cell_defines_only_config_overrides_stages_and_upload():
  cells = [c for c in nbformat.read(IPYNB, as_version=4).cells
           if "parameters" in c.metadata.get("tags", [])]
  assert len(cells) == 1
  names = {}
  exec(cells[0].source, {}, names)
  assert sorted(names) == ["CONFIG", "OVERRIDES", "PREFER", "SFT", "UPLOAD"]
  assert names["UPLOAD"] is None  # nothing is uploaded unless asked


def test_by_category_table_reads_the_results_per_category():
  """The general path's table: each category's mean reward before and after and the win rate,
  and a row for all; None (and a line) where the records have no categories."""
  from reasoner import notebook as nb

  results = {"before": {"mean_reward": 0.4, "mean_reward/math": 0.5, "mean_reward/code": 0.2},
             "after": {"mean_reward": 0.6, "mean_reward/math": 0.7, "mean_reward/code": 0.4,
                       "win_rate": 0.65, "win_rate/math": 0.6, "win_rate/code": 0.8}}
  t = nb.by_category(results)
  assert list(t.index) == ["code", "math", "all"]
  assert t.loc["code"].tolist() == [0.2, 0.4, 0.8] and t.loc["all"].tolist() == [0.4, 0.6, 0.65]
  assert nb.by_category({"before": {"mean_reward": 0.4}, "after": {"mean_reward": 0.5}}) is None


def test_by_category_table_shows_the_instructions_followed_per_set():
  """A set whose records carry checkable instructions adds IFEval's strict prompt- and
  instruction-level rows, before and after, read from that set's own results."""
  from reasoner import notebook as nb

  ife = lambda p, i: {"ifeval/prompt_level_strict": p, "ifeval/instruction_level_strict": i}
  results = {"before": {"mean_reward": 0.4, "sets": {"combination": ife(0.17, 0.41),
                                                     "retention": {"accuracy": 0.3}}},
             "after": {"mean_reward": 0.5, "sets": {"combination": ife(0.30, 0.55),
                                                    "retention": {"accuracy": 0.3}}}}
  t = nb.by_category(results)
  assert list(t.index) == ["combination: instructions followed (prompt-level, strict)",
                           "combination: instructions followed (instruction-level, strict)"]
  assert t.iloc[0].tolist()[:2] == [0.17, 0.30] and t.iloc[1].tolist()[:2] == [0.41, 0.55]


@pytest.mark.slow
def test_notebook_runs_headless_on_the_tiny_config(tmp_path):
  import papermill

  out = tmp_path / "out.ipynb"
  papermill.execute_notebook(
      str(IPYNB), str(out), cwd=str(ROOT), progress_bar=False, kernel_name="python3",
      parameters={"CONFIG": "configs/tiny.yaml",
                  "OVERRIDES": [f"train.run_dir={tmp_path / 'runs'}", "train.steps=2",
                                "train.eval_before=true"],
                  "SFT": ["train.steps=2", "train.eval_before=false"],
                  "PREFER": ["train.steps=1", "train.eval_before=false", "prefer.loss=simpo"]})
  nb = nbformat.read(out, as_version=4)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  html = [o.data["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  assert any("mean_reward" in h and "before" in h and "after" in h for h in html)  # eval table
  assert any("reward before" in h and "reward after" in h for h in html)  # completions
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the reward plot
  text = "".join(o.get("text", "") for o in outputs)
  assert "trained to step 2 of 2" in text and "per chip" in text  # training, the plan
  assert "no table by category" in text  # the tiny set has no categories
  # the report, as the write-up shows it: its markdown in the notebook, its files in the run
  report = tmp_path / "runs" / "tiny" / "report"
  md = (report / "report.md").read_text()
  assert md.startswith("# Run tiny") and sorted(report.glob("*.png"))
  shown = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert md in shown
  sft = json.loads((tmp_path / "runs" / "tiny-sft" / "run.json").read_text())
  assert sft["stage"] == "sft" and (tmp_path / "runs" / "tiny-sft" / "checkpoints" / "2").is_dir()
  prefer = json.loads((tmp_path / "runs" / "tiny-prefer" / "run.json").read_text())
  assert prefer["stage"] == "prefer"  # SFT -> preference -> GRPO, each from the last's LoRA
  assert prefer["config"]["lora"]["init_from"] == str(tmp_path / "runs" / "tiny-sft")
  grpo = json.loads((tmp_path / "runs" / "tiny" / "run.json").read_text())
  assert grpo["stage"] == "grpo"
  assert grpo["config"]["lora"]["init_from"] == str(tmp_path / "runs" / "tiny-prefer")
  assert "LoRA from" in text and "(lora.init_from)" in text
  export = tmp_path / "runs" / "tiny" / "export-step-2"
  assert json.loads((export / "export.json").read_text())["step"] == 2
  assert (export / "tiny" / "_CHECKPOINT_METADATA").is_file()
