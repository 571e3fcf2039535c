"""Bring your own data: Hugging Face datasets (a Hub id or a local folder), a file of a Kaggle
dataset, csv files, responses written from a record's fields by a template, and the checks at
load (templates' missing fields, repeated questions, held-out questions in training), each
source summed up in one line. Nothing here reaches a network: Hub datasets are local folders
laid out as `datasets` writes them, Kaggle's a cache laid out as kagglehub writes it."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import time

import datasets
import pytest

from conftest import no_kaggle_credentials
from reasoner.config import ConfigError, DataConfig, EvalSet
from reasoner.data import hub, sources
from reasoner.errors import DataError

ROWS = [{"problem": f"What is {i} + {i}?", "solution": str(2 * i), "level": f"L{i % 3}",
         "thinking": None if i % 4 == 3 else f"{i} and {i} make {2 * i}"} for i in range(12)]
HAND_IN = "<reasoning>{thinking}</reasoning>\n<answer>{solution}</answer>"
FIELDS = dict(question_field="problem", answer_field="solution", category_field="level")


def exactly(line: str) -> str:
  """A pattern matching `line` whole: one line, nothing before or after."""
  assert "\n" not in line
  return "^" + re.escape(line) + "$"


def expected(rows: list[dict]) -> list[dict]:
  """The records of ROWS-like rows under FIELDS, written out by hand."""
  return [{"question": r["problem"], "answer": r["solution"], "category": r["level"],
           "response": None, "chosen": None, "rejected": None, "rubric": None} for r in rows]


@pytest.fixture(autouse=True)
def quiet_cache(tmp_path, monkeypatch):
  """datasets' locks for local folders go under tmp_path, not the user's cache."""
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_hf_folders_and_csv_give_the_files_records(tmp_path):
  """A save_to_disk DatasetDict (its test split held out), a folder of parquet files, a folder
  of jsonl files split by name, a single Dataset and a csv file: each gives the records the
  same rows give as a jsonl file."""
  train, test = ROWS[:8], ROWS[8:]
  as_file = sources.load_splits(DataConfig(source="jsonl", path=str(write_jsonl(
      tmp_path / "all.jsonl", ROWS)), num_eval=4, **FIELDS), log=lambda _: None)
  assert as_file == (expected(train), expected(test))

  saved = tmp_path / "saved"
  datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                        "test": datasets.Dataset.from_list(test)}).save_to_disk(str(saved))
  said = []
  got = sources.load_splits(DataConfig(source="hf", path=str(saved), eval_split="test",
                                       num_eval=3, **FIELDS), log=said.append)
  assert got == (expected(train), expected(test[:3]))
  assert said == [f"data: hf {saved}: 12 read; 8 training, 3 held out"]

  (tmp_path / "pq").mkdir()
  datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "pq" / "data.parquet"))
  (tmp_path / "js").mkdir()
  write_jsonl(tmp_path / "js" / "train.jsonl", train)
  write_jsonl(tmp_path / "js" / "test.jsonl", test)
  one = tmp_path / "one"
  datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
  for path, eval_split in ((tmp_path / "pq", None), (tmp_path / "js", "test"), (one, None),
                           (tmp_path / "all.jsonl", None)):
    cfg = DataConfig(source="hf", path=str(path), eval_split=eval_split, num_eval=4, **FIELDS)
    assert sources.load_splits(cfg, log=lambda _: None) == as_file, path

  with (tmp_path / "d.csv").open("w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["problem", "solution", "level"])
    w.writeheader()
    w.writerows([{k: r[k] for k in ("problem", "solution", "level")} for r in ROWS])
    w.writerow({"problem": "What is x?", "solution": "", "level": "L9"})
  got = sources.load_splits(DataConfig(source="csv", path=str(tmp_path / "d.csv"), num_eval=1,
                                       **FIELDS), log=lambda _: None)
  assert got == (expected(ROWS), [{**expected(ROWS[:1])[0], "question": "What is x?",
                                   "answer": None, "category": "L9"}])
  assert all(isinstance(r["answer"], str) for r in got[0])  # csv values are text


def test_streaming_reads_only_the_first_records(tmp_path):
  """The second shard of the folder is not JSON: a stream stops before it (num_train 4 and
  num_eval 2 of the first shard's 6 rows); reading the whole split meets it."""
  (tmp_path / "js").mkdir()
  write_jsonl(tmp_path / "js" / "train-00000-of-00002.jsonl", ROWS[:6])
  (tmp_path / "js" / "train-00001-of-00002.jsonl").write_text("{not json\n" * 100)
  said = []
  cfg = DataConfig(source="hf", path=str(tmp_path / "js"), streaming=True, num_train=4,
                   num_eval=2, **FIELDS)
  assert sources.load_splits(cfg, log=said.append) == (expected(ROWS[:4]), expected(ROWS[4:6]))
  assert said == [f"data: hf {tmp_path / 'js'}: 6 read; 4 training, 2 held out"]
  with pytest.raises(DataError, match=rf"^config key 'data.path' = "
                     rf"'{re.escape(str(tmp_path / 'js'))}', split 'train': not readable \(.+\)$"):
    sources.load_splits(DataConfig(source="hf", path=str(tmp_path / "js"), **FIELDS))


def test_streaming_a_parquet_folder_stops_at_num_train(tmp_path):
  """A folder of parquet shards read by datasets as a stream: num_train 5 and num_eval 2 read
  the first 7 rows and no more (the second shard is not parquet: reading the whole split, or
  one row further, meets it); with a held-out split, num_train of the one and num_eval of the
  other; an evaluation set, its first `num`."""
  folder = tmp_path / "pq"
  folder.mkdir()
  datasets.Dataset.from_list(ROWS[:8]).to_parquet(str(folder / "train-00000-of-00002.parquet"))
  (folder / "train-00001-of-00002.parquet").write_bytes(b"not parquet" * 100)
  datasets.Dataset.from_list(ROWS[8:]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
  said = []
  cfg = DataConfig(source="hf", path=str(folder), streaming=True, num_train=5, num_eval=2,
                   **FIELDS)
  assert sources.load_splits(cfg, log=said.append) == (expected(ROWS[:5]), expected(ROWS[5:7]))
  assert said == [f"data: hf {folder}: 7 read; 5 training, 2 held out"]
  split = DataConfig(source="hf", path=str(folder), streaming=True, num_train=3, num_eval=2,
                     eval_split="test", **FIELDS)
  assert sources.load_splits(split, log=said.append) == (expected(ROWS[:3]),
                                                         expected(ROWS[8:10]))
  assert said[-1] == f"data: hf {folder}: 5 read; 3 training, 2 held out"
  s = EvalSet(name="t", source="hf", path=str(folder), split="test", streaming=True, num=3,
              **FIELDS)
  assert sources.load_eval_set(s, DataConfig(), said.append) == expected(ROWS[8:11])
  assert said[-1] == f"data: evaluation set 't' (hf {folder}): 3 read; 3 evaluated"
  for whole in (dataclasses.replace(cfg, streaming=False), dataclasses.replace(cfg, num_train=7)):
    with pytest.raises(DataError, match=rf"^config key 'data.path' = '{re.escape(str(folder))}'"
                       r", split 'train': not readable \(.+\)$"):
      sources.load_splits(whole, log=said.append)


def test_revision_and_subset_reach_load_dataset(monkeypatch):
  """A Hub dataset's subset, revision and streaming are load_dataset's name, revision and
  streaming (here a stand-in at its boundary, offline: no probe), for hf and for gsm8k."""
  calls = []

  def load_dataset(path, name=None, **kwargs):
    calls.append((path, name, kwargs, datasets.config.HF_HUB_OFFLINE))
    rows = [{**r, "question": r["problem"], "answer": r["solution"]} for r in ROWS]
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                                 "test": datasets.Dataset.from_list(rows[8:])})

  monkeypatch.setattr(datasets, "load_dataset", load_dataset)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  cfg = DataConfig(source="hf", path="alice/sums", subset="easy", revision="v1.2",
                   eval_split="test", num_eval=2, **FIELDS)
  assert sources.load_splits(cfg, log=lambda _: None) == (expected(ROWS[:8]),
                                                          expected(ROWS[8:10]))
  sources.load_splits(DataConfig(source="gsm8k", revision="e53f048", streaming=True,
                                 num_train=3, num_eval=1), log=lambda _: None)
  assert calls == [("alice/sums", "easy", {"revision": "v1.2", "streaming": False}, True),
                   ("openai/gsm8k", "main", {"revision": "e53f048", "streaming": True}, True)]


