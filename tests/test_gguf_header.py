"""`gguf.read_header` (the embedded model's open in a fraction of a second) against gguf-py's
own GGUFReader, on a file written here with every kind of field the format has and tensors
in float32, float16 and two quantised types. No model loads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from reasoner.models import gguf as reasoner_gguf


def _write(path, alignment: int | None = None):
  w = gguf.GGUFWriter(str(path), "gemma3")
  if alignment:
    w.add_custom_alignment(alignment)
  for key, value in {"gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
                     "gemma3.attention.key_length": 8, "gemma3.block_count": 2,
                     "gemma3.embedding_length": 32}.items():
    w.add_uint32(key, value)
  w.add_uint8("t.u8", 200)
  w.add_int8("t.i8", -3)
  w.add_uint16("t.u16", 60000)
  w.add_int16("t.i16", -30000)
  w.add_int32("t.i32", -7)
  w.add_float32("t.f32", 0.25)
  w.add_bool("t.bool", True)
  w.add_uint64("t.u64", 2**40)
  w.add_int64("t.i64", -(2**40))
  w.add_float64("t.f64", 1e-300)
  w.add_string("t.str", "héllo")
  w.add_array("t.strings", ["a", "", "ünïcode", "x" * 300] * 50)  # stepped over, not read
  w.add_array("t.ints", list(range(1000)))
  w.add_array("t.floats", [0.5] * 7)
  rng = np.random.default_rng(0)
  tensors = {"a.f32": (rng.normal(size=(3, 5)).astype(np.float32), None),
             "b.f16": (rng.normal(size=(64,)).astype(np.float16), None)}
  for name, qtype in (("c.q8", gguf.GGMLQuantizationType.Q8_0),
                      ("d.q4", gguf.GGMLQuantizationType.Q4_0)):
    tensors[name] = (gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), qtype),
                     qtype)
  for name, (data, qtype) in tensors.items():
    w.add_tensor(name, data, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("alignment", [None, 4096])
def test_the_header_reads_as_gguf_py_reads_it(tmp_path, alignment):
  path = tmp_path / "m.gguf"
  _write(path, alignment)
  ref = gguf.GGUFReader(str(path))
  fields, tensors = reasoner_gguf.read_header(path)
  scalars = {k: f.contents() for k, f in ref.fields.items()
             if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not k.startswith("GGUF.")}
  assert fields.keys() == scalars.keys()
  for key, value in scalars.items():
    assert fields[key] == pytest.approx(value, rel=1e-7) if isinstance(value, float) else (
        fields[key] == value), key
  ckpt = reasoner_gguf.GGUFCheckpoint(path)
  assert ckpt.num_layers == 2 and ckpt.embed_dim == 32 and ckpt.field("t.str") == "héllo"
  assert tensors.keys() == {t.name for t in ref.tensors}
  for t in ref.tensors:
    assert tensors[t.name][0] == t.tensor_type and tensors[t.name][2] == t.data_offset
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    got = ckpt.tensor(t.name)
    assert got.shape == want.shape and np.array_equal(got, want), t.name


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"NOPE" + bytes(40))
  with pytest.raises(ValueError, match=r"x.gguf: not a GGUF file of version 2 or 3"):
    reasoner_gguf.GGUFCheckpoint(path)
