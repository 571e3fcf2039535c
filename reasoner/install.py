"""Installing reasoner to fit the machine: `reasoner[tpu]` where a TPU is present (jax, jaxlib
and libtpu pinned to versions that match), plain `reasoner` elsewhere; then the versions and the
devices JAX sees, and one line with the fix where a TPU is present but JAX came up without it.

Standard library only, and jax is never imported here: the notebook's install cell loads this
file from the attached source before reasoner, or jax, is installed, and JAX's devices are
asked in a child process, so a fix can still be installed before this kernel loads jax.

Where a TPU is present is read from the machine, not from jax (`tpu_signs`): the variables a TPU
VM's runtime sets (Kaggle's and Cloud TPU VMs: TPU_ACCELERATOR_TYPE=v5litepod-8, ISTPUVM=1,
PJRT_DEVICE=TPU, TPU_WORKER_ID; Colab: COLAB_TPU_ADDR), the chips' device files (/dev/accel*,
/dev/vfio/<n>), and Google TPU PCI devices (vendor 0x1ae0, as jax's own hardware_utils reads).

    python -m reasoner.install [SOURCE]    # SOURCE: a path or git URL pip installs; none: check
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Mapping

TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_ID", "TPU_CHIPS_PER_HOST_BOUNDS",
           "COLAB_TPU_ADDR", "ISTPUVM")
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x0027": "v3", "0x0056": "plc", "0x005e": "v4", "0x0062": "v5p",
                   "0x0063": "v5e", "0x006f": "v6e", "0x0076": "tpu7x"}
TPU_PIN = "jax[tpu]==0.10.2"  # pyproject's `tpu` extra, where no installed metadata says


def tpu_signs(environ: Mapping[str, str], root: str | os.PathLike = "/") -> list[str]:
  """What says this machine has a TPU (variables, device files, PCI devices under `root`), in
  words; empty where nothing does."""
  signs = [f"{k}={environ[k]}" for k in TPU_ENV if environ.get(k)]
  if environ.get("PJRT_DEVICE", "").upper() == "TPU":
    signs.append("PJRT_DEVICE=TPU")
  root = pathlib.Path(root)
  files = [*root.glob("dev/accel*"), *(p for p in root.glob("dev/vfio/*") if p.name.isdigit())]
  signs += sorted("/" + p.relative_to(root).as_posix() for p in files)
  for vendor in sorted(root.glob("sys/bus/pci/devices/*/vendor")):
    device = vendor.with_name("device")
    try:
      ids = vendor.read_text().strip(), device.read_text().strip()
    except OSError:
      continue
    if ids[0] == GOOGLE_PCI_VENDOR and ids[1] in TPU_PCI_DEVICES:
      signs.append(f"TPU {TPU_PCI_DEVICES[ids[1]]} PCI device {vendor.parent.name}")
  return signs


def requirement(source: str, tpu: bool) -> str:
  """What pip installs: the source (a path, a git URL or a package name), with the `tpu` extra
  where `tpu`."""
  if not tpu:
    return source
  if "://" in source or source.startswith("git+"):
    return f"reasoner[tpu] @ {source}"
  return f"{source}[tpu]"


def pip_command(source: str, tpu: bool, python: str = sys.executable) -> list[str]:
  return [python, "-m", "pip", "install", "-q", requirement(source, tpu)]


def tpu_pin(requires: list[str] | None) -> str:
  """The `tpu` extra's jax requirement among the installed reasoner's `requires`, else
  TPU_PIN."""
  for r in requires or []:
    if "extra" in r and re.search(r"extra\s*==\s*['\"]tpu['\"]", r) and r.startswith("jax"):
      return r.split(";")[0].strip()
  return TPU_PIN


def fix_command(pin: str, python: str = "python") -> str:
  return f"{python} -m pip install -q '{pin}'"


def report_lines(found: dict, signs: list[str], pin: str = TPU_PIN) -> list[str]:
  """The lines after an install: jax, jaxlib and libtpu's versions; the devices JAX sees; and,
  where the machine has a TPU (`signs`) that JAX did not come up on, one line with the fix.
  `found`: `probe`'s answer ({"jax", "jaxlib", "libtpu": version or None, "platform",
  "devices": [kind, ...], "error"})."""
  v = lambda name: found.get(name) or "not installed"
  lines = [f"jax {v('jax')}, jaxlib {v('jaxlib')}, libtpu {v('libtpu')}"]
  platform, devices = found.get("platform"), found.get("devices") or []
  if platform:
    kinds = ", ".join(f"{devices.count(k)} x {k}" for k in dict.fromkeys(devices))
    lines.append(f"JAX sees {len(devices)} {platform} device(s): {kinds}")
  else:
    lines.append(f"JAX did not start: {found.get('error') or 'no answer'}")
  if signs and platform != "tpu":
    lines.append(f"this machine has a TPU ({signs[0]}) but JAX came up on "
                 f"{platform or 'nothing'} (jax {v('jax')}, jaxlib {v('jaxlib')}, libtpu "
                 f"{v('libtpu')} do not match it): run {fix_command(pin)} and restart the "
                 "kernel (or the process) before anything loads")
  return lines


PROBE = """
import json, importlib.metadata as md
def version(*names):
  for n in names:
    try:
      return md.version(n)
    except md.PackageNotFoundError:
      pass
out = {"jax": version("jax"), "jaxlib": version("jaxlib"),
       "libtpu": version("libtpu", "libtpu-nightly")}
try:
  import jax
  devices = jax.devices()
  out.update(platform=devices[0].platform, devices=[d.device_kind for d in devices])
except Exception as e:
  out["error"] = " ".join(str(e).split())[:300] or type(e).__name__
print("PROBE" + json.dumps(out))
"""


def probe(python: str = sys.executable, timeout: float = 600) -> dict:
  """Versions and JAX's devices, asked of a child process (this one never loads jax)."""
  try:
    r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"JAX took over {timeout:.0f} s to list its devices"}
  for line in r.stdout.splitlines():
    if line.startswith("PROBE"):
      return json.loads(line[len("PROBE"):])
  return {"error": (r.stderr.strip().splitlines() or ["the probe printed nothing"])[-1]}


def installed_pin() -> str:
  from importlib import metadata

  try:
    return tpu_pin(metadata.requires("reasoner"))
  except metadata.PackageNotFoundError:
    return TPU_PIN


def install(source: str, environ: Mapping[str, str] = os.environ, root: str = "/",
            log=print) -> list[str]:
  """pip installs `source` with the `tpu` extra where the machine has a TPU; returns the
  command run."""
  signs = tpu_signs(environ, root)
  cmd = pip_command(source, bool(signs))
  log(f"installing {cmd[-1]}" + (f" (TPU: {signs[0]})" if signs else " (no TPU found)"))
  subprocess.run(cmd, check=True)
  return cmd


def check(environ: Mapping[str, str] = os.environ, root: str = "/", log=print) -> list[str]:
  """Prints (and returns) `report_lines` for this machine."""
  lines = report_lines(probe(), tpu_signs(environ, root), installed_pin())
  for line in lines:
    log(line)
  return lines


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv:
    install(argv[0])
  lines = check()
  return 1 if len(lines) > 2 else 0


if __name__ == "__main__":
  sys.exit(main())
