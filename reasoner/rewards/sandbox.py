"""The reward `tests_pass`: a completion's code run against its record's tests, in a sandbox.

The code is the completion's last ```python block, else the text of its last <answer>; `tests`
a string of asserts (run after the code, in the same program: 1 or 0), a list of such strings
(MBPP's `test_list`: the code run once a test, the fraction passed) or {"input", "output"}
pairs (the program run once a pair, stdout compared without trailing whitespace: the fraction).

Each run is a fresh process: a launcher (`launcher.main`, in a new interpreter and
session) forks the sandbox, which sets itself up and execs the interpreter (`-s -B`; the
environment built from nothing: PATH, LANG, HOME = the cwd, PYTHONDONTWRITEBYTECODE and
PYTHONHASHSEED=0, which `-I` would ignore). The strongest layer a probe finds (`isolation()`):
- as root: new pid, mount, network, IPC and UTS namespaces, then a uid no account uses, one a
  concurrent run on the host (`UIDS`, leased by a lock: RLIMIT_NPROC binds only non-root uids
  and counts a uid's processes), no capability, no_new_privs;
- not root: the same in a user namespace (this uid as 0 while the mounts are made), then a
  nested one (the code as uid 1000, no capability) that locks the mounts as made; this user's
  files outside the hidden folders stay readable;
- else rlimits alone, and the uid as root: /tmp writable, the network reachable.
In the namespaces every mount is read-only but the cwd, a tmpfs of `file_mb`; the run user's
home and the temporary folders are under empty ones (the interpreter's folders bound back), so
the run's files there cannot even be read; /proc is the new pid namespace's (no other process,
no environ); no network interface is up, 127.0.0.1 included. The program is pid 1 there: when
it ends or is killed, the kernel kills what it left.

Limits (`Limits`): wall clock, CPU seconds, address space, file size, processes (threads
count), open files, the output read (past it the run fails). Past the time or the cap the
launcher kills the sandbox, then, as subreaper, all it left (as root, all of the uid's: kill(-1)
from it). A launcher that does not end is killed with its session (the sandbox on its death).

Not stopped: asserts run in the code's interpreter, so code can defeat them (an object equal
to everything); a secret marker printed after them stops an early exit(0). RLIMIT_AS bounds a
process, not a run: a run holds at most processes x memory_mb (no cgroup is used).
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import pathlib
import pwd
import re
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from reasoner.errors import DataError, RewardError
from reasoner.rewards.launcher import SETUP_FAILED

FENCE = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
UIDS = range(2_000_000_000, 2_000_000_256)  # no account's: one a concurrent run, as root
UID_LOCKS = os.path.join(tempfile.gettempdir(), "reasoner-sandbox-uids")  # a lock file a uid
# the sandboxed program: the code, then the asserts and the run's marker (read, then deleted)
HARNESS = """import json, os, sys
def main(job, scope):
  os.unlink("job.json")
  exec(compile(job["code"], "solution.py", "exec"), scope)
  if job["tests"] is not None:
    exec(compile(job["tests"], "tests.py", "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\\n" + job["marker"] + "\\n").encode())
main(json.load(open("job.json")), {"__name__": "__main__"})"""


@dataclasses.dataclass(frozen=True)
class Limits:
  """A run's limits; `cpu_s` defaults to the wall clock rounded up."""
  timeout_s: float = 10.0
  cpu_s: int | None = None
  memory_mb: int = 512
  file_mb: int = 16  # any one file; in the namespaces, the whole cwd as well
  processes: int = 16  # threads count
  open_files: int = 64
  output_bytes: int = 1 << 20
  python: str = sys.executable

  def rlimits(self) -> list[tuple[int, int, int]]:
    cpu, mib = self.cpu_s or max(1, math.ceil(self.timeout_s)), 1 << 20
    return [(resource.RLIMIT_CPU, cpu, cpu + 1)] + [(r, n, n) for r, n in (
        (resource.RLIMIT_AS, self.memory_mb * mib), (resource.RLIMIT_FSIZE, self.file_mb * mib),
        (resource.RLIMIT_NPROC, self.processes), (resource.RLIMIT_NOFILE, self.open_files),
        (resource.RLIMIT_CORE, 0))]


