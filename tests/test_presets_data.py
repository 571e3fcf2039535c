"""The general presets' data (configs/gemma3_1b_general.yaml, configs/gemma2_2b_general.yaml):
each mixture source names a public dataset by its Hub id, subset, splits and fields. Nothing
here reaches a network: each dataset is a local copy with a few rows of its card's fields and
splits, the source's `path` pointed at it, and loaded through the preset's own mapping; the
records come out as the cards' fields say. No model loads."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import datasets
import pytest

from conftest import ROOT
from reasoner.config import load_config
from reasoner.data import curriculum, hub, sources
from reasoner.errors import DataError
from reasoner.objectives import sft
from reasoner.rewards import judge as judge_lib
from reasoner.rewards.scoring import Rewards

PRESETS = ("gemma3_1b_general", "gemma2_2b_general")


def gsm8k(i: int) -> dict:  # openai/gsm8k, main: question, answer (worked steps, "#### n")
  return {"question": f"Natalia sold clips to {48 + i} friends in April and half as many in May. "
                      "How many clips did she sell in all?",
          "answer": f"In May she sold {48 + i}/2 = <<{48 + i}/2={(48 + i) / 2:g}>>"
                    f"{(48 + i) / 2:g} clips.\nIn all {48 + i}+{(48 + i) / 2:g} = "
                    f"<<{48 + i}+{(48 + i) / 2:g}={1.5 * (48 + i):g}>>{1.5 * (48 + i):g}.\n"
                    f"#### {1.5 * (48 + i):g}"}


def sciq(i: int) -> dict:  # allenai/sciq: a question, its answer, three distractors, support
  return {"question": f"What type of organism is commonly used in making cheese ({i})?",
          "distractor3": "viruses", "distractor1": "protozoa", "distractor2": "gymnosperms",
          "correct_answer": "mesophilic organisms",
          # the card: a supporting paragraph "for the majority of the questions" (else empty)
          "support": "" if i % 3 == 2 else f"Mesophiles grow best in moderate temperature ({i})."}


def rar_science(i: int) -> dict:  # ScaleAI/RaR-Science: question, reference, rubric, ...
  rubric = [{"description": "Essential Criteria: Identifies the rate-limiting step.",
             "title": "Rate-limiting step", "weight": 5},
            {"description": "Optional Criteria: Gives the Arrhenius equation.",
             "title": "Arrhenius", "weight": 2},
            {"description": "Pitfall Criteria: Does not confuse rate with equilibrium.",
             "title": "Pitfall", "weight": -1}]
  return {"question": f"Why does a catalyst speed up reaction {i}?",
          "reference_answer": f"A catalyst lowers the activation energy of step {i}.",
          "question_source": "natural_reasoning", "rubric": rubric,
          "rubric_list": [r["description"] for r in rubric], "rubric_count": len(rubric)}


def tldr(i: int) -> dict:  # trl-lib/tldr: prompt (the post, then "TL;DR:"), completion
  return {"prompt": f"SUBREDDIT: r/relationships\n\nTITLE: My roommate ({i}) never cleans\n\n"
                    "POST: We agreed on a rota months ago and she has skipped every week.\n\n"
                    "TL;DR:",
          "completion": f" roommate {i} ignores the cleaning rota, how do I bring it up?"}


def writingprompts(i: int) -> dict:  # euclaise/writingprompts: prompt, story
  return {"prompt": f"[ WP ] You wake up {i} years in the future and nobody remembers you.",
          "story": f"The city had changed in {i} years, but the bakery on the corner had not."}


def mbpp(i: int) -> dict:  # google-research-datasets/mbpp, full
  return {"task_id": 11 + i,
          "text": f"Write a python function to remove the first and last occurrence {i}.",
          "code": "def remove_Occ(s,ch): \r\n    return s.replace(ch, '', 1)[::-1]"
                  ".replace(ch, '', 1)[::-1] ",
          "test_list": ['assert remove_Occ("hello","l") == "heo"',
                        'assert remove_Occ("abcda","a") == "bcd"',
                        'assert remove_Occ("PHP","P") == "H"'],
          "test_setup_code": "", "challenge_test_list": []}


def mbpp_sanitized(i: int) -> dict:  # its other subset, of other fields
  return {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2 + i,
          "prompt": f"Write a function to find the shared elements of two lists ({i}).",
          "code": "def similar_elements(a, b):\n  return tuple(set(a) & set(b))",
          "test_imports": [], "test_list": ["assert similar_elements((3, 4), (4, 5)) == (4,)"]}


# Each source's dataset as its card lays it out: {subset: {split: rows}} (None: the default
# subset), the Hub repository's files under each subset ("data" where the card says so).
CARDS = {
    "gsm8k": ("openai/gsm8k", {"main": {"train": [gsm8k(i) for i in range(4)],
                                        "test": [gsm8k(i) for i in range(10, 13)]}}),
    "sciq": ("allenai/sciq", {None: {"train": [sciq(i) for i in range(5)],
                                     "validation": [sciq(i) for i in range(20, 23)],
                                     "test": [sciq(i) for i in range(40, 42)]}}),
    "rar-science": ("ScaleAI/RaR-Science", {None: {"train": [rar_science(i) for i in range(3)],
                                                   "val": [rar_science(i) for i in range(20, 22)],
                                                   "test": [rar_science(40)]}}),
    "tldr": ("trl-lib/tldr", {None: {"train": [tldr(i) for i in range(3)],
                                     "validation": [tldr(i) for i in range(20, 22)],
                                     "test": [tldr(40)]}}),
    "writingprompts": ("euclaise/writingprompts",
                       {None: {"train": [writingprompts(i) for i in range(3)],
                               "test": [writingprompts(i) for i in range(20, 22)]}}),
    "mbpp": ("google-research-datasets/mbpp",
             {"full": {"train": [mbpp(i) for i in range(3)],
                       "test": [mbpp(i) for i in range(20, 22)],
                       "validation": [mbpp(i) for i in range(30, 32)], "prompt": [mbpp(40)]},
              "sanitized": {s: [mbpp_sanitized(i)] for i, s in enumerate(
                  ("train", "test", "validation", "prompt"))}}),
}


def expected(name: str, row: dict) -> dict:
  """The record each source makes of a row, by its card's fields, written out by hand."""
  plain = {"chosen": None, "rejected": None, "rubric": None, "answer": None, "source": name}
  if name == "gsm8k":
    final = row["answer"].rsplit("#### ", 1)[1]
    steps = re.sub(r"<<[^>]*>>", "", row["answer"].split("####")[0])  # calculator notes
    return {**plain, "question": row["question"], "answer": final, "category": "math",
            "response": f"<reasoning>{steps.strip()}</reasoning>\n<answer>{final}</answer>"}
  if name == "sciq":
    return {**plain, "question": row["question"], "answer": "mesophilic organisms",
            "category": "science", "response": f"<reasoning>{row['support']}</reasoning>\n"
                                               "<answer>mesophilic organisms</answer>"}
  if name == "rar-science":
    return {**plain, "question": row["question"], "category": "science",
            "response": row["reference_answer"],
            "rubric": tuple((c["description"], float(c["weight"])) for c in row["rubric"])}
  if name == "tldr":
    return {**plain, "question": row["prompt"], "answer": row["completion"].strip(),
            "response": row["completion"], "category": "summarisation"}
  if name == "writingprompts":
    return {**plain, "question": row["prompt"], "response": row["story"], "category": "creative"}
  assert name == "mbpp"  # the task and its tests (which name the function), the tests to run
  return {**plain, "category": "code", "tests": row["test_list"],
          "question": row["text"] + "\nYour code should pass these tests:\n"
                      + "\n".join(row["test_list"]),
          "response": f"```python\n{row['code']}\n```"}


