"""The chips a plan is made for (HBM, peak FLOP/s, HBM and interconnect bandwidths) and the
latency + bandwidth ring model of a collective's time on them."""

from __future__ import annotations

import dataclasses

GiB = 2**30
SESSION = 9 * 3600  # seconds of a Kaggle TPU session


@dataclasses.dataclass(frozen=True)
class Collective:
  """One kind of collective op: its kind, the chips in each group and the bytes of the
  array it produces (reduce-scatter: consumes) on each chip."""

  kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
  group: int
  bytes: float


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  hbm: int  # bytes
  flops: float  # peak bf16 FLOP/s
  bandwidth: float  # HBM bytes/s
  ici: float  # interconnect bytes/s of one link, both directions (a ring sends half each way)
  hop: float = 1e-6  # seconds per step of a ring collective (latency)
  # seconds a kernel costs beyond its own work, where kernels run one after another, each
  # launched by the host (a GPU): a step is then the sum of each kernel's own bound plus this
  # for every kernel (`StepPlan.times`). 0: a TPU's program, whose compute and HBM traffic
  # overlap across it (the step is its largest bound).
  launch: float = 0.0


# HBM, FLOP/s and ICI link bandwidths: the chip tables of "How to Scale Your Model" (Austin et
# al., 2025, jax-ml.github.io/scaling-book, "All About TPUs"), which take them from Google's
# Cloud TPU pages: v5e 4.5e10 B/s one way a link (9e10 both ways), v5p and v6e 9e10, v4 4.5e10.
# The ~1 us a hop is that book's order of magnitude for ICI latency: an assumption, which
# matters only for small collectives, where it is the whole cost.
CHIPS = {"v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 9e10),
         "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 1.8e11),
         "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, 1.8e11),
         "v4": Chip("TPU v4", 32 * GiB, 275e12, 1228e9, 9e10),
         # GPUs, for `--topology local` where one is lent (bench/device.py); the HBM is then the
         # device's own limit. The rates are those seen on this workplace's machines (an 8192^3
         # bf16 matmul, a device-to-device copy: 798 / 788 TFLOP/s, 3.0 / 4.3 TB/s), not the
         # datasheets' 989 and 3.35 / 4.8; NVLink 900 GB/s a GPU. The launch cost was fitted on
         # the H200 (`make bench BENCH=device`: the rollouts' decode loops, launch-bound, gave
         # 2.35 and 2.45 us a kernel).
         "h100": Chip("NVIDIA H100", 80 * GiB, 798e12, 3.0e12, 9e11, launch=2.5e-6),
         "h200": Chip("NVIDIA H200", 141 * 10**9, 788e12, 4.3e12, 9e11, launch=2.5e-6)}
# jax's device_kind -> CHIPS key (TPU v5e and v6e report themselves as "lite")
KINDS = {"tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5p": "v5p", "tpu v5": "v5p",
         "tpu v6 lite": "v6e", "tpu v6e": "v6e", "tpu v4": "v4", "h100": "h100", "h200": "h200"}


def chip_of(device_kind: str, hbm: int | None = None) -> Chip | None:
  """The chip table of a jax `device_kind` (its HBM `hbm` where given: the device's own
  limit), or None for a kind without one."""
  kind = device_kind.lower()
  key = next((v for k, v in KINDS.items() if k in kind), None)
  if key is None:
    return None
  return dataclasses.replace(CHIPS[key], hbm=int(hbm)) if hbm else CHIPS[key]


def local_chip(device) -> Chip | None:
  """`chip_of` a local jax device, or None for a CPU or an unknown accelerator."""
  if device.platform == "cpu":
    return None
  return chip_of(device.device_kind, (device.memory_stats() or {}).get("bytes_limit"))


def collective_seconds(c: Collective, chip: Chip) -> float:
  """Latency + bandwidth time of one collective done as a ring over its group of n chips:
  an all-reduce takes 2 (n - 1) steps and puts 2 (n - 1) / n of its bytes on each chip's links,
  an all-gather, reduce-scatter or all-to-all n - 1 steps and (n - 1) / n, a permute one step
  and its bytes."""
  n = c.group
  if n <= 1:
    return 0.0
  steps, wire = {"all-reduce": (2 * (n - 1), 2 * (n - 1) / n),
                 "collective-permute": (1, 1.0)}.get(c.kind, (n - 1, (n - 1) / n))
  return steps * chip.hop + wire * c.bytes / chip.ici