@dataclasses.dataclass(frozen=True)
class Result:
  """One run: stdout (no marker), exit status (128 + n: signal n), whether it passed (in time,
  under the output cap, exit 0, past its asserts), the launcher's process group and the uid."""
  output: str
  returncode: int
  timed_out: bool
  truncated: bool
  passed: bool
  pgid: int
  uid: int | None  # the uid it ran as: one of UIDS, as root


def extract_code(completion: str) -> str | None:
  """The last ```python block, else the text inside the last <answer>, else None."""
  for pattern in (FENCE, ANSWER):
    found = pattern.findall(completion)
    if found and found[-1].strip():
      return found[-1]
  return None


def validate_tests(tests, where: str) -> None:
  """One line (DataError) for tests that cannot run: asserts that do not parse, pairs without
  both "input" and "output" strings, or anything else."""
  if not (isinstance(tests, str) or isinstance(tests, list) and tests):
    raise DataError(f"{where}: tests must be a string of asserts or a non-empty list of "
                    f"asserts or of {{'input', 'output'}} pairs (got {type(tests).__name__})")
  for i, test in enumerate([tests] if isinstance(tests, str) else tests):
    if isinstance(test, str):
      try:
        ast.parse(test)
      except SyntaxError as e:
        what = "its tests do" if test is tests else f"its test {i} does"
        raise DataError(f"{where}: {what} not parse as Python (line {e.lineno}: {e.msg})") from None
    elif not (isinstance(test, dict) and all(isinstance(test.get(k), str)
                                             for k in ("input", "output"))):
      raise DataError(f"{where}: test {i} is not an {{'input': str, 'output': str}} pair (nor "
                      "an assert)")


def same_output(got: str, expected: str) -> bool:
  """Equal once trailing whitespace is stripped from each line and from the end."""
  norm = lambda s: "\n".join(line.rstrip() for line in s.rstrip().splitlines())
  return norm(got) == norm(expected)


def score(completion: str, tests, limits: Limits = Limits()) -> float:
  """The fraction of `tests` the completion's code passes (0 without code), one after another;
  the first that runs out of time ends the row (the rest count as failed)."""
  code = extract_code(completion)
  if code is None:
    return 0.0
  tests = [tests] if isinstance(tests, str) else tests
  passed = 0
  for test in tests:
    asserts = isinstance(test, str)  # run after the code; else a stdin / stdout pair
    run = execute(code, test if asserts else None, "" if asserts else test["input"], limits)
    passed += run.passed and (asserts or same_output(run.output, test["output"]))
    if run.timed_out:
      break
  return passed / len(tests)


def tests_pass(prompts, completions: Sequence[str], tests: Sequence, timeout_s: float = 10.0,
               workers: int | None = None, limits: Limits | None = None, **_) -> list[float]:
  """The fraction of its record's tests each completion's code passes, in the sandbox under
  `limits` (default `Limits()`), each program within `timeout_s`; rows run concurrently
  (`workers`, default: a CPU each)."""
  for i, t in enumerate(tests):
    validate_tests(t, f"completion {i}")
  limits = dataclasses.replace(limits or Limits(), timeout_s=timeout_s)
  _layer()  # probed once, before the threads
  with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
    return list(pool.map(lambda ct: score(*ct, limits), zip(completions, tests)))


tests_pass.needs_tests = True  # the records must carry `tests`


def isolation() -> str:
  """One line: the isolation runs get here (probed once)."""
  return _layer()[1]


