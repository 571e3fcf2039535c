"""`train.compile_cache`: a second process reads the programs the first compiled; a folder it
cannot trust or write is one line and no cache; a cache already set is left alone."""

import os
import subprocess
import sys

import jax
import pytest

from conftest import ROOT
from reasoner.config import ConfigError, load_config
from reasoner.engine import session

SCRIPT = """
import sys
import jax, jax.numpy as jnp
from reasoner.engine import session
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
print(session.compile_cache(sys.argv[1], min_seconds=0))
print(float(jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3)(jnp.ones((8, 8)))))
print(len(hits))
"""


def _process(folder) -> list[str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "REASONER_TEST_"))}
  out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  return out.stdout.split()


def test_a_second_process_reads_the_first_ones_program(tmp_path):
  folder = tmp_path / "cache"
  first = _process(folder)
  assert first[0] == str(folder) and first[2] == "0"  # compiled, and kept
  kept = [p.name for p in folder.iterdir() if p.name.endswith("-cache")]
  assert kept and oct(folder.stat().st_mode & 0o777) == oct(0o700)
  second = _process(folder)  # every program read from the folder, to the same result
  assert second[1] == first[1] and second[2] == str(len(kept))


def test_an_unsafe_or_unusable_folder_is_one_line_and_no_cache(tmp_path):
  lines = []
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o777)
  (tmp_path / "file").write_text("")
  ours = jax.config.jax_compilation_cache_dir  # the suite's, unset for the two calls
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    assert session.compile_cache(str(shared), log=lines.append) is None
    assert session.compile_cache(str(tmp_path / "file" / "c"), log=lines.append) is None
  finally:
    jax.config.update("jax_compilation_cache_dir", ours)
  assert len(lines) == 2
  assert "writable by other users" in lines[0] and str(shared) in lines[0]
  assert lines[1].startswith("compile cache: off (") and "train.compile_cache" in lines[1]


def test_a_cache_already_set_is_left_alone(tmp_path):
  ours = jax.config.jax_compilation_cache_dir  # the suite's (tests/conftest.py)
  assert ours and session.compile_cache(str(tmp_path / "other")) == ours
  assert not (tmp_path / "other").exists() and jax.config.jax_compilation_cache_dir == ours


def test_an_empty_folder_name_is_refused():
  with pytest.raises(ConfigError, match="train.compile_cache"):
    load_config(str(ROOT / "configs/tiny.yaml"), ["train.compile_cache=' '"])
  assert load_config(str(ROOT / "configs/tiny.yaml"),
                     ["train.compile_cache=null"]).train.compile_cache is None
