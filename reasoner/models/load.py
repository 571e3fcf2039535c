"""A model from its config section (`model`, `judge.model`, a teacher's): tokenizer, spec and
weights loaded into their shards on a given mesh, whichever the source (the embedded GGUF, a
Kaggle Flax checkpoint, a random init); and the spec alone where nothing is read (the planner)."""

from __future__ import annotations

import functools
import logging

import jax

from reasoner.config import ModelConfig
from reasoner.models import gemma, gguf, kaggle
from reasoner.models.tokenizer import ByteTokenizer

log = logging.getLogger("reasoner")


def check(m: ModelConfig) -> None:
  """What can fail before any weight is read: a Kaggle model's local layout, or credentials and
  the network (seconds, nothing downloaded)."""
  if m.source == "kaggle":
    kaggle.resolve(m)


def vocabulary(m: ModelConfig) -> tuple[str, int]:
  """(the tokenizer's kind, the vocabulary's size) of model section `m`, read from its name
  (nothing loaded): two models score the same tokens only where both agree."""
  kind = "bytes" if m.tokenizer == "bytes" else m.name.split("-")[0].replace("tiny", "gemma3")
  spec = gemma.model_spec(m)
  return kind, spec.tunix_config.num_embed


def load_model(m: ModelConfig, mesh: jax.sharding.Mesh, seed: int):
  """(tokenizer, spec, model) of model section `m`, its weights loaded into their shards."""
  if m.source == "embedded":
    log.info("loading the embedded Gemma 3 270M (GGUF, dequantised) ...")
    ckpt, tokenizer = embedded()
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
  tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else embedded_tokenizer()
  vocab = max(m.tiny_vocab, tokenizer.vocab_size) if m.name == "tiny" else None
  return tokenizer, gemma.model_spec(m, vocab)


def _kaggle(m: ModelConfig, mesh: jax.sharding.Mesh):
  """(tokenizer, spec, model) from a Kaggle Flax checkpoint, restored straight into its shards."""
  layout = kaggle.fetch(m)
  tokenizer = ByteTokenizer() if m.tokenizer == "bytes" else kaggle.tokenizer(layout)
  meta = kaggle.read_metadata(layout.params)
  spec = gemma.model_spec(m, kaggle.vocab_size(meta))  # the vocabulary: tiny only
  log.info("restoring %s into its shards (mesh %s) ...", layout.params, dict(mesh.shape))
  return tokenizer, spec, kaggle.restore(spec, mesh, layout.params, meta)


@functools.cache
def embedded() -> tuple[gguf.GGUFCheckpoint, object]:
  """The embedded GGUF and its tokenizer, opened once a process: a planner's search asked for
  the tokenizer once a plan (11 times for the gemma3_1b preset's micro-batch search)."""
  return gguf.GGUFCheckpoint(gguf.embedded_gguf_path()), embedded_tokenizer()


@functools.cache
def embedded_tokenizer():
  """The embedded tokenizer alone (`reasoner data`, a plan): its kept copy, without the GGUF."""
  return gguf.embedded_tokenizer()