@pytest.fixture(autouse=True)
def quiet_cache(tmp_path, monkeypatch):
  """datasets' locks for local folders go under tmp_path, not the user's cache; no progress
  bars for the copies written."""
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
  datasets.disable_progress_bars()
  yield
  datasets.enable_progress_bars()


def splits(name: str) -> dict[str, list[dict]]:
  """The rows of the subset the preset reads (GSM8K's main, MBPP's full), by split."""
  return CARDS[name][1][{"gsm8k": "main", "mbpp": "full"}.get(name)]


def saved(root, name: str) -> str:
  """A save_to_disk copy of the source's subset (a local copy has no subsets)."""
  folder = root / name
  datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s, rows in splits(name).items()}
                       ).save_to_disk(str(folder))
  return str(folder)


def hub_layout(root, name: str) -> str:
  """A copy laid out as the Hub repository: parquet files, split and subset by the card's
  `configs:` (GSM8K's main subset alone: `source: gsm8k` with a path reads no subset)."""
  _, subsets = CARDS[name]
  folder = root / f"{name}-hub"
  configs = []
  for subset, by_split in subsets.items():
    where = "." if name == "gsm8k" else "data" if subset is None else subset
    (folder / where).mkdir(parents=True, exist_ok=True)
    for split, rows in by_split.items():
      datasets.Dataset.from_list(rows).to_parquet(
          str(folder / where / f"{split}-00000-of-00001.parquet"))
    configs.append(f"- config_name: {subset or 'default'}\n  data_files:\n" + "".join(
        f"  - split: {s}\n    path: {where}/{s}-*\n" for s in by_split))
  if name != "gsm8k":
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n")
  return str(folder)


