"""Two JAX processes on this machine (4 CPU devices each, one global mesh of 8): Kaggle load and
one GRPO step of the tiny config, checked against the same run in one process of 8 devices.

Each process runs `python -m reasoner`'s `loop.train` in full: restore from a tiny Kaggle-layout
checkpoint, rollout, train step, orbax checkpoint, held-out eval, metrics (process 0 only).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from test_kaggle import TINY, write_download

TIMEOUT = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _spawn(args: list[str], devices: int) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _result(proc: subprocess.Popen) -> dict:
  out, _ = proc.communicate(timeout=TIMEOUT)
  assert proc.returncode == 0, out[-3000:]
  lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert len(lines) == 1, out[-3000:]
  return json.loads(lines[0][len("RESULT "):])


def test_two_processes_agree_with_one(tmp_path):
  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  port = str(_free_port())
  procs = [_spawn([port, str(i), "2", str(tmp_path), "multi", str(ckpt)], 4) for i in range(2)]
  procs.append(_spawn(["0", "0", "1", str(tmp_path), "single", str(ckpt)], 8))
  try:
    p0, p1, single = (_result(p) for p in procs)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert (p0["process"], p1["process"]) == (0, 1)
  assert p0["devices"] == p1["devices"] == single["devices"] == 8
  assert p0["local_devices"] == p1["local_devices"] == 4
  assert len(p0["losses"]) == 1 and p0["losses"] == p1["losses"]
  assert p0["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
  assert p0["lora_norm"] == pytest.approx(single["lora_norm"], rel=1e-4)
  rows = [json.loads(l) for l in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1]  # written once: process 0 only
  assert (tmp_path / "multi" / "checkpoints" / "1" / "state").is_dir()
  assert (tmp_path / "multi" / "eval.json").exists()


@pytest.mark.slow
def test_a_signal_to_one_process_saves_the_same_step_on_every_process(tmp_path):
  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  port = str(_free_port())
  procs = [_spawn([port, str(i), "2", str(tmp_path), "sig", str(ckpt), "500"], 4)
           for i in range(2)]
  metrics = tmp_path / "sig" / "metrics.jsonl"
  try:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and all(p.poll() is None for p in procs) and (
        not metrics.exists() or metrics.read_text().count('"loss"') < 2):
      time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)  # one host only, as a TPU VM's hosts may be
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [143, 143], outs[0][-2000:] + outs[1][-2000:]
  stops = [[l for l in out.splitlines() if l.startswith("STOPPED ")] for out in outs]
  assert stops[0] == stops[1] and len(stops[0]) == 1, stops
  step = int(stops[0][0].split()[1])
  assert 2 <= step < 500 and (tmp_path / "sig" / "checkpoints" / str(step) / "state").is_dir()
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, step + 1))


def _worker(port: str, pid: str, nproc: str, run_dir: str, name: str, ckpt: str,
            steps: str = "1") -> None:
  """One process of the run: `train` with the loss of every step recorded; a signal's stop
  printed as `STOPPED <step>` and its exit code."""
  import jax

  if int(nproc) > 1:  # cross-process collectives on CPU: gloo (jax's default)
    jax.distributed.initialize(f"localhost:{port}", num_processes=int(nproc),
                               process_id=int(pid))
  import numpy as np
  from jax.experimental import multihost_utils

  from reasoner import loop
  from reasoner.config import load_config
  from reasoner.objectives.grpo import GRPOTrainer as Trainer

  losses, states = [], []
  step = Trainer.train_step

  def recording(self, state, batch):
    state, metrics = step(self, state, batch)
    losses.append(float(metrics["loss"]))
    states.append(state)
    return state, metrics

  Trainer.train_step = recording
  cfg = load_config(ROOT / "configs" / "tiny.yaml", [
      f"train.run_dir={run_dir}", f"train.run_name={name}", f"train.steps={steps}",
      f"train.checkpoint_every={steps}", f"train.eval_before={steps == '1'}",
      "model.source=kaggle", f"model.path={ckpt}", "model.tokenizer=auto"])
  try:
    loop.train(cfg)
  except loop.Interrupted as e:
    print(f"STOPPED {loop_step(e)}", flush=True)
    sys.exit(e.code)
  lora = multihost_utils.process_allgather(states[-1].lora, tiled=True)
  norm = float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(lora))))
  print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                                "local_devices": jax.local_device_count(), "losses": losses,
                                "lora_norm": norm}), flush=True)


def loop_step(e) -> int:
  """The saved step, from the line an interrupted run prints ('SIGTERM: saved step N of M')."""
  return int(str(e).split("saved step ")[1].split()[0])


if __name__ == "__main__":
  _worker(*sys.argv[1:])