@functools.cache
def _layer() -> tuple[str, str]:
  """(mode, description): "root" or "user" (namespaces) where a probe runs in them (pid 1,
  no network interface but lo), else "limits"."""
  root = os.geteuid() == 0
  mode, uid = ("root", f"uids {UIDS.start}+") if root else ("user", "no uid drop (not root)")
  probe = "import os, socket\nassert os.getpid() == 1 and len(socket.if_nameindex()) == 1"
  try:
    run = execute(probe, limits=Limits(timeout_s=20.0), mode=mode)
    reason = None if run.passed else f"the probe exited {run.returncode}"
  except RewardError as e:
    reason = str(e)
  if reason is None:
    return mode, (f"sandbox: pid, mount, network, IPC and UTS namespaces "
                  f"({'as root' if root else 'in a user namespace'}), a read-only filesystem "
                  f"but a tmpfs cwd, rlimits, {uid}")
  exposed = "" if root else ", this process and this user's files open to the code"
  return "limits", (f"sandbox: rlimits and {uid} only (no namespaces: {reason}): /tmp "
                    f"writable, the network reachable{exposed}; the code run by "
                    f"{_interpreter(sys.executable, 'limits')}")


def _reachable(path: str) -> bool:
  """Whether any uid can run `path` (every folder above it searchable by others)."""
  p = pathlib.Path(os.path.realpath(path))
  return all(os.stat(d).st_mode & stat.S_IXOTH for d in [p, *p.parents])


def _interpreter(python: str, mode: str) -> str:
  """`python`, or as root without namespaces, /usr/bin/python3 where the uid cannot reach it."""
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    raise RewardError(f"sandbox: no Python interpreter at {python} (Limits.python)")
  if mode != "limits" or os.geteuid() != 0 or _reachable(python):
    return python
  system = shutil.which("python3", path="/usr/bin:/bin")
  if system and _reachable(system):
    return system
  raise RewardError(f"sandbox: uid {UIDS.start} cannot run {python} (a folder above it is "
                    "closed to others) and there is no /usr/bin/python3")


def _hidden(python: str) -> tuple[list[str], list[str]]:
  """(folders to cover with an empty tmpfs: the run user's home and the temporary folders;
  the interpreter's prefixes under them, to bind back)."""
  homes = {os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir, tempfile.gettempdir(),
           "/tmp", "/var/tmp", "/dev/shm"}
  hide = sorted({os.path.realpath(h) for h in homes if os.path.isdir(h)} - {"/"})
  prefixes = {os.path.realpath(p.parent.parent) for p in
              (pathlib.Path(python), pathlib.Path(os.path.realpath(python)))}
  under = lambda p: any(p == h or p.startswith(h.rstrip("/") + "/") for h in hide)
  return hide, sorted(filter(under, prefixes))


def execute(code: str, tests: str | None = None, stdin: str = "", limits: Limits = Limits(),
            mode: str | None = None) -> Result:
  """Runs `code` (then the asserts `tests`, if any) in the sandbox, `stdin` as its input."""
  mode = mode or _layer()[0]
  python = _interpreter(limits.python, mode)
  with _uid_lease() as uid:
    return _execute(code, tests, stdin, limits, mode, python, uid)


def _execute(code, tests, stdin, limits, mode, python, uid) -> Result:
  box = tempfile.mkdtemp(prefix="reasoner-sandbox-")
  try:
    marker = secrets.token_hex(16)
    job = os.path.join(box, "job.json")
    with open(job, "w") as f:
      json.dump({"code": code, "tests": tests, "marker": marker}, f)
    for path in (box, job) if mode == "limits" and uid is not None else ():
      os.chown(path, uid, uid)
    hide, keep = _hidden(python) if mode != "limits" else ([], [])
    spec = {"mode": mode, "uid": uid, "box": box, "box_mb": limits.file_mb, "python": python,
            "argv": [python, "-s", "-B", "-c", HARNESS],
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": box,
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"},
            "rlimits": limits.rlimits(), "hide": hide, "keep": keep}
    with tempfile.TemporaryFile() as feed:
      feed.write(stdin.encode())
      feed.seek(0)
      out, err, returncode, timed_out, truncated, pgid = _run_launcher(spec, feed, limits)
  finally:
    shutil.rmtree(box, ignore_errors=True)
  if returncode == SETUP_FAILED and err.strip():
    raise RewardError(err.decode(errors="replace").strip().splitlines()[-1])
  text = out.decode(errors="replace")
  passed = returncode == 0 and not timed_out and not truncated
  if tests is not None:
    passed = passed and text.rstrip().endswith(marker)
    text = text.rstrip()[:-len(marker)] if passed else text
  return Result(text, returncode, timed_out, truncated, passed, pgid, uid)


