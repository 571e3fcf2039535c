"""Faults a user meets, driven through the CLI: each gets one clear line, a defined exit code,
and loses no saved work."""

import errno
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT, xla_flags

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

STEPS = 40


def _cmd(run_dir, name, *extra):
  return [sys.executable, "-m", "reasoner", "train", "--config", str(ROOT / "configs/tiny.yaml"),
          f"train.run_dir={run_dir}", f"train.run_name={name}", f"train.steps={STEPS}",
          "train.checkpoint_every=1000", *extra]


def _env():
  return dict(os.environ, XLA_FLAGS=xla_flags(2),
              JAX_PLATFORMS="cpu")


def _rows(run):
  p = run / "metrics.jsonl"
  return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def _signalled(run_dir, name, sig, times=1):
  """Starts a run, sends `sig` once it has logged two steps, returns (exit code, stderr). A
  second signal goes once the first's "finishing the step in flight" line is read: sent on a
  clock, it could land after the tiny run had saved and left its handler."""
  proc = subprocess.Popen(_cmd(run_dir, name), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 600
  while len(_rows(run_dir / name)) < 2 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before it could be signalled"
  proc.send_signal(sig)
  seen = []
  if times == 2:
    for line in proc.stderr:  # stderr is piped: read past the first line, keep what was read
      seen.append(line)
      if "finishing the step in flight" in line:
        proc.send_signal(sig)
        break
  _, err = proc.communicate(timeout=600)
  return proc.returncode, "".join(seen) + err


def _state(run, step):
  return ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "state")


@pytest.mark.slow
def test_sigterm_saves_the_step_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
  code, err = _signalled(tmp_path, "cut", signal.SIGTERM)
  assert code == 143, err[-3000:]
  last = err.strip().splitlines()[-1]
  step = len([r for r in _rows(tmp_path / "cut") if "reward/mean" in r])
  assert last.startswith(f"SIGTERM: saved step {step} of {STEPS} in "), last
  assert "continue with: python -m reasoner train --config" in last
  assert step < STEPS and (tmp_path / "cut" / "checkpoints" / str(step)).is_dir()

  subprocess.run(_cmd(tmp_path, "cut"), env=_env(), cwd=ROOT, check=True, capture_output=True)
  subprocess.run(_cmd(tmp_path, "full"), env=_env(), cwd=ROOT, check=True, capture_output=True)
  a, b = _state(tmp_path / "full", STEPS), _state(tmp_path / "cut", STEPS)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  train_steps = [r["step"] for r in _rows(tmp_path / "cut") if "reward/mean" in r]
  assert train_steps == list(range(1, STEPS + 1))  # each step logged once


@pytest.mark.slow
def test_ctrl_c_saves_and_a_second_signal_exits_at_once(tmp_path):
  code, err = _signalled(tmp_path, "int", signal.SIGINT)
  step = len([r for r in _rows(tmp_path / "int") if "reward/mean" in r])
  assert code == 130 and err.strip().splitlines()[-1].startswith(
      f"SIGINT: saved step {step} of {STEPS} in "), err[-3000:]
  code, err = _signalled(tmp_path, "twice", signal.SIGTERM, times=2)
  assert code == 143 and err.strip().splitlines()[-1] == (
      "second SIGTERM: exiting without saving (the latest checkpoint is intact)"), err[-3000:]


def _run(run_dir, name, *extra, steps=None):
  cmd = _cmd(run_dir, name, *extra)
  if steps is not None:
    cmd = [c for c in cmd if not c.startswith("train.steps=")] + [f"train.steps={steps}"]
  return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)


def _errors(p):
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  return [l for l in p.stderr.splitlines() if l.startswith("error: ")]


