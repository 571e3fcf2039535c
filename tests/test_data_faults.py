"""Bad data files and run logs: each fault is one line naming the config key or the file and
its line, never a traceback; a run's log whose last row a kill cut short still resumes. No
model loads here."""

from __future__ import annotations

import json
import re
import socket

import datasets
import pytest

from conftest import PROXIES
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
  (tmp_path / "notes.txt").write_text("What is 1 + 1?\n")
  with pytest.raises(DataError, match=exactly(  # the kinds named from config.data.FILE_KINDS
      "config key 'data.path' = 'notes.txt': not a jsonl, json, parquet or csv file, nor a "
      "folder")):
    load("hf", "notes.txt")


OFFLINE = (*PROXIES, "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def test_the_hubs_probe_goes_where_datasets_would(monkeypatch):
  """hub._online connects where datasets' requests would first: the proxy that HTTPS_PROXY
  (https_proxy, ALL_PROXY) names unless NO_PROXY exempts the Hub, else the Hub (HF_ENDPOINT,
  as datasets read it); with HF_DATASETS_OFFLINE=1 or HF_HUB_OFFLINE=1 it asks nothing. Here a
  local listening socket stands for whichever answers, a closed port for one that does not."""
  from reasoner.data import hub

  for k in OFFLINE:
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  with socket.create_server(("127.0.0.1", 0)) as closed:
    dead = closed.getsockname()[1]
  with socket.create_server(("127.0.0.1", 0)) as listening:
    live = listening.getsockname()[1]
    online = lambda: hub._online(timeout=2)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"https://127.0.0.1:{live}")
    assert online()  # a mirror that answers
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"https://127.0.0.1:{dead}")
    assert not online()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{live}")
    assert online()  # the Hub is asked through the proxy, not directly
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"https://127.0.0.1:{live}")
    monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{dead}")  # host:port alone: http://
    assert not online()
    assert hub._the_hub() == f"127.0.0.1 through the proxy 127.0.0.1:{dead}"
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")  # the Hub exempt: asked directly
    assert online()
    for k in ("HTTPS_PROXY", "NO_PROXY"):
      monkeypatch.delenv(k)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"https://127.0.0.1:{dead}")
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{live}")
    assert online()
    monkeypatch.delenv("https_proxy")
    monkeypatch.setenv("ALL_PROXY", f"socks5://127.0.0.1:{live}")
    assert online()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything answers, and nothing is asked
    assert not online()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert not online()
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("ALL_PROXY", f"socks5://127.0.0.1:{dead}")
    with pytest.raises(DataError, match=exactly(
        f"data.source 'hf' reads 'nobody/sums' from 127.0.0.1 through the proxy "
        f"127.0.0.1:{dead}, which cannot be reached; point data.path at a local folder or file "
        "(Dataset.save_to_disk, or jsonl, json, parquet or csv files), or fill the Hugging "
        "Face cache online and set HF_DATASETS_OFFLINE=1")):
      load("hf", "nobody/sums")
