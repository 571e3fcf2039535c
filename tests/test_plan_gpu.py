"""The planner on a GPU (`--topology local` where one is lent): its compiled HLO's tuple-element
operands and cuBLAS matmuls, kernels summed with their launches, and the local target."""

import dataclasses

import pytest

from reasoner.config import ConfigError
from reasoner import chips
from reasoner.planner import hlo, plan

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

# The shape of XLA:GPU's optimised HLO (as bench/device.py's dumps on an H200 show it): a loop
# whose fusions take elements of the loop's tuple (`%p#k`) rather than get-tuple-elements, and a
# cuBLAS matmul whose result is (product, workspace).
GPU_LIKE = """
HloModule jit_generate, entry_computation_layout={()->f32[]}

%fused_add (param_0: f32[1024], param_1: f32[1024]) -> f32[1024] {
  %param_0 = f32[1024]{0} parameter(0)
  %param_1 = f32[1024]{0} parameter(1)
  ROOT %add.1 = f32[1024]{0} add(%param_0, %param_1)
}

%cond (arg_tuple.2: (s32[], f32[1024], f32[65536,1024], f32[16,1024])) -> pred[] {
  %arg_tuple.2 = (s32[], f32[1024]{0}, f32[65536,1024]{1,0}, f32[16,1024]{1,0}) parameter(0)
  %constant.9 = s32[] constant(5)
  ROOT %lt.1 = pred[] compare(%arg_tuple.2#0, %constant.9), direction=LT
}

%body (arg_tuple.1: (s32[], f32[1024], f32[65536,1024], f32[16,1024])) -> (s32[], f32[1024], f32[65536,1024], f32[16,1024]) {
  %arg_tuple.1 = (s32[], f32[1024]{0}, /*index=2*/f32[65536,1024]{1,0}, f32[16,1024]{1,0}) parameter(0)
  %fusion.1 = f32[1024]{0} fusion(%arg_tuple.1#1, %arg_tuple.1#1), kind=kLoop, calls=%fused_add
  %custom-call.1 = (f32[16,65536]{1,0}, s8[33554432]{0}) custom-call(%arg_tuple.1#3, %arg_tuple.1#2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["1"]}}}
  %constant.1 = s32[] constant(1)
  %add.2 = s32[] add(%arg_tuple.1#0, %constant.1)
  ROOT %tuple.1 = (s32[], f32[1024]{0}, f32[65536,1024]{1,0}, f32[16,1024]{1,0}) tuple(%add.2, %fusion.1, %arg_tuple.1#2, %arg_tuple.1#3)
}

ENTRY %main (p0: f32[65536,1024], p1: f32[16,1024]) -> s32[] {
  %p0 = f32[65536,1024]{1,0} parameter(0)
  %p1 = f32[16,1024]{1,0} parameter(1)
  %constant.0 = s32[] constant(0)
  %constant.2 = f32[1024]{0} constant({...})
  %tuple.0 = (s32[], f32[1024]{0}, f32[65536,1024]{1,0}, f32[16,1024]{1,0}) tuple(%constant.0, %constant.2, %p0, %p1)
  %while.1 = (s32[], f32[1024]{0}, f32[65536,1024]{1,0}, f32[16,1024]{1,0}) while(%tuple.0), condition=%cond, body=%body
  ROOT %gte.0 = s32[] get-tuple-element(%while.1), index=0
}
"""


def test_tuple_elements_and_cublas_matmuls_are_read_at_their_own_size():
  h200 = chips.CHIPS["h200"]
  cost = hlo.analyse(GPU_LIKE, h200.flops / h200.bandwidth)
  trips, rows, vocab, d = 5, 16, 65536, 1024
  gemm_flops = 2 * rows * vocab * d
  assert cost.flops == trips * gemm_flops  # the workspace is no product
  weights, x, product, vector = vocab * d * 4, rows * d * 4, rows * vocab * 4, d * 4
  fusion = 3 * vector  # two reads of element 1 and its result, not the whole tuple each
  counter = 3 * 4 + 2 * 4 + 1  # the s32 counter's add and the condition's compare
  assert cost.bytes == trips * (fusion + weights + x + product + counter)
  assert cost.kernels == trips * 4  # fusion, matmul, add and the condition's compare a trip
  # a 16-row product (8 FLOPs a byte of f32 weights) is below the H200's ridge point: every
  # kernel is bound by its bytes
  assert cost.serial_flops == 0 and cost.serial_bytes == cost.bytes
  # where the ridge is below the matmul's intensity, its FLOPs count and its bytes do not
  low = hlo.analyse(GPU_LIKE, 1.0)
  assert low.serial_flops == trips * gemm_flops
  assert low.serial_bytes == cost.bytes - trips * (weights + x + product)


def test_a_gpu_step_is_the_sum_of_its_kernels_bounds_and_launches():
  h200 = chips.CHIPS["h200"]
  p = plan.StepPlan("rollout", 1, 1, flops=4e12, bytes=4.3e11, kernels=1000,
                    serial_flops=7.88e11, serial_bytes=4.3e10)
  t = p.times(h200)
  assert t["FLOPs"] == pytest.approx(1e-3) and t["HBM"] == pytest.approx(1e-2)
  assert t["launch"] == pytest.approx(1000 * h200.launch)
  assert p.seconds(h200) == pytest.approx(1e-3 + 1e-2 + 1000 * h200.launch)
  assert p.bound(h200) == "HBM"
  v5e = chips.CHIPS["v5e"]  # a TPU: the program's largest bound, totals as before
  assert "launch" not in p.times(v5e)
  assert p.seconds(v5e) == pytest.approx(max(4e12 / v5e.flops, 4.3e11 / v5e.bandwidth))


@dataclasses.dataclass
class FakeDevice:
  device_kind: str
  platform: str = "gpu"
  limit: int | None = None

  def memory_stats(self):
    return {"bytes_limit": self.limit} if self.limit else None


def test_local_chips_by_device_kind():
  assert chips.local_chip(FakeDevice("NVIDIA H200", limit=2**36)).hbm == 2**36
  assert chips.local_chip(FakeDevice("NVIDIA H100 80GB HBM3")) == chips.CHIPS["h100"]
  assert chips.local_chip(FakeDevice("TPU v5 lite", "tpu")).name == "TPU v5e"
  assert chips.local_chip(FakeDevice("TPU v6 lite", "tpu")).name == "TPU v6e"
  assert chips.local_chip(FakeDevice("cpu", "cpu")) is None
  assert chips.local_chip(FakeDevice("NVIDIA A10G")) is None


def test_the_local_target_on_a_host_without_an_accelerator_is_one_line():
  with pytest.raises(ConfigError, match=r"--topology local: no chip table for this host's "
                                        r"'cpu' \(cpu\)"):
    plan.target("local")
