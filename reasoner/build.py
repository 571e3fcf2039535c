"""Builds what a run needs from its config: mesh, tokenizer, model (LoRA in place), rewards."""

from __future__ import annotations

import dataclasses
import logging

import jax
from flax import nnx

from reasoner import lora as lora_lib
from reasoner import mesh as mesh_lib
from reasoner.config import Config, ConfigError, check_mesh
from reasoner.data import sources
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
  eval_records: list

  def model(self, lora=None):
    return nnx.merge(self.graphdef, self.lora if lora is None else lora, self.base)


def check(cfg: Config) -> tuple[jax.sharding.Mesh, Rewards, list, list]:
  """Everything that can fail on bad input, before any weight is read."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  check_mesh(cfg, mesh.shape["fsdp"])
  rewards = Rewards(cfg.rewards)
  train, held_out = sources.load_splits(cfg.data)
  if cfg.model.source == "kaggle":
    raise ConfigError("config key 'model.source' = 'kaggle': loading Kaggle checkpoints is not "
                      "implemented yet; use model.source=embedded or random")
  return mesh, rewards, train, held_out


def build(cfg: Config) -> Setup:
  mesh, rewards, train, held_out = check(cfg)
  m = cfg.model
  if m.source == "embedded":
    from reasoner.models import gguf

    log.info("loading the embedded Gemma 3 270M (GGUF, dequantised) ...")
    ckpt = gguf.GGUFCheckpoint(gguf.embedded_gguf_path())
    tokenizer = ckpt.tokenizer()
    spec = gemma.model_spec(m, tokenizer.vocab_size)
    model = gemma.from_host(spec, mesh, ckpt.reader())
  else:  # random
    tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else _embedded_tokenizer()
    spec = gemma.model_spec(m, None if m.name != "tiny" else max(m.tiny_vocab,
                                                                  tokenizer.vocab_size))
    model = gemma.init_random(spec, mesh, cfg.train.seed)
  model = lora_lib.apply_lora(model, cfg.lora, mesh, cfg.train.seed)
  graphdef, lora, base = lora_lib.split(model)
  return Setup(cfg, mesh, tokenizer, graphdef, lora, base, rewards, train, held_out)


def _embedded_tokenizer():
  from reasoner.models import gguf

  return gguf.GGUFCheckpoint(gguf.embedded_gguf_path()).tokenizer()
