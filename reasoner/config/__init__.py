"""Typed, frozen configuration loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/embedded.yaml", ["train.steps=5", "rollout.temperature=0.7"])

Every section is a frozen dataclass. Loading checks each key and type and every section's own
rules (``__post_init__``); a problem raises ``ConfigError`` naming the key, the value and what was
expected, before any model is loaded. Rules that need the device count live in ``check_mesh``.
Importing this package imports no jax (a bad config fails in a second).

The sections, by who reads them (each importable from here):
- `model.py`: model, mesh, lora (what is trained, on which devices);
- `data.py`: data, eval (records, prompts, evaluation sets);
- `loop.py`: train, optim (the loop and the optimizer);
- `stages.py`: rollout, grpo, sft, prefer, distill, rewards, judge (the training stages and
  their rewards).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml

from reasoner.config import typed
from reasoner.config.data import DataConfig, EvalConfig, EvalSet
from reasoner.config.loop import OptimConfig, TrainConfig
from reasoner.config.model import LoraConfig, MeshConfig, ModelConfig
from reasoner.config.stages import (DEFAULT_RUBRIC, DistillConfig, GRPOConfig, JudgeConfig,
                                    PreferConfig, RewardSpec, RolloutConfig, SFTConfig)
from reasoner.config.typed import fail as _fail
from reasoner.errors import ConfigError

__all__ = ["Config", "ConfigError", "DEFAULT_RUBRIC", "DataConfig", "DistillConfig",
           "EvalConfig", "EvalSet", "GRPOConfig", "JudgeConfig", "LoraConfig", "MeshConfig",
           "ModelConfig", "OptimConfig", "PreferConfig", "RewardSpec", "RolloutConfig",
           "SFTConfig", "TrainConfig",
           "check_mesh", "config_from_dict", "load_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  lora: LoraConfig = LoraConfig()
  data: DataConfig = DataConfig()
  rewards: tuple[RewardSpec, ...] = (
      RewardSpec(fn="format_exact", weight=0.2),
      RewardSpec(fn="correct", weight=0.8),
  )
  rollout: RolloutConfig = RolloutConfig()
  grpo: GRPOConfig = GRPOConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  eval: EvalConfig = EvalConfig()
  sft: SFTConfig = SFTConfig()
  prefer: PreferConfig = PreferConfig()
  distill: DistillConfig = DistillConfig()
  judge: JudgeConfig = JudgeConfig()

  def __post_init__(self):
    if not self.rewards:
      _fail("rewards", [], "at least one reward function")
    if sum(r.weight for r in self.rewards) <= 0:
      _fail("rewards", [r.weight for r in self.rewards], "weights that sum to more than 0")
    if self.grpo.overlong_buffer > self.rollout.max_new_tokens:
      _fail("grpo.overlong_buffer", self.grpo.overlong_buffer,
            f"at most rollout.max_new_tokens = {self.rollout.max_new_tokens}")
    if self.rollout.devices and self.grpo.sampler_is != "token":
      _fail("grpo.sampler_is", self.grpo.sampler_is,
            f"'token' with rollout.devices = {self.rollout.devices}: rollouts drawn one update "
            "ahead are corrected by truncated importance weights")
    sources = ({m.source for m in self.data.mixture} if self.data.mixture is not None
               else {self.data.source})
    # the generators' split: what training draws and what their evaluation sets hold out
    generated = (sources | {s.source for s in self.eval.sets}) & {"arithmetic", "instructions"}
    if self.data.held_out_by == "template" and not generated:
      _fail("data.held_out_by", "template", "'record' unless a source is generated "
            "('arithmetic', 'instructions'; a file's records are held out by record)")
    for s in self.eval.sets:
      if s.held_out_by in ("template", "task") and self.data.held_out_by != "template":
        _fail(f"eval.sets[{s.name}].held_out_by", s.held_out_by, "'record' or null unless "
              "data.held_out_by is 'template' (no wording is held out of training)")
    buckets = self.rollout.prompt_buckets
    if buckets is not None and buckets[-1] < self.data.max_prompt_tokens:
      _fail("rollout.prompt_buckets", list(buckets),
            f"a largest bucket of at least data.max_prompt_tokens = {self.data.max_prompt_tokens}")

  @property
  def run_path(self) -> pathlib.Path:
    return pathlib.Path(self.train.run_dir) / self.train.run_name

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def check_mesh(cfg: Config, fsdp: int) -> None:
  """Rules that need the resolved data-parallel size: batches must split evenly over it."""
  rollout = cfg.train.batch_size * cfg.rollout.num_generations
  if rollout % fsdp:
    _fail("train.batch_size", cfg.train.batch_size,
          f"a value for which batch_size * rollout.num_generations ({rollout}) is divisible by "
          f"the data-parallel size mesh.fsdp = {fsdp}")


def config_from_dict(tree: dict[str, Any]) -> Config:
  return typed.build(Config, tree, "")


def _preset(p: pathlib.Path, seen: tuple[pathlib.Path, ...]) -> dict[str, Any]:
  """The preset at `p` as a tree, with the presets it extends beneath it (`seen`: those that
  extend it, a cycle's check)."""
  if not p.is_file():
    where = f" (config key 'extends' in '{seen[-1]}')" if seen else ""
    raise ConfigError(f"config file '{p}' does not exist{where}")
  try:
    tree = typed.parse_yaml(p.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file '{p}' is not valid YAML: {e}") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
  base = tree.pop("extends", None)
  if base is None:
    return tree
  if not isinstance(base, str):
    raise ConfigError(f"{p}: config key 'extends' must be a preset's path, got {base!r}")
  under = (p.parent / base).resolve()
  if under in seen or under == p.resolve():
    raise ConfigError(f"{p}: config key 'extends' = {base!r} extends itself, through "
                      f"{' -> '.join(str(s) for s in (*seen, p))}")
  return _laid_over(_preset(under, (*seen, p.resolve())), tree)


def _laid_over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
  """`top`'s keys over `base`'s: mappings merged key by key, anything else replaced."""
  out = dict(base)
  for k, v in top.items():
    out[k] = (_laid_over(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict)
              else v)
  return out


def load_config(path: str | pathlib.Path | None, overrides: list[str] | tuple[str, ...] = ()
                ) -> Config:
  """Loads a YAML preset (or the defaults when `path` is None) and applies overrides. A preset
  may name another in `extends` (a path relative to its own folder): its keys are laid over
  that preset's, mappings key by key and anything else (a list, a value) whole."""
  tree = _preset(pathlib.Path(path), ()) if path is not None else {}
  for o in overrides:
    typed.apply_override(tree, o)
  try:
    return config_from_dict(tree)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}" if path else str(e)) from None
