"""Kaggle Flax checkpoints: a tiny checkpoint in the exact upstream layout, restored into shards.

The checkpoint is written here by hand in google-deepmind/gemma's tree layout (flat module keys
'transformer/layer_N/...' with one leaf each, bf16, a vision entry the text model must skip),
independently of the loader's mapping. References are built by Tunix's own upstream mappings
(`map_from_upstream_checkpoint` for Gemma 3, the linen-variable mapping for Gemma 2).
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import ROOT, no_kaggle_credentials, shard_fraction, tiny_config, xla_flags
from reasoner import mesh as mesh_lib
from reasoner.config import ConfigError, MeshConfig, ModelConfig
from reasoner.models import gemma, kaggle
from reasoner.models.tokenizer import sentencepiece_from_vocab
from reasoner.models.cache import causal_mask, positions_from_mask

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

TINY = dict(layers=2, vocab=384, d=64, f=128, heads=2, kv=1, h=32)  # configs/tiny.yaml's shapes
GEMMA2 = dict(layers=2, vocab=384, d=64, f=96, heads=4, kv=2, h=16)
SECRET = "k3y-must-never-be-printed-0123456789"
KAGGLE_1B = ModelConfig(source="kaggle", name="gemma3-1b",
                        kaggle_handle="google/gemma-3/flax/gemma3-1b-it")


def upstream_tree(family: str, s: dict, seed: int = 0) -> dict:
  """Random bf16 parameters under the upstream names and shapes (Tunix params.py's comment)."""
  rng = np.random.default_rng(seed)
  n = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(ml_dtypes.bfloat16)
  t = {"transformer/embedder": {"input_embedding": n(s["vocab"], s["d"])},
       "transformer/final_norm": {"scale": n(s["d"])}}
  for i in range(s["layers"]):
    p = f"transformer/layer_{i}/"
    t[p + "attn/q_einsum"] = {"w": n(s["heads"], s["d"], s["h"])}
    t[p + "attn/kv_einsum"] = {"w": n(2, s["kv"], s["d"], s["h"])}
    t[p + "attn/attn_vec_einsum"] = {"w": n(s["heads"], s["h"], s["d"])}
    # Gemma 3 stores the gating einsum [2, F, D]; Gemma 2 2B stores it [2, D, F].
    gating = (2, s["f"], s["d"]) if family == "gemma3" else (2, s["d"], s["f"])
    t[p + "mlp/gating_einsum"] = {"w": n(*gating)}
    t[p + "mlp/linear"] = {"w": n(s["f"], s["d"])}
    for norm in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm"):
      t[p + norm] = {"scale": n(s["d"])}
    if family == "gemma3":
      t[p + "attn/_query_norm"] = {"scale": n(s["h"])}
      t[p + "attn/_key_norm"] = {"scale": n(s["h"])}
  if family == "gemma3":  # the 4B+ checkpoints carry a vision encoder; text models skip it
    t["SigLiPFromPatches_0/siglip_encoder/embedding"] = {"kernel": n(2, 2, 3, 8), "bias": n(8)}
  return t


def tokenizer_model() -> bytes:
  """A small Gemma-style BPE SentencePiece model: control ids 0-3, turn markers, bytes, letters."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"]
  types = [3, 3, 3, 2, 3, 3, 1]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  tokens += list("\u2581abcdefghijklmnopqrstuvwxyz0123456789") + ["\u2581a", "an", "is"]
  types += [1] * (len(tokens) - len(types))
  scores = [0.0] * 263 + [-float(i) for i in range(len(tokens) - 263)]
  return sentencepiece_from_vocab(tokens, scores, types)


def _placed(host: np.ndarray, devices: int) -> jax.Array:
  """On one device, or split over `devices` along its last axis that divides (the stored chunks
  follow): some line up with the loader's blocks (read as shards), some do not (read whole)."""
  if devices == 1:
    return jnp.asarray(host)
  axes = [a for a in range(host.ndim) if host.shape[a] % devices == 0]
  spec = [None] * host.ndim
  if axes:
    spec[axes[-1]] = "x"
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def write_download(root, family: str, shapes: dict, variant: str, devices: int = 8):
  """A Kaggle Flax download: <variant>/ (orbax checkpoint) and tokenizer.model."""
  tree = upstream_tree(family, shapes)
  root.mkdir(parents=True, exist_ok=True)
  ocp.PyTreeCheckpointer().save(root / variant,
                                jax.tree.map(lambda a: _placed(a, devices), tree))
  (root / "tokenizer.model").write_bytes(tokenizer_model())
  return tree


@pytest.fixture(scope="module")
def download(tmp_path_factory):
  root = tmp_path_factory.mktemp("kaggle") / "gemma3-tiny"
  return root, write_download(root, "gemma3", TINY, "gemma3-1b-it")


def tiny_spec(vocab: int = 384):
  cfg = tiny_config().model
  return gemma.model_spec(cfg, vocab)


def gemma2_spec():
  _, gemma_lib, _, Gemma2 = gemma.classes()
  s = GEMMA2
  tcfg = gemma_lib.ModelConfig(
      num_layers=s["layers"], num_embed=s["vocab"], embed_dim=s["d"], hidden_dim=s["f"],
      num_heads=s["heads"], head_dim=s["h"], num_kv_heads=s["kv"], final_logit_softcap=30.0,
      use_post_attn_norm=True, use_post_ffw_norm=True, attn_logits_soft_cap=50.0,
      attention_types=(gemma_lib.AttentionType.LOCAL_SLIDING, gemma_lib.AttentionType.GLOBAL),
      sliding_window_size=8, shd_config=gemma_lib.ShardingConfig.get_default_sharding())
  return gemma.ModelSpec(family="gemma2", tunix_config=tcfg, cls=Gemma2, dtype=jnp.float32)


def mesh_of(n: int):
  return mesh_lib.make_mesh(MeshConfig(), jax.devices()[:n])


def reference_gemma3(spec, mesh, tree):
  """The model built directly from the same arrays through Tunix's Gemma 3 mapping."""
  from flax import traverse_util
  from tunix.models.gemma3 import params as tunix_params

  mapped = tunix_params.map_from_upstream_checkpoint(tree)
  flat = {".".join(map(str, k)): v for k, v in traverse_util.flatten_dict(mapped).items()}
  return gemma.from_host(spec, mesh, lambda name, shape: np.asarray(flat[name], np.float32)), flat


def logits(model, tokens):
  """Tunix's forward (`__call__`): what Tunix's loaders return."""
  return np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32)))


