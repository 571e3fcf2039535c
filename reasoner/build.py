"""Builds what a run needs from its config: devices, mesh, tokenizer, model (LoRA in place),
rewards (the judge bound to its model).

`build(cfg)` loads the weights into their shards; `build(cfg, abstract=True, devices=...)` gives
the planner the same `Setup` with ShapeDtypeStructs placed exactly as the weights would be
(nothing allocated, nothing read or downloaded), so that what it compiles is what a run runs."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
from flax import nnx

from reasoner import mesh as mesh_lib
from reasoner.config import Config, ConfigError, check_mesh
from reasoner.data import curriculum, prompts, sources
from reasoner.engine import layout, session
from reasoner.engine.teacher import Teacher
from reasoner.models import lora as lora_lib
from reasoner.models import gemma, load
from reasoner.rewards import judge as judge_lib, sandbox
from reasoner.rewards.judge import Judge
from reasoner.rewards.scoring import Rewards

log = logging.getLogger("reasoner")


@dataclasses.dataclass(frozen=True)
class Devices:
  """The run's devices: the policy's (its training), and those of a judge, a teacher or the
  rollout of its own (`judge.devices`, the last N; `distill.devices`, the N before them;
  `rollout.devices`, the N before those), or None where it shares the policy's."""

  policy: list
  judge: list | None = None
  teacher: list | None = None
  rollout: list | None = None


@dataclasses.dataclass
class Setup:
  cfg: Config
  mesh: jax.sharding.Mesh
  tokenizer: object
  graphdef: object
  lora: object  # nnx.State of the LoRA parameters
  base: object  # nnx.State of the frozen base weights
  rewards: Rewards
  train_records: list
  eval_records: list  # the held-out split
  spec: gemma.ModelSpec
  eval_sets: dict[str, list] = dataclasses.field(default_factory=dict)  # eval.sets by name
  devices: Devices | None = None
  teacher: Teacher | None = None  # distillation's (`build(teacher=True)`)
  # the LoRA the run started from (lora.init_from's; the loop sets it), or None: the
  # reference policy of DPO and of GRPO's KL is the base under it
  reference: object | None = None
  weights: str = "sharded"  # the training weights' placement (`mesh.weights`, auto resolved)
  weights_why: str = ""  # and why (`engine.layout.weights_placement`'s reason)

  def model(self, lora=None):
    return nnx.merge(self.graphdef, self.lora if lora is None else lora, self.base)


@dataclasses.dataclass(frozen=True)
class Checked:
  """What `check` found before any weight is read."""

  devices: Devices
  mesh: jax.sharding.Mesh
  rewards: Rewards
  train: list
  held_out: list
  sets: dict[str, list]


def check(cfg: Config, devices: list | None = None,
          check_records: Callable[..., None] | None = None, teacher: bool = False) -> Checked:
  """Everything that can fail on bad input, before any weight is read: the devices and mesh, a
  Kaggle model's local layout or credentials and the network (seconds, nothing downloaded), the
  records against the rewards, and `check_records(cfg, records, where)` (a stage's own rule,
  e.g. SFT's responses) on the training records; `teacher`: the teacher's devices set apart."""
  split = split_devices(cfg, devices, teacher)
  mesh = mesh_lib.make_mesh(cfg.mesh, split.policy)
  check_mesh(cfg, mesh.shape["fsdp"])
  rewards = Rewards(cfg.rewards)
  for m in (cfg.model, cfg.judge.model if judged(cfg) else None):
    if m is not None:
      load.check(m)
  sets = {s.name: sources.load_eval_set(s, cfg.data) for s in cfg.eval.sets}
  train, held_out = sources.load_splits(cfg.data, evaluated=sets)  # less the sets' questions
  for where, records in (("the training data", train), ("the held-out data", held_out),
                         *((f"evaluation set '{k}'", v) for k, v in sets.items())):
    rewards.check(records, where)
    if judged(cfg):
      judge_lib.check_records(cfg.judge, records, where)
  if judged(cfg):
    judge_lib.check_agreement_records(cfg.judge, train + held_out, "the data")
  curriculum.check(cfg.data, train, "the training data")
  if check_records is not None:
    check_records(cfg, train, "the training data")
  return Checked(split, mesh, rewards, train, held_out, sets)


