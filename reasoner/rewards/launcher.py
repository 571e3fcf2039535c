"""The sandbox's launcher, run by `reasoner.rewards.sandbox` as a new process (`-I -S`, a
session of its own): it forks the sandbox, which sets itself up as its spec says (namespaces,
mounts, rlimits, uid) and execs the interpreter; then it waits for it, kills and reaps all it
left (its subreaper; without a pid namespace, all of the uid's processes) and exits with its
status. It imports nothing of the project: the module runs before anything else is set up.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import resource
import signal

SETUP_FAILED = 125  # the launcher's exit status when it could not set the sandbox up
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
INNER_UID = 1000  # the code's uid in the nested user namespace (not root)


def main(arg: str) -> None:
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