def test_a_template_writes_the_hand_in_format(tmp_path):
  """response_template writes SFT's target from the fields; a record without one it names is
  dropped and counted (data.overlong: drop) or one line (error)."""
  path = write_jsonl(tmp_path / "d.jsonl", ROWS)
  said = []
  cfg = DataConfig(source="jsonl", path=str(path), num_eval=2, response_template=HAND_IN,
                   chosen_template="<answer>{solution}</answer>",
                   rejected_template="<answer>{level}</answer>", **FIELDS)
  train, held = sources.load_splits(cfg, log=said.append)
  kept = [r for r in ROWS if r["thinking"] is not None]
  assert [r["question"] for r in train + held] == [r["problem"] for r in kept]
  assert train[0]["response"] == "<reasoning>0 and 0 make 0</reasoning>\n<answer>0</answer>"
  assert (train[1]["chosen"], train[1]["rejected"]) == ("<answer>2</answer>", "<answer>L1</answer>")
  assert said == [f"data: jsonl {path}: 12 read, 3 dropped (3 missing field 'thinking'); "
                  "7 training, 2 held out"]
  with pytest.raises(DataError, match=exactly(
      f"{path}: record 3 has no field 'thinking', which data.response_template names "
      "(data.overlong: error; 'drop' skips such records)")):
    sources.load_splits(DataConfig(source="jsonl", path=str(path), overlong="error",
                                   response_template=HAND_IN, **FIELDS))
  with pytest.raises(DataError, match=exactly(
      "config key 'data.response_template' names field 'reasoning', which no record of "
      f"{path} has; they have level, problem, solution, thinking")):
    sources.load_splits(DataConfig(source="jsonl", path=str(path),
                                   response_template="{reasoning}", **FIELDS))
  with pytest.raises(ConfigError, match=exactly(
      "config key 'eval.sets[x].response_template' = '<a>{solution</a>': expected a template "
      "of record fields in braces, e.g. '<answer>{solution}</answer>' ({{ and }} for a brace): "
      "expected '}' before end of string")):
    EvalSet(name="x", source="jsonl", path="x.jsonl", response_template="<a>{solution</a>")


