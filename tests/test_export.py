"""Export: the run's LoRA merged into the base, loaded by Tunix's own loaders and by ours.

References are Tunix 0.1.7's loaders reading the exported folder (`create_model_from_checkpoint`
for Gemma 3, `load_and_format_params` + its linen mapping for Gemma 2); the safetensors names and
layouts are checked against the GGUF file's tensors, whose names are Hugging Face's one to one.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, shard_fraction, tiny_config
from reasoner import export, mesh as mesh_lib
from reasoner.models import lora as lora_lib
from reasoner.build import build
from reasoner.config import LoraConfig, MeshConfig
from reasoner.models import gemma, load
from reasoner.models.cache import causal_mask, positions_from_mask
from test_kaggle import TOKENS, gemma2_spec, logits

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

TINY = ROOT / "configs" / "tiny.yaml"


def lora_logits(model, tokens):
  """Our forward (`hidden_states`, where qwix's LoRA applies) through the tied head."""
  return np.asarray(_lora_forward(model, jnp.asarray(tokens, jnp.int32)))


# Jitted: run eagerly over 8 fake devices, XLA:CPU aborted under a loaded machine (CI).
@nnx.jit
def _lora_forward(model, x):
  v = jnp.ones_like(x, bool)
  h, _ = model.hidden_states(x, positions_from_mask(v), None, causal_mask(v))
  z = jnp.einsum("btd,vd->btv", h, model.embedding())
  cap = model.logit_softcap
  return z if cap is None else jnp.tanh(z / cap) * cap


def cli(*args):
  return subprocess.run([sys.executable, "-m", "reasoner", *args], cwd=ROOT, capture_output=True,
                        text=True)


def _export_tree(graphdef, lora, base, scale, family, where):
  import orbax.checkpoint as ocp

  params = export.merged(graphdef, lora, base, scale)
  with ocp.PyTreeCheckpointer() as c:
    c.save(where, export.upstream_tree(family, params))
  return params


def _noisy(lora, scale=0.05):
  return jax.tree.map(lambda x: x + scale * jax.random.normal(jax.random.key(1), x.shape), lora)


def test_trained_tiny_run_exports_to_tunix_and_loads_back(tmp_path):
  """Two GRPO steps through the CLI, export through the CLI; Tunix's loader and `model.path`
  give our LoRA model's logits. Float32 throughout: W + (alpha/r) A B formed once against
  x W + (alpha/r) (x A) B at every call differ only by float32 reassociation (2e-5 here)."""
  from tunix.models.gemma3 import params as tunix_params

  run = [f"train.run_dir={tmp_path}", "train.steps=2"]
  assert cli("train", "--config", str(TINY), *run).returncode == 0
  out = tmp_path / "export"
  p = cli("export", "--config", str(TINY), "--out", str(out), *run)
  assert p.returncode == 0, p.stderr[-2000:]
  meta = json.loads((out / "export.json").read_text())
  assert meta["step"] == 2 and meta["variant"] == "tiny"

  from reasoner.engine import checkpoint as run_lib

  setup = build(tiny_config(*run))
  trained, step = run_lib.restore_lora(setup)
  assert step == 2 and any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(trained))
  ours = lora_logits(setup.model(trained), TOKENS)
  tunix = tunix_params.create_model_from_checkpoint(
      str(out / "tiny"), gemma.model_spec(setup.cfg.model, 384).tunix_config,
      dtype=jnp.float32)
  np.testing.assert_allclose(logits(tunix, TOKENS), ours, rtol=1e-4, atol=1e-4)

  back = build(tiny_config(*run, "model.source=kaggle", f"model.path={out}"))
  np.testing.assert_allclose(lora_logits(back.model(), TOKENS), ours, rtol=1e-4, atol=1e-4)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(
      nnx.state(back.lora, lambda p, v: p[-1] == "w_lora_b" or p[-1] == "kernel_lora_b")))