def _tree_digest(folder):
  """Every file's bytes but the lock's, which names whichever process last held the run."""
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(tmp_path):
  every = ["train.checkpoint_every=1", "train.keep_checkpoints=3",
           "optim.min_lr_ratio=1"]  # a constant learning rate: 3 steps, then 5, equal 5 at once
  assert _run(tmp_path, "hit", *every, steps=3).returncode == 0
  state = tmp_path / "hit" / "checkpoints" / "3" / "state"
  data = sorted(state.glob("**/d/*"))
  for f in data:  # its data files emptied: a partial copy, a disk that failed mid-flush
    f.write_bytes(b"")
  p = _run(tmp_path, "hit", *every, steps=5)
  assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
  said = [l for l in p.stdout.splitlines() if "checkpoint" in l]
  assert said[0].startswith(f"checkpoint {tmp_path / 'hit' / 'checkpoints' / '3'} cannot be "
                            "read: "), said
  assert said[0].endswith(f"; moved to {tmp_path / 'hit' / 'checkpoints' / 'corrupt-3'}")
  assert said[1].startswith(f"resumed from {tmp_path / 'hit' / 'checkpoints' / '2'} (step 2")
  aside = tmp_path / "hit" / "checkpoints" / "corrupt-3"
  assert all((aside / "state" / f.relative_to(state)).is_file() for f in data)  # not deleted
  assert _run(tmp_path, "whole", *every, steps=5).returncode == 0
  for x, y in zip(jax.tree.leaves(_state(tmp_path / "whole", 5)),
                  jax.tree.leaves(_state(tmp_path / "hit", 5)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert [r["step"] for r in _rows(tmp_path / "hit") if "reward/mean" in r] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_resume_names_each_changed_setting_and_records_the_safe_ones(tmp_path):
  assert _run(tmp_path, "r", steps=2).returncode == 0
  run = tmp_path / "r"
  before = _tree_digest(run)
  p = _run(tmp_path, "r", "lora.rank=8", "lora.alpha=4", "rollout.num_generations=2", steps=3)
  assert p.returncode == 2
  assert _errors(p) == [
      f"error: config key '{k}' = {new}: run {run} was trained with {old}; set it back to "
      f"continue it (or to branch off its weights: train.run_name=<new> "
      f"train.resume_from={run}), or start afresh under a new train.run_name"
      for k, old, new in (("lora.rank", 4, 8), ("lora.alpha", 8.0, 4.0))], p.stderr[-2000:]
  assert _tree_digest(run) == before  # refused before anything was written

  p = _run(tmp_path, "r", "rollout.num_generations=2", steps=3)
  assert p.returncode == 0, p.stderr[-3000:]
  assert (f"settings changed at step 2 (recorded in {run / 'run.json'}): "
          "rollout.num_generations: 4 -> 2; train.steps: 2 -> 3") in p.stdout
  m = json.loads((run / "run.json").read_text())
  assert m["history"] == [{"step": 2, "changes": {"rollout.num_generations": [4, 2],
                                                  "train.steps": [2, 3]}}]
  assert m["lora"]["rank"] == 4 and m["data"]["records"] > 0 and m["versions"]["jax"]
  assert (run / "config.json").read_bytes() == before["config.json"]  # the first start's
  p = _run(tmp_path, "r", "rollout.num_generations=2", steps=3)  # nothing new: nothing said
  assert "settings changed" not in p.stdout
  assert len(json.loads((run / "run.json").read_text())["history"]) == 1


def _mount_small_disk(path, size):
  path.mkdir()
  try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)
  except (OSError, subprocess.CalledProcessError):
    return False
  return True


def _full_disk_line(step, folder, last):
  return re.compile(
      rf"error: cannot save checkpoint {step} in {re.escape(str(folder))}: no space left on its "
      rf"disk \(\d+(\.\d)? (bytes|KiB|MiB|GiB) free\); the last whole checkpoint is {last} "
      rf"\(re-running resumes from it\)")


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_last_whole_checkpoint(tmp_path, monkeypatch,
                                                                     capsys):
  disk = tmp_path / "disk"
  if _mount_small_disk(disk, "1200k"):  # a real full disk, where the platform allows it
    try:
      p = _run(disk, "f", "train.checkpoint_every=1", "train.keep_checkpoints=9", steps=9)
      folder = disk / "f" / "checkpoints"
      last = max(int(c.name) for c in folder.iterdir() if c.name.isdigit())
      assert p.returncode == 2 and last < 9, p.stderr[-3000:]
      # the disk fills in a checkpoint's save or in a log's row, whichever comes first: one
      # line either way
      row = re.compile(rf"error: cannot use {re.escape(str(disk / 'f'))}/(metrics\.jsonl|"
                       rf"samples\.jsonl|tb): no space left on its disk \(\d+(\.\d)? "
                       rf"(bytes|KiB) free\)")
      line = _errors(p)[0]
      assert (_full_disk_line(last + 1, folder, last).fullmatch(line) or row.fullmatch(line)), (
          p.stderr[-3000:])
      assert not list(folder.glob("*tmp*"))  # the partial save removed, the whole ones kept
    finally:
      subprocess.run(["umount", str(disk)], check=False)
  # Everywhere: a write error injected at the checkpoint writer, in this process.
  from reasoner import cli

  real = ocp.CheckpointManager.save
  writers = []

  def failing(self, step, *a, **k):
    if step == 2:  # a write still in flight lands after the failure and recreates the folder,
      # and its thread logs what it raised, as orbax's _SignalingThread does
      late = pathlib.Path(self.directory) / "2.orbax-checkpoint-tmp" / "state" / "d"
      writers.append(threading.Timer(0.3, lambda: (
          late.mkdir(parents=True), (late / "x").write_text("x"),
          logging.getLogger("absl").error("_SignalingThread.run() raised an exception"))))
      writers[-1].start()
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, step, *a, **k)

  monkeypatch.setattr(ocp.CheckpointManager, "save", failing)
  logged = logging.Handler(logging.ERROR)  # what reaches absl's handlers (stderr)
  logged.emit = lambda r: shown.append(r.getMessage())
  shown = []
  logging.getLogger("absl").addHandler(logged)
  capsys.readouterr()
  try:
    assert cli.main(["train", "--config", str(ROOT / "configs/tiny.yaml"),
                     f"train.run_dir={tmp_path}", "train.run_name=inj", "train.steps=3",
                     "train.checkpoint_every=1"]) == 2
  finally:
    logging.getLogger("absl").removeHandler(logged)
  folder = tmp_path / "inj" / "checkpoints"
  err = capsys.readouterr().err
  writers[0].join()
  assert _full_disk_line(2, folder, 1).fullmatch(err.strip().splitlines()[-1]), err[-3000:]
  assert not shown, shown
  assert sorted(c.name for c in folder.iterdir()) == ["1"]
  small = tmp_path / "small"  # an export onto a full disk leaves nothing behind
  if _mount_small_disk(small, "64k"):
    try:
      p = subprocess.run([sys.executable, "-m", "reasoner", "export", "--config",
                          str(ROOT / "configs/tiny.yaml"), f"train.run_dir={tmp_path}",
                          "train.run_name=inj", "--out", str(small / "model")], env=_env(),
                         cwd=ROOT, capture_output=True, text=True)
      assert p.returncode == 2 and re.fullmatch(
          rf"error: cannot export to {re.escape(str(small))}/model: no space left on its disk "
          rf"\(\d+\.\d KiB free\); nothing was left there", p.stderr.strip()), p.stderr[-3000:]
      assert not list(small.iterdir())
    finally:
      subprocess.run(["umount", str(small)], check=False)