def test_repeats_and_held_out_questions_leave_training(tmp_path):
  """A question repeated in training keeps its first record; a held-out question also in
  training leaves training; each source of a mixture says so in its own line."""
  rows = ROWS[:6] + [{**ROWS[1], "solution": "again"}, ROWS[2], {**ROWS[0], "problem":
                     " What is 0 +  0? "}] + ROWS[6:8] + [ROWS[4], ROWS[9]]
  path = write_jsonl(tmp_path / "d.jsonl", rows)
  said = []
  train, held = sources.load_splits(DataConfig(source="jsonl", path=str(path), num_eval=2,
                                               **FIELDS), log=said.append)
  assert held == expected([ROWS[4], ROWS[9]])
  assert train == expected([r for r in ROWS[:8] if r is not ROWS[4]])
  assert said == [f"data: jsonl {path}: 13 read, 3 dropped (3 duplicate question), 1 held-out "
                  "questions also in training dropped from training (contamination); "
                  "7 training, 2 held out"]
  other = write_jsonl(tmp_path / "other.jsonl", ROWS[:4])
  said = []
  mixture = ({"name": "mine", "source": "jsonl", "path": str(path), "num_eval": 2, **FIELDS},
             {"name": "more", "source": "jsonl", "path": str(other), "num_eval": 0, **FIELDS})
  from reasoner.config.data import MixtureSource

  cfg = DataConfig(mixture=tuple(MixtureSource(**m) for m in mixture))
  train, held = sources.load_splits(cfg, log=said.append)
  assert len(train) == 7 + 4 and len(held) == 2
  assert said == [f"data: 'mine' (jsonl {path}): 13 read, 3 dropped (3 duplicate question), 1 "
                  "held-out questions also in training dropped from training (contamination); "
                  "7 training, 2 held out",
                  f"data: 'more' (jsonl {other}): 4 read; 4 training, 0 held out"]