GENERATED = ("arithmetic", "instructions")  # sources written here, with no dataset card


def hub_sources(cfg) -> list:
  """The preset's mixture sources read from a dataset (the generated ones left out)."""
  return [m for m in cfg.data.mixture if m.source not in GENERATED]


def local(cfg, root, layout: str):
  """The preset with each source's path at its local copy (and, for a save_to_disk copy, no
  subset), everything else as the preset has it."""
  mixture = []
  for m in cfg.data.mixture:
    if m.source in GENERATED:
      mixture.append(m)
      continue
    assert m.name in CARDS, f"a source with no card here: {m.name}"
    if layout == "saved":
      mixture.append(dataclasses.replace(m, path=saved(root, m.name), subset=None))
    else:
      mixture.append(dataclasses.replace(m, path=hub_layout(root, m.name)))
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mixture=tuple(mixture)))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_preset_validates_and_names_the_cards_datasets(preset):
  """The preset loads as it is, and each source names its dataset's Hub id, subset and splits
  as the card has them."""
  cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
  named = {m.name: (m.source, m.path, m.subset, m.split, m.eval_split) for m in cfg.data.mixture}
  assert named == {
      "gsm8k": ("gsm8k", None, None, "train", None),  # openai/gsm8k, main, test held out
      "sciq": ("hf", "allenai/sciq", None, "train", "validation"),
      "rar-science": ("hf", "ScaleAI/RaR-Science", None, "train", "val"),
      "tldr": ("hf", "trl-lib/tldr", None, "train", "validation"),
      "writingprompts": ("hf", "euclaise/writingprompts", None, "train", "test"),
      "mbpp": ("hf", "google-research-datasets/mbpp", "full", "train", "validation"),
      "instructions": ("instructions", None, None, "train", None)}  # generated: no card
  assert {m.name for m in cfg.data.mixture if m.streaming} == {"tldr", "writingprompts"}
  assert sources.GSM8K["path"] == CARDS["gsm8k"][0] and sources.GSM8K["subset"] == "main"
  assert all(CARDS[m.name][0] == (m.path or sources.GSM8K["path"]) for m in hub_sources(cfg))


@pytest.mark.parametrize("layout", ["saved", "hub"])
@pytest.mark.parametrize("preset", PRESETS)
def test_each_source_maps_its_cards_fields(preset, layout, tmp_path):
  """Local copies in the cards' schemas, loaded through the preset's mapping: GSM8K's answer
  ends in '#### 72' and the record's answer is 72, its steps the response; SciQ's support and
  answer write the response; RaR-Science's rubric (title, description, weight) becomes the
  record's criteria; TL;DR's completion is the reference and the response; each source's
  held-out records are its eval split's. The records pass the checks a run makes before any
  model loads (every category has a reward, references where a reward needs one, rubrics
  within judge.max_criteria, a response on every record for SFT)."""
  cfg = local(load_config(ROOT / "configs" / f"{preset}.yaml"), tmp_path, layout)
  said = []
  train, held = sources.load_splits(cfg.data, log=said.append)
  assert len(said) == len(hub_sources(cfg))  # a generated source says nothing unless it drops
  for m in hub_sources(cfg):
    rows = splits(m.name)
    held_split = "test" if m.name == "gsm8k" else m.eval_split
    assert [r for r in train if r["source"] == m.name] == [
        expected(m.name, row) for row in rows[m.split]], m.name
    assert [r for r in held if r["source"] == m.name] == [
        expected(m.name, row) for row in rows[held_split][:m.num_eval]], m.name
  by_name = {}
  for r in train:
    by_name.setdefault(r["source"], r)  # each source's first
  assert by_name["gsm8k"]["answer"] == "72" and by_name["gsm8k"]["response"] == (
      "<reasoning>In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72.</reasoning>\n"
      "<answer>72</answer>")
  assert by_name["rar-science"]["rubric"] == (
      ("Essential Criteria: Identifies the rate-limiting step.", 5.0),
      ("Optional Criteria: Gives the Arrhenius equation.", 2.0),
      ("Pitfall Criteria: Does not confuse rate with equilibrium.", -1.0))

  rewards = Rewards(cfg.rewards)
  for where, records in (("the training data", train), ("the held-out data", held)):
    rewards.check(records, where)
    judge_lib.check_records(cfg.judge, records, where)
  judge_lib.check_agreement_records(cfg.judge, train + held, "the data")
  curriculum.check(cfg.data, train, "the training data")
  sft.check(cfg, train, "the training data")
  scored = {c for r in cfg.rewards for c in r.categories or ()}
  assert {r["category"] for r in train + held} <= scored
  relevance, = [r for r in cfg.rewards if r.fn == "relevance"]
  assert relevance.categories == ("summarisation",)  # the category whose records have references