@nnx.jit  # jitted: eager ops over 8 fake devices aborted XLA:CPU on a loaded machine
def _forward(model, x):
  v = jnp.ones_like(x, bool)
  return model(x, positions_from_mask(v), None, causal_mask(v))[0]


TOKENS = [[2, 40, 41, 300, 5, 7, 100, 263], [2, 9, 8, 7, 6, 5, 4, 3]]


def test_restore_matches_tunix_mapping_and_holds_only_its_shards(download, caplog):
  root, tree = download
  spec, mesh = tiny_spec(), mesh_of(8)
  caplog.set_level("INFO")
  model = kaggle.restore(spec, mesh, root / "gemma3-1b-it")
  # Both read paths run: 'last axis' chunks line up with embedding, out, gating, down, norms.
  assert "restoring 20 parameters from their shards, 4 whole on the host" in caplog.text
  ref, flat = reference_gemma3(spec, mesh, tree)
  np.testing.assert_allclose(logits(model, TOKENS), logits(ref, TOKENS), rtol=1e-6, atol=1e-6)
  split = 0
  for path, var in nnx.to_flat_state(nnx.state(model)):
    arr, name = var.get_value(), ".".join(map(str, path))
    full = np.asarray(flat[name], np.float32)
    assert arr.dtype == jnp.float32 and arr.shape == full.shape, name
    assert len(arr.addressable_shards) == 8
    for shard in arr.addressable_shards:
      assert shard.data.shape == arr.sharding.shard_shape(arr.shape), name
      np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=name)
    if "fsdp" in jax.tree.leaves(tuple(arr.sharding.spec)):
      assert shard_fraction(arr) == pytest.approx(1 / 8), name
      split += 1
  assert split == 1 + 6 * TINY["layers"]  # embedding, q, kv, out, gate, up, down per layer


