"""Plans a run for a TPU slice from any CPU machine: per-chip HBM, FLOPs and step time.

    python -m reasoner plan --config configs/gemma3_1b.yaml          # v5e:2x4, with search
    python -m reasoner plan --config configs/tiny.yaml --no-search --topology v5e:2x4

The real train step (`Trainer.step`, state donated as on an accelerator) and the real
rollout step (the sampler's `generate`) are compiled ahead of time for the topology with
libtpu's compiler (`pip install '.[tpu]'`), from abstract inputs: ShapeDtypeStructs carrying
NamedShardings on a mesh of the topology's compile-only devices, so nothing is allocated.

Memory per chip: arguments + temporaries + outputs - aliased (donated) bytes, from XLA's
memory analysis (on CPU `peak_memory_in_bytes` is arguments + outputs only). A compile that
runs out of HBM counts as not fitting.

Time per chip: XLA's cost analysis counts a while loop's body once, so a `lax.scan` of K steps
(the chunked head) or the sampler's decode loop would be one step. The planner walks the
compiled HLO instead (`hlo.analyse`), loop bodies once per trip (for the sampler's early-exit
loop max_new_tokens trips, an upper bound): matmul FLOPs, bytes moved to and from HBM (on-chip
buffers excluded) and every collective. A step's time is the largest of FLOPs / peak, HBM bytes
/ bandwidth and its collectives' time under a latency + bandwidth ring model
(`collective_seconds`, the chip's ICI figures): a lower bound, named by what binds it.

Without libtpu (or with `--analytic`) the figures are an analytic estimate, and say so.
`topology="cpu"` compiles for this host's devices instead (XLA:CPU's memory, for tests).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

from reasoner import mesh as mesh_lib
from reasoner.build import build, judged, judged_share, taught
from reasoner.chips import CHIPS, Chip, collective_seconds, local_chip
from reasoner.config import Config, ConfigError, check_mesh
from reasoner.engine import heads
from reasoner.engine.layout import decode_layout, weights_placement
from reasoner.engine.sampler import Sampler, SamplingConfig, on_own_chips
from reasoner.engine.teacher import Teacher
from reasoner.models.cache import kv_cache_split, new_slots
from reasoner.models.load import spec_without_checkpoint
from reasoner.objectives.grpo import GRPOTrainer
from reasoner.planner import libtpu
from reasoner.planner.hlo import Cost, analyse
from reasoner.rewards.judge import (SUFFIX_PLANNED, Judge, estimate, in_passes,
                                    planned_prefix, prefix_template)

@dataclasses.dataclass
class StepPlan:
  """One compiled (or estimated) step, per chip."""

  what: str  # train | rollout
  prompts: int
  rows: int  # prompts x G
  arguments: int = 0
  outputs: int = 0
  temporaries: int = 0
  aliased: int = 0
  flops: float = 0.0  # loop bodies once per trip
  xla_flops: float = 0.0  # XLA's cost analysis (loop bodies once)
  bytes: float = 0.0
  fits: bool = True
  note: str = ""
  needed: int = 0  # bytes XLA reported needing when the compile ran out of HBM (a lower bound)
  kv_cache: int = 0  # rollout: the sampler's own estimate of its KV cache (`kv_cache_bytes`)
  kv_local: int = 0  # of it, the sliding-window layers' (rings of their window in Gemma 3's)
  micro: int = 0  # train: prompts per micro-batch (= prompts: one pass)
  collectives: dict = dataclasses.field(default_factory=dict)  # Collective -> count per step
  token: Cost | None = None  # rollout: one trip of the decode loop (one token for every row)
  layout: str = ""  # rollout: the decode layout (`rollout.layout`)
  resident: int = 0  # rollout: bytes of the base's copy in the decode layout, kept all run
  kernels: float = 0.0  # ops launched, loop bodies once per trip
  serial_flops: float = 0.0  # FLOPs of the kernels bound by FLOPs (`hlo.analyse(ridge=)`)
  serial_bytes: float = 0.0  # HBM bytes of the others

  @property
  def total(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def times(self, chip: Chip) -> dict[str, float]:
    """Seconds the step would take if bound by each resource alone; on a chip that launches
    kernels one by one (`Chip.launch`, a GPU), the seconds of the kernels each resource binds
    and of their launches, which add up."""
    wire = sum(n * collective_seconds(c, chip) for c, n in self.collectives.items())
    if chip.launch:
      return {"HBM": self.serial_bytes / chip.bandwidth, "FLOPs": self.serial_flops / chip.flops,
              "launch": self.kernels * chip.launch, "interconnect": wire}
    return {"HBM": self.bytes / chip.bandwidth, "FLOPs": self.flops / chip.flops,
            "interconnect": wire}

  def bound(self, chip: Chip) -> str:
    times = self.times(chip)
    return max(times, key=times.get)

  def seconds(self, chip: Chip) -> float:
    """The step's time under the resource that binds it: a lower bound (on a GPU, the sum)."""
    times = self.times(chip).values()
    return sum(times) if chip.launch else max(times)


