"""The one place that knows the device mesh and how arrays map onto it.

Axes: 'fsdp' (data parallel + parameter sharding) and 'tp' (tensor parallel). Model code only
names these axes through Tunix's ShardingConfig, built here; batches shard over 'fsdp'.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner.config import ConfigError, MeshConfig

AXES = ("fsdp", "tp")


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int]:
  """Resolves -1 and checks that fsdp * tp equals the device count."""
  fsdp, tp = cfg.fsdp, cfg.tp
  if fsdp == -1:
    if n_devices % tp:
      raise ConfigError(f"config key 'mesh.tp' = {tp}: expected a divisor of the "
                        f"{n_devices} devices")
    fsdp = n_devices // tp
  elif tp == -1:
    if n_devices % fsdp:
      raise ConfigError(f"config key 'mesh.fsdp' = {fsdp}: expected a divisor of the "
                        f"{n_devices} devices")
    tp = n_devices // fsdp
  if fsdp * tp != n_devices:
    raise ConfigError(f"config key 'mesh' = fsdp {fsdp} x tp {tp}: expected a product equal to "
                      f"the {n_devices} devices")
  return fsdp, tp


def make_mesh(cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) axis over 'fsdp', the rest replicated."""
  return NamedSharding(mesh, P("fsdp", *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def row_axis(mesh: Mesh, rows: int) -> str | None:
  """'fsdp' where `rows` divide evenly over it; otherwise (a few prompts shared by their G
  completions) None: replicated."""
  return "fsdp" if rows % mesh.shape["fsdp"] == 0 else None


def batch_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Rows split over 'fsdp' where they divide evenly (`row_axis`), otherwise replicated."""
  return batch_sharding(mesh, len(shape)) if row_axis(mesh, shape[0]) else replicated(mesh)


def activation_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """[B, T, D] activations: rows over 'fsdp' where they divide evenly (`row_axis`), the model
  dimension over 'tp' where it divides (Tunix's act_btd for training)."""
  rows = row_axis(mesh, shape[0])
  model = "tp" if mesh.shape["tp"] > 1 and shape[-1] % mesh.shape["tp"] == 0 else None
  return NamedSharding(mesh, P(rows, *([None] * (len(shape) - 2)), model))


def micro_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Micro-batches stacked on a leading axis, [K, rows, ...]: each placed as `batch_placement`
  places a batch of its own shape."""
  return NamedSharding(mesh, P(None, *batch_placement(mesh, shape[1:]).spec))


def put_batch(mesh: Mesh, host: np.ndarray) -> jax.Array:
  """Places a host batch (the same on every process) as `batch_placement` says, built from
  each host's copy, never device_put."""
  return array_from_host(host.shape, batch_placement(mesh, host.shape), lambda idx: host[idx])


def replicate_unplaced(tree: Any, mesh: Mesh) -> Any:
  """Small arrays not yet on the mesh (step counters, PRNG keys) replicated over it, built from
  each host's copy, so that checkpoints restore them onto the mesh too."""
  rep = replicated(mesh)

  def place(x):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      return x
    host = np.asarray(x)
    return array_from_host(host.shape, rep, lambda idx: host[idx])

  return jax.tree.map(place, tree)


def array_from_host(shape: tuple[int, ...], sharding: NamedSharding,
                    read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """Builds a global array shard by shard: `read(index)` returns only that shard's block.

  Never `device_put` of a whole host array onto a replicated sharding (on several hosts that
  runs an equality check that allgathers the tensor); each device gets just its slice.
  """
  return jax.make_array_from_callback(shape, sharding, read)


def shard_fraction(arr: jax.Array) -> float:
  """Fraction of the array's elements held by one addressable shard (1/N when fully split)."""
  shard = arr.addressable_shards[0].data
  return math.prod(shard.shape) / max(1, math.prod(arr.shape))


def agreed(value: int) -> int:
  """Process 0's value on every process: decisions that start collective work (resume step,
  whether to evaluate) must not depend on when each process looked at the run directory."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def largest(value: int) -> int:
  """The largest of the processes' values, on every process: a signal that reached one host
  stops all of them at the same step (a TPU VM's hosts are not signalled at the same instant)."""
  if jax.process_count() == 1:
    return value
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))
