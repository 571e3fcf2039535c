"""Kill a training process, re-run the same command, and get the uninterrupted run's weights."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import ROOT, xla_flags

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

STEPS = 6


# Dynamic sampling draws a varying number of prompts a step (the parity reward makes some groups
# informative, some not): resume is exact only if the data state counts every one.
DYNAMIC = ("rewards=[{fn: 'parity_reward:parity'}]", "grpo.dynamic_sampling=true",
           "grpo.max_sample_batches=3")


def _cmd(run_dir, name, extra=()):
  return [sys.executable, "-m", "reasoner", "train", "--config", str(ROOT / "configs/tiny.yaml"),
          f"train.run_dir={run_dir}", f"train.run_name={name}", f"train.steps={STEPS}",
          "train.checkpoint_every=2", "train.keep_checkpoints=3", *extra]


def _env():
  return dict(os.environ, XLA_FLAGS=xla_flags(2),
              JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "tests"))


def _lora(run_dir, name, step):
  out = ocp.StandardCheckpointer().restore(run_dir / name / "checkpoints" / str(step) / "state")
  return out["lora"], out["opt_state"]


# A rollout drawn a step ahead on a chip of its own: a checkpoint keeps the LoRA it samples with
# and the data's state before it, and the resumed run draws it again.
AHEAD = ("rollout.devices=1", "grpo.sampler_is=token", *DYNAMIC)


# `make test` keeps the rollout ahead (dynamic sampling included: the most state a resume
# carries); the default resume is also tests/test_faults.py's SIGTERM case and the other two
# repeat this one with a setting changed: `make soak` runs them (pytest -m extended)
@pytest.mark.parametrize("extra", [pytest.param((), marks=pytest.mark.extended),
                                   pytest.param(DYNAMIC, marks=pytest.mark.extended),
                                   pytest.param(("mesh.weights=replicated",),
                                                marks=pytest.mark.extended), AHEAD],
                         ids=["default", "dynamic-sampling", "replicated-weights", "rollout-ahead"])
def test_killed_run_resumes_to_the_same_parameters(tmp_path, extra):
  subprocess.run(_cmd(tmp_path, "full", extra), env=_env(), cwd=ROOT, check=True,
                 capture_output=True)

  proc = subprocess.Popen(_cmd(tmp_path, "cut", extra), env=_env(), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = tmp_path / "cut" / "checkpoints"
  deadline = time.time() + 600
  while not (ckpt / "2").exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  assert proc.poll() is None, "the run finished before it could be interrupted"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert steps and steps[-1] < STEPS

  out = subprocess.run(_cmd(tmp_path, "cut", extra), env=_env(), cwd=ROOT, capture_output=True,
                       text=True, check=True)
  assert "resumed from" in out.stderr + out.stdout
  a, b = _lora(tmp_path, "full", STEPS), _lora(tmp_path, "cut", STEPS)
  import jax

  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert (tmp_path / "cut" / "eval.json").exists() and (tmp_path / "cut" / "reward.png").exists()
  if extra == AHEAD:
    assert (ckpt / str(STEPS) / "behind").is_dir()
  if extra in (DYNAMIC, AHEAD):  # the refills happened, and the resumed run drew the same prompts
    rows = lambda name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")
                         if "groups_drawn" in line]
    full, cut = rows("full"), rows("cut")
    assert [r["groups_drawn"] for r in full] == [r["groups_drawn"] for r in cut]
    assert sum(r["refill_rounds"] for r in full) > 0
    assert 0 < sum(r["groups_trained"] for r in full)
