"""The hand-in: an install that fits the machine (`reasoner.install`, read from a fake environ
and a fake root) and `export --upload`, stopped at kagglehub's network boundary
(`kagglehub.model_upload` replaced) on an export folder made by hand."""

from __future__ import annotations

import json

import pytest

from reasoner import credentials, install
from reasoner.errors import UserError

HANDLE = "someone/gemma3-1b-grpo/flax/gemma3-1b-it"


# ------------------------------------------------------------------------------ the install

def _root(tmp_path, *files, pci=None):
  for f in files:
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).touch()
  for slot, (vendor, device) in (pci or {}).items():
    d = tmp_path / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  return tmp_path


def test_no_tpu_on_a_plain_machine(tmp_path):
  root = _root(tmp_path, "dev/null", "dev/vfio/vfio", pci={"0000:00:01.0": ("0x8086", "0x1237")})
  assert install.tpu_signs({"PATH": "/usr/bin", "KAGGLE_KERNEL_RUN_TYPE": "Interactive"},
                           root) == []


def test_a_tpu_is_found_by_its_variables_device_files_and_pci_devices(tmp_path):
  kaggle = {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "ISTPUVM": "1", "PJRT_DEVICE": "TPU"}
  assert install.tpu_signs(kaggle, tmp_path) == [
      "TPU_ACCELERATOR_TYPE=v5litepod-8", "ISTPUVM=1", "PJRT_DEVICE=TPU"]
  assert install.tpu_signs({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, tmp_path)
  root = _root(tmp_path / "a", "dev/accel0", "dev/accel1")
  assert install.tpu_signs({}, root) == ["/dev/accel0", "/dev/accel1"]
  root = _root(tmp_path / "v", "dev/vfio/vfio", "dev/vfio/0")
  assert install.tpu_signs({}, root) == ["/dev/vfio/0"]
  root = _root(tmp_path / "p", pci={"0000:00:04.0": ("0x1ae0", "0x0063")})
  assert install.tpu_signs({}, root) == ["TPU v5e PCI device 0000:00:04.0"]


def test_the_tpu_extra_is_installed_only_where_a_tpu_is(tmp_path):
  assert install.pip_command("/kaggle/input/reasoner", True, "py") == [
      "py", "-m", "pip", "install", "-q", "/kaggle/input/reasoner[tpu]"]
  assert install.pip_command("/kaggle/input/reasoner", False, "py")[-1] == "/kaggle/input/reasoner"
  assert install.requirement("git+https://github.com/x/reasoner", True) == (
      "reasoner[tpu] @ git+https://github.com/x/reasoner")
  ran = []
  install.subprocess.run, real = (lambda cmd, check: ran.append(cmd)), install.subprocess.run
  try:
    install.install("/src", {"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, tmp_path, log=ran.append)
    install.install("/src", {}, tmp_path, log=ran.append)
  finally:
    install.subprocess.run = real
  assert ran[0] == "installing /src[tpu] (TPU: TPU_ACCELERATOR_TYPE=v5litepod-8)"
  assert ran[1][-1] == "/src[tpu]" and ran[3][-1] == "/src"


def test_the_pin_comes_from_the_installed_extra():
  assert install.tpu_pin(["numpy>=2", 'jax[tpu]==0.10.2; extra == "tpu"']) == "jax[tpu]==0.10.2"
  assert install.tpu_pin(None) == install.TPU_PIN


def test_the_versions_and_devices_are_printed():
  found = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.30", "platform": "tpu",
           "devices": ["TPU v5 lite"] * 8}
  assert install.report_lines(found, ["ISTPUVM=1"]) == [
      "jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.30", "JAX sees 8 tpu device(s): 8 x TPU v5 lite"]
  cpu = {"jax": "0.10.2", "jaxlib": "0.10.2", "platform": "cpu", "devices": ["cpu"]}
  assert install.report_lines(cpu, []) == [
      "jax 0.10.2, jaxlib 0.10.2, libtpu not installed", "JAX sees 1 cpu device(s): 1 x cpu"]


def test_a_tpu_that_jax_did_not_come_up_on_is_one_line_with_the_fix():
  found = {"jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.23", "platform": "cpu",
           "devices": ["cpu"]}
  lines = install.report_lines(found, ["TPU_ACCELERATOR_TYPE=v5litepod-8"], "jax[tpu]==0.10.2")
  assert len(lines) == 3
  assert lines[2] == (
      "this machine has a TPU (TPU_ACCELERATOR_TYPE=v5litepod-8) but JAX came up on cpu (jax "
      "0.7.2, jaxlib 0.7.2, libtpu 0.0.23 do not match it): run python -m pip install -q "
      "'jax[tpu]==0.10.2' and restart the kernel (or the process) before anything loads")
  broken = install.report_lines({"error": "libtpu.so: cannot open"}, ["/dev/accel0"])
  assert broken[1] == "JAX did not start: libtpu.so: cannot open"
  assert "JAX came up on nothing" in broken[2]


def test_the_probe_answers_from_a_child_process(monkeypatch):
  class Done:
    stdout, stderr = 'noise\nPROBE{"jax": "1", "platform": "cpu", "devices": ["cpu"]}\n', ""
  monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: Done())
  assert install.probe()["platform"] == "cpu"


# ------------------------------------------------------------------------------ the upload

@pytest.fixture
def export_lib():
  return pytest.importorskip("reasoner.export")


@pytest.fixture
def folder(tmp_path):
  """An export as `export.export` writes it, by hand, with its run's eval.json."""
  run = tmp_path / "runs" / "r"
  run.mkdir(parents=True)
  (run / "eval.json").write_text(json.dumps({
      "before": {"accuracy": 0.25, "format_rate": 0.5, "mean_reward": 0.3, "n": 40,
                 "mean_reward/math": 0.2, "mean_reward/writing": 0.4},
      "after": {"accuracy": 0.5, "format_rate": 0.75, "mean_reward": 0.6, "n": 40,
                "mean_reward/math": 0.55, "mean_reward/writing": 0.65, "win_rate": 0.7}}))
  out = tmp_path / "model"
  (out / "gemma3-1b-it").mkdir(parents=True)
  (out / "gemma3-1b-it" / "_METADATA").write_text("{}")
  (out / "tokenizer.model").write_bytes(b"sp")
  (out / "export.json").write_text(json.dumps({
      "model": "gemma3-1b-it", "step": 200, "run": str(run), "lora": {"rank": 64, "alpha": 64}}))
  return out


@pytest.fixture
def online(monkeypatch):
  monkeypatch.setattr(credentials, "credential_source", lambda: "KAGGLE_USERNAME/KAGGLE_KEY")
  monkeypatch.setattr(credentials, "reachable", lambda host, port, timeout=3.0: True)


def _cfg(steps=200):
  return type("Cfg", (), {"train": type("T", (), {"steps": steps})(), "run_path": None})()


def _snapshot(out):
  return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
          if p.is_file()}