def test_gsm8k_is_hf_with_its_mapping(tmp_path):
  """source: gsm8k reads a local copy laid out as GSM8K (question, and an answer whose worked
  solution ends in '#### 72') as hf does, with GSM8K's mapping: train, test held out, the
  worked solutions the responses; an evaluation set reads its test split."""
  def row(i):
    return {"question": f"Tom has {i} bags of 2 apples. How many?",
            "answer": f"{i} bags of 2 is {i}*2=<<{i}*2={2 * i}>>{2 * i}.\n#### {2 * i}"}

  copy = tmp_path / "gsm8k"
  datasets.DatasetDict({"train": datasets.Dataset.from_list([row(i) for i in range(5)]),
                        "test": datasets.Dataset.from_list([row(i) for i in range(50, 53)])}
                       ).save_to_disk(str(copy))
  said = []
  train, held = sources.load_splits(DataConfig(source="gsm8k", path=str(copy), num_eval=2),
                                    log=said.append)
  assert train == [{"question": row(i)["question"], "answer": str(2 * i), "category": "math",
                    "response": f"<reasoning>{i} bags of 2 is {i}*2={2 * i}.</reasoning>\n"
                                f"<answer>{2 * i}</answer>", "chosen": None, "rejected": None,
                    "rubric": None} for i in range(5)]
  assert train[3]["answer"] == "6" and train[3]["response"] == (
      "<reasoning>3 bags of 2 is 3*2=6.</reasoning>\n<answer>6</answer>")
  assert [r["answer"] for r in held] == ["100", "102"]
  assert said == [f"data: gsm8k {copy}: 8 read; 5 training, 2 held out"]
  s = EvalSet(name="gsm8k", source="gsm8k", path=str(copy), num=2)
  assert [r["answer"] for r in sources.load_eval_set(s, DataConfig(), said.append)] == [
      "100", "102"]
  assert said[-1] == f"data: evaluation set 'gsm8k' (gsm8k {copy}): 3 read; 2 evaluated"