def build(cfg: Config, abstract: bool = False, devices: list | None = None,
          check_records: Callable[..., None] | None = None, teacher: bool = False,
          with_judge: bool = True, hbm: int | None = None) -> Setup:
  """The run's `Setup`; `abstract`: its model as placed ShapeDtypeStructs and no records, on
  `devices` (default: this host's), e.g. a TPU topology's compile-only devices;
  `check_records`: a stage's rule for its training records (`check`); `teacher`: with
  distillation's teacher (`distill.*`), on its own devices or the policy's; `with_judge`: False
  where nothing is scored (the export), the judge reward then unbound and its model not read;
  `hbm`: an abstract build's chip memory, which resolves `mesh.weights: auto` (a topology's
  compile-only devices have no figure)."""
  if abstract:
    return _abstract(cfg, devices, teacher, hbm)
  session.compile_cache(cfg.train.compile_cache, log.warning)  # before anything compiles
  c = check(cfg, devices, check_records, teacher)
  tokenizer, spec, model = load.load_model(cfg.model, c.mesh, cfg.train.seed)
  d = cfg.data
  fit = lambda recs, split: prompts.within_limit(recs, split, d.template, tokenizer,
                                                  d.max_prompt_tokens, d.overlong, log.warning)
  train, held_out = fit(c.train, "training"), fit(c.held_out, "held-out")
  sets = {name: fit(recs, f"'{name}' evaluation") for name, recs in c.sets.items()}
  model = lora_lib.apply_lora(model, cfg.lora, c.mesh, cfg.train.seed)
  graphdef, lora, base = lora_lib.split(model)
  weights, why = placement(cfg, c.mesh, base, layout.chip_hbm(c.mesh.devices.flat))
  if weights == "replicated":  # loaded into shards, then gathered once
    lora, base = mesh_lib.gathered_whole((lora, base), c.mesh)
  setup = Setup(cfg, c.mesh, tokenizer, graphdef, lora, base, c.rewards, train, held_out, spec,
                sets, c.devices, weights=weights, weights_why=why)
  if judged(cfg) and with_judge:
    judge = Judge.for_run(setup) if c.devices.judge is None else Judge.own(
        cfg.judge, c.devices.judge, cfg.train.seed)
    if cfg.judge.check:
      a = judge_lib.check(judge, c.train + c.held_out)
      log.info("judge.check: %.2f of its calls right on %d records (at least %.2f needed)",
               a["agreement"], a["n"], cfg.judge.min_agreement)
    c.rewards.bind("judge", judge)
  if any(s.fn == "tests_pass" for s in cfg.rewards):
    log.info("tests_pass: %s", sandbox.isolation())  # which isolation the code runs under
  if teacher:
    setup.teacher = Teacher.for_run(setup, c.devices.teacher)
  return setup


def judged(cfg: Config) -> bool:
  return any(s.fn == "judge" for s in cfg.rewards)


# the generated sources' records' category, and the preset sources' (their mapping's)
OWN_CATEGORY = {"arithmetic": "math", "instructions": "instructions",
                **{name: preset["category"] for name, preset in sources.PRESETS.items()}}


def judged_share(cfg: Config) -> float:
  """The share of a step's prompts the judge reward scores, by the mixture's weights: a source
  counts where the judge names its records' category (`category`, or a generated or preset
  source's own) or where its records may carry any (a file's, no `category`); 1.0 without a
  mixture or where the judge scores every category."""
  if not judged(cfg):
    return 0.0
  cats = next(s.categories for s in cfg.rewards if s.fn == "judge")
  if cfg.data.mixture is None or cats is None:
    return 1.0
  own = lambda m: m.category or OWN_CATEGORY.get(m.source)
  weight = sum(m.weight for m in cfg.data.mixture if own(m) is None or own(m) in cats)
  return weight / sum(m.weight for m in cfg.data.mixture)


def taught(cfg: Config) -> bool:
  """Whether the config names distillation's teacher."""
  return cfg.distill.teacher is not None or cfg.distill.teacher_lora is not None


