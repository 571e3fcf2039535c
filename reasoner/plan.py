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
from reasoner.hlo import Collective, Cost, analyse
from reasoner.config import Config, ConfigError, check_mesh
from reasoner.models.prompt import prompt_layout

GiB = 2**30
SESSION = 9 * 3600  # seconds of a Kaggle TPU session


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  hbm: int  # bytes
  flops: float  # peak bf16 FLOP/s
  bandwidth: float  # HBM bytes/s
  ici: float  # interconnect bytes/s of one link, both directions (a ring sends half each way)
  hop: float = 1e-6  # seconds per step of a ring collective (latency)


# HBM, FLOP/s and ICI link bandwidths: the chip tables of "How to Scale Your Model" (Austin et
# al., 2025, jax-ml.github.io/scaling-book, "All About TPUs"), which take them from Google's
# Cloud TPU pages: v5e 4.5e10 B/s one way a link (9e10 both ways), v5p and v6e 9e10, v4 4.5e10.
# The ~1 us a hop is that book's order of magnitude for ICI latency: an assumption, which
# matters only for small collectives, where it is the whole cost.
CHIPS = {"v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 9e10),
         "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 1.8e11),
         "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, 1.8e11),
         "v4": Chip("TPU v4", 32 * GiB, 275e12, 1228e9, 9e10)}


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
  micro: int = 0  # train: prompts per micro-batch (= prompts: one pass)
  collectives: dict = dataclasses.field(default_factory=dict)  # Collective -> count per step
  token: Cost | None = None  # rollout: one trip of the decode loop (one token for every row)
  layout: str = ""  # rollout: the decode layout (`rollout.layout`)
  resident: int = 0  # rollout: bytes of the base's copy in the decode layout, kept all run

  @property
  def total(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def times(self, chip: Chip) -> dict[str, float]:
    """Seconds the step would take if bound by each resource alone."""
    return {"HBM": self.bytes / chip.bandwidth, "FLOPs": self.flops / chip.flops,
            "interconnect": sum(n * collective_seconds(c, chip)
                                for c, n in self.collectives.items())}

  def bound(self, chip: Chip) -> str:
    times = self.times(chip)
    return max(times, key=times.get)

  def seconds(self, chip: Chip) -> float:
    """The step's time under the resource that binds it: a lower bound."""
    return max(self.times(chip).values())


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
  seen = analyse(compiled.as_text())
  out = StepPlan(what, prompts, rows, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                 mem.temp_size_in_bytes, mem.alias_size_in_bytes, seen.flops,
                 float(cost.get("flops", 0.0)), seen.bytes, collectives=seen.collectives)
  loop = seen.decode_loop() if what == "rollout" else None
  out.token = loop[1] if loop else None
  out.fits = out.total <= chip.hbm
  return out


def train_plan(setup, prompts: int, chip: Chip, micro: int | None = None) -> StepPlan:
  """The run's train step (`Trainer.step`) for `prompts` x G rows of `setup` (abstract), in
  micro-batches of `micro` prompts (None: one pass) whatever `train.micro_batch` says."""
  from reasoner.trainer import Trainer

  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  trainer = Trainer.for_run(setup.graphdef, setup.base, cfg, micro_batch=micro)
  args = trainer.abstract_inputs(setup.lora, prompts, g, cfg.data.max_prompt_tokens,
                                 cfg.rollout.max_new_tokens)
  out = compile_plan(trainer.step, args, {}, "train", prompts, prompts * g, chip)
  out.micro = micro or prompts
  return out


def reference_plan(setup, prompts: int, chip: Chip) -> StepPlan:
  """The forward-only log-probs of the rollout (`Trainer.logprobs`) that a run computes once a
  step for the reference (zeroed LoRA, grpo.beta > 0) and for the old policy (grpo.mu > 1)."""
  from reasoner.trainer import Trainer

  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  trainer = Trainer.for_run(setup.graphdef, setup.base, cfg)
  base, _, batch = trainer.abstract_inputs(setup.lora, prompts, g, cfg.data.max_prompt_tokens,
                                           cfg.rollout.max_new_tokens)
  return compile_plan(trainer._logprobs, (base, setup.lora, *batch[:4]), {}, "logprobs",
                      prompts, prompts * g, chip)


def judge_plan(setup, devices: list, chip: Chip) -> tuple[StepPlan, str]:
  """One batch of the judge reward (`judge.batch_size` prompts of `judge.max_tokens` tokens) on
  its devices (the policy's, or its own `judge.devices`), and which they are."""
  from reasoner.judge import Judge

  judge = Judge.abstract(setup, devices)
  n = judge.cfg.batch_size
  where = f"{judge.mesh.devices.size} chips" + (
      ", the policy's" if judge.mesh is setup.mesh else " of its own")
  return compile_plan(judge._probs, judge.abstract_inputs(), {}, "judge", n, n, chip), where


def judge_batches(report: dict[str, Any]) -> int:
  """Judge batches a GRPO step scores (every completion of the rollout, at most)."""
  cfg = report["cfg"]
  rows = cfg.train.batch_size * cfg.rollout.num_generations
  return -(-rows // cfg.judge.batch_size)


def step_seconds(report: dict[str, Any], rollout: str = "rollout") -> float:
  """A GRPO step's estimate: the rollout (`rollout`: which plan of it), the log-prob forwards
  the objective needs (reference, old policy), the judge's batches and the train step."""
  cfg, chip = report["cfg"], report["chip"]
  forwards = (cfg.grpo.beta > 0) + (cfg.grpo.num_iterations > 1)
  ref, judge = report.get("logprobs"), report.get("judge")
  return (report[rollout].seconds(chip) + report["train"].seconds(chip)
          + (forwards * ref.seconds(chip) if ref is not None else 0.0)
          + (judge_batches(report) * judge.seconds(chip) if judge is not None else 0.0))


def rollout_plan(setup, prompts: int, chip: Chip, layout: str | None = None) -> StepPlan:
  """The run's rollout (`Sampler.generate`: prefill once per prompt, the decode loop) for
  `prompts` x G rows of `setup` (abstract), with the run's sampling config, decoding in
  `layout` (default: `rollout.layout`, auto resolved for `chip`)."""
  from reasoner.models.cache import kv_cache_bytes
  from reasoner.sampler import Sampler, SamplingConfig

  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  sampler = Sampler.for_run(setup, layout or decode_layout(setup, chip.hbm, chip))
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  args, kwargs = sampler.abstract_inputs((setup.lora, setup.base), prompts, g, scfg)
  out = compile_plan(sampler.generate, args, kwargs, "rollout", prompts, prompts * g, chip)
  out.kv_cache = kv_cache_bytes(setup.spec.tunix_config, args[1].shape[0],
                                kwargs["num_generations"], cfg.data.max_prompt_tokens,
                                cfg.rollout.max_new_tokens, cfg.model.dtype, sampler.mesh,
                                shared=setup.spec.family == "gemma3",
                                over_rows=sampler.over_rows)
  out.layout = sampler.layout
  if sampler.layout != "train":  # the base's copy in the decode layout, held through training
    out.resident = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(args[0][-1]))
  return out


# ---------------------------------------------------------------------- the decode layout

def _nbytes(state, where: Callable[[Any], bool] = lambda path: True) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if where(path))