def test_a_hub_dataset_offline_is_one_line_in_seconds(monkeypatch):
  """HF_DATASETS_OFFLINE=1 (set after datasets was imported, as a notebook sets it) and a
  dataset not in the cache; or no network and no offline mode: one line, at once."""
  ways_out = ("point data.path at a local folder or file (Dataset.save_to_disk, or jsonl, "
              "json, parquet or csv files), or fill the Hugging Face cache online and set "
              "HF_DATASETS_OFFLINE=1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  t = time.perf_counter()
  with pytest.raises(DataError, match=exactly(
      "data.source 'hf' reads 'nobody/no-such-dataset' with HF_DATASETS_OFFLINE=1, but it is "
      f"not in the Hugging Face cache; {ways_out}")):
    sources.load_splits(DataConfig(source="hf", path="nobody/no-such-dataset"))
  assert not datasets.config.HF_HUB_OFFLINE  # datasets' own setting is left as it was
  monkeypatch.delenv("HF_DATASETS_OFFLINE")
  monkeypatch.setattr(hub, "_online", lambda *a, **k: False)
  with pytest.raises(DataError, match=exactly(
      "data.source 'gsm8k' reads 'openai/gsm8k' from huggingface.co, which cannot be reached; "
      f"{ways_out}")):
    sources.load_splits(DataConfig(source="gsm8k"))
  assert time.perf_counter() - t < 5


def test_a_split_subset_or_field_not_there_names_those_there_are(tmp_path):
  saved = tmp_path / "saved"
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                        "validation": datasets.Dataset.from_list(ROWS[4:])}
                       ).save_to_disk(str(saved))
  with pytest.raises(DataError, match=exactly(
      f"config key 'data.eval_split' = 'test': {saved} has no such split; it has train, "
      "validation")):
    sources.load_splits(DataConfig(source="hf", path=str(saved), eval_split="test", **FIELDS))
  with pytest.raises(DataError, match=exactly(
      f"config key 'eval.sets[v].split' = 'dev': {saved} has no such split; it has train, "
      "validation")):
    sources.load_eval_set(EvalSet(name="v", source="hf", path=str(saved), split="dev"),
                          DataConfig())
  with pytest.raises(DataError, match=exactly(
      f"{saved} (train) has no field 'answer_text' (data.answer_field) in any record; they "
      "have level, problem, solution, thinking")):
    sources.load_splits(DataConfig(source="hf", path=str(saved), **{
        **FIELDS, "answer_field": "answer_text"}))
  (tmp_path / "repo" / "main").mkdir(parents=True)  # a Hub repository's layout, two subsets
  (tmp_path / "repo" / "socratic").mkdir()
  write_jsonl(tmp_path / "repo" / "main" / "train.jsonl", ROWS)
  write_jsonl(tmp_path / "repo" / "socratic" / "train.jsonl", ROWS)
  (tmp_path / "repo" / "README.md").write_text(
      "---\nconfigs:\n- config_name: main\n  data_files: main/*.jsonl\n"
      "- config_name: socratic\n  data_files: socratic/*.jsonl\n---\n")
  repo = tmp_path / "repo"
  with pytest.raises(DataError, match=exactly(
      f"config key 'data.subset' = 'first': {repo} has no such subset; it has main, socratic")):
    sources.load_splits(DataConfig(source="hf", path=str(repo), subset="first", **FIELDS))
  train, _ = sources.load_splits(DataConfig(source="hf", path=str(repo), subset="socratic",
                                            num_eval=2, **FIELDS), log=lambda _: None)
  assert train == expected(ROWS[:10])


def test_kaggle_without_credentials_is_one_line(tmp_path, monkeypatch):
  no_kaggle_credentials(monkeypatch, tmp_path)
  with pytest.raises(DataError, match=exactly(
      "data.mixture[k].source 'kaggle' downloads 'train.csv' of alice/sums, but no Kaggle "
      "credentials were found: set KAGGLE_USERNAME and KAGGLE_KEY (or KAGGLE_API_TOKEN), write "
      '~/.kaggle/kaggle.json ({"username": ..., "key": ...}), or add them as Kaggle notebook '
      "secrets; or set data.mixture[k].source to jsonl, parquet or csv and "
      "data.mixture[k].path to a local copy")):
    from reasoner.config.data import MixtureSource

    sources.load_splits(DataConfig(mixture=(MixtureSource(
        name="k", source="kaggle", path="alice/sums", file="train.csv"),)))


def kaggle_cache(home, version: int, rows: list[dict], marker: str | None = "file",
                 file: str = "data/sums.jsonl") -> None:
  """Version `version` of Kaggle dataset alice/sums in the kagglehub cache under `home` (where
  no_kaggle_credentials points KAGGLEHUB_CACHE), laid out as kagglehub writes it: FILE in
  datasets/alice/sums/versions/N/, marked complete as a file downloaded alone is
  (.complete/N/FILE.complete), as a whole download is (`marker` "whole": N.complete), or not at
  all (None: a download that never completed)."""
  base = home / "cache" / "datasets" / "alice" / "sums"
  (base / "versions" / str(version) / file).parent.mkdir(parents=True)
  write_jsonl(base / "versions" / str(version) / file, rows)
  done = {"file": base / ".complete" / str(version) / f"{file}.complete",
          "whole": base / f"{version}.complete", None: None}[marker]
  if done is not None:
    done.parent.mkdir(parents=True, exist_ok=True)
    done.touch()


