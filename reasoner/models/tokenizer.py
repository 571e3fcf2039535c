"""Tokenizers with one interface: SentencePiece (Gemma) and a byte-level one for tiny tests."""

from __future__ import annotations

import functools
from typing import Protocol, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

# SentencePiece piece types (and GGUF's token types, which use the same numbering).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int
  end_of_turn_id: int | None

  def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def texts(self) -> Sequence[str]: ...  # each id's text alone


@functools.lru_cache(maxsize=16)
def stop_pattern(tokenizer: Tokenizer, text: str) -> tuple[tuple[int, ...], ...]:
  """The tokens that can end a completion with `text`, position by position: `text`'s own
  tokens, the first widened to every token whose text ends with the first's and the last to
  every token whose text starts with the last's. BPE merges across the edges: Gemma writes
  '.</answer>' as '.</' 'answer' '>', and the ids of '</answer>' alone never match it."""
  ids, texts = tokenizer.encode(text), tokenizer.texts()
  if not ids:
    raise ValueError(f"a stop text that encodes to no tokens: {text!r}")
  if len(ids) == 1:
    return (tuple(i for i, t in enumerate(texts) if text in t),)
  first, last = texts[ids[0]], texts[ids[-1]]  # a piece of a character (a byte): itself alone
  return (tuple(i for i, t in enumerate(texts) if t.endswith(first)) if first else tuple(ids[:1]),
          *((i,) for i in ids[1:-1]),
          tuple(i for i, t in enumerate(texts) if t.startswith(last)) if last else tuple(ids[-1:]))


class SentencePieceTokenizer:
  """Gemma's SentencePiece model, from a serialized ModelProto or a tokenizer.model file (the
  GGUF's rebuilt vocabulary, or the Kaggle download's own file)."""

  def __init__(self, model_proto: bytes):
    self._sp = spm.SentencePieceProcessor()
    self._sp.LoadFromSerializedProto(model_proto)
    self.model_proto = model_proto
    self.vocab_size = self._sp.GetPieceSize()
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else 0
    self.bos_id = self._sp.bos_id()
    self.eos_id = self._sp.eos_id()
    eot = self._sp.PieceToId("<end_of_turn>")
    self.end_of_turn_id = eot if eot != self._sp.unk_id() else None

  @classmethod
  def from_file(cls, path: str) -> "SentencePieceTokenizer":
    with open(path, "rb") as f:
      return cls(f.read())

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = self._sp.EncodeAsIds(text)
    return [self.bos_id, *ids] if add_bos else list(ids)

  def decode(self, ids: Sequence[int]) -> str:
    """Ids past the vocabulary are dropped: Gemma 2's embedding has 128 rows more (256,128)
    than its tokenizer has pieces (256,000), and a sampled padding row must not crash."""
    return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  def piece(self, i: int) -> str:
    return self._sp.IdToPiece(int(i))

  @functools.cache
  def texts(self) -> list[str]:
    """Each id's piece as text ('▁' a space); byte and control pieces as written."""
    return [p.replace("\u2581", " ") for p in self._sp.id_to_piece(list(range(self.vocab_size)))]


def sentencepiece_from_vocab(tokens: Sequence[str], scores: Sequence[float],
                             types: Sequence[int]) -> bytes:
  """Rebuilds Gemma's BPE SentencePiece model from a GGUF vocabulary (see shared FACTS.md).

  Byte fallback, split digits, identity normalizer, no dummy prefix, whitespace kept and escaped
  to U+2581. Control tokens other than <pad>/<eos>/<bos> become user-defined so that
  '<start_of_turn>' in text is one token, and GGUF's literal spaces inside user-defined
  whitespace tokens go back to U+2581.
  """
  m = sp_pb2.ModelProto()
  t = m.trainer_spec
  t.model_type = sp_pb2.TrainerSpec.BPE
  t.vocab_size = len(tokens)
  t.byte_fallback = True
  t.split_digits = True
  t.split_by_whitespace = True
  t.allow_whitespace_only_pieces = True
  t.unk_id, t.bos_id, t.eos_id, t.pad_id = 3, 2, 1, 0
  t.unk_piece, t.bos_piece, t.eos_piece, t.pad_piece = "<unk>", "<bos>", "<eos>", "<pad>"
  n = m.normalizer_spec
  n.name = "identity"
  n.add_dummy_prefix = False
  n.remove_extra_whitespaces = False
  n.escape_whitespaces = True
  keep_control = {"<pad>", "<eos>", "<bos>"}
  for text, score, kind in zip(tokens, scores, types):
    p = m.pieces.add()
    kind = int(kind)
    if text == "<unk>":
      kind = UNKNOWN
    elif kind == CONTROL and text not in keep_control:
      kind = USER_DEFINED
    if kind == USER_DEFINED and text.strip() == "" and text:
      text = text.replace(" ", "\u2581")
    p.piece, p.score, p.type = text, float(score), kind
  return m.SerializeToString()


class ByteTokenizer:
  """UTF-8 bytes as ids 3..258 (0 pad, 1 eos, 2 bos): a real tokenizer with no files."""

  vocab_size = 259
  pad_id, eos_id, bos_id = 0, 1, 2
  end_of_turn_id = None

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = [b + 3 for b in text.encode("utf-8")]
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", errors="replace")

  def texts(self) -> list[str]:
    return ["", "", "", *(chr(b) if b < 128 else "" for b in range(256))]
