"""tools/own_answers.py: which completions become SFT targets (exactly formatted and correct),
and the tool on a model: training records of the category only, a new file, one line for bad
input."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import own_answers  # noqa: E402

RECORDS = [{"question": f"q{i}", "answer": a, "category": "math"}
           for i, a in enumerate(["12", "9", "7", "30", "5"])]


def test_kept_only_the_right_answers_in_the_exact_format():
  completions = [
      "<reasoning>3 * 4 = 12</reasoning>\n<answer>12</answer>",  # right, exact: kept
      "<reasoning>15 - 6 = 8</reasoning>\n<answer>8</answer>",  # wrong
      "<answer>7</answer>",  # right, no reasoning
      "<reasoning>6 * 5 = 30</reasoning>\n<answer>30</answer>\nQuestion: more",  # run on
      "<reasoning>2 + 3 = 5</reasoning>\n<answer>5.0</answer>",  # right as a number: kept
  ]
  own = own_answers.kept(RECORDS, completions)
  assert [r["question"] for r in own] == ["q0", "q4"]
  assert own[0] == {"question": "q0", "answer": "12", "category": "math",
                    "response": completions[0]}
  assert own_answers.kept([], []) == []


@pytest.mark.slow  # builds a model
def test_the_tool_answers_training_records_of_the_category(tmp_path, capsys):
  out = tmp_path / "own" / "math.jsonl"
  args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--category", "math", "--num", "5",
          "--out", str(out), f"train.run_dir={tmp_path}"]
  own_answers.main(args)
  # a random tiny model answers nothing right: every record dropped, the file written empty
  assert "0 of 5 math records answered right by the base model" in capsys.readouterr().out
  assert out.read_text() == "" and not out.with_name("math.jsonl.tmp").exists()
  out.write_text(json.dumps(RECORDS[0]) + "\n")
  with pytest.raises(SystemExit, match="exists; name a new file"):
    own_answers.main(args)
  assert out.read_text() == json.dumps(RECORDS[0]) + "\n"  # left as it was
  with pytest.raises(SystemExit, match=r"no training record of category 'poems' .*math"):
    own_answers.main([*args[:3], "poems", "--out", str(tmp_path / "new.jsonl"), args[-1]])