def test_code_is_scored_by_its_tests_not_the_judge(tmp_path):
  """MBPP's records go to `tests_pass`, not the judge; each record's own solution passes each
  of its tests in the sandbox, and a wrong one those it happens to pass."""
  from reasoner.rewards import sandbox

  cfg = local(load_config(ROOT / "configs" / "gemma3_1b_general.yaml"), tmp_path, "saved")
  train, held = sources.load_splits(cfg.data, log=lambda _: None)
  code = [r for r in train + held if r["category"] == "code"]
  assert len(code) == 5
  by_fn = {r.fn: r.categories for r in cfg.rewards}
  assert "code" in by_fn["tests_pass"] and "code" not in by_fn["judge"]
  wrong = "```python\ndef remove_Occ(s, ch):\n  return s.strip(ch)\n```"  # "hello" fails
  assert sandbox.tests_pass([""] * 6, [r["response"] for r in code] + [wrong],
                            [r["tests"] for r in code] + [code[0]["tests"]],
                            timeout_s=10.0) == [1.0] * 5 + [pytest.approx(2 / 3)]


@pytest.mark.parametrize("preset", PRESETS)
def test_without_the_network_each_hub_source_is_one_line(preset, tmp_path, monkeypatch):
  """Here (no network) every source but the local copies fails at load in one line naming
  its Hub id and the ways out, source after source."""
  monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(hub, "_online", lambda *a, **k: False)
  cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
  mixture = list(cfg.data.mixture)
  for k, m in enumerate(mixture):
    if m.source in GENERATED:
      continue
    data = dataclasses.replace(cfg.data, mixture=tuple(mixture))
    with pytest.raises(DataError, match=(
        rf"^data\.mixture\[{m.name}\]\.source '{m.source}' reads '{CARDS[m.name][0]}' from "
        r"huggingface\.co, which cannot be reached; point data\.mixture\[[\w.-]+\]\.path at a "
        "local folder")):
      sources.load_splits(data, log=lambda _: None)
    mixture[k] = dataclasses.replace(m, path=saved(tmp_path, m.name), subset=None)


def rehearsal():
  """tools/rehearse.py, as a module."""
  spec = importlib.util.spec_from_file_location("rehearse", ROOT / "tools" / "rehearse.py")
  rehearse = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rehearse)
  return rehearse


def test_the_rehearsal_draws_offline_data(monkeypatch):
  """`make rehearse PRESET=gemma3_1b_general` has no network: GSM8K becomes the arithmetic
  set and the Hub's datasets one source of data/general.jsonl with their weight."""
  rehearse = rehearsal()
  monkeypatch.chdir(ROOT)  # the rehearsal's paths are the repository's
  path = ROOT / "configs" / "gemma3_1b_general.yaml"
  preset = load_config(path)
  cfg = load_config(path, rehearse.cuts(preset, ROOT / "no-judge-here"))
  assert [(m.name, m.source, m.weight) for m in cfg.data.mixture] == [
      ("gsm8k", "arithmetic", 1.0), ("instructions", "instructions", 1.0),
      ("general", "jsonl", sum(m.weight for m in preset.data.mixture if m.source == "hf"))]
  # data/general.jsonl's code records have no tests: the judge scores them here
  assert {r.fn: r.categories for r in cfg.rewards}["judge"] == (
      "creative", "summarisation", "science", "code")
  assert "tests_pass" not in {r.fn for r in cfg.rewards}
  train, held = sources.load_splits(cfg.data, log=lambda _: None)
  rewards = Rewards(cfg.rewards)
  rewards.check(train, "the training data")
  rewards.check(held, "the held-out data")
  judge_lib.check_records(cfg.judge, train + held, "the data")