def test_the_handle_is_checked_in_one_line(export_lib):
  assert export_lib.check_handle(HANDLE) == HANDLE
  for bad, says in (("me/model/flax", "got 3"), (HANDLE + "/2", "a version is given by Kaggle"),
                    ("me//flax/v", "its MODEL is empty"), ("me/m o/flax/v", "its MODEL 'm o'"),
                    ("me/m/tensorflow9/v", "its FRAMEWORK 'tensorflow9'")):
    with pytest.raises(export_lib.UploadError, match=says) as e:
      export_lib.check_handle(bad)
    assert "\n" not in str(e.value) and isinstance(e.value, UserError)


def test_the_notes_come_from_the_run(folder, export_lib):
  info = json.loads((folder / "export.json").read_text())
  results = json.loads((folder.parent / "runs/r/eval.json").read_text())
  notes = export_lib.version_notes("configs/gemma3_1b.yaml", info, results, 200)
  assert notes.splitlines() == [
      "gemma3-1b-it with LoRA (rank 64) merged in, trained by reasoner with "
      "configs/gemma3_1b.yaml: step 200 of 200.",
      "Held-out (40 records, before -> after training): accuracy 0.250 -> 0.500, format rate "
      "0.500 -> 0.750, mean reward 0.300 -> 0.600, judge win rate 0.700.",
      "Mean reward by category: math 0.200 -> 0.550, writing 0.400 -> 0.650."]
  assert "No held-out evaluation" in export_lib.version_notes("c.yaml", info, {})


def test_upload_hands_kagglehub_the_folder_the_handle_and_the_notes(folder, export_lib, online,
                                                                    monkeypatch):
  import kagglehub

  seen = {}

  def model_upload(handle, local_model_dir, license_name=None, version_notes=""):
    seen.update(handle=handle, files=_snapshot(__import__("pathlib").Path(local_model_dir)),
                license=license_name, notes=version_notes)

  monkeypatch.setattr(kagglehub, "model_upload", model_upload)
  before, lines = _snapshot(folder), []
  assert export_lib.upload_run(_cfg(), folder, HANDLE, "configs/gemma3_1b.yaml",
                               log=lines.append) == HANDLE
  assert seen["handle"] == HANDLE and seen["files"] == before
  assert set(before) == {"gemma3-1b-it/_METADATA", "tokenizer.model", "export.json"}
  assert seen["license"] == export_lib.LICENSE
  assert "step 200 of 200" in seen["notes"] and "math 0.200 -> 0.550" in seen["notes"]
  assert lines[-1].startswith(f"uploaded: Kaggle model {HANDLE}")


def test_a_failed_upload_is_one_line_and_keeps_the_export(folder, export_lib, online,
                                                          monkeypatch):
  import kagglehub

  monkeypatch.setenv("KAGGLE_KEY", "s3cret-key")

  def refuse(*a, **k):
    raise RuntimeError("403 Client Error: Forbidden\nfor url ... key s3cret-key")

  monkeypatch.setattr(kagglehub, "model_upload", refuse)
  before = _snapshot(folder)
  with pytest.raises(export_lib.UploadError) as e:
    export_lib.upload_run(_cfg(), folder, HANDLE, "c.yaml", log=lambda s: None)
  text = str(e.value)
  assert "\n" not in text and "s3cret-key" not in text and "403 Client Error" in text
  assert f"the export stays in {folder}" in text
  assert _snapshot(folder) == before


def test_no_credentials_or_no_network_is_one_line_and_keeps_the_export(folder, export_lib,
                                                                       monkeypatch):
  import kagglehub

  called = []
  monkeypatch.setattr(kagglehub, "model_upload", lambda *a, **k: called.append(a))
  monkeypatch.setattr(credentials, "credential_source", lambda: None)
  before = _snapshot(folder)
  with pytest.raises(export_lib.UploadError, match="no Kaggle credentials were found") as e:
    export_lib.upload(folder, HANDLE, "notes")
  assert "\n" not in str(e.value)
  monkeypatch.setattr(credentials, "credential_source", lambda: "KAGGLE_API_TOKEN")
  monkeypatch.setattr(credentials, "reachable", lambda host, port, timeout=3.0: False)
  with pytest.raises(export_lib.UploadError, match="cannot be reached"):
    export_lib.upload(folder, HANDLE, "notes")
  assert not called and _snapshot(folder) == before


def test_a_folder_without_an_export_is_not_uploaded(tmp_path, export_lib, online):
  with pytest.raises(export_lib.UploadError, match="holds no export"):
    export_lib.upload(tmp_path, HANDLE, "notes")