def test_same_logits_on_one_and_eight_devices_whoever_wrote_it(download, tmp_path):
  """Written from 8 devices (mixed read paths) or from one (every parameter read whole, the
  gating einsum split on the host), read on 1 or 8 devices: the same logits."""
  root, _ = download
  write_download(tmp_path, "gemma3", TINY, "gemma3-1b-it", devices=1)  # the same values
  ref = logits(kaggle.restore(tiny_spec(), mesh_of(8), root / "gemma3-1b-it"), TOKENS)
  for where, n in ((root, 1), (tmp_path, 8), (tmp_path, 1)):
    model = kaggle.restore(tiny_spec(), mesh_of(n), where / "gemma3-1b-it")
    np.testing.assert_allclose(logits(model, TOKENS), ref, rtol=1e-5, atol=1e-5)


def test_gating_split_moves_nothing_between_devices():
  mesh = mesh_of(8)
  out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tp"))
  src = kaggle._read_sharding(kaggle.Source("k", "w", ((), ()), (2, 128, 64), True), out)
  arg = jax.ShapeDtypeStruct((2, 128, 64), jnp.float32, sharding=src)
  hlo = kaggle._gating_splitter(True, out).lower(arg).compile().as_text()
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert op not in hlo


def test_gemma2_parameters_are_held_in_model_dtype_however_they_are_made():
  """Tunix's Gemma 2 creates its parameters in float32 whatever model.dtype says; a run holds
  them in model.dtype, as the Kaggle restore casts them: so do the planner's abstract model and
  a random init (a rehearsal's), and the random values are the float32 init's, rounded."""
  f32 = gemma2_spec()
  spec, mesh = dataclasses.replace(f32, dtype=jnp.bfloat16), mesh_of(8)
  raw = nnx.state(nnx.eval_shape(lambda: spec.cls(spec.tunix_config, rngs=nnx.Rngs(0))))
  assert {x.dtype for x in jax.tree.leaves(raw)} == {jnp.dtype(jnp.float32)}  # Tunix's own
  _, abstract, _ = gemma.abstract_model(spec, mesh)
  made = nnx.state(gemma.init_random(spec, mesh, 3))
  for state in (abstract, made):
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}
  for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(nnx.state(gemma.init_random(f32, mesh,
                                                                                      3)))):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jnp.bfloat16))


def test_gemma2_layout_matches_tunix_linen_mapping(tmp_path):
  from tunix.models.gemma import model as gemma_lib, params as params_lib

  tree = write_download(tmp_path, "gemma2", GEMMA2, "gemma2-2b-it", devices=1)
  spec, mesh = gemma2_spec(), mesh_of(8)
  model = kaggle.restore(spec, mesh, tmp_path / "gemma2-2b-it")
  as_f32 = {k: {l: np.asarray(v, np.float32) for l, v in d.items()} for k, d in tree.items()}
  nested = params_lib._unflatten_params(params_lib._param_remapper(as_f32))
  ref = gemma_lib.module_from_linen_variables(
      lambda: spec.cls(spec.tunix_config, rngs=nnx.Rngs(0)), nested["transformer"],
      map_key_fn=gemma_lib._map_linen_var_names,
      assign_val_fn=gemma_lib._assign_linen_params_to_nnx_state)
  np.testing.assert_allclose(logits(model, TOKENS), logits(ref, TOKENS), rtol=1e-5, atol=1e-5)
  gate = model.layers[1].mlp.gate_proj.kernel.get_value()
  assert shard_fraction(gate) == pytest.approx(1 / 8)


def test_tokenizer_from_the_download_has_the_common_interface(download):
  root, _ = download
  tok = kaggle.tokenizer(kaggle.find_layout(root))
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert tok.end_of_turn_id == 5 and tok.vocab_size == 263 + 40
  ids = tok.encode("<start_of_turn>user\nis 42", add_bos=True)
  assert ids[:2] == [2, 4]
  assert tok.decode(ids[1:]) == "<start_of_turn>user\nis 42"
  assert tok.decode([*tok.encode("Tom"), 383, 303]) == "Tom"  # ids past the pieces are dropped


