"""`train.loggers`: Weights & Biases beside TensorBoard, offline without credentials and never
printing a key; a missing wandb is one line and TensorBoard only. No model, no network."""

from __future__ import annotations

import json
import pathlib
import struct
import sys

import pytest

from reasoner.config import ConfigError, config_from_dict
from reasoner.engine.metrics import MetricsWriter
from reasoner.engine.wandb_log import WandbRun, run_id

KEY = "0123456789abcdef0123456789abcdef01234567"  # a made-up key, 40 characters as W&B's are
BLOCK = 32768  # the .wandb file's records, LevelDB log style: blocks of 32 KiB


@pytest.fixture
def quiet_env(tmp_path, monkeypatch):
  """No credentials, no netrc, no user's W&B settings: HOME is the test's own."""
  for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_DIR",
               "NETRC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  (tmp_path / "home").mkdir()
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "home" / "cache"))
  monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "home" / "data"))


def _run(run: pathlib.Path, loggers=("tensorboard", "wandb")) -> None:
  """A session of three steps as the loop logs them (a string among the numbers)."""
  w = MetricsWriter(run, enabled=True, loggers=loggers, config={"train": {"steps": 3}})
  w.start(0)
  for step in (1, 2, 3):
    w.log(step, {"loss": 1.0 / step, "reward/mean": 0.25 * step, "note": "text"})
  w.close()


def _history(path: pathlib.Path) -> dict[int, dict]:
  """{step: {key: value}} read back from an offline run's .wandb file (its records are
  length-prefixed protobufs, split over the blocks)."""
  from wandb.proto import wandb_internal_pb2 as pb

  data, pos, part, out = path.read_bytes(), 7, b"", {}
  assert data[:4] == b":W&B"
  while pos + 7 <= len(data):
    if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
      pos += BLOCK - pos % BLOCK
      continue
    _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
    part, pos = part + data[pos + 7:pos + 7 + size], pos + 7 + size
    if kind in (1, 4):  # a whole record, or its last piece
      record, part = pb.Record.FromString(part), b""
      if record.HasField("history"):
        items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
        out[record.history.step.num] = {k: json.loads(v) for k, v in items.items()
                                        if not k.startswith("_")}  # W&B's own: _step, _runtime
  return out


def _tensorboard(run: pathlib.Path) -> list[pathlib.Path]:
  return [p for p in (run / "tb").glob("events.out.tfevents.*") if p.stat().st_size]


def _rows(run: pathlib.Path) -> list[int]:
  return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_without_a_key_wandb_logs_offline_in_the_run_beside_tensorboard(
    tmp_path, quiet_env, capfd):
  pytest.importorskip("wandb")
  run = tmp_path / "runs" / "demo"
  _run(run)
  assert _rows(run) == [1, 2, 3] and _tensorboard(run)
  offline = list((run / "wandb").glob("offline-run-*"))
  assert len(offline) == 1 and offline[0].name.endswith(run_id(run))  # the folder's own id
  history = _history(offline[0] / f"run-{run_id(run)}.wandb")
  assert history == {s: {"loss": 1.0 / s, "reward/mean": 0.25 * s} for s in (1, 2, 3)}
  out, err = capfd.readouterr()
  assert out == "" and err.splitlines() == [
      f"train.loggers: W&B logs offline to {run / 'wandb'}; upload with: "
      f"wandb sync {run / 'wandb'}/offline-run-*"]
  assert run_id(run) == run_id(tmp_path / "runs" / ".." / "runs" / "demo") != run_id(tmp_path)


def test_a_users_wandb_mode_offline_wins_over_a_key_that_is_never_shown(
    tmp_path, quiet_env, monkeypatch, capfd):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_API_KEY", KEY)
  monkeypatch.setenv("WANDB_MODE", "offline")
  run = tmp_path / "keyed"
  _run(run)
  offline = list((run / "wandb").glob("offline-run-*"))
  assert len(offline) == 1 and _history(next(offline[0].glob("*.wandb")))[3]["loss"] == 1 / 3
  out, err = capfd.readouterr()
  assert "offline" in err and KEY not in out + err
  for p in run.rglob("*"):  # nor in the logs wandb leaves in the run folder
    assert not p.is_file() or KEY.encode() not in p.read_bytes(), p


def test_a_missing_wandb_is_one_line_and_tensorboard_still_logs(tmp_path, monkeypatch, capfd):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  run = tmp_path / "run"
  _run(run)
  out, err = capfd.readouterr()
  assert out == "" and err.splitlines() == [
      "train.loggers: wandb is not installed (pip install 'reasoner[wandb]'); logging to "
      "TensorBoard only"]
  assert _rows(run) == [1, 2, 3] and _tensorboard(run) and not (run / "wandb").exists()


def test_wandb_alone_falls_back_to_tensorboard(tmp_path, monkeypatch, capfd):
  monkeypatch.setitem(sys.modules, "wandb", None)
  _run(tmp_path / "run", loggers=("wandb",))
  assert _tensorboard(tmp_path / "run") and "TensorBoard only" in capfd.readouterr().err


def test_a_resumed_online_run_skips_the_steps_wandb_already_holds(capfd):
  """W&B refuses a step below its last; a resumed session repeats the steps after its
  checkpoint, which are skipped rather than refused; a failure stops W&B, not the run."""
  pytest.importorskip("wandb")

  class Run:  # a resumed online run whose history ends at step 4
    starting_step, logged, finished = 5, [], False

    def log(self, scalars, step):
      if step == 7:
        raise ConnectionError
      self.logged.append(step)

    def finish(self):
      Run.finished = True

  w = WandbRun(Run())
  for step in (3, 4, 5, 5, 6, 4, 7, 8):
    w.log(step, {"loss": 1.0})
  assert Run.logged == [5, 5, 6] and Run.finished and w.run is None
  assert capfd.readouterr().err.splitlines() == [
      "train.loggers: wandb stopped logging (ConnectionError); the other logs go on"]


@pytest.mark.parametrize("loggers", [["tensorboard", "mlflow"], [], "wandb"])
def test_a_bad_logger_is_a_config_error_naming_train_loggers(loggers):
  with pytest.raises(ConfigError, match=r"config key 'train\.loggers'"):
    config_from_dict({"train": {"loggers": loggers}})
  assert config_from_dict({}).train.loggers == ("tensorboard",)