@contextlib.contextmanager
def _uid_lease():
  """As root, a uid of UIDS that no other run on this host holds (an flock on its file in
  UID_LOCKS, root's own folder; released when the run ends or its process dies), else None.
  RLIMIT_NPROC counts a uid's processes and a sweep kills all of them, so two runs, of one
  process or of two (pytest's workers, a host's JAX processes), never share one."""
  if os.geteuid() != 0:
    yield None
    return
  os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
  st = os.lstat(UID_LOCKS)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
    raise RewardError(f"sandbox: {UID_LOCKS} must be a folder root alone can open (it holds "
                      "the uids' locks); remove it")
  start = os.getpid() % len(UIDS)  # each process from its own place: a uid's next run is
  while True:  # rarely another process's, which a check for what a run left would count
    for uid in (*UIDS[start:], *UIDS[:start]):
      fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                   0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      try:
        yield uid
      finally:
        os.close(fd)
      return
    time.sleep(0.05)  # every uid in use: wait for one


def _launcher_argv(spec: dict) -> list[str]:
  package_root = str(pathlib.Path(__file__).resolve().parents[2])
  return [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
          "from reasoner.rewards import launcher; launcher.main(sys.argv[1])", json.dumps(spec)]


def _run_launcher(spec: dict, feed, limits: Limits):
  """(stdout, the launcher's stderr, exit status, timed out, output cut, pgid). Past the time
  or the cap the launcher is told (SIGTERM) to kill the sandbox; if it has not ended 2 s later,
  its session is killed and the uid swept from here."""
  try:
    proc = subprocess.Popen(_launcher_argv(spec), stdin=feed, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            env={"LANG": "C.UTF-8"})
  except OSError as e:
    raise RewardError(f"sandbox: cannot start {sys.executable}: {e.strerror}") from None
  deadline = time.monotonic() + limits.timeout_s
  out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
  bufs = {out_fd: bytearray(), err_fd: bytearray()}
  timed_out = truncated = False
  with selectors.DefaultSelector() as sel:
    for fd in bufs:
      sel.register(fd, selectors.EVENT_READ)
    while sel.get_map() and not truncated:
      left = deadline - time.monotonic()
      if left <= 0:
        timed_out = True
        break
      ready = sel.select(min(left, 0.05))
      if not ready and proc.poll() is not None:
        break  # ended, and nothing more to read (a child it left may hold the pipe)
      for key, _ in ready:
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fd)
        bufs[key.fd] += chunk
        truncated = len(bufs[out_fd]) > limits.output_bytes
  if timed_out or truncated:
    proc.send_signal(signal.SIGTERM)
  try:
    returncode = proc.wait(max(deadline - time.monotonic(), 0) + 2)
  except subprocess.TimeoutExpired:
    timed_out = True
    os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group is there
    returncode = proc.wait()
    if spec["uid"] is not None:
      subprocess.run(_launcher_argv({"mode": "sweep", "uid": spec["uid"]}), check=False,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env={})
  proc.stdout.close()
  proc.stderr.close()
  return bytes(bufs[out_fd]), bytes(bufs[err_fd]), returncode, timed_out, truncated, proc.pid
