"""A session's clock and its continuation: the deadline stops a run cleanly, another session
resumes from a read-only copy of its output, and the two end where one uninterrupted run ends."""

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT, tiny_config
from reasoner import loop
from reasoner.engine import session
from reasoner.config import ConfigError
from reasoner.config.loop import parse_deadline, process_start

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

TIMING = {"step_time_s", "tokens_per_s", "rollout_s", "rollout_tokens_per_s", "reward_s"}


def test_deadline_forms():
  t0 = 1_000.0
  assert parse_deadline("8h45m", t0) == t0 + 8 * 3600 + 45 * 60
  assert parse_deadline("90m", t0) == t0 + 5400
  assert parse_deadline("1.5h", t0) == t0 + 5400
  assert parse_deadline("600s", t0) == t0 + 600
  iso = "2026-11-25T08:30:00+00:00"
  assert parse_deadline(iso) == 1795595400.0
  assert abs(process_start() - time.time()) < 3600  # this process began recently
  with pytest.raises(ConfigError, match=r"config key 'train.deadline' = '9 hours': expected a "
                                        r"duration"):
    tiny_config("train.deadline=9 hours")
  assert tiny_config("train.deadline=2026-11-25T08:30:00").train.deadline == "2026-11-25T08:30:00"
  assert tiny_config("train.deadline=2026-11-25T08:30").train.deadline == "2026-11-25T08:30"


def test_clock_keeps_time_for_the_final_save_eval_and_export():
  clock = session.Clock(time.time() + 100, None)
  for what, s in (("load", 10), ("eval", 20), ("save", 5)):
    clock.measured(what, s)
  clock.measured("step", 300)  # the first step compiles: not the estimate once others exist
  clock.measured("step", 30)
  assert clock.times["step"] == 30 and clock.reserve(True) == 35
  assert not clock.stop_before_next_step(True)  # 30 + 35 < ~100
  clock.measured("step", 70)
  assert clock.stop_before_next_step(True)  # 70 + 35 > ~100
  clock.estimated("eval", 1)  # a timed evaluation wins over an estimate
  assert clock.reserve(True) == 35
  every = session.Clock(None, checkpoint_minutes=1 / 600)  # 0.1 s
  assert not every.save_due()
  time.sleep(0.15)
  assert every.save_due() and not session.Clock(None, None).save_due()


def _digest(folder):
  h = hashlib.sha256()
  for p in sorted(folder.rglob("*")):
    h.update(str(p.relative_to(folder)).encode())
    if p.is_file():
      h.update(p.read_bytes())
      h.update(str(p.stat().st_mtime_ns).encode())
  return h.hexdigest()


def _state(run):
  ckpt = run / "checkpoints"
  step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  return step, ocp.StandardCheckpointer().restore(ckpt / str(step) / "state")


def _train_rows(run):
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows if "reward/mean" in r]


def _stop_at(monkeypatch, step_to_stop):
  calls = iter(range(100))
  monkeypatch.setattr(session.Clock, "stop_before_next_step",
                      lambda self, eval_after: next(calls) >= step_to_stop)


def test_two_sessions_equal_one(tmp_path, monkeypatch):
  common = [f"train.run_dir={tmp_path}", "train.steps=4", "train.checkpoint_every=3",
            "train.eval_before=true", "train.deadline=8h45m"]
  full = loop.train(tiny_config(*common, "train.run_name=full"))
  assert "stopped" not in full

  with monkeypatch.context() as m:
    _stop_at(m, 2)
    first = loop.train(tiny_config(*common, "train.run_name=first"), command="the command")
  assert first["stopped"].startswith("stopped for the deadline at step 2 of 4 (saved in ")
  assert "continue with: the command" in first["stopped"]
  assert _state(tmp_path / "first")[0] == 2  # saved at the stop, though checkpoint_every is 3

  copy = tmp_path / "input" / "first"  # how Kaggle mounts the previous session's output
  shutil.copytree(tmp_path / "first", copy)
  before = _digest(copy)
  second = loop.train(tiny_config(*common, "train.run_name=second",
                                     f"train.resume_from={tmp_path / 'input'}"))
  assert "stopped" not in second and _digest(copy) == before  # nothing written there
  manifest = json.loads((tmp_path / "second" / "run.json").read_text())
  assert manifest["history"] == [{"step": 2, "changes": {}, "continued_from": str(copy)}]
  assert manifest["config"] == json.loads((copy / "run.json").read_text())["config"]

  (s_full, a), (s_two, b) = _state(tmp_path / "full"), _state(tmp_path / "second")
  assert s_full == s_two == 4
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _train_rows(tmp_path / "second") == _train_rows(tmp_path / "full")
  untimed = lambda r: {k: v for k, v in r.items() if k != "seconds"}
  assert untimed(second["before"]) == untimed(full["before"]) and second["after"] == full["after"]