# ------------------------------------------------------------------------------- compiling

def out_of_memory(e: Exception, plan: StepPlan) -> StepPlan:
  """`plan` (not fitting) with what a compile that ran out of HBM said; other errors raise."""
  msg = str(e)
  if "RESOURCE_EXHAUSTED" not in msg and "memory" not in msg.lower():
    raise e
  m = re.search(r"(?:required[^(]*\(|Used )([\d.]+)([KMGT])", msg)
  plan.needed = int(float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)) if m else 0
  plan.note = msg.strip().splitlines()[0][:200]
  return plan


def compile_plan(fn, args: tuple, kwargs: dict, what: str, prompts: int, rows: int,
                 chip: Chip) -> StepPlan:
  """Lowers and compiles `fn` (a jax.jit) on abstract args; out of memory -> fits=False."""
  try:
    compiled = fn.lower(*args, **kwargs).compile()
  except Exception as e:  # XlaRuntimeError; its type moves between jax versions
    return out_of_memory(e, StepPlan(what, prompts, rows, fits=False))
  mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  seen = analyse(compiled.as_text(), chip.flops / chip.bandwidth)
  out = StepPlan(what, prompts, rows, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                 mem.temp_size_in_bytes, mem.alias_size_in_bytes, seen.flops,
                 float(cost.get("flops", 0.0)), seen.bytes, collectives=seen.collectives,
                 kernels=seen.kernels, serial_flops=seen.serial_flops,
                 serial_bytes=seen.serial_bytes)
  loop = seen.decode_loop() if what == "rollout" else None
  out.token = loop[1] if loop else None
  out.fits = out.total <= chip.hbm
  return out


def train_plan(setup, prompts: int, chip: Chip, micro: int | None = None) -> StepPlan:
  """The run's train step (`Trainer.step`) for `prompts` x G rows of `setup` (abstract), in
  micro-batches of `micro` prompts (None: one pass) whatever `train.micro_batch` says."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  trainer = GRPOTrainer.for_run(setup.graphdef, setup.base, cfg, micro_batch=micro)
  args = trainer.abstract_inputs(setup.lora, prompts, g, cfg.data.max_prompt_tokens,
                                 cfg.rollout.max_new_tokens,
                                 soft_k=cfg.distill.topk if taught(cfg) else 0)
  out = compile_plan(trainer.step, args, {}, "train", prompts, prompts * g, chip)
  out.micro = micro or prompts
  return out


def reference_plan(setup, prompts: int, chip: Chip) -> StepPlan:
  """The forward-only log-probs of the rollout (`Trainer.logprobs`) that a run computes once a
  step for the reference (zeroed LoRA, grpo.beta > 0) and for the old policy (grpo.mu > 1)."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  trainer = GRPOTrainer.for_run(setup.graphdef, setup.base, cfg)
  base, _, batch = trainer.abstract_inputs(setup.lora, prompts, g, cfg.data.max_prompt_tokens,
                                           cfg.rollout.max_new_tokens)
  return compile_plan(trainer._logprobs, (base, setup.lora, *batch[:4]), {}, "logprobs",
                      prompts, prompts * g, chip)


