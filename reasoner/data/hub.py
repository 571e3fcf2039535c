"""Rows from the Hugging Face Hub and from Kaggle datasets, as dicts that `sources` maps to
records by the configured fields, as it maps a file's.

hf: `path` is a dataset id, read by `datasets` (downloaded to its cache, or with `streaming`
only its first rows), or a local folder or file: a `save_to_disk` folder (a DatasetDict's splits,
or a Dataset as the split `train`), or parquet, json, jsonl or csv files, split by their names
as `datasets` splits a Hub repository's (train-*.jsonl, test.parquet; otherwise all `train`).
A single file is its split `train`, read by `files` as the file sources read it; a folder's
files stream, so nothing is written to the Hugging Face cache for them, and a folder of csv
files is read as text, as the csv source reads it (pandas would make an answer 007 the number
7.0). A `path` that exists on disk is read as a local one, before any Hub id of that name.

kaggle: `file` inside the dataset `path` (OWNER/DATASET[/versions/N]), fetched by
`kagglehub.dataset_download`. Without credentials or the network, the newest complete copy in
kagglehub's cache (KAGGLEHUB_CACHE, default ~/.cache/kagglehub) is read where it lies: the file
downloaded alone, or inside a whole download of the dataset.

Every failure is one DataError line naming what to do, and it comes in seconds: offline, the
Hub is never asked (datasets would retry for minutes).
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import logging
import os
import pathlib
import re
from urllib.parse import urlsplit

from reasoner import credentials
from reasoner.config.data import FILE_KINDS, KINDS
from reasoner.data import files
from reasoner.errors import DataError, first_line

log = logging.getLogger("reasoner")

_WAYS_OUT = (f"point {{key}} at a local folder or file (Dataset.save_to_disk, or {KINDS} "
             "files), or fill the Hugging Face cache online and set HF_DATASETS_OFFLINE=1")


def hf_rows(c, section: str, limits: dict[str, int | None],
            source: str = "hf") -> dict[str, list[dict]]:
  """{split: its rows, the first `limit` of them (None: all)} of dataset `c.path` (`c`: the
  source's config, `section` its key, `source` its name as configured: hf or gsm8k)."""
  local = pathlib.Path(c.path).expanduser()
  if local.exists():
    splits = _local(local, c, section)
  elif local.suffix.lower() in FILE_KINDS:  # a mistyped file name, not a Hub id
    where = "" if local.is_absolute() else f" (looked for {local.absolute()})"
    raise DataError(f"config key '{section}.path' = '{c.path}': no such file{where}")
  elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", c.path):
    splits = _hub(c, section, source)
  else:
    raise DataError(f"config key '{section}.path' = '{c.path}': no such folder or file, and not "
                    "a Hugging Face dataset id (OWNER/NAME)")
  for name in limits:
    if name not in splits:
      which = "split" if name == c.split else "eval_split"
      raise DataError(f"config key '{section}.{which}' = '{name}': {c.path} has no such split; "
                      f"it has {', '.join(splits)}")
  key = f"config key '{section}.path' = '{c.path}'"
  return {name: _take(splits[name], n, f"{key}, split '{name}'") for name, n in limits.items()}


def _take(split, n: int | None, where: str) -> list[dict]:
  """The first `n` rows of a split (all: None); a Dataset or an IterableDataset alike, so a
  stream stops after them."""
  try:
    return [dict(row) for row in itertools.islice(split, n)]
  except Exception as e:  # pyarrow and datasets raise many types for unreadable rows
    raise DataError(f"{where}: not readable ({first_line(e)})") from None


def _local(path: pathlib.Path, c, section: str):
  """The splits of a local save_to_disk folder, folder of data files, or data file."""
  import datasets

  if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
    return _saved(path, c, section)
  if path.is_file():
    if path.suffix not in FILE_KINDS:
      raise DataError(f"config key '{section}.path' = '{path}': not a {KINDS} file, nor a "
                      "folder")
    return {"train": files.file_rows(str(path), FILE_KINDS[path.suffix], f"{section}.path")}
  try:
    return datasets.load_dataset(str(path), c.subset, streaming=True, **_as_text(path))
  except FileNotFoundError:
    raise DataError(f"config key '{section}.path' = '{path}': neither a save_to_disk folder nor "
                    f"a folder of {KINDS} files") from None
  except ValueError as e:
    raise _subset_error(e, c, section) from None


def _saved(path: pathlib.Path, c, section: str):
  """The splits of a save_to_disk folder."""
  import datasets

  if c.subset is not None:
    raise DataError(f"config key '{section}.subset' = '{c.subset}': {path} is a save_to_disk "
                    "folder, which has no subsets; set it to null")
  try:
    saved = datasets.load_from_disk(str(path))
  except Exception as e:  # a partial copy: datasets raises JSON, arrow and file errors alike
    raise DataError(f"config key '{section}.path' = '{path}': a save_to_disk folder that "
                    f"cannot be read ({first_line(e)})") from None
  return {"train": saved} if isinstance(saved, datasets.Dataset) else saved


def _as_text(path: pathlib.Path) -> dict:
  """load_dataset's options for a folder of csv files alone: every column a string and only an
  empty cell null, as the csv source reads them (pandas would make 007 the number 7.0 and NA
  null). Only where all its csv files have one header: the columns must be named."""
  import datasets

  found = [p for p in path.rglob("*") if p.suffix in FILE_KINDS  # datasets skips .* and _*
           and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)]
  if not found or any(p.suffix != ".csv" for p in found):
    return {}
  headers = {files.csv_header(p) for p in found}
  if len(headers) != 1 or None in headers:
    return {}
  features = datasets.Features({k: datasets.Value("string") for k in headers.pop()})
  return {"features": features, "keep_default_na": False, "na_values": [""]}


