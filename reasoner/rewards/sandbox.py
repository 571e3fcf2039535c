"""The reward `tests_pass`: a completion's code run against its record's tests, in a sandbox.

The code is the completion's last ```python block, else the text of its last <answer>; `tests`
a string of asserts (run after the code, in the same program: 1 or 0), a list of such strings
(MBPP's `test_list`: the code run once a test, the fraction passed) or {"input", "output"}
pairs (the program run once a pair, stdout compared without trailing whitespace: the fraction).

Each run is a fresh process: a launcher (`_launch`, this module in a new interpreter and
session) forks the sandbox, which sets itself up and execs the interpreter (`-s -B`; the
environment built from nothing: PATH, LANG, HOME = the cwd, PYTHONDONTWRITEBYTECODE and
PYTHONHASHSEED=0, which `-I` would ignore). The strongest layer a probe finds (`isolation()`):
- as root: new pid, mount, network, IPC and UTS namespaces, then a uid no account uses, one a
  concurrent run (`UIDS`: RLIMIT_NPROC binds only non-root uids and counts a uid's processes),
  no capability, no_new_privs;
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
import ctypes
import dataclasses
import functools
import json
import math
import os
import pathlib
import pwd
import queue
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

FENCE = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
UIDS = range(2_000_000_000, 2_000_000_256)  # no account's: one a concurrent run, as root
_free_uids: queue.SimpleQueue = queue.SimpleQueue()
list(map(_free_uids.put, UIDS))
SETUP_FAILED = 125  # the launcher's exit status when it could not set the sandbox up
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
  under the output cap, exit 0, past its asserts), and the launcher's process group."""
  output: str
  returncode: int
  timed_out: bool
  truncated: bool
  passed: bool
  pgid: int


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
  uid = _free_uids.get() if os.geteuid() == 0 else None
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
    if uid is not None:
      _free_uids.put(uid)
    shutil.rmtree(box, ignore_errors=True)
  if returncode == SETUP_FAILED and err.strip():
    raise RewardError(err.decode(errors="replace").strip().splitlines()[-1])
  text = out.decode(errors="replace")
  passed = returncode == 0 and not timed_out and not truncated
  if tests is not None:
    passed = passed and text.rstrip().endswith(marker)
    text = text.rstrip()[:-len(marker)] if passed else text
  return Result(text, returncode, timed_out, truncated, passed, pgid)


def _launcher_argv(spec: dict) -> list[str]:
  package_root = str(pathlib.Path(__file__).resolve().parents[2])
  return [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
          "from reasoner.rewards import sandbox; sandbox._launch(sys.argv[1])", json.dumps(spec)]


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


# the launcher's side, in a new process
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
INNER_UID = 1000  # the code's uid in the nested user namespace (not root)


def _launch(arg: str) -> None:
  """The launcher: forks the sandbox (set up as `spec` says), waits for it, kills and reaps
  what it left, exits with its status; one line and SETUP_FAILED where the setup fails."""
  spec = json.loads(arg)
  err = os.dup(2)  # closed on exec
  try:
    if spec["mode"] == "sweep":
      _kill_uid(spec["uid"])
      os._exit(0)
    user, ns = spec["mode"] == "user", spec["mode"] != "limits"
    if ns:  # the pid namespace (and the user one) made here: the sandbox is its pid 1
      _check(_libc().unshare(CLONE_NEWPID | (CLONE_NEWUSER if user else 0)), "unshare")
      if user:
        _map(f"0 {os.getuid()} 1", f"0 {os.getgid()} 1")
    _check(_libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    sandbox = []
    signal.signal(signal.SIGTERM, lambda *_: sandbox and _kill(sandbox[0]))  # the host's stop
    pid = os.fork()
    if pid == 0:
      if ns:
        _mounts(spec)
      _exec(spec)
    sandbox.append(pid)
    os._exit(_supervise(sandbox, None if ns else spec["uid"]))
  except Exception as e:  # a setup step, in one line: a RewardError on the host
    os.write(err, f"sandbox: {e}\n".encode())
    os._exit(SETUP_FAILED)


def _kill(pid: int) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.kill(pid, signal.SIGKILL)


def _supervise(sandbox: list[int], uid: int | None) -> int:
  """The sandbox's exit status, once it ended and `uid`'s processes (without a pid namespace)
  and all its descendants (orphans come here, their subreaper) are killed and reaped."""
  os.closerange(0, 2)  # stdin, stdout: the host's EOF is the sandbox's alone
  _, status = os.waitpid(sandbox[0], 0)
  sandbox.clear()
  if uid is not None and os.fork() == 0:
    with contextlib.suppress(OSError):
      _kill_uid(uid)
    os._exit(0)
  while True:
    for name in filter(str.isdigit, os.listdir("/proc")):
      with contextlib.suppress(OSError), open(f"/proc/{name}/stat") as f:  # OSError: gone
        if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
          _kill(int(name))
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      break
  code = os.waitstatus_to_exitcode(status)
  return code if code >= 0 else 128 - code


def _kill_uid(uid: int) -> None:
  """As `uid` (never root), kills all its processes: kill(-1) spares only the caller."""
  _drop(uid)
  _kill(-1)


@functools.cache
def _libc():
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
  libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
  return libc


def _check(result: int, what: str) -> None:
  if result != 0:
    raise OSError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target: str, fstype, flags: int, data=None) -> None:
  enc = lambda s: s.encode() if s is not None else None
  _check(_libc().mount(enc(src), target.encode(), enc(fstype), flags, enc(data)),
         f"mount {target}")