def judge_plan(setup, chip: Chip) -> tuple[StepPlan, str]:
  """One batch of the judge reward (`judge.batch_size` prompts of `judge.max_tokens` tokens, or
  where records carry rubrics one pass of as many completions with their criteria,
  `Judge.planned`) on its devices (the policy's, or its own `judge.devices`), and which."""
  judge = Judge.abstract(setup)
  n = judge.cfg.batch_size
  where = f"{judge.mesh.devices.size} chips" + (
      ", the policy's" if judge.mesh is setup.mesh else " of its own")
  return compile_plan(*judge.planned(), {}, "judge", n, n, chip), where


def teacher_plan(setup, chip: Chip) -> tuple[StepPlan, str]:
  """One batch of distillation's teacher (`engine.teacher`: the log-probs of a rollout's B x G
  completions, and their top-k with `distill.topk`) on its devices (the policy's, or its own
  `distill.devices`), and which."""
  teacher = Teacher.abstract(setup)
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  b = cfg.train.batch_size
  args = teacher.abstract_inputs(b, b * g, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens)
  where = f"{teacher.mesh.devices.size} chips" + (
      ", the policy's" if teacher.mesh is setup.mesh else " of its own")
  k = cfg.distill.topk
  fn, args = (teacher._top, (*args, k)) if k else (teacher._fwd, args)
  return compile_plan(fn, args, {}, "teacher", b, b * g, chip), where