def split_devices(cfg: Config, devices: list | None, teacher: bool = False) -> Devices:
  """The policy's devices and, with `judge.devices: N`, the judge's: the last N; with a
  `teacher` on `distill.devices: M`, the teacher's: the M before them; with `rollout.devices:
  R`, the rollout's: the R before those. On several hosts each host gives alike
  (`_split_per_host`; the rollout's on one host only)."""
  devices = list(jax.devices() if devices is None else devices)
  j = (cfg.judge.devices or 0) if judged(cfg) else 0
  t = (cfg.distill.devices or 0) if teacher and cfg.distill.teacher is not None else 0
  r = cfg.rollout.devices or 0
  if j + t + r and j + t + r >= len(devices):
    key, value = next((k, v) for k, v in (("distill.devices", t), ("rollout.devices", r),
                                         ("judge.devices", j)) if v)
    others = " and ".join(f"{k} = {v}" for k, v in (("judge.devices", j), ("distill.devices", t),
                                                   ("rollout.devices", r)) if v and k != key)
    raise ConfigError(f"config key '{key}' = {value}{' and ' + others if others else ''}: this "
                      f"run has {len(devices)} devices, and the policy needs at least one (at "
                      f"most {len(devices) - 1 - (j + t + r - value)})")
  if r and jax.process_count() > 1:  # (a topology's compile-only devices plan on one)
    raise ConfigError(f"config key 'rollout.devices' = {r}: this run spans "
                      f"{jax.process_count()} hosts (processes), and rollouts on chips of their "
                      "own run on one host")
  hosts = sorted({d.process_index for d in devices})
  # several hosts at run time: each gives every model its share. A topology's compile-only
  # devices (the planner, one process) keep whole slices: libtpu compiles for a slice, and
  # aborts on chips taken from each of its hosts.
  if len(hosts) > 1 and j + t and jax.process_count() > 1:
    return _split_per_host(devices, hosts, j, t)
  rest = len(devices) - j - t - r
  return Devices(devices[:rest], devices[len(devices) - j:] if j else None,
                 devices[rest + r:rest + r + t] if t else None,
                 devices[rest:rest + r] if r else None)


def _split_per_host(devices: list, hosts: list[int], j: int, t: int) -> Devices:
  """The judge's and the teacher's devices taken alike from every host (the last j / P of each
  host's, the t / P before them), so that every process runs every model's programs on devices
  of its own, as multi-controller JAX needs."""
  n = len(hosts)
  for key, value in (("judge.devices", j), ("distill.devices", t)):
    if value % n:
      raise ConfigError(f"config key '{key}' = {value}: this run spans {n} hosts (processes), "
                        f"and a model of its own takes the same number of devices from each: "
                        f"a multiple of {n}")
  policy, judge, teacher = [], [], []
  for h in hosts:
    local = [d for d in devices if d.process_index == h]
    rest = len(local) - (j + t) // n
    policy += local[:rest]
    teacher += local[rest:rest + t // n]
    judge += local[rest + t // n:]
  return Devices(policy, judge or None, teacher or None)


def placement(cfg: Config, mesh: jax.sharding.Mesh, base, hbm: int | None) -> tuple[str, str]:
  """The training weights' placement (`mesh.weights`, auto resolved by
  `engine.layout.weights_placement` for `base` on chips of `hbm` bytes) and why, logged where
  auto had a choice (several chips of known memory)."""
  weights, why = layout.weights_placement(cfg.mesh.weights, mesh.size, layout.nbytes(base),
                                          hbm)
  if cfg.mesh.weights == "auto" and hbm and mesh.size > 1:
    log.info("mesh.weights auto: %s (%s)", weights, why)
  return weights, why


def _abstract(cfg: Config, devices: list | None, teacher: bool = False,
              hbm: int | None = None) -> Setup:
  split = split_devices(cfg, devices, teacher)
  mesh = mesh_lib.make_mesh(cfg.mesh, split.policy)
  check_mesh(cfg, mesh.shape["fsdp"])
  tokenizer, spec = load.spec_without_checkpoint(cfg.model)

  # Two traces: qwix finds a kernel by following its tracer to the module's parameter, which
  # must be an input of the trace, not the output of its initializer (QLoRA's MLP kernels
  # came out without LoRA weights when both ran in one).
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: gemma.new_model(spec, 0))
    graphdef, lora, base = lora_lib.split(nnx.eval_shape(
        lambda m: lora_lib.with_lora(m, cfg.lora, cfg.train.seed), model))
  weights, why = placement(cfg, mesh, base, hbm)
  rule = mesh_lib.weight_rule(weights)
  return Setup(cfg, mesh, tokenizer, graphdef, mesh_lib.placed(lora, mesh, rule),
               mesh_lib.placed(base, mesh, rule), Rewards(cfg.rewards), [], [], spec,
               devices=split, weights=weights, weights_why=why)
