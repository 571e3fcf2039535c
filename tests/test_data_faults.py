"""Bad data files and run logs: each fault is one line naming the config key or the file and
its line, never a traceback; a run's log whose last row a kill cut short still resumes. No
model loads here."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from reasoner.config import DataConfig
from reasoner.data import sources
from reasoner.engine.metrics import MetricsWriter, truncate_rows
from reasoner.errors import DataError

FIELDS = dict(question_field="problem", answer_field="solution")
ROWS = [{"problem": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(6)]


def exactly(line: str) -> str:
  assert "\n" not in line
  return "^" + re.escape(line) + "$"


def jsonl(rows: list) -> str:
  return "".join(json.dumps(r) + "\n" for r in rows)


def load(source: str, path, **kw):
  return sources.load_splits(DataConfig(source=source, path=str(path), num_eval=1,
                                        **{**FIELDS, **kw}), log=lambda _: None)


@pytest.fixture(autouse=True)
def quiet_cache(tmp_path, monkeypatch):
  """datasets' locks for local folders go under tmp_path, not the user's cache."""
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_a_torn_last_row_is_dropped_when_a_run_resumes(tmp_path):
  """A kill mid-write leaves half a row at the end of metrics.jsonl: resuming drops it with the
  rows past the step resumed at, and the writer's readers skip it; a bad row elsewhere is one
  line naming the file and the line."""
  rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
  path = tmp_path / "metrics.jsonl"
  path.write_text(jsonl(rows) + '{"step": 4, "lo')
  truncate_rows(path, 2)
  assert path.read_text() == jsonl(rows[:2])
  path.write_text(jsonl(rows) + '{"step": 4, "lo')
  truncate_rows(path, 10)
  assert path.read_text() == jsonl(rows)
  path.write_text(jsonl(rows)[:-1])  # cut just before its last newline: the next row joins it
  truncate_rows(path, 10)
  assert path.read_text() == jsonl(rows)
  samples = [{"step": 1, "tag": "eval-before", "question": "q"}]
  (tmp_path / "samples.jsonl").write_text(jsonl(samples) + '{"step": 2, "tag": "ev')
  w = MetricsWriter(tmp_path, enabled=True, loggers=())
  assert w.rows("eval-before") == samples
  path.write_text(jsonl(rows) + '{"step": 4, "lo')
  assert w.plot() == tmp_path / "reward.png"
  path.write_text(jsonl(rows[:1]) + '{"step": 2, "lo\n' + jsonl(rows[2:]))
  with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not valid JSON \(.+\)$"):
    truncate_rows(path, 2)


def test_a_row_that_is_not_an_object_is_one_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(jsonl(ROWS[:2]) + '"hello"\n' + jsonl(ROWS[2:]))
  with pytest.raises(DataError, match=exactly(
      f'{path}:3: not a JSON object but a string; a row is {{"field": value, ...}}')):
    load("jsonl", path)
  listed = tmp_path / "d.json"
  listed.write_text(json.dumps([ROWS[0], 7]))
  with pytest.raises(DataError, match=exactly(
      f'{listed}: item 1: not a JSON object but a number; a row is {{"field": value, ...}}')):
    load("hf", listed)


def test_a_file_not_in_utf8_is_one_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_bytes(jsonl(ROWS[:2]).encode() + '{"problem": "café?"}\n'.encode("latin-1"))
  with pytest.raises(DataError, match=exactly(
      f"{path}:3: not UTF-8 text (byte 0xe9); save the file as UTF-8")):
    load("jsonl", path)
  table = tmp_path / "d.csv"
  table.write_bytes("problem,solution\ncafé?,1\n".encode("latin-1"))
  with pytest.raises(DataError, match=exactly(
      f"{table}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8")):
    load("csv", table)


def test_a_csv_row_with_more_cells_than_its_header_is_one_line(tmp_path):
  path = tmp_path / "d.csv"
  path.write_text('problem,solution\n"What is 1, 2?",3\nWhat is 2, 3?,5\n')
  with pytest.raises(DataError, match=exactly(
      f"{path}:3: 3 cells, but the header has 2 (a value with a comma needs double quotes)")):
    load("csv", path)


def test_a_broken_save_to_disk_folder_is_one_line(tmp_path):
  saved = tmp_path / "saved"
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
  (saved / "dataset_dict.json").write_text('{"splits": ["train", "te')  # a partial copy
  with pytest.raises(DataError, match=rf"^config key 'data.path' = '{re.escape(str(saved))}': "
                     r"a save_to_disk folder that cannot be read \(.+\)$"):
    load("hf", saved)


def test_an_empty_or_null_question_is_dropped_and_counted(tmp_path):
  """str(None) would train on the question 'None'."""
  path = tmp_path / "d.jsonl"
  path.write_text(jsonl(ROWS + [{"problem": None, "solution": "1"}, {"problem": " ",
                                "solution": "2"}, {"solution": "3"}]))
  said = []
  train, held = sources.load_splits(DataConfig(source="jsonl", path=str(path), num_eval=1,
                                               **FIELDS), log=said.append)
  assert [r["question"] for r in train + held] == [r["problem"] for r in ROWS]
  assert said == [f"data: jsonl {path}: 9 read, 3 dropped (3 missing field 'problem'); "
                  "5 training, 1 held out"]


def test_a_wrong_path_says_what_is_wrong_with_it(tmp_path, monkeypatch):
  """A mistyped file name is no Hub id; a folder is not a file; a folder given to a file
  source says so."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(DataError, match=exactly(
      f"config key 'data.path' = 'data/nosuch.jsonl': no such file (looked for "
      f"{tmp_path / 'data' / 'nosuch.jsonl'})")):
    load("hf", "data/nosuch.jsonl")
  (tmp_path / "folder.csv").mkdir()
  with pytest.raises(DataError, match=exactly(
      "config key 'data.path' = 'folder.csv': a folder, not a csv file (source 'hf' reads a "
      "folder of data files)")):
    load("csv", "folder.csv")
