"""Tests run on 8 fake CPU devices (a v5e-8's shape); single-device cases use one of them."""

import atexit
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback


# The suite's time is XLA:CPU compiling tiny programs (a GRPO step compiles in seconds and runs
# in milliseconds). Without LLVM's optimisation passes and with the classic fused-loop emitters,
# the tiny GRPO step compiles in 6 s of CPU rather than 14, to the same loss bit for bit (docs/
# LOG.md, 2026-11-28). Collectives wait as long as a loaded two-core host needs: the default
# terminate timeout aborted the process when eight fake devices' threads were starved.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1 "
                "--xla_cpu_collective_call_terminate_timeout_seconds=3600 "
                "--xla_cpu_collective_timeout_seconds=3600")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test's process, or its child's, on `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the whole session (tests/test_faults.py + tests/test_resume.py:
# 679 s -> 339 s), its children's and its own:
# - the child processes the tests start (resume, faults, sessions, export, SFT) keep every
#   program: they compile the same tiny programs again and again;
# - this process, and each pytest-xdist worker, keeps only the programs that took a second or
#   more to compile: the trainers and samplers that tests of several files build with the same
#   settings (test_sft.py alone, side by side: 316 s -> 270 s). Every program (the eager
#   references' ops included) made in-process tests slower than the compiles they share (the SFT
#   dense reference 29 s -> 120 s).
# A size limit turns on the cache's file lock, so that no process reads an entry another is
# still writing. The workers inherit the first process's folder; only that process deletes it.
_CACHE_KEYS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_COMPILATION_CACHE_MAX_SIZE")
_INHERITED = os.environ.get("REASONER_TEST_XLA_CACHE")
_HIDDEN = {k: os.environ.pop(k) for k in _CACHE_KEYS if _INHERITED and k in os.environ}

import jax  # noqa: E402  (jax reads its settings now: the environment's are the children's)

if _INHERITED:
  os.environ.update(_HIDDEN)
else:
  _CACHE = tempfile.mkdtemp(prefix="reasoner-test-xla-cache-")
  _HANGS = tempfile.mkdtemp(prefix="reasoner-test-hangs-")
  for folder in (_CACHE, _HANGS):
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
  os.environ["REASONER_TEST_XLA_CACHE"], os.environ["REASONER_TEST_HANGS"] = _CACHE, _HANGS
  for key, value in zip(_CACHE_KEYS, (_CACHE, "0", "-1", str(8 << 30))):
    os.environ.setdefault(key, value)
jax.config.update("jax_compilation_cache_dir", os.environ["REASONER_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)

import pathlib  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_overrides(tmp_path):
  return [f"train.run_dir={tmp_path}"]


# the variables that send a request through a proxy (urllib's getproxies, httpx, requests)
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy",
           "NO_PROXY", "no_proxy")


def no_kaggle_credentials(monkeypatch, home):
  """No Kaggle credentials anywhere kagglehub looks (the environment, `home`/.kaggle), no
  proxy, and an empty kagglehub cache under `home`."""
  for k in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_CONFIG_DIR",
            "KAGGLE_KERNEL_RUN_TYPE", *PROXIES):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.setenv("KAGGLEHUB_CACHE", str(home / "cache"))


def tiny_config(*overrides, **kw):
  from reasoner.config import load_config

  return load_config(ROOT / "configs" / "tiny.yaml", list(overrides))


def shard_fraction(arr) -> float:
  """Fraction of the array's elements held by one addressable shard (1/N when fully split)."""
  import math

  shard = arr.addressable_shards[0].data
  return math.prod(shard.shape) / max(1, math.prod(arr.shape))


def dense_grade_probs(model, tokenizer, texts, grades):
  """[n, K] a judge's probabilities of the K one-token `grades` among themselves after each
  text: one prompt at a time, no padding, from the full vocabulary's logits."""
  import jax.numpy as jnp
  import numpy as np

  from reasoner.engine import heads
  from reasoner.models.cache import causal_mask, positions_from_mask

  from flax import nnx

  ids = jnp.asarray([tokenizer.encode(g)[0] for g in grades])

  @nnx.jit  # jitted: eager ops on 8 fake devices, each its own rendezvous, aborted XLA:CPU once
  def last_logits(model, tokens):
    valid = jnp.ones_like(tokens, bool)
    h, _ = model.hidden_states(tokens, positions_from_mask(valid), None, causal_mask(valid))
    return heads.logits(h[:, -1], model.embedding(), model.logit_softcap)[0]

  out = []
  for text in texts:
    z = last_logits(model, jnp.asarray([tokenizer.encode(text, add_bos=True)]))
    out.append(np.asarray(jax.nn.softmax(z[ids])))
  return np.stack(out)


def hidden_states(model, *args, **kwargs):
  """`model.hidden_states` as one jitted program: eager ops over 8 fake devices, each its own
  rendezvous, aborted XLA:CPU on a loaded machine (a fresh clone's suite beside a compile)."""
  from flax import nnx

  global _JITTED_HIDDEN
  if _JITTED_HIDDEN is None:
    _JITTED_HIDDEN = nnx.jit(lambda m, *a, **k: m.hidden_states(*a, **k))
  return _JITTED_HIDDEN(model, *args, **kwargs)


_JITTED_HIDDEN = None


# A test that hangs ends the run with its threads' stacks, not at CI's limit. CI timed out at
# 506ae09 (docs/LOG.md, 2026-12-07): one pytest-xdist worker died 98% in, and a worker that
# dies says nothing of where it was (its stderr does not reach the run's output). Past
# HANG_S a test's watchdog writes every thread's stack and its processes' command lines into
# the first process's folder, kills those processes and ends the worker; pytest-xdist (no
# worker restarts: pyproject.toml) then stops, and the summary prints what was written.
HANG_S = float(os.environ.get("REASONER_TEST_HANG_S", 1200))
_RUNNER = ("/_pytest/", "/pluggy/", "/xdist/", "/execnet/")  # frames left out of the stacks


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  done = threading.Event()
  threading.Thread(target=_watch, args=(item.nodeid, done), daemon=True,
                   name="hang-watchdog").start()
  try:
    yield
  finally:
    done.set()


def _watch(nodeid: str, done: threading.Event) -> None:
  if done.wait(HANG_S):
    return
  frames, lines = sys._current_frames(), [f"{nodeid} ran past {HANG_S:g} s (pid {os.getpid()})"]
  for thread in threading.enumerate():
    if thread.ident in frames and thread.name != "hang-watchdog":
      stack = [f for f in traceback.extract_stack(frames[thread.ident])
               if not any(part in f.filename for part in _RUNNER)]
      lines += [f"--- thread {thread.name}:", *traceback.format_list(stack)]
  below = _descendants(os.getpid())
  for pid, command in below:
    lines.append(f"--- process {pid} below it: {command}")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(os.environ["REASONER_TEST_HANGS"], f"{os.getpid()}.txt"), "w") as f:
    f.write(text)
  sys.__stderr__.write(text)  # without pytest-xdist, this process's own output
  sys.__stderr__.flush()
  for pid, _ in below:
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  os._exit(3)


def processes() -> dict[int, tuple[int, int, str]]:
  """Every live process's (parent pid, uid, state letter), read from /proc (one that ends
  while it is read is left out)."""
  table = {}
  for name in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{name}/stat") as f:
        state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
      table[int(name)] = (int(ppid), os.stat(f"/proc/{name}").st_uid, state)
    except (OSError, ValueError):
      continue
  return table


def _descendants(root: int) -> list[tuple[int, str]]:
  """(pid, command line) of every process below `root`."""
  children: dict[int, list[int]] = {}
  for pid, (ppid, _, _) in processes().items():
    children.setdefault(ppid, []).append(pid)
  found, todo = [], list(children.get(root, ()))
  while todo:
    pid = todo.pop()
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
      command = "?"
    found.append((pid, command[:300]))
    todo += children.get(pid, ())
  return found


def pytest_terminal_summary(terminalreporter):
  """The stacks of the tests that hung (above), in the run's output."""
  folder = os.environ.get("REASONER_TEST_HANGS")
  for name in sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else ():
    terminalreporter.write_sep("=", f"a test hung: {name}")
    with open(os.path.join(folder, name)) as f:
      terminalreporter.write(f.read())