def test_kaggle_reads_kagglehubs_cache_offline(tmp_path, monkeypatch):
  """A cache laid out as kagglehub writes it (datasets/OWNER/DATASET/versions/N/FILE, with
  .complete/N/FILE.complete): without credentials the file is read from it, an unversioned
  handle reading the newest complete version there."""
  no_kaggle_credentials(monkeypatch, tmp_path)
  kaggle_cache(tmp_path, 1, ROWS[:4])
  kaggle_cache(tmp_path, 3, ROWS)
  kaggle_cache(tmp_path, 4, ROWS[:1], marker=None)
  said = []
  cfg = DataConfig(source="kaggle", path="alice/sums", file="data/sums.jsonl", num_eval=2,
                   **FIELDS)
  assert sources.load_splits(cfg, log=said.append) == (expected(ROWS[:10]), expected(ROWS[10:]))
  assert said == ["data: kaggle alice/sums data/sums.jsonl: 12 read; 10 training, 2 held out"]
  pinned = DataConfig(source="kaggle", path="alice/sums/versions/1", file="data/sums.jsonl",
                      num_eval=1, **FIELDS)
  assert sources.load_splits(pinned, log=lambda _: None)[0] == expected(ROWS[:3])


def test_kaggle_reads_a_file_of_a_whole_dataset_download_offline(tmp_path, monkeypatch):
  """kagglehub marks a whole download of a version once (OWNER/DATASET/N.complete), not each of
  its files: the file is read from inside it, without kagglehub (which would go online). A
  whole download without the file is no copy of it."""
  no_kaggle_credentials(monkeypatch, tmp_path)
  kaggle_cache(tmp_path, 2, ROWS, marker="whole")
  kaggle_cache(tmp_path, 5, ROWS, marker="whole", file="other.jsonl")
  import kagglehub

  monkeypatch.setattr(kagglehub, "dataset_download", lambda *a, **k: pytest.fail("online"))
  cfg = DataConfig(source="kaggle", path="alice/sums", file="data/sums.jsonl", num_eval=2,
                   **FIELDS)
  assert sources.load_splits(cfg, log=lambda _: None) == (expected(ROWS[:10]),
                                                          expected(ROWS[10:]))
  with pytest.raises(DataError, match="^data.source 'kaggle' downloads 'missing.jsonl' of "
                     "alice/sums, but no Kaggle credentials were found"):
    sources.load_splits(DataConfig(source="kaggle", path="alice/sums", file="missing.jsonl",
                                   **FIELDS))