def test_a_deadline_too_short_for_one_step(tmp_path, monkeypatch):
  _stop_at(monkeypatch, 0)
  with pytest.raises(ConfigError, match=r"config key 'train.deadline' = '8h': too short for one "
                                        r"step \(\d+h\d+m left; the final save, evaluation and "
                                        r"export alone take \d+m\d+s\)"):
    loop.train(tiny_config(f"train.run_dir={tmp_path}", "train.deadline=8h"))


def test_checkpoint_minutes_saves_between_step_checkpoints(tmp_path):
  loop.train(tiny_config(f"train.run_dir={tmp_path}", "train.steps=3",
                            "train.checkpoint_every=100", "train.keep_checkpoints=5",
                            "train.checkpoint_minutes=0.00001"))
  steps = sorted(int(p.name) for p in (tmp_path / "tiny" / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert steps == [1, 2, 3]


def cli(*args):
  return subprocess.run([sys.executable, "-m", "reasoner", "train", "--config",
                         str(ROOT / "configs/tiny.yaml"), *args], cwd=ROOT, capture_output=True,
                        text=True)


def one_line(p, code, pattern):
  assert p.returncode == code, p.stderr[-3000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1, p.stderr[-3000:]
  assert re.search(pattern, lines[0]), lines[0]


def test_bad_session_input_is_one_line_and_damages_nothing(tmp_path):
  one_line(cli(f"train.run_dir={tmp_path}", "train.deadline=2020-01-01T00:00"), 2,
           r"^error: config key 'train.deadline' = '2020-01-01T00:00': already past \(\d+h\d\dm ago\)$")
  empty = tmp_path / "empty"
  empty.mkdir()
  one_line(cli(f"train.run_dir={tmp_path}", f"train.resume_from={empty}"), 2,
           r"^error: config key 'train.resume_from' = '.*empty': no checkpoints in it")
  old = [f"train.run_dir={tmp_path}", "train.run_name=old", "train.steps=2"]
  assert cli(*old).returncode == 0
  before = _digest(tmp_path / "old" / "checkpoints")
  one_line(cli(f"train.run_dir={tmp_path}", "train.run_name=new", "lora.rank=8",
               f"train.resume_from={tmp_path / 'old'}"), 2,
           r"^error: config key 'lora.rank' = 8: the run in train.resume_from \(.*old\) was "
           r"trained with 4; set it back to use its weights$")
  for f in ("config.json", "run.json"):  # a bare copy: the stored shapes are checked, one line
    (tmp_path / "old" / f).unlink()
  p = cli(f"train.run_dir={tmp_path}", "train.run_name=new2", "lora.rank=8",
          f"train.resume_from={tmp_path / 'old'}")
  one_line(p, 2, r"^error: .*old/checkpoints/2 does not fit this run: lora/layers/0/attn/"
           r"attn_vec_einsum/w_lora_a/value is \(2, 32, 4\) float32 there and \(2, 32, 8\) "
           r"float32 here \(other model or LoRA settings\?\)$")
  assert _digest(tmp_path / "old" / "checkpoints") == before
  for new in ("new", "new2"):  # ... and neither refused run wrote a checkpoint
    assert not any((tmp_path / new / "checkpoints").glob("[0-9]*"))
