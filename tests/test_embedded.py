"""The embedded Gemma 3 270M: tokenizer ids and logits against Hugging Face transformers.

Reference values in gguf_reference_logits.json were computed once with an independent
implementation (transformers 5.12.1 + torch 2.13.0 CPU, float32, eager attention, reading the
same GGUF file) by:
    pip install torch==2.13.0 transformers==5.12.1 accelerate gguf
    python tools/reference_logits.py <dir holding gemma-3-270m-q4_k_m.gguf> > ref.json
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from reasoner import mesh as mesh_lib
from reasoner.engine import heads
from reasoner.config import MeshConfig, ModelConfig
from reasoner.models import gemma, load, tokenizer
from reasoner.models.cache import causal_mask, positions_from_mask

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

REF = json.loads((ROOT / "tests" / "gguf_reference_logits.json").read_text())


@pytest.fixture(scope="module")
def ckpt():  # the process's one open of the file, shared with every embedded build
  return load.embedded()[0]


def test_tokenizer_ids(ckpt):
  tok = ckpt.tokenizer()
  assert tok.vocab_size == 262144
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert tok.encode("<start_of_turn>user\nHi<end_of_turn>") == [105, 2364, 107, 10979, 106]
  assert tok.end_of_turn_id == 106
  assert tok.encode("Question: What is 12 + 7?\nAnswer:", add_bos=True) == REF["input_ids"]
  assert tok.encode("12") == [236770, 236778]  # digits are split
  text = "Hello  world,\n\ttabs and   spaces: 3.14 <answer>7</answer>"
  assert tok.decode(tok.encode(text)) == text


def test_the_answer_stop_matches_every_way_gemma_writes_it(ckpt):
  """'.</answer>' is '.</' 'answer' '>' in Gemma's BPE: the ids of '</answer>' alone never end
  such a completion (before this test, 44 of 90 closed instruction answers ran on past it)."""
  tok = ckpt.tokenizer()
  pattern = tokenizer.stop_pattern(tok, "</answer>")
  assert tok.encode("</answer>") == [954, 14433, 236813] and len(pattern) == 3

  def stops_at(ids):  # every k where ids[:k] ends in the pattern
    return [k for k in range(3, len(ids) + 1)
            if all(i in p for i, p in zip(ids[k - 3:k], pattern))]

  for text in ("7</answer>", "you.</answer>", "(a)</answer>", "done!</answer>", "x</answer>>",
               "Why? </answer>\n\nQuestion:"):
    ids = tok.encode(text)
    ends = stops_at(ids)
    assert ends and tok.decode(ids[:ends[0]]).rstrip(">").endswith("</answer"), text
  assert 9047 in pattern[0] and all(tok.texts()[i].endswith("</") for i in pattern[0])
  assert pattern[1] == (14433,) and all(tok.texts()[i].startswith(">") for i in pattern[2])
  for text in ("<answer>7", "</reasoning>", "answer>", "</ answer>"):  # no stop before its end
    assert not stops_at(tok.encode(text)), text


def test_the_tokenizer_is_kept_beside_the_gguf(ckpt, tmp_path, monkeypatch):
  """The first read rebuilds the tokenizer from the GGUF and keeps its ModelProto beside the
  file; the next reads it without opening the GGUF; a damaged copy is rebuilt and replaced."""
  from reasoner.models import gguf

  real = gguf.embedded_gguf_path()
  (tmp_path / real.name).symlink_to(real)  # the same size and time, kept copies land here
  monkeypatch.setattr(gguf, "embedded_gguf_path", lambda: tmp_path / real.name)
  opened, tok = [], ckpt.tokenizer()

  class Opened:  # the GGUF, counted: the module's one read stands in for reopening it
    def __init__(self, path):
      opened.append(path)

    tokenizer = staticmethod(lambda: tok)

  monkeypatch.setattr(gguf, "GGUFCheckpoint", Opened)
  text = "Question: What is 12 + 7?\n<answer>19</answer>"
  assert gguf.embedded_tokenizer().encode(text) == tok.encode(text) and len(opened) == 1
  kept, = tmp_path.glob("*.tokenizer.model")
  assert kept.read_bytes() == tok.model_proto and not list(tmp_path.glob("*.part"))
  again = gguf.embedded_tokenizer()
  assert len(opened) == 1 and again.encode(text) == tok.encode(text)
  assert (again.vocab_size, again.end_of_turn_id) == (262144, 106)
  kept.write_bytes(b"not a model")
  assert gguf.embedded_tokenizer().encode(text) == tok.encode(text) and len(opened) == 2
  assert kept.read_bytes() == tok.model_proto


def test_logits_match_transformers(ckpt):
  mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:1])
  model = gemma.from_host(gemma.model_spec(ModelConfig()), mesh, ckpt.reader())
  x = jnp.asarray([REF["input_ids"]])
  v = jnp.ones_like(x, bool)
  h, _ = model.hidden_states(x, positions_from_mask(v), None, causal_mask(v))
  z = np.asarray(heads.logits(h[0], model.embedding()))
  for pos, ref in REF["positions"].items():
    row = z[int(pos)]
    ids = [i for i, _ in ref["top8"]]
    assert list(np.argsort(-row)[:8]) == ids
    np.testing.assert_allclose(row[ids], [v for _, v in ref["top8"]], rtol=1e-4, atol=2e-4)
    sel = {int(k): v for k, v in ref["selected"].items()}
    np.testing.assert_allclose(row[list(sel)], list(sel.values()), rtol=1e-4, atol=2e-4)