def judge_batches(report: dict[str, Any], average: bool = False) -> float:
  """Judge batches a GRPO step scores: at most (every completion, a row each, or with rubrics a
  pass each, its criteria in it, `judge_plan`; a row a criterion where the criterion prompt
  shares no prefix), or on `average`, each prompt the judge's with the `judged_share`."""
  cfg, b, p = report["cfg"], report["cfg"].train.batch_size, judged_share(report["cfg"])
  k = max(1, cfg.judge.max_criteria) if prefix_template(cfg.judge.criterion_prompt) is None else 1
  batches = lambda n: -(-n * cfg.rollout.num_generations * k // cfg.judge.batch_size)
  return sum(math.comb(b, n) * p**n * (1 - p)**(b - n) * batches(n)
             for n in range(b + 1)) if average else batches(b)


def sides(report: dict[str, Any], rollout: str = "rollout") -> dict[str, float]:
  """A GRPO step's two halves in seconds: the rollout's (`rollout`: which plan of it; the
  judge's batches and distillation's teacher, which score it) and the training's (the log-prob
  forwards the objective needs, reference or old policy, and the train step); with
  `rollout.devices`, the LoRA's move to the rollout's chips too ("transfer")."""
  cfg, chip = report["cfg"], report["chip"]
  forwards = (cfg.grpo.beta > 0) + (cfg.grpo.num_iterations > 1)
  ref, judge, teacher = report.get("logprobs"), report.get("judge"), report.get("teacher")
  out = {"rollout": report[rollout].seconds(chip)
         + (judge_batches(report) * judge.seconds(chip) if judge is not None else 0.0)
         + (teacher.seconds(chip) if teacher is not None else 0.0),
         "train": report["train"].seconds(chip)
         + (forwards * ref.seconds(chip) if ref is not None else 0.0)}
  if "transfer" in report:
    out["transfer"] = report["transfer"] / chip.ici
  return out


def step_seconds(report: dict[str, Any], rollout: str = "rollout") -> float:
  """A GRPO step's estimate (`sides`): the two halves one after the other, or with rollouts a
  step ahead on chips of their own (`rollout.devices`) the slower one plus the transfer."""
  t = sides(report, rollout)
  if "transfer" in t:
    return max(t["rollout"], t["train"]) + t["transfer"]
  return t["rollout"] + t["train"]


def rollout_plan(setup, prompts: int, chip: Chip, layout: str | None = None) -> StepPlan:
  """The run's rollout (`Sampler.generate`: prefill once per prompt, the decode loop) for
  `prompts` x G rows of `setup` (abstract), with the run's sampling config, decoding in
  `layout` (default: `rollout.layout`, auto resolved for `chip`)."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  sampler = Sampler.for_run(setup, layout or decode_layout(setup, chip.hbm, chip))
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  args, kwargs = sampler.abstract_inputs((setup.lora, setup.base), prompts, g, scfg)
  out = compile_plan(sampler.generate, args, kwargs, "rollout", prompts, prompts * g, chip)
  split = kv_cache_split(setup.spec.tunix_config, args[1].shape[0], kwargs["num_generations"],
                         cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens,
                         cfg.model.dtype, sampler.mesh, shared=setup.spec.family == "gemma3",
                         over_rows=sampler.over_rows)
  out.kv_cache, out.kv_local = sum(split), split[1]
  out.layout = sampler.layout
  if sampler.layout != "train":  # the base's copy in the decode layout, held through training
    out.resident = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                       for x, w in zip(jax.tree.leaves(args[0][-1]), jax.tree.leaves(setup.base))
                       if not mesh_lib.placed_alike(w.sharding, x.sharding, len(x.shape)))
  return out


# ---------------------------------------------------------------------------- the search

def largest_fitting(measure: Callable[[int], StepPlan], start: int, step: int, limit: int,
                    cap: int, budget: int = 6) -> dict[int, StepPlan]:
  """Largest multiple of `step` (<= cap) whose plan fits, assuming memory grows with it.

  Bisection between the largest fitting and smallest failing sizes, where each next guess is
  the linear extrapolation of the last two fitting sizes' memory to `limit` (memory is close to
  linear in the batch), so a search usually takes 3-4 compiles. Returns every plan tried.
  """
  seen: dict[int, StepPlan] = {}
  x = start
  while len(seen) < budget and x not in seen:
    seen[x] = measure(x)
    fit = sorted(u for u, r in seen.items() if r.fits)
    lo = fit[-1] if fit else 0
    hi = min([u for u, r in seen.items() if not r.fits and u > lo], default=cap + step)
    if hi - lo <= step:
      break
    if len(fit) >= 2 and seen[fit[-1]].total > seen[fit[-2]].total:
      a, b = seen[fit[-2]], seen[fit[-1]]
      slope = (b.total - a.total) / (fit[-1] - fit[-2])
      guess = fit[-1] + (limit - b.total) / slope
    else:  # double up to the first failure, then bisect
      guess = (2 * lo if hi > cap else (lo + hi) / 2) if fit else hi / 2
    x = min(max(int(guess) // step * step, lo + step), hi - step)
  return seen


def micro_batch_for(prompts: int, largest: int, g: int, fsdp: int) -> int:
  """The micro-batch (prompts) to split a batch of `prompts` into, given the largest one-pass
  batch that fits: the largest divisor of `prompts` up to it, one of whole rows per chip
  (d x G a multiple of fsdp) where there is one, since a micro-batch that does not split over
  'fsdp' is computed whole on every chip."""
  divisors = [d for d in range(1, min(prompts, largest) + 1) if prompts % d == 0]
  return max([d for d in divisors if d * g % fsdp == 0] or divisors)


# -------------------------------------------------------------------------------- analytic

def analytic_plan(cfg: Config, fsdp: int, tp: int, what: str, prompts: int,
                  chip: Chip, micro: int | None = None) -> StepPlan:
  """A rough per-chip estimate from the model's shapes, used when nothing can be compiled:
  sharded weights (whole with `mesh.weights: replicated`), replicated LoRA + AdamW, saved
  activations by remat setting, the chunked head's blocks, the KV cache; FLOPs 2 x weights x
  tokens (x2 backward, x1 more with remat)."""
  spec = spec_without_checkpoint(cfg.model)[1]
  t = spec.tunix_config
  d, f, layers, v = t.embed_dim, t.hidden_dim, t.num_layers, t.num_embed
  nh, kh = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
  item = jnp.dtype(cfg.model.dtype).itemsize
  per_layer = d * (2 * nh + 2 * kh) + 3 * d * f
  weights = layers * per_layer + v * d
  lora = layers * cfg.lora.rank * (6 * d + 2 * nh + 2 * kh + 3 * f)
  g, p, n = cfg.rollout.num_generations, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
  rows, chips = prompts * g, fsdp * tp
  tokens = (prompts * p + rows * n) / fsdp  # the prompt is computed once per group
  q = cfg.lora.base_qtype  # QLoRA: the layers' kernels in 4 or 8 bits plus a scale per tile
  kernel = item if q == "none" else {"nf4": 0.5, "int8": 1}[q] + item / cfg.lora.base_tile_size
  held = layers * per_layer * kernel + v * d * item
  whole = what == "train" and weights_placement(cfg.mesh.weights, chips, held,  # whole on each
                                                chip.hbm)[0] == "replicated"
  out = StepPlan(what, prompts, rows, arguments=int(held / (1 if whole else chips)),
                 note="analytic estimate (nothing compiled)", micro=micro or prompts)
  if what == "train":
    if spec.family == "gemma3":  # `models.layer`: named matmul outputs, no [T, S] probabilities
      none = item * (3 * d + 2 * f + 2 * nh + 2 * kh)
    else:  # Tunix's layer left to autodiff
      none = item * (8 * d + 3 * f + 2 * nh + 2 * kh) + 8 * t.num_heads * (p + n)
    act = {"none": none, "block": 2 * d * item, "decoder": d * item}[cfg.model.remat]
    chunk = (heads.auto_chunk(v, tp, shards=fsdp) if cfg.train.head_chunk is None
             else cfg.train.head_chunk)
    out.arguments += 16 * lora
    live = tokens * out.micro / prompts  # one micro-batch's activations at a time
    out.temporaries = int(live * (layers * act + d * item) + 3 * chunk * v / tp * 4)
    passes = 2 + (cfg.model.remat != "none")  # forward, activation gradients, remat forward
    out.flops = 2 * (passes * layers * per_layer * tokens + 2 * v * d * rows * n / fsdp) / tp
  else:
    slots = new_slots(t, n) if spec.family == "gemma3" else (n,) * layers  # Gemma 3: rings
    out.temporaries = int(2 * rows / fsdp * sum(p + s for s in slots) * kh * item
                          + rows / fsdp * v * 8 + prompts / fsdp * p * (p + n) * t.num_heads * 4)
    out.flops = 2 * (prompts * p * layers * per_layer + rows * n * weights) / chips
  out.bytes = out.arguments * (1 + (what == "rollout") * n)
  out.fits = out.total <= chip.hbm
  return out


# ---------------------------------------------------------------------------------- a plan

def target(topology: str, compile: bool = True) -> tuple[list[Any] | None, Chip, str]:
  """(devices to compile for or None, the chip, how the figures are obtained)."""
  if topology == "cpu":
    return ((jax.devices() if compile else None), CHIPS["v5e"],
            "compiled for this host's CPU devices (XLA:CPU figures, v5e limits)" if compile
            else "analytic estimate (--analytic), v5e limits")
  if topology == "local":
    devices, chip, method = _local()
    return (devices, chip, method) if compile else (None, chip, "analytic estimate (--analytic)")
  chip = CHIPS.get(topology.split(":")[0])
  if chip is None or not re.fullmatch(r"\w+:\d+(x\d+)*", topology):
    raise ConfigError(f"--topology {topology!r}: expected '<chip>:<shape>' with a chip among "
                     f"{', '.join(CHIPS)}, e.g. v5e:2x4, or 'local' or 'cpu'")
  if not compile:
    return None, chip, "analytic estimate (--analytic)"
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only; others may hold it
  try:
    with libtpu.quiet():
      devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  except Exception as e:  # no libtpu, or an unknown shape
    return None, chip, (f"analytic estimate: could not compile for {topology} ({str(e)[:80]}); "
                        "install the tpu extra (pip install '.[tpu]') to compile")
  return devices, chip, f"compiled ahead of time for {topology} (libtpu)"


def _local() -> tuple[list[Any], Chip, str]:
  """This host's accelerators and their chip table (a lent GPU, a TPU VM's chips)."""
  devices = jax.devices()
  chip = local_chip(devices[0])
  if chip is None:
    raise ConfigError(f"--topology local: no chip table for this host's "
                      f"{devices[0].device_kind!r} ({jax.default_backend()}); known: "
                      f"{', '.join(CHIPS)}. Use 'cpu' or a TPU topology such as v5e:2x4")
  return devices, chip, (f"compiled for this host's {len(devices)} x {devices[0].device_kind} "
                         f"({chip.hbm / 2**30:.0f} GiB each)")


def plan(cfg: Config, topology: str = "v5e:2x4", search: bool = True, analytic: bool = False,
         log: Callable[[str], None] = lambda s: None, compare: bool = True) -> dict[str, Any]:
  """Per-chip plans of the configured train and rollout steps (and the log-prob forward, the
  judge and the teacher where the run has them, and with `compare` the rollout on the training
  layout) and, with `search`, the largest train micro-batch and rollout batch that fit the chip
  (`_search`)."""
  devices, chip, method = target(topology, compile=not analytic)
  shape = topology.partition(":")[2]
  n_dev = (len(devices) if devices is not None else
           math.prod(int(x) for x in shape.split("x")) if shape else len(jax.devices()))
  chips = n_dev
  n_dev -= (cfg.judge.devices or 0) if judged(cfg) else 0  # the policy's share
  n_dev -= (cfg.distill.devices or 0) if cfg.distill.teacher is not None else 0
  n_dev -= cfg.rollout.devices or 0
  fsdp, tp = mesh_lib.mesh_shape(cfg.mesh, n_dev)
  check_mesh(cfg, fsdp)
  g = cfg.rollout.num_generations
  if devices is None:
    setup = None
    measure = {"train": lambda u, m=None: analytic_plan(cfg, fsdp, tp, "train", u, chip, m),
               "rollout": lambda u: analytic_plan(cfg, fsdp, tp, "rollout", u, chip)}
  else:
    hbm = None if topology == "cpu" else chip.hbm
    setup = build(cfg, abstract=True, devices=devices, teacher=taught(cfg), hbm=hbm)
    layout = decode_layout(on_own_chips(setup), hbm, chip)
    measure = {"train": lambda u, m=None: train_plan(setup, u, chip, micro=m),
               "rollout": lambda u: rollout_plan(setup, u, chip, layout)}
  report: dict[str, Any] = {"topology": topology, "chip": chip, "method": method, "cfg": cfg,
                            "mesh": {"fsdp": fsdp, "tp": tp}, "largest": {}, "tried": {},
                            "chips": chips}

  def logged(what: str, u: int, *micro) -> StepPlan:
    log(f"  {what} step, {u} prompts x {g}"
        + (f" in micro-batches of {micro[0]}" if micro and micro[0] else "") + " ...")
    return measure[what](u, *micro)

  b, micro = cfg.train.batch_size, cfg.train.micro_batch
  report["train"], report["rollout"] = logged("train", b, micro), logged("rollout", b)
  if setup is None and judged(cfg):  # nothing compiled: one judge batch estimated
    n, j, model = cfg.judge.devices or fsdp * tp, cfg.judge.batch_size, cfg.judge.model
    report["judge"] = StepPlan("judge", j, j, **estimate(cfg.judge, model or cfg.model, n))
    report["judge"].fits = report["judge"].total <= chip.hbm
    report["judge_on"] = f"{n} chips" + (" of its own" if cfg.judge.devices else ", the policy's")
  if setup is not None:
    _beside(report, setup, chip, log, compare)
    report["weights"] = (setup.weights, setup.weights_why)
    if compare and cfg.mesh.weights == "auto" and setup.mesh.size > 1 and hbm:
      _weights(report, cfg, devices, hbm, chip, log)
    report["lora_bytes"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.lora))
    if cfg.rollout.devices:  # the LoRA moves to the rollout's chips once a step
      report["transfer"] = report["lora_bytes"]
  if search:
    _search(report, logged, fsdp)
  return report


def _beside(report: dict[str, Any], setup, chip: Chip, log: Callable[[str], None],
            compare: bool = True) -> None:
  """The programs a GRPO step runs beside its train step and rollout, compiled: the log-prob
  forward (reference or old policy), the rollout on the training layout where another decodes,
  one judge batch, and distillation's teacher."""
  cfg, b, g = setup.cfg, setup.cfg.train.batch_size, setup.cfg.rollout.num_generations
  if cfg.grpo.beta > 0 or cfg.grpo.num_iterations > 1:
    log(f"  log-prob forward, {b} prompts x {g} ...")
    report["logprobs"] = reference_plan(setup, b, chip)
  if compare and report["rollout"].layout != "train":
    log(f"  rollout step on the training layout, {b} prompts x {g} ...")
    report["rollout_train"] = rollout_plan(setup, b, chip, "train")
  if judged(cfg):
    j = cfg.judge
    log(f"  judge, a pass of {j.batch_size} completions x {j.max_criteria} criteria "
        f"({planned_prefix(j)}-token prefixes, {SUFFIX_PLANNED}-token suffixes) ..."
        if in_passes(j) else
        f"  judge, {j.batch_size} prompts of {j.max_tokens} tokens ...")
    report["judge"], report["judge_on"] = judge_plan(setup, chip)
  if taught(cfg):
    log(f"  teacher's log-probs, {b} prompts x {g} ...")
    report["teacher"], report["teacher_on"] = teacher_plan(setup, chip)