def test_hf_reads_csv_values_as_the_csv_source_does(tmp_path):
  """Answers such as 007, 1.50 and NA stay that text through an hf source, a csv file or a
  folder of them, as through `source: csv` (pandas would make them 7.0, 1.5 and null); an empty
  cell is null in each."""
  rows = [{"problem": f"Q{i}?", "solution": a, "level": lv} for i, (a, lv) in enumerate(
      (("007", "1"), ("1.50", "2.0"), ("3", ""), ("NA", "None"), ("", "x"), ("-0", "1e3")))]
  (tmp_path / "folder").mkdir()
  for path in (tmp_path / "d.csv", tmp_path / "folder" / "train.csv"):
    with path.open("w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=["problem", "solution", "level"])
      w.writeheader()
      w.writerows(rows)
  as_csv = sources.load_splits(DataConfig(source="csv", path=str(tmp_path / "d.csv"),
                                          num_eval=2, **FIELDS), log=lambda _: None)
  assert [r["answer"] for r in as_csv[0] + as_csv[1]] == ["007", "1.50", "3", "NA", None, "-0"]
  for path in (tmp_path / "d.csv", tmp_path / "folder"):
    assert sources.load_splits(DataConfig(source="hf", path=str(path), num_eval=2, **FIELDS),
                               log=lambda _: None) == as_csv, path


def test_bad_source_settings_fail_in_one_line():
  cases = (
      (dict(source="kaggle", path="alice", file="a.csv"), "config key 'data.path' = 'alice': "
       "expected a Kaggle dataset, OWNER/DATASET or OWNER/DATASET/versions/N"),
      (dict(source="kaggle", path="alice/sums", file="a.txt"), "config key 'data.file' = "
       "'a.txt': expected a .jsonl, .json, .parquet or .csv file in the Kaggle dataset"),
      (dict(source="hf"), "config key 'data.path' = None: expected a Hugging Face dataset id "
       "(OWNER/NAME) or a local folder or file when data.source is 'hf'"),
      (dict(source="csv"), "config key 'data.path' = None: expected a file path when "
       "data.source is 'csv'"),
      (dict(source="jsonl", path="d.jsonl", subset="main"), "config key 'data.subset' = "
       "'main': expected null unless data.source is 'hf'"),
      (dict(source="jsonl", path="d.jsonl", streaming=True), "config key 'data.streaming' = "
       "True: expected false unless data.source is 'hf' or 'gsm8k' or 'ifeval'"),
      (dict(source="hf", path="a/b", eval_path="t.jsonl"), "config key 'data.eval_path' = "
       "'t.jsonl': expected null unless the source is a file (jsonl, parquet, csv); hf holds "
       "out its eval_split or the last num_eval records"),
      (dict(source="jsonl", path="d.jsonl", response_template="<a>{0}</a>"), "config key "
       "'data.response_template' = '<a>{0}</a>': expected a template of record fields in "
       "braces, e.g. '<answer>{solution}</answer>' ({{ and }} for a brace): {0} is not a "
       "field name"),
  )
  for kw, line in cases:
    with pytest.raises(ConfigError, match=exactly(line)):
      DataConfig(**kw)
  with pytest.raises(ConfigError, match=exactly(
      "config key 'eval.sets[t].eval_split' = 'test': expected null: a set reads its `split`")):
    EvalSet(name="t", source="hf", path="a/b", eval_split="test")


def test_kaggle_downloads_with_credentials_and_never_shows_the_key(tmp_path, monkeypatch):
  """With credentials and the network, kagglehub.dataset_download fetches the file (here a
  stand-in at kagglehub's network boundary); its failure is one line without the key."""
  import kagglehub

  from reasoner import credentials

  secret = "kaggle-key-0123456789"
  monkeypatch.setenv("KAGGLE_USERNAME", "someone")
  monkeypatch.setenv("KAGGLE_KEY", secret)
  monkeypatch.setattr(credentials, "reachable", lambda host, port, timeout=3.0: True)
  local = tmp_path / "sums.csv"
  with local.open("w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["problem", "solution"])
    w.writeheader()
    w.writerows([{"problem": r["problem"], "solution": r["solution"]} for r in ROWS[:3]])
  calls = []
  monkeypatch.setattr(kagglehub, "dataset_download",
                      lambda handle, path=None: calls.append((handle, path)) or str(local))
  cfg = DataConfig(source="kaggle", path="alice/sums", file="sums.csv", num_eval=1,
                   question_field="problem", answer_field="solution")
  train, held = sources.load_splits(cfg, log=lambda _: None)
  assert calls == [("alice/sums", "sums.csv")]
  assert [r["answer"] for r in train + held] == ["0", "2", "4"]

  def refuse(handle, path=None):
    raise RuntimeError(f"404 Client Error: Not Found\nfor url https://x?key={secret}")

  monkeypatch.setattr(kagglehub, "dataset_download", refuse)
  with pytest.raises(DataError, match=exactly(
      "downloading 'sums.csv' of Kaggle dataset alice/sums failed: RuntimeError: 404 Client "
      "Error: Not Found for url https://x?key=***; are the dataset and the file right? "
      "(kaggle.com/datasets/alice/sums)")):
    sources.load_splits(cfg)
