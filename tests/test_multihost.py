"""JAX processes on this machine (2 x 4 and 4 x 2 CPU devices, one global mesh of 8): Kaggle load
and GRPO steps of the tiny config, checked against the same run in one process of 8 devices. The
whole loop (a decode layout, resume, export), a teacher and a judge across hosts are marked
`multihost`: `make multihost` runs them, `make test` leaves them out.

Each process runs `python -m reasoner`'s `loop.train` in full: restore from a tiny Kaggle-layout
checkpoint, rollout, train step, orbax checkpoint, held-out eval, metrics (process 0 only).
"""

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, xla_flags
from test_kaggle import TINY, write_download

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

TIMEOUT = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _spawn(args: list[str], devices: int, **env_extra: str) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(devices), **env_extra)
  return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _result(proc: subprocess.Popen) -> dict:
  out, _ = proc.communicate(timeout=TIMEOUT)
  return _result_of(proc, out)


def _two_and_one(tmp_path, ckpt, steps: str = "1", **env: str) -> tuple[dict, dict, dict]:
  """The run as 2 processes of 4 devices ("multi") and as 1 of 8 ("single"): their results."""
  port = str(_free_port())
  procs = [_spawn([port, str(i), "2", str(tmp_path), "multi", str(ckpt), steps], 4, **env)
           for i in range(2)]
  procs.append(_spawn(["0", "0", "1", str(tmp_path), "single", str(ckpt), steps], 8, **env))
  try:
    return tuple(_result(p) for p in procs)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.parametrize("layout", ["train", pytest.param("tp4", marks=pytest.mark.multihost)])
def test_two_processes_agree_with_one(tmp_path, layout):
  """2 processes x 4 devices against one of 8, decoding on the training layout or in tp4 (a tp
  group of each host's four devices)."""
  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  p0, p1, single = _two_and_one(tmp_path, ckpt, WORKER_OVERRIDES=json.dumps(
      [f"rollout.layout={layout}"]))
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


OWN_TEACHER = ["distill.teacher={source: random, name: tiny, tokenizer: bytes, tiny_layers: 1}",
               "distill.devices=4"]


def test_a_model_of_its_own_takes_its_devices_alike_from_every_host(monkeypatch):
  import types

  import jax

  from conftest import tiny_config
  from reasoner.build import split_devices
  from reasoner.config import ConfigError

  devices = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]  # 2 x 4
  cfg = tiny_config(*OWN_TEACHER)
  planned = split_devices(cfg, devices, teacher=True)  # one process: a topology's whole slices
  assert [d.id for d in planned.teacher] == [4, 5, 6, 7]
  monkeypatch.setattr(jax, "process_count", lambda: 2)  # two processes at run time
  split = split_devices(cfg, devices, teacher=True)
  assert [d.id for d in split.policy] == [0, 1, 4, 5]
  assert [d.id for d in split.teacher] == [2, 3, 6, 7] and split.judge is None
  one_host = split_devices(cfg, devices[:4] + [types.SimpleNamespace(id=i, process_index=0)
                                               for i in range(4, 8)], teacher=True)
  assert [d.id for d in one_host.teacher] == [4, 5, 6, 7]  # one host: the last four
  with pytest.raises(ConfigError, match=r"^config key 'distill.devices' = 3: this run spans 2 "
                                        r"hosts \(processes\), .* a multiple of 2$"):
    split_devices(tiny_config(*OWN_TEACHER, "distill.devices=3"), devices, teacher=True)


@pytest.mark.multihost
def test_a_teacher_across_two_hosts_distils_as_on_one(tmp_path):
  """Distillation with a teacher of its own on 4 of 8 devices: on 2 processes x 4 it takes 2
  devices of each host; the losses equal one process's, whose teacher has the last 4."""
  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  teacher = (f"distill.teacher={{source: kaggle, name: tiny, path: '{ckpt}', tokenizer: auto, "
             "layers: 1}")  # the first layer of the policy's checkpoint
  p0, p1, single = _two_and_one(tmp_path, ckpt, "2", WORKER_STAGE="distill",
                                WORKER_OVERRIDES=json.dumps([teacher, "distill.devices=4"]))
  assert p0["losses"] == p1["losses"] and len(p0["losses"]) == 2 and any(p0["losses"])
  assert p0["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
  assert p0["lora_norm"] == pytest.approx(single["lora_norm"], rel=1e-4)


@pytest.mark.multihost
def test_a_judge_across_two_hosts_scores_as_on_one(tmp_path):
  """A rubric judge of its own on 4 of 8 devices (2 of each of 2 hosts) grades the general
  records of data/mixed.jsonl: the losses and evaluation equal one process's."""
  from test_judge import MIXED, RUBRIC

  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  judge = f"judge.model={{source: kaggle, name: tiny, path: '{ckpt}', tokenizer: auto, layers: 1}}"
  p0, p1, single = _two_and_one(tmp_path, ckpt, "2", WORKER_OVERRIDES=json.dumps(
      [*MIXED, judge, "judge.devices=4", f"judge.rubric={json.dumps(RUBRIC)}"]))
  assert p0["losses"] == p1["losses"] and len(p0["losses"]) == 2
  assert p0["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
  graded = [[r["reward/judge"] for r in map(json.loads, (tmp_path / n / "metrics.jsonl").open())
             if "reward/judge" in r] for n in ("multi", "single")]
  assert len(graded[0]) == 2 and min(graded[0]) > 0  # the judge graded both steps' rows
  assert graded[0] == pytest.approx(graded[1], rel=1e-5)
  evals = [json.loads((tmp_path / n / "eval.json").read_text()) for n in ("multi", "single")]
  assert evals[0]["after"]["mean_reward"] > 0
  assert evals[0]["after"]["mean_reward"] == pytest.approx(evals[1]["after"]["mean_reward"])


WHOLE = ["rollout.layout=tp2", "mesh.weights=replicated", "train.checkpoint_every=1"]


@pytest.mark.multihost
def test_the_whole_loop_on_four_processes_agrees_with_one(tmp_path):
  """4 processes x 2 devices: train 2 steps decoding in a tp2 layout with the weights whole on
  every chip, a held-out evaluation, then a resumed third step, then an export (orbax and
  safetensors) written from every host: the same losses, evaluation and exported tensors as
  one process of 8 devices."""
  from safetensors.numpy import load_file

  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  port, env = str(_free_port()), {"WORKER_OVERRIDES": json.dumps(WHOLE),
                                  "WORKER_THEN": "resume,export"}
  procs = [_spawn([port, str(i), "4", str(tmp_path), "multi", str(ckpt), "2"], 2, **env)
           for i in range(4)]
  procs.append(_spawn(["0", "0", "1", str(tmp_path), "single", str(ckpt), "2"], 8, **env))
  try:
    *multi, single = (_result(p) for p in procs)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [m["process"] for m in multi] == [0, 1, 2, 3]
  assert all(m["local_devices"] == 2 and m["devices"] == 8 for m in multi)
  assert all(m["losses"] == multi[0]["losses"] for m in multi) and len(single["losses"]) == 3
  assert multi[0]["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)
  assert multi[0]["lora_norm"] == pytest.approx(single["lora_norm"], rel=1e-4)
  evals = [json.loads((tmp_path / n / "eval.json").read_text()) for n in ("multi", "single")]
  assert evals[0]["after"]["mean_reward"] == pytest.approx(evals[1]["after"]["mean_reward"])
  assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()
                if p.name.isdigit())[-1] == "3"
  a, b = (load_file(str(tmp_path / f"{n}_export" / "model.safetensors"))
          for n in ("multi", "single"))
  assert a.keys() == b.keys() and len(a) > 0
  for k in a:
    np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), rtol=1e-5,
                               atol=1e-6, err_msg=k)