def _map(uid_map: str, gid_map: str) -> None:
  for name, text in (("setgroups", "deny"), ("uid_map", uid_map), ("gid_map", gid_map)):
    with open(f"/proc/self/{name}", "w") as f:
      f.write(text)


def _mounts(spec: dict) -> None:
  """In the sandbox (pid 1): mount, network, IPC and UTS namespaces, a fresh /proc, the folders
  hidden, a tmpfs cwd with the job, the rest read-only; not root, a nested user namespace."""
  user = spec["mode"] == "user"
  with open(os.path.join(spec["box"], "job.json"), "rb") as f:
    job = f.read()
  _check(_libc().unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  keep = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in spec["keep"]]
  for folder in spec["hide"]:  # parents first
    os.makedirs(folder, exist_ok=True)
    _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
  for path, fd in keep:
    os.makedirs(path, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    os.close(fd)
  box, owner = spec["box"], "" if user else f",uid={spec['uid']},gid={spec['uid']}"
  os.makedirs(box, exist_ok=True)
  _mount("tmpfs", box, "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={spec['box_mb']}m,nr_inodes=4096,mode=700{owner}")
  fd = os.open(os.path.join(box, "job.json"), os.O_WRONLY | os.O_CREAT, 0o600)
  os.write(fd, job)
  if not user:
    os.fchown(fd, spec["uid"], spec["uid"])
  os.close(fd)
  _read_only(box)
  if user:
    _check(_libc().unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare (nested user namespace)")
    _map(f"{INNER_UID} 0 1", f"{INNER_UID} 0 1")


def _read_only(box: str) -> None:
  """Every mount but `box` (and /proc's) read-only, in this mount namespace."""
  with open("/proc/self/mountinfo") as f:
    mounts = [line.split() for line in f]
  unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)
  for fields in mounts:
    target, options = unescape(fields[4]), fields[5].split(",")
    if "ro" in options or target in (box, "/proc") or target.startswith("/proc/"):
      continue
    try:
      _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY |
             sum(MOUNT_FLAGS.get(o, 0) for o in options))
    except OSError:
      if os.path.ismount(target):  # else under another mount: out of reach already
        raise


def _drop(uid: int) -> None:
  """To `uid`, for good (no groups, no capabilities); never to root."""
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  if uid == 0 or os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
    raise OSError(f"could not drop to uid {uid}")


def _exec(spec: dict) -> None:
  """In the sandbox: a session of its own (kill(0) reaches no launcher), the limits, the uid,
  no new privileges, death with the launcher, the cwd, stderr to /dev/null, the interpreter."""
  os.setsid()
  for res, soft, hard in spec["rlimits"]:
    resource.setrlimit(res, (soft, hard))
  if spec["uid"] is not None:
    _drop(spec["uid"])
  _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
  _check(_libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
  os.chdir(spec["box"])
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the original closed on exec
  os.execve(spec["python"], spec["argv"], spec["env"])
