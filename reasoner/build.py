"""Builds what a run needs from its config: mesh, tokenizer, model (LoRA in place), rewards."""

from __future__ import annotations

import dataclasses
import logging

import jax
from flax import nnx

from reasoner import lora as lora_lib
from reasoner import mesh as mesh_lib
from reasoner.config import Config, check_mesh
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
  eval_records: list

  def model(self, lora=None):
    return nnx.merge(self.graphdef, self.lora if lora is None else lora, self.base)


def check(cfg: Config) -> tuple[jax.sharding.Mesh, Rewards, list, list]:
  """Everything that can fail on bad input, before any weight is read: for Kaggle, the local
  download's layout, or credentials and the network (seconds, nothing downloaded)."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  check_mesh(cfg, mesh.shape["fsdp"])
  rewards = Rewards(cfg.rewards)
  if cfg.model.source == "kaggle":
    from reasoner.models import kaggle

    kaggle.resolve(cfg.model)
  train, held_out = sources.load_splits(cfg.data)
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
  elif m.source == "kaggle":
    tokenizer, model = _kaggle(cfg, mesh)
  else:  # random
    tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else _embedded_tokenizer()
    spec = gemma.model_spec(m, None if m.name != "tiny" else max(m.tiny_vocab,
                                                                  tokenizer.vocab_size))
    model = gemma.init_random(spec, mesh, cfg.train.seed)
  d = cfg.data
  train, held_out = (prompts.within_limit(recs, split, d.template, tokenizer, d.max_prompt_tokens,
                                          d.overlong, log.warning)
                     for recs, split in ((train, "training"), (held_out, "held-out")))
  model = lora_lib.apply_lora(model, cfg.lora, mesh, cfg.train.seed)
  graphdef, lora, base = lora_lib.split(model)
  return Setup(cfg, mesh, tokenizer, graphdef, lora, base, rewards, train, held_out)


def _kaggle(cfg: Config, mesh: jax.sharding.Mesh):
  """(tokenizer, model) from a Kaggle Flax checkpoint, restored straight into its shards."""
  from reasoner.models import kaggle

  layout = kaggle.fetch(cfg.model)
  tokenizer = ByteTokenizer() if cfg.model.tokenizer == "bytes" else kaggle.tokenizer(layout)
  meta = kaggle.read_metadata(layout.params)
  spec = gemma.model_spec(cfg.model, kaggle.vocab_size(meta))  # the vocabulary: tiny only
  log.info("restoring %s into its shards (mesh %s) ...", layout.params, dict(mesh.shape))
  return tokenizer, kaggle.restore(spec, mesh, layout.params, meta)


def _embedded_tokenizer():
  from reasoner.models import gguf

  return gguf.GGUFCheckpoint(gguf.embedded_gguf_path()).tokenizer()
