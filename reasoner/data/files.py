"""Rows of local files, read alike wherever they are read: the data files of the jsonl,
parquet and csv sources (a Kaggle dataset's file and an hf source's local file too), and a
run's own JSONL logs (metrics.jsonl, samples.jsonl), which the metrics writer, the report and
the notebook read back. Every value of a csv file stays the text it is (an answer 007 stays
007); an empty cell is None. Each fault of a file is one DataError line naming the file and,
where there is one, the line.
"""

from __future__ import annotations

import csv
import io
import json
import pathlib

from reasoner.errors import DataError

_WHAT = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
          bool: "true or false", type(None): "null"}


def file_rows(path: str, kind: str, key: str) -> list[dict]:
  """The rows of a jsonl, json (a list, or an object a line), parquet or csv file (`kind`);
  `key` names its config key."""
  p = pathlib.Path(path)
  if p.is_dir():
    raise DataError(f"config key '{key}' = '{path}': a folder, not a {kind} file (source 'hf' "
                    "reads a folder of data files)")
  if not p.is_file():
    raise DataError(f"config key '{key}' = '{path}': the file does not exist")
  if kind == "parquet":
    return _parquet_rows(p)
  text = read_text(p)
  if kind == "csv":
    return csv_rows(text, str(p))
  if kind == "json" and text.lstrip().startswith("["):
    return _json_list(text, str(p))
  return jsonl_rows(text, str(p))


def read_jsonl(path: pathlib.Path, *, where: str | None = None,
               torn_tail_ok: bool = False) -> list[dict]:
  """The rows of a JSONL file (`where`: its name in messages, default the path). A run's own
  log passes `torn_tail_ok`: a kill mid-write leaves its last row cut short, which is dropped
  (that step is run again) where anywhere else a line not JSON is an error."""
  return jsonl_rows(read_text(path), where or str(path), torn_tail_ok)


def read_text(p: pathlib.Path) -> str:
  """A file's text, a leading byte-order mark dropped (Excel writes one); one line where it is
  not UTF-8."""
  raw = p.read_bytes()
  try:
    return raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise DataError(f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as "
                    "UTF-8") from None


def jsonl_rows(text: str, where: str, torn_tail_ok: bool = False) -> list[dict]:
  """The JSON objects of JSONL text, one a line, blank lines skipped (see `read_jsonl`). Lines
  split at \\n only: str.splitlines would split a string holding U+2028 as well."""
  lines = text.split("\n")
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  rows = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      value = json.loads(line)
    except json.JSONDecodeError as e:
      if torn_tail_ok and i == last:
        break
      raise DataError(f"{where}:{i + 1}: not valid JSON ({e.msg})") from None
    rows.append(_object(value, f"{where}:{i + 1}"))
  return rows


def _object(value, where: str) -> dict:
  """A row must be a JSON object (a dict); anything else is one line saying what it is."""
  if not isinstance(value, dict):
    raise DataError(f"{where}: not a JSON object but {_WHAT.get(type(value), 'a value')}; a "
                    'row is {"field": value, ...}')
  return value


def _json_list(text: str, where: str) -> list[dict]:
  try:
    rows = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{where}:{e.lineno}: not valid JSON ({e.msg})") from None
  return [_object(r, f"{where}: item {i}") for i, r in enumerate(rows)]


def _parquet_rows(p: pathlib.Path) -> list[dict]:
  import pyarrow.parquet as pq

  try:
    return pq.read_table(p).to_pylist()
  except Exception as e:  # pyarrow raises several types for unreadable files
    raise DataError(f"{p}: not a readable Parquet file ({e})") from None


def csv_rows(text: str, where: str) -> list[dict]:
  """A csv file's rows under its header: every value a string, an empty cell (or one a short
  row lacks) None. A row with more cells than the header is one line: csv.DictReader would
  drop the extra cells, most likely a value with an unquoted comma."""
  reader = csv.reader(io.StringIO(text, newline=""))
  try:
    header = next(reader, [])
    rows = []
    for cells in reader:
      if not cells:  # a blank line
        continue
      if len(cells) > len(header):
        raise DataError(f"{where}:{reader.line_num}: {len(cells)} cells, but the header has "
                        f"{len(header)} (a value with a comma needs double quotes)")
      rows.append({k: (cells[j] if j < len(cells) else None) or None
                   for j, k in enumerate(header)})
    return rows
  except csv.Error as e:
    raise DataError(f"{where}:{reader.line_num}: not valid CSV ({e})") from None


def csv_header(p: pathlib.Path) -> tuple[str, ...] | None:
  """A csv file's column names (None where its first line cannot be read: the full read says
  why)."""
  try:
    with p.open(newline="", encoding="utf-8-sig") as f:
      return tuple(next(csv.reader(f), []))
  except (OSError, UnicodeDecodeError, csv.Error):
    return None