def test_export_holds_every_matrix_in_its_shards():
  s = build(tiny_config())
  params = export.merged(s.graphdef, _noisy(s.lora), s.base, 2.0)
  tree = export.upstream_tree("gemma3", params)
  for key, leaves in tree.items():
    for leaf, x in leaves.items():
      if x.ndim >= 2:
        assert shard_fraction(x) <= 1 / 2, (key, leaf, x.sharding)


def test_gemma2_export_loads_in_tunix(tmp_path):
  from tunix.models.gemma import model as gemma_lib, params as params_lib

  spec, mesh = gemma2_spec(), mesh_lib.make_mesh(MeshConfig(), jax.devices())
  model = lora_lib.apply_lora(gemma.init_random(spec, mesh, 0), LoraConfig(rank=4, alpha=8.0),
                              mesh, 0)
  graphdef, lora, base = lora_lib.split(model)
  lora = _noisy(lora)
  _export_tree(graphdef, lora, base, 2.0, "gemma2", tmp_path / "gemma2-2b-it")
  nested = params_lib.load_and_format_params(str(tmp_path / "gemma2-2b-it"))
  ref = gemma_lib.module_from_linen_variables(
      lambda: spec.cls(spec.tunix_config, rngs=nnx.Rngs(0)), nested["transformer"],
      map_key_fn=gemma_lib._map_linen_var_names,
      assign_val_fn=gemma_lib._assign_linen_params_to_nnx_state)
  np.testing.assert_allclose(logits(ref, TOKENS), lora_logits(nnx.merge(graphdef, lora, base), TOKENS),
                             rtol=1e-4, atol=1e-4)


def test_export_refuses_a_non_empty_directory(tmp_path):
  out = tmp_path / "taken"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  p = cli("export", "--config", str(TINY), "--out", str(out), f"train.run_dir={tmp_path}")
  assert p.returncode == 2
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "not an empty directory" in lines[0], p.stderr
  assert [x.name for x in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.extended  # the real 270M (12 GB of this host's memory): make soak; make test
def test_embedded_export_matches_tunix_and_the_gguf(tmp_path):
  """The real 270M: Tunix's loader on the export of a LoRA'd model gives its logits; with the
  LoRA at zero, every safetensors tensor is the GGUF's (HF names one to one, norms minus 1)."""
  from safetensors.numpy import load_file
  from tunix.models.gemma3 import model as tunix_model, params as tunix_params

  cfg = tiny_config("model.source=embedded", "model.name=gemma3-270m", "model.tokenizer=auto",
                    "lora.rank=8")
  setup = build(cfg)
  lora = _noisy(setup.lora, 0.01)
  scale = cfg.lora.alpha / cfg.lora.rank
  params = _export_tree(setup.graphdef, lora, setup.base, scale, "gemma3", tmp_path / "m")
  tunix = tunix_params.create_model_from_checkpoint(
      str(tmp_path / "m"), tunix_model.ModelConfig.gemma3_270m(), dtype=jnp.float32)
  ids = [[2, 9259, 236787, 2900, 563, 236743, 236770, 236778, 900, 236743, 236832, 236881]]
  ours = lora_logits(setup.model(lora), ids)
  np.testing.assert_allclose(logits(tunix, ids), ours, rtol=2e-4, atol=2e-3)

  del params
  zero = export.merged(setup.graphdef, setup.lora, setup.base, scale)
  export.write_safetensors(tmp_path / "m.safetensors", export.hf_tensors(zero), zero)
  st = load_file(str(tmp_path / "m.safetensors"))
  ck = load.embedded()[0]  # the file `build` read
  assert len(st) == len(ck._tensors)
  for name, value in st.items():
    ref = ck.tensor(_gguf_name(name))
    if name.endswith("norm.weight"):
      ref = ref - 1.0
    np.testing.assert_array_equal(value, ref.reshape(value.shape), err_msg=name)
    assert value.shape == ref.shape, name


def _gguf_name(hf: str) -> str:
  table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight"}
  if hf in table:
    return table[hf]
  parts = hf.split(".")
  sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
         "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm":
         "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm":
         "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
  return f"blk.{parts[2]}.{sub['.'.join(parts[3:-1])]}.weight"
