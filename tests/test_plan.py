"""The planner: loop bodies counted once per trip, the search, and plans of the tiny config."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import ROOT, tiny_config
from reasoner import mesh as mesh_lib
from reasoner import chips
from reasoner.engine import layout as layout_lib
from reasoner.planner import hlo, libtpu, plan, report as report_lib

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_scan_flops_are_counted_once_per_trip():
  def f(x, w):
    def body(c, xi):
      return c + jnp.sum(jnp.tanh(xi @ w)), None
    return jax.lax.scan(body, 0.0, x)[0]

  k, m, n, d = 12, 16, 32, 64
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((k, m, n), jnp.float32),
                              jax.ShapeDtypeStruct((n, d), jnp.float32)).compile()
  flops, traffic = hlo.hlo_cost(compiled.as_text())
  assert flops == 2 * m * n * d * k
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  assert xla["flops"] < 2 * 2 * m * n * d  # XLA: the body once
  assert traffic >= k * (m * n + n * d) * 4  # every trip reads its slice and the weights


STEP2 = """
%cond (p: (u32[], f32[4,8])) -> pred[] {
  %p = (u32[], f32[4,8]{1,0}) parameter(0)
  %n = u32[] constant(8)
  %i = u32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (u32[], f32[4,8])) -> (u32[], f32[4,8]) {
  %p.1 = (u32[], f32[4,8]{1,0}) parameter(0)
  %i.1 = u32[] get-tuple-element(%p.1), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p.1), index=1
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %two = u32[] constant(2)
  %next = u32[] add(%i.1, %two)
  ROOT %t = (u32[], f32[4,8]{1,0}) tuple(%next, %d)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %zero = u32[] constant(0)
  %init = (u32[], f32[4,8]{1,0}) tuple(%zero, %a)
  %loop = (u32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_trip_count_from_the_induction_variable():
  """A loop XLA left without known_trip_count (TPU's windowed einsums step by 2): i = 0, 2,
  4, 6 -> 4 trips, not the bound 8."""
  assert hlo.hlo_cost(STEP2)[0] == 4 * 2 * 4 * 8 * 8


def test_collectives_of_a_sharded_loop_are_counted_once_per_trip_as_in_the_hlo():
  """A loop whose matmul contracts over 'tp' all-reduces its partial sums on every trip: the
  count, group and bytes are the program's, and match the compiled HLO's own ops."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
  split = NamedSharding(mesh, P("fsdp", "tp"))

  def f(x, w):
    body = lambda i, x: jax.lax.with_sharding_constraint(jnp.tanh(x @ w), split)
    return jax.lax.fori_loop(0, 5, body, x)

  text = jax.jit(f).lower(jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=split),
                          jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                               sharding=NamedSharding(mesh, P("tp", None)))
                          ).compile().as_text()
  cost = hlo.analyse(text)
  assert cost.collectives == {chips.Collective("all-reduce", 2, 4 * 64 * 4): 5}  # [16/4, 64] f32
  trips, token = cost.decode_loop()
  assert trips == 5 and token.num_collectives == 1
  comps, _ = hlo.parse_hlo(text)  # the HLO's own count: collective ops in the loop's body
  loop = next(op for c in comps.values() for op in c.values() if op.op == "while")
  body = comps[re.search(r"body=%?([\w.\-]+)", loop.attrs).group(1)]
  assert sum(op.op == "all-reduce" for op in body.values()) == 1
  assert re.search(r'"known_trip_count":\{"n":"5"', loop.attrs)
  chip = chips.CHIPS["v5e"]  # 2 ring steps of 1 us and 1 KiB over a 90 GB/s link
  assert chips.collective_seconds(chips.Collective("all-reduce", 2, 1024), chip) == pytest.approx(
      2e-6 + 1024 / 9e10)


TPU_LIKE = """
%fused (param_0: bf16[2,32,8]) -> bf16[2,32,64] {
  %param_0 = bf16[2,32,8]{1,2,0:T(8,128)(2,1)} parameter(0)
  %ag = bf16[2,32,64]{1,2,0:T(8,128)(2,1)S(1)} all-gather(%param_0), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, dimensions={2}
  ROOT %cc = bf16[2,32,64]{1,2,0:T(8,128)(2,1)S(1)} custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

ENTRY %main (a: f32[64,128], b: bf16[2,32,8], c: f32[4,1]) -> f32[64,128] {
  %a = f32[64,128]{1,0:T(8,128)} parameter(0)
  %b = bf16[2,32,8]{1,2,0:T(8,128)(2,1)} parameter(1)
  %c = f32[4,1]{0,1:T(1,128)} parameter(2)
  %cs = (f32[64,128]{1,0:T(8,128)S(1)}, f32[64,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%a)
  %cd = f32[64,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  %fu = bf16[2,32,64]{1,2,0:T(8,128)(2,1)S(1)} fusion(%b), kind=kCustom, calls=%fused
  %ps = (f32[4,1]{0,1:T(1,128)S(1)}, f32[4,1]{0,1:T(1,128)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%c), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %pd = f32[4,1]{0,1:T(1,128)S(1)} collective-permute-done(%ps)
  %ss = ((f32[64,128]{1,0:T(8,128)}), f32[16,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:16], [0:128]}
  %sd = f32[16,128]{1,0:T(8,128)S(1)} slice-done(%ss)
  ROOT %e = f32[64,128]{1,0:T(8,128)} exponential(%cd)
}
"""


def test_on_chip_buffers_are_not_hbm_traffic_and_async_collectives_count_once():
  """TPU's HLO: a prefetch into VMEM (`S(1)`) reads its HBM source once (a sliced prefetch
  only its part); the on-chip copy, the fusion's VMEM result and each -done move no HBM bytes;
  a collective inside a fusion and a -start/-done pair count once each, groups from the mesh
  form and the permute's pairs."""
  cost = hlo.analyse(TPU_LIKE)
  a, b, c = 64 * 128 * 4, 2 * 32 * 8 * 2, 4 * 4
  # copy-start reads a, the fusion b, the permute c, the slice-start a quarter of a; the
  # exponential writes its HBM result (its input is on chip)
  assert cost.bytes == a + b + c + a // 4 + a
  assert cost.collectives == {
      chips.Collective("all-gather", 8, 2 * 32 * 64 * 2): 1,
      chips.Collective("collective-permute", 2, 16): 1}


def test_one_async_collective_split_over_fusions_counts_once_per_channel():
  """TPU splits one asynchronous all-gather into a start fusion, a continuation fused with the
  dot it overlaps, and a done fusion, each holding the op with one channel_id: one gather (read
  in the tiny model's v5e log-prob forward, docs/LOG.md); another channel is another gather."""
  ag = ("  %ag{i} = bf16[2,32,64]{{1,2,0}} all-gather(%p{i}), channel_id={ch}, "
        "replica_groups=mesh['axis_0'=8] {{'axis_0'}}, dimensions={{2}}\n")
  comps, calls = "", ""
  for i, ch in enumerate([7, 7, 7, 9]):
    comps += (f"%f{i} (p{i}: bf16[2,32,8]) -> bf16[2,32,64] {{\n"
              f"  %p{i} = bf16[2,32,8]{{1,2,0}} parameter(0)\n" + ag.format(i=i, ch=ch)
              + f"  ROOT %r{i} = bf16[2,32,64]{{1,2,0}} copy(%ag{i})\n}}\n\n")
    calls += f"  %u{i} = bf16[2,32,64]{{1,2,0}} fusion(%b), kind=kCustom, calls=%f{i}\n"
  text = (comps + "ENTRY %main (b: bf16[2,32,8]) -> bf16[2,32,64] {\n"
          "  %b = bf16[2,32,8]{1,2,0} parameter(0)\n" + calls
          + "  ROOT %o = bf16[2,32,64]{1,2,0} copy(%u3)\n}\n")
  assert hlo.analyse(text).collectives == {chips.Collective("all-gather", 8, 2 * 32 * 64 * 2): 2}


@pytest.mark.parametrize("target,remat", [("cpu", "none"), ("cpu", "block"),
                                           pytest.param("v5e:2x4", "block", marks=pytest.mark.skipif(
                                               not HAS_LIBTPU, reason="libtpu is not installed"))])
def test_each_layer_kernel_is_gathered_once_a_pass(target, remat):
  """Issue 39: the log-prob forward gathers each layer's kernels at most once for the prompt and
  the completions together; the train step at most once a direction (forward, backward, and the
  remat recompute). Counted in the compiled program's HLO (once per channel), for the tiny
  model split over 8 chips by fsdp; an all-gather of a kernel's size, in its dtype or bf16."""
  from reasoner.build import build

  cfg = tiny_config("data.max_prompt_tokens=64", "rollout.max_new_tokens=32",
                    f"model.remat={remat}")
  devices, chip, _ = plan.target(target)
  setup = build(cfg, abstract=True, devices=devices)
  assert dict(setup.mesh.shape) == {"fsdp": 8, "tp": 1}
  vocab = max(x.shape[0] for x in jax.tree.leaves(setup.base))
  kernels = [x for x in jax.tree.leaves(setup.base) if x.ndim >= 2 and x.shape[0] != vocab]
  assert len(kernels) == 6 * setup.spec.num_layers  # q, kv, o, gate, up, down
  sizes = {x.size * b for x in kernels for b in (2, 4)}

  def gathers(p):
    return sum(n for c, n in p.collectives.items() if c.kind == "all-gather" and c.bytes in sizes)

  forward = plan.reference_plan(setup, cfg.train.batch_size, chip)
  train = plan.train_plan(setup, cfg.train.batch_size, chip)
  assert 0 < gathers(forward) <= len(kernels), forward.collectives
  assert 0 < gathers(train) <= (3 if remat == "block" else 2) * len(kernels), train.collectives


def test_search_finds_the_largest_fitting_batch_in_few_compiles():
  calls = []

  def measure(u):  # memory 1 + 0.3 u GiB, limit 16 GiB -> 50 fits, 51 does not
    calls.append(u)
    total = int((1 + 0.3 * u) * chips.GiB)
    return plan.StepPlan("train", u, u, temporaries=total, fits=total <= 16 * chips.GiB)

  tried = plan.largest_fitting(measure, 4, 1, 16 * chips.GiB, cap=4096, budget=8)
  assert max(u for u, r in tried.items() if r.fits) == 50
  assert 51 in tried and not tried[51].fits and len(calls) <= 5
  # Starting above the limit: halve to a fit, then bisect (not step down one at a time).
  calls.clear()
  tried = plan.largest_fitting(measure, 256, 1, 16 * chips.GiB, cap=4096, budget=8)
  assert max(u for u, r in tried.items() if r.fits) == 50 and len(calls) <= 8


def test_analytic_plan_of_the_tiny_config():
  cfg = tiny_config()
  report = plan.plan(cfg, "v5e:2x4", search=True, analytic=True)
  assert "analytic" in report["method"]
  for what in ("train", "rollout"):
    r = report[what]
    assert r.total > 0 and r.flops > 0 and r.fits
    assert report["largest"][what].prompts >= r.prompts
  assert "analytic" in report_lib.format_report(report)


def test_a_quantised_base_is_planned_with_fewer_bytes():
  """QLoRA: the compiled train step's arguments (XLA's figure on this host) and the analytic
  estimate's both shrink by the kernels' bytes."""
  small = ("data.max_prompt_tokens=64", "rollout.max_new_tokens=8", "lora.base_tile_size=32")
  for analytic in (False, True):
    f, q = (plan.plan(tiny_config(*small, f"lora.base_qtype={t}"), "cpu", search=False,
                      analytic=analytic)["train"] for t in ("none", "nf4"))
    assert q.arguments < 0.9 * f.arguments, (analytic, q.arguments, f.arguments)


def test_compiled_plan_of_the_tiny_config_on_this_host():
  report = plan.plan(tiny_config("data.max_prompt_tokens=64", "rollout.max_new_tokens=32"),
                     "cpu", search=False)
  train, rollout = report["train"], report["rollout"]
  assert train.rows == 2 * 4 and train.temporaries > 0 and train.arguments > 0
  assert 0.5 < train.flops / train.xla_flops < 2  # no long loops: matmuls ~ XLA's count
  assert rollout.flops > 1.2 * rollout.xla_flops  # 32 decode steps, XLA counts one
  # The sampler's KV-cache estimate is printed beside the compiled figure and fits inside it.
  assert 0 < rollout.kv_cache <= rollout.temporaries
  assert rollout.kv_local == rollout.kv_cache  # the tiny model's 2 layers: sliding-window ones
  text = report_lib.format_report(report)
  assert "KV cache" in text and "(global layers 0.0, sliding-window layers" in text
  # each program's collectives grouped by kind, group and size, the longest first
  rows = re.findall(r"all-gather +of 8 chips +([\d.]+) MiB x +(\d+) = +([\d.]+) ms", text)
  assert rows and all(float(ms) > 0 and int(n) > 0 for _, n, ms in rows)


@pytest.mark.parametrize("remat", ["block", "decoder"])
def test_plan_with_each_remat(remat):
  """Tunix's remat is nnx.remat: the train step's gradient must be an nnx transform, and the
  rollout (no gradient, remat changes nothing) is planned without it."""
  report = plan.plan(tiny_config("data.max_prompt_tokens=64", f"model.remat={remat}"), "cpu",
                     search=False)
  for what in ("train", "rollout"):
    assert report[what].fits and report[what].temporaries > 0 and report[what].flops > 0


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (the tpu extra)")
def test_compiled_plan_of_the_tiny_config_for_v5e():
  # weights sharded for training (auto would take the tiny model whole: no gathers to count)
  report = plan.plan(tiny_config("data.max_prompt_tokens=64", "rollout.max_new_tokens=32",
                                 "mesh.weights=sharded"), "v5e:2x4", search=False)
  assert "libtpu" in report["method"]
  assert report["train"].fits and 0 < report["train"].total < chips.GiB
  assert report["rollout_train"].flops > 1.2 * report["rollout_train"].xla_flops  # 32 steps
  # auto decodes with the whole tiny model on each chip: one collective a token (whether all
  # rows are done), where the training layout takes dozens.
  decode, train_layout = report["rollout"], report["rollout_train"]
  assert decode.layout == "replicated" and decode.token.num_collectives == 1
  assert train_layout.token.num_collectives > 20
  assert decode.seconds(report["chip"]) < 0.4 * train_layout.seconds(report["chip"])
  assert "steps in a 9-hour session" in report_lib.format_report(report)


def test_auto_decode_layout_is_the_fastest_whose_weights_fit_a_quarter_of_a_chip():
  from reasoner.build import build

  setup = build(tiny_config(), abstract=True)
  weights = layout_lib.nbytes(setup.base)
  chip = chips.CHIPS["v5e"]
  assert layout_lib.decode_layout(setup) == "train"  # XLA:CPU: no memory figure, no copies
  assert layout_lib.decode_layout(setup, 4 * weights, chip) == "replicated"  # no collective at all
  # tp8's copy, the smallest: 1/8 of the weights, the attention's whole (one KV head: over rows)
  eighth = layout_lib.copy_bytes(setup, setup.base, 8)
  attention = layout_lib.nbytes(setup.base, mesh_lib.in_attention)
  assert eighth == (weights - attention) / 8 + attention < layout_lib.copy_bytes(setup,
                                                                                setup.base, 4)
  assert layout_lib.decode_layout(setup, 4 * eighth + 8, chip) == "tp8"  # only tp8's copy fits
  assert layout_lib.decode_layout(setup, 1, chip) == "train"  # no copy fits
  est = {k: layout_lib.decode_estimate(setup, k, chip) for k in (1, 2, 8)}
  assert est[1]["interconnect"] == 0 < est[2]["interconnect"] < est[8]["interconnect"]
  lora = layout_lib.nbytes(setup.lora)  # each chip reads its share of the weights, and its rows'
  for k in (1, 2, 8):  # KV cache, more of it the fewer chips the rows split over
    assert est[k]["HBM"] > (weights + lora) / k / chip.bandwidth
  assert layout_lib.decode_layout(build(tiny_config("rollout.layout=tp2"), abstract=True)) == "tp2"


def test_attention_over_rows_keeps_two_collectives_a_layer():
  """The tiny model (one KV head) decoding in tp4 on 8 CPU devices: attention runs over each
  chip's own rows (its cache's rows split over all 8 chips), the residual stream stays on them,
  and a decoded token takes two collectives a layer (the MLP's input gathered, its output's
  shares sent to their rows' chips: an all-to-all; the last layer's output reduced whole for
  the head) and two more (the head's candidates, "all done?"), none of them vocabulary-sized."""
  from reasoner.build import build
  from reasoner.models.cache import kv_cache_bytes

  setup = build(tiny_config("rollout.layout=tp4", "data.max_prompt_tokens=64"), abstract=True)
  r = plan.rollout_plan(setup, 4, chips.CHIPS["v5e"])
  layers, t = setup.spec.num_layers, setup.spec.tunix_config
  assert r.layout == "tp4" and 0 < r.token.num_collectives <= 2 * layers + 2
  assert max(c.bytes for c in r.token.collectives) < 16 * t.num_embed * 4 / 2  # [16, V] f32
  rows = 8 * t.embed_dim * 4  # a tp group's 8 rows' f32 activations
  count = lambda kind: sum(n for c, n in r.token.collectives.items()
                           if c.kind == kind and c.group == 4 and c.bytes == rows)
  assert count("all-gather") == layers  # each MLP's input
  assert count("all-to-all") == layers - 1  # each MLP's output to its rows' chips, but the last
  assert count("all-reduce") == 1  # the last layer's, whole for the head
  mesh = mesh_lib.decode_mesh(setup.mesh, "tp4")
  args = (t, 4, 4, 64, setup.cfg.rollout.max_new_tokens, setup.cfg.model.dtype, mesh, True)
  assert r.kv_cache == kv_cache_bytes(*args, over_rows=True) < kv_cache_bytes(*args)


def test_plan_command_line(capsys):
  from reasoner import cli

  tiny = str(ROOT / "configs" / "tiny.yaml")
  assert cli.main(["plan", "--config", tiny, "--analytic", "--no-search"]) == 0
  out = capsys.readouterr().out
  assert "per chip" in out and "train" in out and "rollout" in out
  assert cli.main(["plan", "--config", tiny, "--topology", "v9x"]) == 2


# libtpu 0.0.42.1 starting on a CPU host (a compile-only plan), as printed on this machine
LIBTPU_START = (
    "Failed to find host bounds for accelerator type: WARNING: could not determine TPU "
    "accelerator type, please set env var `TPU_ACCELERATOR_TYPE` manually, otherwise libtpu.so "
    "may not properly initialize.\n"
    "WARNING: Logging before InitGoogle() is written to STDERR\n"
    "E0000 00:00:1795682730.595588    5835 common_lib.cc:554] INVALID_ARGUMENT: Error: "
    "unexpected worker hostname 'WARNING: could not determine TPU worker hostnames or IP "
    "addresses' from env var TPU_WORKER_HOSTNAMES. Expecting a valid hostname or IP address\n"
    "=== Source Location Trace: === \n"
    "learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n")


def test_libtpu_start_up_lines_are_dropped_and_real_errors_kept():
  real = ("E0000 00:00:1.5 77 tpu_compiler.cc:10] INTERNAL: the compile failed\n"
          "=== Source Location Trace: ===\nlearning/tpu_compiler.cc:12\n")
  assert libtpu.quiet_lines(LIBTPU_START) == ""
  assert libtpu.quiet_lines(LIBTPU_START + real + "done\n") == real + "done\n"
  assert libtpu.quiet_lines(real + LIBTPU_START) == real


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (the tpu extra)")
def test_commands_print_nothing_of_libtpus_start_up():
  """`reasoner plan` in a fresh process (libtpu starts there): the plan on stdout, its own
  progress lines on stderr, and none of what libtpu prints on a host without a TPU; nor does
  any other command (jax's backends start under the same filter)."""
  out = subprocess.run([sys.executable, "-m", "reasoner", "plan", "--config",
                        str(ROOT / "configs" / "tiny.yaml"), "--no-search",
                        "data.max_prompt_tokens=64", "rollout.max_new_tokens=16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "compiled ahead of time for v5e:2x4 (libtpu)" in out.stdout
  assert "train step" in out.stderr  # the planner's own progress
  # any other command: jax's backends start under the same filter (a tiny model's sample)
  tiny = str(ROOT / "configs" / "tiny.yaml")
  sample = subprocess.run([sys.executable, "-m", "reasoner", "sample", "--config", tiny,
                           "--question", "2 + 2?", "eval.max_new_tokens=4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
  assert sample.returncode == 0 and sample.stdout.startswith("[0] "), sample.stderr[-2000:]
  for noise in ("Failed to find host bounds", "InitGoogle", "unexpected worker hostname",
                "Source Location Trace"):
    assert noise not in out.stderr + out.stdout + sample.stderr + sample.stdout


def test_micro_batched_step_is_planned_with_every_pass_counted():
  """train.micro_batch: the step's FLOPs are the one-pass step's (the scan over micro-batches
  counted once per trip), and the row says how many passes."""
  # 2 prompts x G = 4: 8 rows, one per fake device (a micro-batch that does not split over
  # 'fsdp' is computed whole on every chip, which the planner rightly counts per chip).
  cfg = tiny_config("data.max_prompt_tokens=64", "train.batch_size=4", "train.micro_batch=2")
  micro = plan.plan(cfg, "cpu", search=False)["train"]
  one = plan.plan(tiny_config("data.max_prompt_tokens=64", "train.batch_size=4"), "cpu",
                  search=False)["train"]
  assert (micro.micro, one.micro) == (2, 4) and micro.fits
  assert 0.9 < micro.flops / one.flops < 1.1
  assert micro.xla_flops < 0.75 * one.xla_flops  # XLA alone would count one of the 2 passes
  assert "in 2 micro-batches" in report_lib.format_report({**plan.plan(cfg, "cpu", search=False),
                                                     "tried": {}})


def test_planner_finds_the_micro_batch_that_fits():
  """Gemma3-1B at 256 prompts x 8 does not fit a v5e chip in one pass (analytic); the planner
  finds the largest micro-batch that does, and the configured batch in micro-batches of the
  largest divisor of it fits."""
  from reasoner.config import load_config

  cfg = load_config(ROOT / "configs" / "gemma3_1b.yaml",
                    ["train.batch_size=256", "data.max_prompt_tokens=256",
                     "rollout.max_new_tokens=768", "mesh.fsdp=8", "mesh.tp=1"])
  report = plan.plan(cfg, "v5e:2x4", analytic=True)
  assert not report["train"].fits
  best, micro = report["largest"]["train"], report["micro"]
  assert 1 <= best.prompts < 256 and best.fits and best.micro == best.prompts
  assert micro.fits and micro.prompts == 256 and 256 % micro.micro == 0
  assert micro.micro <= best.prompts < 2 * micro.micro  # the largest divisor of 256 that fits
  assert micro.flops == pytest.approx(report["train"].flops)
  assert f"train.micro_batch={micro.micro}" in report_lib.format_report(report)


def test_micro_batch_for_prefers_whole_rows_per_chip():
  assert plan.micro_batch_for(256, 40, 8, 8) == 32  # the largest divisor up to the fit
  assert plan.micro_batch_for(6, 5, 4, 8) == 2  # not 3: 3 x 4 rows do not split over 8 chips
  assert plan.micro_batch_for(3, 3, 1, 8) == 3  # no divisor splits: the largest one


@pytest.mark.parametrize("qtype", ["none", "nf4"])
def test_the_abstract_build_is_the_real_build_without_arrays(qtype):
  """`build(cfg, abstract=True)`, what the planner compiles on: the same graph, and every LoRA
  and base array with the shape, dtype and sharding the real build gives it (a QLoRA base's
  values and scales too); no records read."""
  from reasoner.build import build

  cfg = tiny_config("model.remat=block", "lora.rank=4", f"lora.base_qtype={qtype}",
                    "lora.base_tile_size=32")
  real, abstract = build(cfg), build(cfg, abstract=True)
  assert repr(abstract.graphdef) == repr(real.graphdef)
  assert abstract.spec == real.spec and abstract.eval_records == []
  for part in ("lora", "base"):
    got, want = getattr(abstract, part), getattr(real, part)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert isinstance(a, jax.ShapeDtypeStruct)
      assert (a.shape, a.dtype, a.sharding) == (w.shape, w.dtype, w.sharding)
  assert abstract.tokenizer.vocab_size == real.tokenizer.vocab_size


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (the tpu extra)")
def test_the_general_presets_12b_judge_is_planned_on_its_four_chips_and_fits():
  """configs/gemma3_1b_general.yaml's judge, a Gemma 3 12B-it of its real shapes (48 layers,
  262,144 vocabulary), compiled ahead of time for v5e:2x4: one batch of 16 prompts of 1,024
  tokens on the last 4 chips fits their 16 GiB; the policy keeps the first 4 (about 2 min on 2
  cores; the whole preset's `reasoner plan`, train step included, takes 7 min 40 s)."""
  from reasoner.build import build
  from reasoner.config import load_config

  cfg = load_config(ROOT / "configs" / "gemma3_1b_general.yaml")
  devices, chip, method = plan.target("v5e:2x4")
  assert "libtpu" in method
  setup = build(cfg, abstract=True, devices=devices)
  judge, where = plan.judge_plan(setup, chip)
  assert where == "4 chips of its own" and setup.mesh.devices.size == 4
  assert judge.fits and 8 * chips.GiB < judge.total < chip.hbm  # 11.45 GiB measured
  assert judge.flops > 2 * 10e9 * 16 * 1024 / 4  # 2 x its ~11B matmul weights x tokens, / 4
