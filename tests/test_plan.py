"""The planner: loop bodies counted once per trip, the search, and plans of the tiny config."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT, tiny_config
from reasoner import hlo, plan

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


def test_search_finds_the_largest_fitting_batch_in_few_compiles():
  calls = []

  def measure(u):  # memory 1 + 0.3 u GiB, limit 16 GiB -> 50 fits, 51 does not
    calls.append(u)
    total = int((1 + 0.3 * u) * plan.GiB)
    return plan.StepPlan("train", u, u, temporaries=total, fits=total <= 16 * plan.GiB)

  tried = plan.largest_fitting(measure, 4, 1, 16 * plan.GiB, cap=4096, budget=8)
  assert max(u for u, r in tried.items() if r.fits) == 50
  assert 51 in tried and not tried[51].fits and len(calls) <= 5
  # Starting above the limit: halve to a fit, then bisect (not step down one at a time).
  calls.clear()
  tried = plan.largest_fitting(measure, 256, 1, 16 * plan.GiB, cap=4096, budget=8)
  assert max(u for u, r in tried.items() if r.fits) == 50 and len(calls) <= 8


def test_analytic_plan_of_the_tiny_config():
  cfg = tiny_config()
  report = plan.plan(cfg, "v5e:2x4", search=True, analytic=True)
  assert "analytic" in report["method"]
  for what in ("train", "rollout"):
    r = report[what]
    assert r.total > 0 and r.flops > 0 and r.fits
    assert report["largest"][what].prompts >= r.prompts
  assert "analytic" in plan.format_report(report)


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
  assert "KV cache" in plan.format_report(report)


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
  report = plan.plan(tiny_config("data.max_prompt_tokens=64", "rollout.max_new_tokens=32"),
                     "v5e:2x4", search=False)
  assert "libtpu" in report["method"]
  assert report["train"].fits and 0 < report["train"].total < plan.GiB
  assert report["rollout"].flops > 1.2 * report["rollout"].xla_flops  # 32 decode steps


def test_plan_command_line(capsys):
  from reasoner import cli

  tiny = str(ROOT / "configs" / "tiny.yaml")
  assert cli.main(["plan", "--config", tiny, "--analytic", "--no-search"]) == 0
  out = capsys.readouterr().out
  assert "per chip" in out and "train" in out and "rollout" in out
  assert cli.main(["plan", "--config", tiny, "--topology", "v9x"]) == 2


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
  assert "in 2 micro-batches" in plan.format_report({**plan.plan(cfg, "cpu", search=False),
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
  assert f"train.micro_batch={micro.micro}" in plan.format_report(report)


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
