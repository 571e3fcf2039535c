"""libtpu on a host without a TPU: the start-up lines it prints there (a compile-only plan, or
a machine with the tpu extra installed) are expected and read by users as failures; they are
kept out of the output, and any other line it prints, a real error, is kept.

libtpu writes to file descriptor 2 beneath Python, once a process, when it starts (the first
`get_topology_desc`, or the first backend start). `quiet()` holds fd 2 while a block runs and
writes back all but those lines; `start_backends()` starts jax's backends inside it, which the
CLI does for every command once the config is valid.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile


# What libtpu prints when it starts on a host without a TPU (a compile-only plan): expected
# there, and read by users as a failure. Each pattern is one line; a trace ("=== Source Location
# Trace: ===" and the paths under it) goes with the line before it.
LIBTPU_NOISE = re.compile(
    r"Failed to find host bounds for accelerator type: WARNING: could not determine TPU "
    r"accelerator type|WARNING: Logging before InitGoogle\(\) is written to STDERR|"
    r"[EW]\d{4} .*unexpected worker hostname 'WARNING: could not determine TPU worker")


def quiet_lines(text: str) -> str:
  """`text` without libtpu's start-up complaints on a host with no TPU (`LIBTPU_NOISE`, with
  the traces under them); every other line, a real libtpu error's too, kept."""
  kept, dropping = [], False
  for line in text.splitlines(keepends=True):
    trace = line.startswith("=== Source Location Trace") or (
        dropping and re.match(r"\S+\.(cc|h):\d+\s*$", line))
    dropping = bool(LIBTPU_NOISE.match(line)) or (dropping and bool(trace))
    if not dropping:
      kept.append(line)
  return "".join(kept)


@contextlib.contextmanager
def quiet():
  """What is written to file descriptor 2 inside the block (libtpu logs there, beneath
  Python) held, then written back through `quiet_lines`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = quiet_lines(held.read().decode(errors="replace"))
      if text:
        sys.stderr.write(text)
        sys.stderr.flush()


def start_backends() -> None:
  """jax's backends started (libtpu's start-up lines dropped, as `quiet` does)."""
  import jax  # the CLI calls this once the config is valid: jax loads here, not before

  with quiet():
    jax.devices()
