"""Faults a user meets, driven through the CLI: each gets one clear line, a defined exit code,
and loses no saved work."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT

STEPS = 40


def _cmd(run_dir, name, *extra):
  return [sys.executable, "-m", "reasoner", "train", "--config", str(ROOT / "configs/tiny.yaml"),
          f"train.run_dir={run_dir}", f"train.run_name={name}", f"train.steps={STEPS}",
          "train.checkpoint_every=1000", *extra]


def _env():
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
              JAX_PLATFORMS="cpu")


def _rows(run):
  p = run / "metrics.jsonl"
  return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def _signalled(run_dir, name, sig, times=1):
  """Starts a run, sends `sig` once it has logged two steps, returns (exit code, stderr)."""
  proc = subprocess.Popen(_cmd(run_dir, name), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 600
  while len(_rows(run_dir / name)) < 2 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before it could be signalled"
  for _ in range(times):
    proc.send_signal(sig)
    time.sleep(0.05)
  _, err = proc.communicate(timeout=600)
  return proc.returncode, err


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