@pytest.mark.multihost
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


LATE = """import time
import jax
calls = 0
def late(prompts, completions, **_):
    global calls
    calls += 1
    if jax.process_index() == 1 and calls >= 2:  # from step 2 on, on the second host only
        time.sleep(3600)
    return [0.5] * len(completions)
"""


@pytest.mark.multihost
@pytest.mark.parametrize("on_timeout", ["zero", "stop"])
def test_a_reward_late_on_one_process_acts_on_every_process(tmp_path, on_timeout):
  """A reward past its limit on one host only (a remote judge that stalls for one of them):
  every process zeroes its rows and counts them (`zero`), or every process stops at the same
  step with the line and the step before saved once (`stop`), instead of the others training
  on rewards the late one never saw, or waiting in the next collective forever."""
  ckpt = tmp_path / "download"
  write_download(ckpt, "gemma3", TINY, "gemma3-1b-it")
  (tmp_path / "late_reward.py").write_text(LATE)
  over = json.dumps([f"rewards=[{{fn: 'late_reward:late', timeout_s: 2, on_timeout: "
                     f"{on_timeout}}}, {{fn: format_partial}}]"])
  port = str(_free_port())
  procs = [_spawn([port, str(i), "2", str(tmp_path), "late", str(ckpt), "2"], 4,
                  PYTHONPATH=str(tmp_path), WORKER_OVERRIDES=over) for i in range(2)]
  try:
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  run = tmp_path / "late"
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  if on_timeout == "zero":
    results = [_result_of(p, out) for p, out in zip(procs, outs)]
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 2
    # process 0 (which writes the metrics) got its reward back, and counts the other's rows
    late = [(r["reward/late_reward:late"], r["reward/late_reward:late/timeouts"])
            for r in rows if "loss" in r]
    assert late == [(0.5, 0), (0.0, 8)]
    return
  assert [p.returncode for p in procs] == [2, 2], outs[0][-2000:] + outs[1][-2000:]
  lines = [[l for l in out.splitlines() if l.startswith("TIMEOUT ")] for out in outs]
  assert "did not return within 2 s on another process" in lines[0][0], lines
  assert "did not return within 2 s (rewards[0].timeout_s" in lines[1][0], lines
  assert all("at step 2: that step was not trained on; step 1 is saved" in l[0] for l in lines)
  assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
  assert [r["step"] for r in rows if "loss" in r] == [1]


def _result_of(proc: subprocess.Popen, out: str) -> dict:
  assert proc.returncode == 0, out[-3000:]
  lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert len(lines) == 1, out[-3000:]
  return json.loads(lines[0][len("RESULT "):])


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
  from reasoner.errors import RewardTimeout
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
      "model.source=kaggle", f"model.path={ckpt}", "model.tokenizer=auto",
      *json.loads(os.environ.get("WORKER_OVERRIDES", "[]"))])
  try:
    loop.train(cfg, stage=os.environ.get("WORKER_STAGE", "grpo"))
  except loop.Interrupted as e:
    print(f"STOPPED {loop_step(e)}", flush=True)
    sys.exit(e.code)
  except RewardTimeout as e:
    print(f"TIMEOUT {e}", flush=True)
    sys.exit(2)
  then = os.environ.get("WORKER_THEN", "")
  if "resume" in then:  # one more step, resumed from the last checkpoint
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=int(steps) + 1))
    loop.train(cfg, stage=os.environ.get("WORKER_STAGE", "grpo"))
  if "export" in then:
    from reasoner import export

    export.export(cfg, pathlib.Path(run_dir) / f"{name}_export", formats=("orbax",
                                                                          "safetensors"))
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