def test_a_full_disk_under_tensorboard_names_its_folder_and_keeps_the_row(tmp_path):
  """Found by `make soak`: TensorBoard's flush on a full disk raised with no file name (a
  traceback, exit 1), and tensorboardX flushed again at exit and in its thread."""
  from reasoner.engine.metrics import MetricsWriter

  w = MetricsWriter(tmp_path, enabled=True)
  w.start(0)
  w.log(1, {"loss": 1.0})
  events = w._tb.file_writer.event_writer

  def full():
    raise OSError(errno.ENOSPC, "No space left on device")

  events._ev_writer.flush = full
  with pytest.raises(OSError) as e:
    w.log(2, {"loss": 2.0})
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "tb"))
  assert events._closed  # its exit hook and thread flush no more
  assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
          ] == [1, 2]
  w.close()


def test_an_unwritable_run_directory_is_one_line_before_anything_loads(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  p = subprocess.run([sys.executable, "-m", "reasoner", "train", "--config",
                      str(ROOT / "configs/tiny.yaml"), f"train.run_dir={blocker}"],
                     env=_env(), cwd=ROOT, capture_output=True, text=True)
  assert p.returncode == 2 and p.stderr.strip().splitlines() == [
      f"error: the run directory {blocker / 'tiny'} cannot be written: Not a directory"]


def test_debug_shows_the_traceback_that_is_otherwise_one_line(tmp_path):
  bad = [sys.executable, "-m", "reasoner", "train", "--config", str(ROOT / "configs/tiny.yaml"),
         f"train.run_dir={tmp_path}", "train.deadline=2020-01-01T00:00"]
  quiet = subprocess.run(bad, env=_env(), cwd=ROOT, capture_output=True, text=True)
  assert quiet.returncode == 2 and len(quiet.stderr.strip().splitlines()) == 1
  for how in (["--debug"], []):
    env = _env() if how else dict(_env(), REASONER_DEBUG="1")
    p = subprocess.run(bad[:3] + how + bad[3:], env=env, cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr
    assert "ConfigError: config key 'train.deadline'" in p.stderr.strip().splitlines()[-1]


def test_a_run_in_use_by_another_process_is_refused_in_one_line(tmp_path):
  run = tmp_path / "busy"
  run.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", (
      "import sys, time; sys.path.insert(0, %r); import pathlib\n"
      "from reasoner.engine import session\n"
      "session.claim(pathlib.Path(%r)); print('held', flush=True); time.sleep(120)")
      % (str(ROOT), str(run))], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    p = subprocess.run([sys.executable, "-m", "reasoner", "train", "--config",
                        str(ROOT / "configs/tiny.yaml"), f"train.run_dir={tmp_path}",
                        "train.run_name=busy"], env=_env(), cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: run {run} is in use by process {holder.pid} on {os.uname().nodename}; wait "
        "for it to end, or use another train.run_name"], p.stderr[-2000:]
    assert sorted(f.name for f in run.iterdir()) == [".lock"]  # nothing written
  finally:
    holder.kill()
    holder.wait()
  from reasoner.engine import session  # the kernel dropped the killed holder's lock

  session.claim(run)
  session.claim(run)  # again in the same process (a notebook cell run twice): a no-op
  session.release(run)
