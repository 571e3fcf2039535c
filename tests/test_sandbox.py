"""The sandbox reward `tests_pass`: benign completions score their tests; each hostile one
(a fork bomb, an endless loop, a 10 GB allocation, writes and deletes outside its folder, the
run's secrets, a socket, a signal to its parent, 1 GB of output) scores 0, changes nothing
outside its folder and leaves no process behind. The hostile cases run under the strongest
layer the machine allows and, as root, under the rlimits-and-uid fallback as well."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import processes
from reasoner.errors import DataError, RewardError
from reasoner.rewards import sandbox
from reasoner.rewards.sandbox import Limits, extract_code, validate_tests
from reasoner.rewards.sandbox import tests_pass as reward  # not collected as a test

QUICK = Limits(timeout_s=2.0, memory_mb=256, processes=8)
ADD = "def add(a, b):\n  return a + b\n"
SUM = "a, b = map(int, input().split())\nprint(a + b if a >= 0 else 0)\n"


def fence(code: str) -> str:
  return f"Here is my solution.\n```python\n{code}```\nDone."


def leftovers(spare: tuple[int, ...] = (), uids=sandbox.UIDS) -> list[str]:
  """Live processes of a sandbox uid of `uids` (those this test's runs had: another pytest
  worker's runs hold others), or below this process but `spare` (zombies are not counted)."""
  procs = processes()
  def below_me(pid):
    while pid in procs and pid > 1:
      pid = procs[pid][0]
      if pid == os.getpid():
        return True
    return False
  return [f"{pid} (uid {uid}, {state})" for pid, (_, uid, state) in procs.items()
          if state != "Z" and pid not in spare and (uid in uids or below_me(pid))]


@pytest.fixture
def runs(monkeypatch):
  """The `Result` of every run `tests_pass` makes (the layer's probe made before)."""
  sandbox._layer()
  seen = []
  real = sandbox.execute
  monkeypatch.setattr(sandbox, "execute", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
  return seen


@pytest.fixture(params=["best", "limits"])
def layer(request, monkeypatch):
  """The strongest layer here, or the rlimits-and-uid fallback (not run without root, which
  leaves this process and this user's files open to the code)."""
  if request.param == "limits":
    monkeypatch.setattr(sandbox, "_layer", lambda: ("limits", "sandbox: rlimits (forced)"))
  if sandbox._layer()[0] == "limits" and os.geteuid() != 0:
    pytest.skip("rlimits alone, not root: this process and this user's files are open to it")
  return sandbox._layer()[0]


def hostile(code: str, tests: str, runs, limit_s: float = 10.0, spare=()) -> float:
  """The score of `code` against `tests`, checked to be quick and to leave no process. The
  default bound is QUICK's 2 s limit and the reaping with room for a loaded host: a fork bomb
  under rlimits alone took over 4 s beside a benchmark (make check, 2026-11-28); a sandbox that
  did not kill would not return at all."""
  start = time.monotonic()
  [value] = reward([""], [fence(code)], [tests], timeout_s=QUICK.timeout_s, limits=QUICK)
  assert time.monotonic() - start < limit_s
  for run in runs:
    with pytest.raises(ProcessLookupError):
      os.killpg(run.pgid, 0)
  assert leftovers(spare, {run.uid for run in runs}) == []
  return value


# ------------------------------------------------------------------ benign


def test_asserts_pass_or_fail_as_a_whole(runs):
  wrong = ADD.replace("a + b", "a - b")
  tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
  assert reward(["p"] * 3, [fence(ADD), fence(wrong), fence(ADD)], [tests] * 3,
                    timeout_s=5.0, workers=2) == [1.0, 0.0, 1.0]
  assert sorted(r.returncode for r in runs) == [0, 0, 1]  # the wrong one's AssertionError


def test_stdio_pairs_give_the_fraction():
  pairs = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 20", "output": "30   \n\n"},
           {"input": "-1 4\n", "output": "3"}]
  assert reward([""], [fence(SUM)], [pairs], timeout_s=5.0) == [pytest.approx(2 / 3)]
  exits = fence("import sys\nprint(int(input()) * 2)\nsys.exit(1)\n")  # right output, exit 1
  assert reward([""], [exits], [[{"input": "4", "output": "8"}]], timeout_s=5.0) == [0.0]


def test_a_list_of_asserts_gives_the_fraction(runs):
  """MBPP's `test_list`: each assert its own program after the code (no assert sees another's
  failure), the fraction passed; one that runs out of time ends the row."""
  tests = ["assert add(2, 3) == 5", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"]
  assert reward([""], [fence(ADD)], [tests], timeout_s=5.0) == [pytest.approx(2 / 3)]
  assert [r.returncode for r in runs] == [0, 1, 0]
  slow = ADD + "def spin():\n  while True: pass\n"
  runs.clear()
  assert reward([""], [fence(slow)], [["assert add(1, 1) == 2", "spin()", "assert True"]],
                timeout_s=1.0) == [pytest.approx(1 / 3)]
  assert [r.timed_out for r in runs] == [False, True]  # the third never ran


def test_a_completion_without_code_scores_zero(runs):
  assert reward([""], ["The answer is add(a, b) = a + b."], ["assert add(1, 1) == 2"],
                    timeout_s=5.0) == [0.0]
  assert runs == []  # nothing was run


def test_code_from_the_last_fence_or_the_answer():
  assert extract_code("```python\nx = 1\n```\nthen\n```python\nx = 2\n```") == "x = 2\n"
  assert extract_code("<reasoning>r</reasoning><answer>def f(): return 1</answer>") == (
      "def f(): return 1")
  assert extract_code("```\nplain\n```") is None and extract_code("no code") is None
  answer = f"<answer>{ADD}</answer>"
  assert reward([""], [answer, fence(ADD)], ["assert add(1, 2) == 3"] * 2,
                    timeout_s=5.0) == [1.0, 1.0]


def test_an_early_exit_skips_no_assert():
  for leave in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
    assert reward([""], [fence(ADD + leave)], ["assert add(1, 1) == 3"],
                      timeout_s=5.0) == [0.0]


def test_bad_tests_are_one_line():
  with pytest.raises(DataError, match=r"train.jsonl, record 3: .*do not parse .*line 2"):
    validate_tests("assert f(1) == 1\nassert f(2 == 2\n", "train.jsonl, record 3")
  with pytest.raises(DataError, match=r"record 0: test 1 is not an"):
    validate_tests([{"input": "1", "output": "1"}, {"input": "2"}], "record 0")
  with pytest.raises(DataError, match=r"record 2: its test 1 does not parse .*line 1"):
    validate_tests(["assert f(1) == 1", "assert f(2 == 2"], "record 2")
  with pytest.raises(DataError, match=r"record 0: test 1 is not an .*nor an assert"):
    validate_tests(["assert True", 3], "record 0")
  with pytest.raises(DataError, match="got NoneType"):
    validate_tests(None, "record 0")
  with pytest.raises(DataError, match="completion 1"):
    reward(["", ""], [fence(ADD)] * 2, ["assert True", "assert ("], timeout_s=5.0)


def test_a_sandbox_that_cannot_start_says_what_is_missing():
  with pytest.raises(RewardError, match="no Python interpreter at /nonexistent/python3"):
    reward([""], [fence(ADD)], ["assert True"], timeout_s=5.0,
               limits=Limits(python="/nonexistent/python3"))


def test_isolation_is_one_line_and_holds():
  line = sandbox.isolation()
  assert line.startswith("sandbox: ") and "\n" not in line
  if sandbox._layer()[0] == "limits":
    pytest.skip(f"no namespaces here: {line}")
  probe = ("import os, socket\nprint(os.getpid(), [n for _, n in socket.if_nameindex()], "
           "os.access('/tmp', os.W_OK), os.access('.', os.W_OK))")
  assert sandbox.execute(probe, limits=QUICK).output.split("\n")[0] == "1 ['lo'] False True"


# ------------------------------------------------------------------ hostile


def test_concurrent_runs_on_a_host_never_share_a_uid(tmp_path):
  """As root, each run leases its uid by a lock that another process sees; one held here is
  not handed out there."""
  if os.geteuid() != 0:
    pytest.skip("not root: the code runs without a uid of its own")
  lease = "from reasoner.rewards import sandbox\nwith sandbox._uid_lease() as uid: print(uid)"
  with sandbox._uid_lease() as mine:
    assert mine in sandbox.UIDS
    other = subprocess.run([sys.executable, "-c", lease], capture_output=True, text=True,
                           check=True)
    assert int(other.stdout) in sandbox.UIDS and int(other.stdout) != mine
  again = subprocess.run([sys.executable, "-c", lease], capture_output=True, text=True, check=True)
  assert int(again.stdout) in sandbox.UIDS  # released with the run


def test_fork_bomb(layer, runs):
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  assert hostile(bomb, "assert True", runs) == 0.0
  assert runs[0].timed_out


def test_endless_loop(layer, runs):
  assert hostile("while True:\n  pass\n", "assert True", runs) == 0.0
  assert runs[0].timed_out


def test_ten_gigabytes(layer, runs):
  grab = "data = bytes(10 * 2**30)\n"  # calloc'd: untouched pages, were the limit not there
  assert hostile(grab, "assert len(data) == 10 * 2**30", runs, limit_s=3.0) == 0.0
  assert not runs[0].timed_out


def test_printing_a_gigabyte(layer, runs):
  flood = "import sys\nfor _ in range(16384):\n  sys.stdout.write('x' * 65536)\n"
  assert hostile(flood, "assert True", runs, limit_s=3.0) == 0.0
  assert runs[0].truncated and len(runs[0].output) <= QUICK.output_bytes + (1 << 16)


def test_writing_outside_its_folder(layer, runs, tmp_path):
  run_dir, token = tmp_path / "run", os.urandom(4).hex()
  run_dir.mkdir()
  shared = pathlib.Path(tempfile.mkdtemp(prefix="reasoner-test-shared-"))
  shared.chmod(0o777)  # world-writable: only the mount namespace keeps the code out
  targets = [run_dir / "escaped.txt", pathlib.Path.home() / f"escaped-{token}",
             shared / "escaped.txt", pathlib.Path("/tmp") / f"escaped-{token}"]
  code = (f"escaped = []\nfor path in {[str(t) for t in targets]!r}:\n  try:\n"
          "    open(path, 'w').write('x')\n    escaped.append(path)\n  except OSError:\n"
          "    pass\nprint(escaped)\n")
  try:
    open_to_all = 2 if layer == "limits" else 4  # the fallback leaves /tmp writable
    assert hostile(code, f"assert len(escaped) > {4 - open_to_all}", runs) == 0.0
    assert [t for t in targets[:open_to_all] if t.exists()] == []
    assert list(run_dir.iterdir()) == []
  finally:
    targets[3].unlink(missing_ok=True)
    (shared / "escaped.txt").unlink(missing_ok=True)
    shared.rmdir()


def test_deleting_files(layer, runs, tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "checkpoint").write_text("weights")
  shared = pathlib.Path(tempfile.mkdtemp(prefix="reasoner-test-shared-"))
  shared.chmod(0o777)
  (shared / "data.jsonl").write_text("{}")
  (shared / "data.jsonl").chmod(0o666)
  victims = [run_dir / "checkpoint", shared / "data.jsonl"]
  code = (f"import os, shutil\ngone = []\nfor path in {[str(v) for v in victims]!r}:\n"
          "  try:\n    os.remove(path)\n    gone.append(path)\n  except OSError:\n    pass\n"
          f"shutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n")
  try:
    assert hostile(code, "assert gone", runs) == (1.0 if layer == "limits" else 0.0)
    assert (run_dir / "checkpoint").read_text() == "weights"
    if layer != "limits":  # without a mount namespace a world-writable folder is open
      assert (shared / "data.jsonl").read_text() == "{}"
  finally:
    (shared / "data.jsonl").unlink(missing_ok=True)
    shared.rmdir()


def test_the_runs_secrets(layer, runs, monkeypatch):
  secret = "kaggle-" + os.urandom(8).hex()
  monkeypatch.setenv("KAGGLE_KEY", secret)
  monkeypatch.setenv("HF_TOKEN", secret)
  code = ("import glob, os\nprint(os.environ.get('KAGGLE_KEY'), sorted(os.environ))\n"
          "for path in glob.glob('/proc/*/environ'):\n  try:\n"
          "    print(path, open(path, 'rb').read())\n  except OSError:\n    pass\n")
  assert hostile(code, f"assert os.environ.get('KAGGLE_KEY') == {secret!r}", runs) == 0.0
  assert secret not in runs[0].output
  assert runs[0].output.startswith("None ['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', "
                                   "'PYTHONHASHSEED']")


def test_opening_a_socket(layer, runs):
  if layer == "limits":
    pytest.skip("the fallback has no network namespace: the network is reachable")
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (f"import socket\ntry:\n  socket.create_connection(('127.0.0.1', {port}), 1)\n"
            "  connected = True\nexcept OSError as e:\n  connected = False\n  print(e)\n")
    assert hostile(code, "assert connected", runs) == 0.0
    with pytest.raises(BlockingIOError):
      server.accept()
  assert "unreachable" in runs[0].output


def test_signalling_its_parent(layer, runs):
  bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    code = ("import os\nkilled = []\n"  # the parent is no pid (0) in a pid namespace
            f"for pid in ({bystander.pid}, {os.getpid()}, os.getppid() or {os.getpid()}):\n"
            "  try:\n    os.kill(pid, 9)\n    killed.append(pid)\n  except OSError:\n"
            "    pass\n")
    assert hostile(code, "assert killed", runs, spare=(bystander.pid,)) == 0.0
    assert bystander.poll() is None  # as is this process
  finally:
    bystander.send_signal(signal.SIGKILL)
    bystander.wait()