def test_build_through_a_kagglehub_stand_in(download, monkeypatch, caplog):
  import kagglehub

  root, tree = download
  calls = []
  monkeypatch.setattr(kagglehub, "model_download", lambda h: calls.append(h) or str(root))
  monkeypatch.setattr(kaggle, "reachable", lambda host, port, timeout=3.0: True)
  monkeypatch.setenv("KAGGLE_USERNAME", "someone")
  monkeypatch.setenv("KAGGLE_KEY", SECRET)
  caplog.set_level("DEBUG")
  m = KAGGLE_1B
  layout = kaggle.fetch(m)
  assert calls == ["google/gemma-3/flax/gemma3-1b-it"]
  assert layout.params == root / "gemma3-1b-it" and layout.tokenizer == root / "tokenizer.model"
  assert SECRET not in caplog.text and "KAGGLE_USERNAME/KAGGLE_KEY" in caplog.text

  from reasoner.build import build

  setup = build(tiny_config("model.source=kaggle", f"model.path={root}", "model.tokenizer=auto",
                            "lora.rank=2"))
  emb = setup.base["embedder"]["input_embedding"].get_value()
  assert shard_fraction(emb) == pytest.approx(1 / 8)
  np.testing.assert_array_equal(
      np.asarray(emb), np.asarray(tree["transformer/embedder"]["input_embedding"], np.float32))
  assert setup.tokenizer.end_of_turn_id == 5


def test_download_errors_are_one_line_without_the_key(monkeypatch):
  import kagglehub

  def refuse(handle):
    raise RuntimeError(f"401 Client Error: Unauthorized\nfor url https://x?key={SECRET}")

  monkeypatch.setattr(kagglehub, "model_download", refuse)
  monkeypatch.setattr(kaggle, "reachable", lambda host, port, timeout=3.0: True)
  monkeypatch.setenv("KAGGLE_USERNAME", "someone")
  monkeypatch.setenv("KAGGLE_KEY", SECRET)
  m = KAGGLE_1B
  with pytest.raises(kaggle.KaggleError) as e:
    kaggle.fetch(m)
  msg = str(e.value)
  assert "\n" not in msg and SECRET not in msg and "***" in msg
  assert "accept the Gemma license" in msg


def test_wrong_checkpoint_names_the_parameter(download):
  root, _ = download
  bigger = gemma.model_spec(tiny_config("model.tiny_layers=3").model, 384)
  with pytest.raises(kaggle.KaggleError, match="no 'transformer/layer_2/"):
    kaggle.restore(bigger, mesh_of(8), root / "gemma3-1b-it")
  wider = gemma.model_spec(tiny_config("model.tiny_hidden_dim=256").model, 384)
  with pytest.raises(kaggle.KaggleError, match=r"mlp/(linear|gating_einsum)' \{'w'\} has shape"):
    kaggle.restore(wider, mesh_of(8), root / "gemma3-1b-it")


def test_local_path_layout_errors(tmp_path, download):
  root, _ = download
  assert kaggle.find_layout(root / "gemma3-1b-it").tokenizer == root / "tokenizer.model"
  with pytest.raises(kaggle.KaggleError, match="does not exist"):
    kaggle.find_layout(tmp_path / "nope")
  with pytest.raises(kaggle.KaggleError, match="no orbax checkpoint folder"):
    kaggle.find_layout(tmp_path)


def test_credentials_offline_and_cache(monkeypatch, tmp_path):
  no_kaggle_credentials(monkeypatch, tmp_path)
  m = KAGGLE_1B
  with pytest.raises(kaggle.KaggleError, match="no Kaggle credentials were found.*model.path"):
    kaggle.resolve(m)
  (tmp_path / ".kaggle").mkdir()
  (tmp_path / ".kaggle" / "kaggle.json").write_text('{"username": "u", "kee": "%s"}' % SECRET)
  with pytest.raises(kaggle.KaggleError, match="has no 'key'") as e:
    kaggle.resolve(m)
  assert SECRET not in str(e.value)
  (tmp_path / ".kaggle" / "kaggle.json").write_text(json.dumps({"username": "u", "key": SECRET}))
  monkeypatch.setenv("KAGGLE_API_ENVIRONMENT", "TEST")  # http://localhost:7777: nobody listens
  t0 = time.perf_counter()
  with pytest.raises(kaggle.KaggleError, match="localhost:7777 cannot be reached") as e:
    kaggle.resolve(m)
  assert time.perf_counter() - t0 < 5 and SECRET not in str(e.value)
  from kagglehub.cache import Cache
  from kagglehub.handle import parse_model_handle

  h = parse_model_handle("google/gemma-3/flax/gemma3-1b-it/3")
  os.makedirs(Cache().get_path(h))
  Cache().mark_as_complete(h)
  assert kaggle.resolve(m) == ("path", tmp_path / "cache/models/google/gemma-3/flax/gemma3-1b-it/3")


