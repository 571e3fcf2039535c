"""Bad inputs as a new user makes them: one clear error line, checkpoints on disk untouched."""

import hashlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT, xla_flags


def run(*args, cwd=ROOT):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "tests"))
  return subprocess.run([sys.executable, "-m", "reasoner", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=900)


def one_error_line(p, pattern):
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [l for l in p.stderr.splitlines() if l.strip() and "Warning" not in l
           and not l.startswith(("  ", "WARNING"))]
  errors = [l for l in lines if l.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert pattern in errors[0], errors[0]


def test_missing_config_file():
  one_error_line(run("train", "--config", "configs/nope.yaml"),
                 "config file 'configs/nope.yaml' does not exist")


def test_typo_key():
  one_error_line(run("train", "--config", "configs/tiny.yaml", "train.stepz=3"),
                 "unknown config key 'train.stepz'")


def test_missing_dataset_path():
  one_error_line(run("train", "--config", "configs/tiny.yaml", "data.source=jsonl",
                     "data.path=no/such.jsonl"),
                 "'data.path' = 'no/such.jsonl': the file does not exist")


def _digest(folder):
  h = hashlib.sha256()
  for p in sorted(folder.rglob("*")):
    if p.is_file():
      h.update(str(p.relative_to(folder)).encode())
      h.update(p.read_bytes())
  return h.hexdigest()


@pytest.mark.slow
def test_reward_that_raises_leaves_checkpoints_intact(tmp_path):
  (tmp_path / "bad_reward.py").write_text(
      "def explode(prompts, completions, **kw):\n    raise ValueError('bad reward')\n")
  base = ["--config", "configs/tiny.yaml", f"train.run_dir={tmp_path}", "train.run_name=r",
          "train.steps=2", "train.checkpoint_every=2"]
  assert run("train", *base).returncode == 0
  ckpt = tmp_path / "r" / "checkpoints"
  before = _digest(ckpt)
  env_path = "rewards=[{fn: bad_reward:explode}]"
  p = subprocess.run([sys.executable, "-m", "reasoner", "train", *base, "train.steps=4",
                      env_path], cwd=ROOT, capture_output=True, text=True, timeout=900,
                     env=dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu",
                              XLA_FLAGS=xla_flags(1)))
  one_error_line(p, "reward function 'bad_reward:explode' raised ValueError: bad reward")
  assert _digest(ckpt) == before