def test_the_rehearsal_puts_hub_kaggle_and_missing_files_on_local_data(tmp_path, monkeypatch):
  """A single hf or kaggle source (every dataset key, fields and a template set) becomes the
  arithmetic set where the rewards score math, else data/general.jsonl, every such key back to
  its default; in a mixture GSM8K (streamed, at a revision) becomes the arithmetic set, the Hub's
  and Kaggle's datasets and a file not here one source of data/general.jsonl with their weight,
  and a file here stays as it is. Each rewritten preset validates and loads offline."""
  rehearse = rehearsal()
  monkeypatch.chdir(ROOT)
  tiny = ROOT / "configs" / "tiny.yaml"
  hf = ["data.source=hf", "data.path=alice/sums", "data.subset=easy", "data.split=training",
        "data.eval_split=test", "data.revision=v2", "data.streaming=true",
        "data.question_field=problem", "data.response_template='<answer>{solution}</answer>'"]
  kaggle = ["data.source=kaggle", "data.path=alice/sums", "data.file=sums.csv",
            "data.answer_field=solution", "data.num_eval=16"]
  not_math = "rewards=[{fn: format_exact, categories: [creative, summarisation, science, code]}]"
  for preset, general in ((hf, False), (kaggle, False), ([*kaggle, not_math], True),
                          (["data.source=csv", "data.path=/kaggle/input/d/sums.csv"], False)):
    cut = rehearse.offline_data(load_config(tiny, preset))
    got = load_config(tiny, [*preset, *cut]).data
    want = ["data.source=jsonl", "data.path=data/general.jsonl", "data.num_eval=4"] if (
        general) else ["data.num_eval=8"]
    assert got == load_config(tiny, want).data, preset
    sources.load_splits(got, log=lambda _: None)
  here = tmp_path / "here.csv"
  here.write_text("problem,solution\n" + "".join(f"What is {i} + 1?,{i + 1}\n" for i in range(9)))
  mixture = [
      {"name": "gsm8k", "source": "gsm8k", "streaming": True, "revision": "e53f048",
       "num_eval": 128},
      {"name": "sums", "source": "hf", "path": "alice/sums", "subset": "easy", "split": "train",
       "eval_split": "test", "revision": "v2", "streaming": True, "question_field": "problem",
       "response_template": "<answer>{solution}</answer>", "weight": 0.5},
      {"name": "kg", "source": "kaggle", "path": "alice/sums", "file": "sums.csv", "weight": 0.25},
      {"name": "gone", "source": "csv", "path": "/kaggle/input/d/sums.csv", "weight": 0.25},
      {"name": "here", "source": "csv", "path": str(here), "question_field": "problem",
       "answer_field": "solution", "weight": 2, "num_eval": 3, "category": "math"},
      {"name": "general", "path": "data/general.jsonl", "weight": 0.5, "num_eval": 2}]
  preset = [f"data.mixture={json.dumps(mixture)}"]
  cut = rehearse.offline_data(load_config(tiny, preset))
  cfg = load_config(tiny, [*preset, *cut])
  assert [(m.name, m.source, m.path, m.weight, m.num_eval) for m in cfg.data.mixture] == [
      ("gsm8k", "arithmetic", None, 1.0, 8), ("here", "csv", str(here), 2.0, 3),
      ("general", "jsonl", "data/general.jsonl", 0.5, 2),
      ("rehearsal-general", "jsonl", "data/general.jsonl", 1.0, 4)]
  assert (cfg.data.mixture[0].streaming, cfg.data.mixture[0].revision) == (False, None)
  assert cfg.data.mixture[1] == load_config(tiny, preset).data.mixture[4]
  train, held = sources.load_splits(cfg.data, log=lambda _: None)
  assert [r["answer"] for r in train if r["source"] == "here"] == [str(i) for i in range(1, 7)]