def _weights(report: dict[str, Any], cfg: Config, devices, hbm: int | None, chip: Chip,
             log: Callable[[str], None]) -> None:
  """`mesh.weights: auto` checked: the train step and log-prob forward compiled with the
  training weights placed the other way too (`report['weights_other']`: it and its plans), and
  `weights_choice`: the faster of the two that fits, and why."""
  b, picked = cfg.train.batch_size, report["weights"][0]
  other = "sharded" if picked == "replicated" else "replicated"
  setup = build(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, weights=other)),
                abstract=True, devices=devices, teacher=taught(cfg), hbm=hbm)
  log(f"  train step and log-prob forward with the weights {other}, {b} prompts ...")
  plans = {picked: [report["train"], report.get("logprobs")],
           other: [train_plan(setup, b, chip),
                   reference_plan(setup, b, chip) if "logprobs" in report else None]}
  report["weights_other"] = (other, dict(zip(("train", "logprobs"), plans[other])))
  seconds = {w: sum(p.seconds(chip) for p in ps if p is not None) for w, ps in plans.items()}
  fits = [w for w in (picked, other) if plans[w][0].fits]
  best = min(fits, key=seconds.get) if fits else picked
  why = ", ".join(f"{w} {seconds[w] * 1e3:.1f} ms" + ("" if plans[w][0].fits else
                                                          " (does not fit)") for w in plans)
  report["weights_choice"] = (best, f"train step + log-prob forward: {why}")


