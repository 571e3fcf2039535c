"""Tests run on 8 fake CPU devices (a v5e-8's shape); single-device cases use one of them."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_overrides(tmp_path):
  return [f"train.run_dir={tmp_path}"]


def tiny_config(*overrides, **kw):
  from reasoner.config import load_config

  return load_config(ROOT / "configs" / "tiny.yaml", list(overrides))


def shard_fraction(arr) -> float:
  """Fraction of the array's elements held by one addressable shard (1/N when fully split)."""
  import math

  shard = arr.addressable_shards[0].data
  return math.prod(shard.shape) / max(1, math.prod(arr.shape))