def _decode_mesh(setup, tp: int):  # (the decode mesh of `tp`, whether attention is over rows)
  mesh = mesh_lib.decode_mesh(setup.mesh, "replicated" if tp == 1 else f"tp{tp}")
  return mesh, setup.spec.family == "gemma3" and mesh_lib.attention_over_rows(
      setup.spec.tunix_config.num_kv_heads, mesh)


def copy_bytes(setup, state, tp: int) -> float:
  """Bytes a chip holds of `state` in the decode layout of `tp` (`mesh.decode_shardings`):
  1 / tp of each parameter, the attention's whole where attention runs over rows."""
  whole = _nbytes(state, mesh_lib.in_attention) if _decode_mesh(setup, tp)[1] else 0
  return (_nbytes(state) - whole) / tp + whole


def decode_estimate(setup, tp: int, chip: Chip) -> dict[str, float]:
  """Seconds of one decoded token (all rows) in the decode layout of `tp`, bound by HBM (the
  chip's copy of the weights, its rows' KV cache) or by the interconnect (two collectives of
  the rows' hidden states a layer over `tp` chips, and the head's top-k candidates)."""
  from reasoner.models.cache import kv_cache_bytes

  cfg, t, (mesh, over_rows) = setup.cfg, setup.spec.tunix_config, _decode_mesh(setup, tp)
  g, prompts = cfg.rollout.num_generations, cfg.train.batch_size
  c, extra = prompt_layout(mesh, prompts, g)
  kv = kv_cache_bytes(t, prompts * c + extra, g // c, cfg.data.max_prompt_tokens,
                      cfg.rollout.max_new_tokens, cfg.model.dtype, mesh,
                      setup.spec.family == "gemma3", over_rows)
  rows = -(-prompts * g // (setup.mesh.size // tp))  # a chip's rows
  hidden = lambda kind: collective_seconds(Collective(kind, tp, rows * t.embed_dim * 4), chip)
  topk = Collective("all-gather", tp, rows * tp * (cfg.rollout.top_k or 1) * 8)
  weights = copy_bytes(setup, setup.base, tp) + copy_bytes(setup, setup.lora, tp)
  attention = hidden("all-gather" if over_rows else "all-reduce")  # its output, a layer
  return {"HBM": (weights + kv) / chip.bandwidth,
          "interconnect": t.num_layers * (attention + hidden("all-reduce"))
          + collective_seconds(topk, chip)}


def decode_layout(setup, hbm: int | None = None, chip: Chip | None = None) -> str:
  """`rollout.layout`, with 'auto' resolved: of the layouts whose copy of the base weights
  (`copy_bytes`) takes at most a quarter of a chip's memory (`hbm`, else the device's), the
  one whose decoded token `decode_estimate` finds fastest; 'train' on one device or where a
  chip's memory is unknown (XLA:CPU: a copy per fake device would cost the host's memory)."""
  layout, n = setup.cfg.rollout.layout, setup.mesh.size
  if layout != "auto":
    return layout
  if hbm is None and n > 1:  # this process's own chip: another host's has no memory figure
    local = [d for d in setup.mesh.devices.flat if d.process_index == jax.process_index()]
    hbm = ((local[0].memory_stats() if local else None) or {}).get("bytes_limit")
  if n == 1 or not hbm:
    return "train"
  chip = chip or CHIPS["v5e"]
  fits = [k for k in range(1, n + 1) if n % k == 0 and copy_bytes(setup, setup.base, k) <= hbm / 4]
  if not fits:
    return "train"
  best = min(fits, key=lambda k: max(decode_estimate(setup, k, chip).values()))
  return "replicated" if best == 1 else f"tp{best}"


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
  sharded weights, replicated LoRA + AdamW, saved activations by remat setting, the chunked
  head's blocks, the KV cache; FLOPs 2 x weights x tokens (x2 backward, x1 more with remat)."""
  from reasoner import heads
  from reasoner.build import spec_without_checkpoint

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
  out = StepPlan(what, prompts, rows, arguments=int(held / chips),
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
    out.temporaries = int(layers * 2 * rows / fsdp * (p + n) * kh * item
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
  chip = CHIPS.get(topology.split(":")[0])
  if chip is None or not re.fullmatch(r"\w+:\d+(x\d+)*", topology):
    raise ConfigError(f"--topology {topology!r}: expected '<chip>:<shape>' with a chip among "
                     f"{', '.join(CHIPS)}, e.g. v5e:2x4, or 'cpu'")
  if not compile:
    return None, chip, "analytic estimate (--analytic)"
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only; others may hold it
  try:
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  except Exception as e:  # no libtpu, or an unknown shape
    return None, chip, (f"analytic estimate: could not compile for {topology} ({str(e)[:80]}); "
                        "install the tpu extra (pip install '.[tpu]') to compile")
  return devices, chip, f"compiled ahead of time for {topology} (libtpu)"


def plan(cfg: Config, topology: str = "v5e:2x4", search: bool = True, analytic: bool = False,
         log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
  """Per-chip plans of the configured train and rollout steps and (search) the largest train
  micro-batch (prompts in one pass) and rollout batch (prompts, each x G rows) that fit the
  chip's HBM; then the configured batch in the largest micro-batches that divide it, compiled,
  where that differs from `train.micro_batch`."""
  from reasoner.build import build, judged

  devices, chip, method = target(topology, compile=not analytic)
  shape = topology.partition(":")[2]
  n_dev = (len(devices) if devices is not None else
           math.prod(int(x) for x in shape.split("x")) if shape else len(jax.devices()))
  n_dev -= (cfg.judge.devices or 0) if judged(cfg) else 0  # the policy's share
  fsdp, tp = mesh_lib.mesh_shape(cfg.mesh, n_dev)
  check_mesh(cfg, fsdp)
  g = cfg.rollout.num_generations
  if devices is None:
    measure = {"train": lambda u, m=None: analytic_plan(cfg, fsdp, tp, "train", u, chip, m),
               "rollout": lambda u: analytic_plan(cfg, fsdp, tp, "rollout", u, chip)}
  else:
    setup = build(cfg, abstract=True, devices=devices)
    layout = decode_layout(setup, None if topology == "cpu" else chip.hbm, chip)
    measure = {"train": lambda u, m=None: train_plan(setup, u, chip, micro=m),
               "rollout": lambda u: rollout_plan(setup, u, chip, layout)}
  report: dict[str, Any] = {"topology": topology, "chip": chip, "method": method, "cfg": cfg,
                            "mesh": {"fsdp": fsdp, "tp": tp}, "largest": {}, "tried": {}}

  def logged(what: str, u: int, *micro) -> StepPlan:
    log(f"  {what} step, {u} prompts x {g}"
        + (f" in micro-batches of {micro[0]}" if micro and micro[0] else "") + " ...")
    return measure[what](u, *micro)

  b, micro = cfg.train.batch_size, cfg.train.micro_batch
  report["train"], report["rollout"] = logged("train", b, micro), logged("rollout", b)
  if devices is not None:
    if cfg.grpo.beta > 0 or cfg.grpo.num_iterations > 1:
      log(f"  log-prob forward, {b} prompts x {g} ...")
      report["logprobs"] = reference_plan(setup, b, chip)
    if report["rollout"].layout != "train":
      log(f"  rollout step on the training layout, {b} prompts x {g} ...")
      report["rollout_train"] = rollout_plan(setup, b, chip, "train")
    if judged(cfg):
      log(f"  judge, {cfg.judge.batch_size} prompts of {cfg.judge.max_tokens} tokens ...")
      report["judge"], report["judge_on"] = judge_plan(setup, devices, chip)
  if not search:
    return report
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
  return report


def _row(r: StepPlan, chip: Chip) -> str:
  rows = f"x G = {r.rows:5d} rows" if r.what != "judge" else "prompts"
  head = f"  {r.what:8s} {r.prompts:5d} {rows}" + (
      f" in {r.prompts // r.micro} micro-batches:" if 0 < r.micro < r.prompts else ":")
  if not r.fits and not r.total:
    return f"{head} does not fit: {r.note}"
  gib = lambda b: f"{b / GiB:6.2f}"
  t = r.times(chip)
  count = sum(r.collectives.values())
  token = (f"; a decoded token: {r.token.num_collectives:.0f} collectives, "
           f"{sum(c.bytes * n for c, n in r.token.collectives.items()) / 2**20:.2f} MiB"
           if r.token is not None else "")
  return (f"{head} args {gib(r.arguments)}  temp {gib(r.temporaries)}  out "
          f"{gib(r.outputs - r.aliased)}  total {gib(r.total)} GiB of {chip.hbm / GiB:.0f} "
          f"{'fits' if r.fits else 'DOES NOT FIT'}"
          + (f"; KV cache {r.kv_cache / 2**20:.1f} MiB of it" if r.kv_cache else "")
          + f"\n{'':11s}{r.flops / 1e12:.3g} TFLOP, {r.bytes / GiB:.3g} GiB HBM traffic, "
          f"{count:.0f} collectives{token}\n{'':11s}est. {r.seconds(chip) * 1e3:.1f} ms, bound "
          f"by {r.bound(chip)} (HBM {t['HBM'] * 1e3:.1f} ms, interconnect "
          f"{t['interconnect'] * 1e3:.1f} ms, FLOPs {t['FLOPs'] * 1e3:.1f} ms)")


def format_report(report: dict[str, Any]) -> str:
  chip, m = report["chip"], report["mesh"]
  rollout = report["rollout"]
  lines = [f"plan for {report['topology']} ({chip.name}: {chip.hbm / GiB:.0f} GiB HBM, "
           f"{chip.flops / 1e12:.0f} TFLOP/s, {chip.bandwidth / 1e9:.0f} GB/s), mesh fsdp "
           f"{m['fsdp']} x tp {m['tp']}; {report['method']}",
           "per chip; every loop body counted once per trip; time = the bound that binds "
           "(HBM bytes, collectives' latency + bandwidth, FLOPs), a lower bound",
           "configured:", _row(report["train"], chip)]
  if "logprobs" in report:
    lines.append(_row(report["logprobs"], chip))
  lines.append(_row(rollout, chip) + (f"  (decode layout {rollout.layout})" if rollout.layout
                                       else ""))
  if rollout.resident:
    train = report["train"]
    lines.append(f"{'':11s}beside training: the base's copy in the decode layout "
                 f"{rollout.resident / GiB:.2f} GiB a chip; train step + copy "
                 f"{(train.total + rollout.resident) / GiB:.2f} GiB, rollout + the train "
                 f"step's arguments {(rollout.total + train.arguments) / GiB:.2f} GiB")
  if "rollout_train" in report:
    lines.append(_row(report["rollout_train"], chip) + "  (training layout)")
  if "judge" in report:
    j = report["judge"]
    n = judge_batches(report)
    lines.append(_row(j, chip) + f"  (on {report['judge_on']}; {n} batch{'es' * (n > 1)} a "
                 "step)")
  for what, tried in report["tried"].items():
    best = report["largest"].get(what)
    name = "train micro-batch (one pass)" if what == "train" else "rollout batch"
    lines += [f"search ({what}):", *(_row(r, chip) for r in tried),
              f"  largest {name} that fits: "
              + (f"{best.prompts} prompts x G = {best.rows} rows" if best else "none")]
  if "micro" in report:
    r = report["micro"]
    lines += [f"with train.micro_batch={r.micro if r.micro < r.prompts else 'null'} "
              f"({r.prompts // r.micro} pass{'es' if r.micro < r.prompts else ''} per step):",
              _row(r, chip)]
  for key, name in (("rollout", f"decoding in the {rollout.layout or 'configured'} layout"),
                    ("rollout_train", "decoding in the training layout")):
    if key in report:
      step = step_seconds(report, key)
      lines.append(f"GRPO step ({name}): est. {step:.3g} s (rollout + "
                   + ("log-prob forwards + " * ("logprobs" in report))
                   + ("judge + " * ("judge" in report))
                   + f"train): at most {int(SESSION // step) if step else 0} steps in a "
                   f"{SESSION // 3600}-hour session")
  return "\n".join(lines)