def _search(report: dict[str, Any], logged: Callable[..., StepPlan], fsdp: int) -> None:
  """The largest train micro-batch (prompts in one pass) and rollout batch (prompts, each x G
  rows) that fit the chip's HBM; then the configured batch in the largest micro-batches that
  divide it, compiled, where that differs from `train.micro_batch`."""
  cfg, chip = report["cfg"], report["chip"]
  b, micro, g = cfg.train.batch_size, cfg.train.micro_batch, cfg.rollout.num_generations
  steps = {"train": fsdp // math.gcd(fsdp, g), "rollout": fsdp}  # prompts per increment
  for what, first in (("train", micro or b), ("rollout", b)):
    start = -(-first // steps[what]) * steps[what]
    known = {b: report[what]} if report[what].micro in (0, b) else {}  # one pass over b
    tried = largest_fitting(lambda u, w=what, k=known: k[u] if u in k else logged(w, u),
                            start, steps[what], chip.hbm, max(start, 8192 // g))
    report["tried"][what] = [tried[u] for u in sorted(tried)]
    fit = [u for u, r in tried.items() if r.fits]
    report["largest"][what] = tried[max(fit)] if fit else None
  best = report["largest"]["train"]
  if best is not None:  # the configured batch in the largest micro-batches that fit
    m = micro_batch_for(b, best.prompts, g, fsdp)
    if m != (micro or b):
      report["micro"] = logged("train", b, m if m < b else None)
