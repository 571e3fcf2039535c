"""Builds what a run needs from its config: mesh, tokenizer, model (LoRA in place), rewards.

`build(cfg)` loads the weights into their shards; `build(cfg, abstract=True, devices=...)` gives
the planner the same `Setup` with ShapeDtypeStructs placed exactly as the weights would be
(nothing allocated, nothing read or downloaded), so that what it compiles is what a run runs."""

from __future__ import annotations

import dataclasses
import logging

import jax
from flax import nnx

from reasoner import lora as lora_lib
from reasoner import mesh as mesh_lib
from reasoner.config import Config, ConfigError, ModelConfig, check_mesh
from reasoner.data import prompts, sources
from reasoner.models import gemma
from reasoner.models.tokenizer import ByteTokenizer
from reasoner.rewards import Rewards

log = logging.getLogger("reasoner")


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

  def model(self, lora=None):
    return nnx.merge(self.graphdef, self.lora if lora is None else lora, self.base)


def check(cfg: Config, devices: list | None = None, sft: bool = False
          ) -> tuple[jax.sharding.Mesh, Rewards, list, list, dict[str, list]]:
  """Everything that can fail on bad input, before any weight is read: for Kaggle, the local
  download's layout, or credentials and the network (seconds, nothing downloaded); for `sft`,
  the training records' responses. Returns (mesh, rewards, train, held_out, {eval set name:
  records})."""
  mesh = mesh_lib.make_mesh(cfg.mesh, split_devices(cfg, devices)[0])
  check_mesh(cfg, mesh.shape["fsdp"])
  rewards = Rewards(cfg.rewards)
  for m in (cfg.model, cfg.judge.model if judged(cfg) else None):
    if m is not None and m.source == "kaggle":
      from reasoner.models import kaggle

      kaggle.resolve(m)
  train, held_out = sources.load_splits(cfg.data)
  sets = {s.name: sources.load_eval_set(s, cfg.data) for s in cfg.eval.sets}
  for where, records in (("the training data", train), ("the held-out data", held_out),
                         *((f"evaluation set '{k}'", v) for k, v in sets.items())):
    rewards.check(records, where)
  if sft:
    from reasoner import sft as sft_lib

    sft_lib.check(train, "the training data", cfg.data.response_field)
  return mesh, rewards, train, held_out, sets


def build(cfg: Config, abstract: bool = False, devices: list | None = None,
          sft: bool = False) -> Setup:
  """The run's `Setup`; `abstract`: its model as placed ShapeDtypeStructs and no records, on
  `devices` (default: this host's), e.g. a TPU topology's compile-only devices; `sft`: the
  training records must have responses."""
  if abstract:
    return _abstract(cfg, devices)
  mesh, rewards, train, held_out, sets = check(cfg, devices, sft)
  tokenizer, spec, model = load_model(cfg.model, mesh, cfg.train.seed)
  d = cfg.data
  fit = lambda recs, split: prompts.within_limit(recs, split, d.template, tokenizer,
                                                  d.max_prompt_tokens, d.overlong, log.warning)
  train, held_out = fit(train, "training"), fit(held_out, "held-out")
  sets = {name: fit(recs, f"'{name}' evaluation") for name, recs in sets.items()}
  model = lora_lib.apply_lora(model, cfg.lora, mesh, cfg.train.seed)
  graphdef, lora, base = lora_lib.split(model)
  setup = Setup(cfg, mesh, tokenizer, graphdef, lora, base, rewards, train, held_out, spec, sets)
  if judged(cfg):
    from reasoner.judge import Judge

    judge_devices = split_devices(cfg, devices)[1]
    rewards.bind("judge", Judge.for_run(setup) if judge_devices is None else Judge.own(
        cfg.judge, judge_devices, cfg.train.seed))
  return setup


def judged(cfg: Config) -> bool:
  return any(s.fn == "judge" for s in cfg.rewards)


def split_devices(cfg: Config, devices: list | None) -> tuple[list, list | None]:
  """(the policy's devices, the judge's or None): with `judge.devices: N`, the last N."""
  devices = list(jax.devices() if devices is None else devices)
  k = cfg.judge.devices if judged(cfg) else None
  if not k:
    return devices, None
  if k >= len(devices):
    raise ConfigError(f"config key 'judge.devices' = {k}: this run has {len(devices)} devices, "
                      f"and the policy needs at least one (at most {len(devices) - 1})")
  return devices[:-k], devices[-k:]


def load_model(m: ModelConfig, mesh: jax.sharding.Mesh, seed: int):
  """(tokenizer, spec, model) of model section `m`, its weights loaded into their shards."""
  if m.source == "embedded":
    from reasoner.models import gguf

    log.info("loading the embedded Gemma 3 270M (GGUF, dequantised) ...")
    ckpt = gguf.GGUFCheckpoint(gguf.embedded_gguf_path())
    tokenizer = ckpt.tokenizer()
    spec = gemma.model_spec(m, tokenizer.vocab_size)
    return tokenizer, spec, gemma.from_host(spec, mesh, ckpt.reader())
  if m.source == "kaggle":
    return _kaggle(m, mesh)
  tokenizer, spec = spec_without_checkpoint(m)
  return tokenizer, spec, gemma.init_random(spec, mesh, seed)


def spec_without_checkpoint(m: ModelConfig) -> tuple[object, gemma.ModelSpec]:
  """(tokenizer, model spec) where no checkpoint is read: a random init, and the planner. The
  byte tokenizer or the embedded Gemma 3 one, which stands in for a Kaggle model's in a plan
  (its stop tokens only: nothing is read from Kaggle); a tiny model's vocabulary holds it."""
  tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else _embedded_tokenizer()
  vocab = max(m.tiny_vocab, tokenizer.vocab_size) if m.name == "tiny" else None
  return tokenizer, gemma.model_spec(m, vocab)


def _abstract(cfg: Config, devices: list | None) -> Setup:
  mesh = mesh_lib.make_mesh(cfg.mesh, split_devices(cfg, devices)[0])
  check_mesh(cfg, mesh.shape["fsdp"])
  tokenizer, spec = spec_without_checkpoint(cfg.model)

  # Two traces: qwix finds a kernel by following its tracer to the module's parameter, which
  # must be an input of the trace, not the output of its initializer (QLoRA's MLP kernels
  # came out without LoRA weights when both ran in one).
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: spec.cls(spec.tunix_config, rngs=nnx.Rngs(0)))
    graphdef, lora, base = lora_lib.split(nnx.eval_shape(
        lambda m: lora_lib.with_lora(m, cfg.lora, cfg.train.seed), model))
  return Setup(cfg, mesh, tokenizer, graphdef, mesh_lib.placed(lora, mesh),
               mesh_lib.placed(base, mesh), Rewards(cfg.rewards), [], [], spec)


def _kaggle(m: ModelConfig, mesh: jax.sharding.Mesh):
  """(tokenizer, spec, model) from a Kaggle Flax checkpoint, restored straight into its shards."""
  from reasoner.models import kaggle

  layout = kaggle.fetch(m)
  tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else kaggle.tokenizer(layout)
  meta = kaggle.read_metadata(layout.params)
  spec = gemma.model_spec(m, kaggle.vocab_size(meta))  # the vocabulary: tiny only
  log.info("restoring %s into its shards (mesh %s) ...", layout.params, dict(mesh.shape))
  return tokenizer, spec, kaggle.restore(spec, mesh, layout.params, meta)


def _embedded_tokenizer():
  from reasoner.models import gguf

  return gguf.GGUFCheckpoint(gguf.embedded_gguf_path()).tokenizer()
