"""The suite's hang watchdog (tests/conftest.py): a test past `REASONER_TEST_HANG_S` ends its
pytest-xdist worker, the processes it started are killed, the run stops at once, and its
output names the test and shows where each of its threads, and its child, was waiting."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # starts a pytest run of its own

HANGS = """import subprocess, sys
def test_hangs_in_a_child():
  subprocess.run([sys.executable, "-c", "import time; time.sleep(600)  # {tag}"])
def test_after_it():
  pass
"""


def test_a_hung_test_stops_the_run_with_its_stacks(tmp_path):
  tag = f"hang-{os.getpid()}-{time.time_ns()}"
  shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
  (tmp_path / "test_hangs.py").write_text(HANGS.format(tag=tag))
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  env = {k: v for k, v in os.environ.items()
         if k not in ("REASONER_TEST_XLA_CACHE", "REASONER_TEST_HANGS")}
  start = time.monotonic()
  run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile",
                        "--max-worker-restart=0", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, text=True,
                       env={**env, "REASONER_TEST_HANG_S": "3"}, capture_output=True,
                       timeout=300)
  out = run.stdout
  assert run.returncode == 1, out[-3000:]
  assert time.monotonic() - start < 120, "the run waited for the hung test"
  assert "a test hung: " in out and "test_hangs.py::test_hangs_in_a_child ran past 3 s" in out
  assert "in test_hangs_in_a_child" in out and "os.waitpid" in out, out[-3000:]  # its stack
  assert f"below it: {sys.executable} -c import time; time.sleep(600)  # {tag}" in out
  assert "_pytest/" not in out.split("a test hung: ")[1].split("short test summary")[0]
  assert "FAILED test_hangs.py::test_hangs_in_a_child - worker" in out
  last = out.strip().splitlines()[-1]
  assert "1 failed in" in last and "passed" not in last, last  # stopped: no worker replaced it
  left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout
  assert left == "", f"the hung test's child is still running: {left}"