def test_the_api_probe_goes_through_the_proxy(monkeypatch, tmp_path):
  """Where a proxy is set (HTTPS_PROXY, or ALL_PROXY), kagglehub's requests connect to it
  first, so the reachability probe asks it, not api.kaggle.com; NO_PROXY exempts the host."""
  from reasoner import credentials

  no_kaggle_credentials(monkeypatch, tmp_path)
  monkeypatch.delenv("KAGGLE_API_ENVIRONMENT", raising=False)
  assert credentials.api_host() == ("api.kaggle.com", 443)
  monkeypatch.setenv("HTTPS_PROXY", "http://10.0.0.7:3128")
  assert credentials.api_host() == ("10.0.0.7", 3128)
  monkeypatch.setenv("NO_PROXY", "kaggle.com")
  assert credentials.api_host() == ("api.kaggle.com", 443)
  monkeypatch.delenv("HTTPS_PROXY")
  monkeypatch.setenv("ALL_PROXY", "socks5://10.0.0.7")
  monkeypatch.setenv("NO_PROXY", "example.org")
  assert credentials.api_host() == ("10.0.0.7", 1080)


def test_config_checks_the_kaggle_keys():
  with pytest.raises(ConfigError, match="model.kaggle_handle"):
    ModelConfig(source="kaggle", name="gemma3-1b")
  with pytest.raises(ConfigError, match="a variation of model.name = 'gemma3-4b'"):
    ModelConfig(source="kaggle", name="gemma3-4b", kaggle_handle="google/gemma-3/flax/gemma3-1b-it")
  with pytest.raises(ConfigError, match="owner/model/framework/variation"):
    ModelConfig(source="kaggle", name="gemma3-1b", kaggle_handle="gemma3-1b-it")
  with pytest.raises(ConfigError, match="model.tokenizer"):
    ModelConfig(source="kaggle", name="gemma3-1b", path="x", tokenizer="bytes")
  # A tiny test checkpoint (e.g. the export of a byte-tokenizer run, which has no tokenizer.model)
  assert ModelConfig(source="kaggle", name="tiny", path="x", tokenizer="bytes").path == "x"


@pytest.mark.parametrize("creds", [False, True])
def test_gemma3_1b_config_fails_fast_with_one_line(tmp_path, creds):
  env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE")}
  env.update(HOME=str(tmp_path), KAGGLEHUB_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(8))
  if creds:
    env.update(KAGGLE_USERNAME="someone", KAGGLE_KEY=SECRET, KAGGLE_API_ENVIRONMENT="TEST")
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, "-m", "reasoner", "train", "--config",
                      "configs/gemma3_1b.yaml"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300)
  elapsed = time.perf_counter() - t0
  assert p.returncode == 2, p.stderr[-2000:]
  assert "Traceback" not in p.stderr and SECRET not in p.stdout + p.stderr
  errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, p.stderr[-2000:]
  assert ("cannot be reached" if creds else "no Kaggle credentials were found") in errors[0]
  assert "model.path" in errors[0]
  assert elapsed < 90, elapsed  # imports dominate; the checks themselves take < 5 s


def test_model_layers_reads_only_the_first_layers(download):
  """`model.layers` (rehearsals): the first N layers of a deeper checkpoint, as they are there."""
  import dataclasses

  root, tree = download
  cfg = dataclasses.replace(tiny_config().model, layers=1)
  spec = gemma.model_spec(cfg, 384)
  model = kaggle.restore(spec, mesh_of(8), root / "gemma3-1b-it")
  assert len(model.layers) == 1 and spec.num_layers == 1
  q = np.asarray(model.layers[0].attn.q_einsum.w.get_value())
  np.testing.assert_array_equal(q, np.asarray(tree["transformer/layer_0/attn/q_einsum"]["w"],
                                              np.float32))
  with pytest.raises(ConfigError, match="config key 'model.layers' = 0: expected a positive"):
    tiny_config("model.layers=0")