def _hub(c, section: str, source: str):
  """The splits of a Hub dataset: downloaded (or from the cache offline), or streaming."""
  import datasets
  from datasets.exceptions import DatasetNotFoundError

  where = f"{section}.source '{source}' reads '{c.path}'"
  ways_out = _WAYS_OUT.format(key=f"{section}.path")
  with _offline_mode() as offline:
    if not offline and not _online():
      raise DataError(f"{where} from {_the_hub()}, which cannot be reached; {ways_out}")
    try:
      return datasets.load_dataset(c.path, c.subset, revision=c.revision, streaming=c.streaming)
    except DatasetNotFoundError as e:
      raise DataError(f"{where}, which huggingface.co does not have ({first_line(e)}; a gated or "
                      f"private one needs `hf auth login`); {ways_out}") from None
    except ConnectionError:
      why = ("with HF_DATASETS_OFFLINE=1, but it is not in the Hugging Face cache" if offline
             else f"from {_the_hub()}, which cannot be reached")
      raise DataError(f"{where} {why}; {ways_out}") from None
    except ValueError as e:
      raise _subset_error(e, c, section) from None


def _subset_error(e: ValueError, c, section: str) -> DataError:
  """datasets' complaint about a subset (its `name`), naming those there are."""
  text = str(e)
  names = re.search(r"(?:Available|available configs): (\[.*?\])", text)
  if names is None:
    return DataError(f"config key '{section}.path' = '{c.path}': {first_line(e)}")
  have = ", ".join(ast.literal_eval(names.group(1)))
  if c.subset is None:
    return DataError(f"config key '{section}.subset' = null: {c.path} has several subsets; "
                     f"name one of {have}")
  return DataError(f"config key '{section}.subset' = '{c.subset}': {c.path} has no such subset; "
                   f"it has {have}")


def _online(timeout: float = 3.0) -> bool:
  """Whether the Hub can be asked: not with HF_DATASETS_OFFLINE or HF_HUB_OFFLINE set; else
  whether the first hop of datasets' requests accepts a connection within `timeout` seconds:
  the proxy HTTPS_PROXY (https_proxy, ALL_PROXY) names unless NO_PROXY exempts the Hub, or the
  Hub itself, HF_ENDPOINT (default huggingface.co) as datasets read it."""
  import datasets.config

  if _offline_env():
    return False
  host, port = credentials.first_hop(datasets.config.HF_ENDPOINT)
  return bool(host) and credentials.reachable(host, port, timeout)


def _the_hub() -> str:
  """The Hub as datasets reaches it, for messages: huggingface.co (or HF_ENDPOINT's host), and
  the proxy in between."""
  import datasets.config

  endpoint = urlsplit(datasets.config.HF_ENDPOINT).hostname or datasets.config.HF_ENDPOINT
  proxy = credentials.proxy_for(datasets.config.HF_ENDPOINT)
  return endpoint if proxy is None else f"{endpoint} through the proxy {proxy[0]}:{proxy[1]}"


def _offline_env() -> bool:
  """Whether HF_DATASETS_OFFLINE (else HF_HUB_OFFLINE) is set now, or was when datasets was
  imported."""
  import datasets.config

  value = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", ""))
  return value.upper() in ("1", "ON", "YES", "TRUE") or datasets.config.HF_HUB_OFFLINE


@contextlib.contextmanager
def _offline_mode():
  """Whether HF_DATASETS_OFFLINE (else HF_HUB_OFFLINE) is set. datasets and huggingface_hub
  read them once, when imported: one set later (a notebook's os.environ) holds for this load."""
  import datasets.config
  from huggingface_hub import constants

  offline = _offline_env()
  saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
  if offline:
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
  try:
    yield offline
  finally:
    datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def kaggle_file(c, section: str) -> pathlib.Path:
  """The local copy of file `c.file` of Kaggle dataset `c.path`: downloaded by kagglehub, or
  without credentials or the network its newest complete copy in kagglehub's cache."""
  import kagglehub
  from kagglehub.handle import parse_dataset_handle

  h = parse_dataset_handle(c.path)
  creds = credentials.credential_source()
  host, port = credentials.api_host()
  if not (creds and credentials.reachable(host, port)) and not credentials.in_kaggle_notebook():
    cached = credentials.newest_cached(h, c.file)
    if cached is None:
      why = credentials.NO_CREDENTIALS if creds is None else (
          f"{host}:{port} cannot be reached (offline?)")
      raise DataError(f"{section}.source 'kaggle' downloads '{c.file}' of {c.path}, but {why}; "
                      f"or set {section}.source to jsonl, parquet or csv and {section}.path to "
                      "a local copy")
    # read where it lies: kagglehub would ask the network for a file of a whole download
    log.info("reading %s of %s/%s/versions/%d from kagglehub's cache (no network or no "
             "credentials)", c.file, h.owner, h.dataset, cached[0])
    return cached[1]
  try:
    return pathlib.Path(kagglehub.dataset_download(c.path, path=c.file))
  except Exception as e:  # kagglehub raises HTTP, auth and connection errors of many types
    text = credentials.scrub(" ".join(str(e).split()))[:300]
    page = "kaggle.com/datasets/" + "/".join(c.path.split("/")[:2])
    hint = f"; are the dataset and the file right? ({page})" if "404" in text else ""
    raise DataError(f"downloading '{c.file}' of Kaggle dataset {c.path} failed: "
                    f"{type(e).__name__}: {text}{hint}") from None
