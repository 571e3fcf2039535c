"""The trained model as a checkpoint anyone can load: LoRA merged into the base weights.

    python -m reasoner export --config configs/gemma3_1b.yaml --out /kaggle/working/model

writes `DIR/<variant>/` (an orbax checkpoint in the upstream Kaggle Flax layout, the layout
`reasoner.models.kaggle` reads) and `DIR/tokenizer.model`, so the folder is a Kaggle Flax
download: Tunix's `create_model_from_checkpoint` (Gemma 3) and `load_and_format_params` (Gemma 2)
load `DIR/<variant>`, `model.path=DIR` loads it back here, and it uploads as a Kaggle model.
`--format safetensors` adds `DIR/model.safetensors` with Hugging Face's parameter names.

Each merged parameter is W + (alpha / r) A B, formed inside `jax.jit` with W's own sharding (in
W's dtype), so no parameter is ever whole on one device; orbax writes each process's shards,
copying to the host no more than about the largest parameter's bytes at a time
(`save_device_host_concurrent_gb`).
The safetensors file is written one tensor at a time (its header first): the host holds at
most one full parameter. The folder is written beside DIR and renamed into place: an export
that fails leaves nothing half-written, and an existing non-empty DIR is never touched.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import NamedSharding

from reasoner import credentials, mesh as mesh_lib
from reasoner.build import build
from reasoner.config import Config, ConfigError
from reasoner.engine.checkpoint import held_back, remove_until_gone, restore_lora
from reasoner.errors import UserError, is_write_failure, write_error
from reasoner.models import gemma, kaggle


class ExportError(ConfigError):
  """The export cannot be written where asked (one line)."""


def lora_delta(strings: tuple[str | None, str | None], shape: tuple[int, ...], a: jax.Array,
               b: jax.Array, scale: float) -> jax.Array:
  """scale A B in the weight's own layout. qwix runs an einsum's LoRA as 'lhs,a,b->out'
  (`strings[0]`; a: the weight's contracted axes + r, b: r + its other axes; `strings[1]`: the
  module's own einsum), a Linear's (strings None) as x A B with A [in, r], B [r, out]."""
  lora_str, einsum_str = strings
  if lora_str is None:
    return (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(shape) * scale
  _, a_str, b_str = lora_str.split("->")[0].split(",")
  rhs = einsum_str.split("->")[0].split(",")[1]
  return jnp.einsum(f"{a_str},{b_str}->{rhs}", a, b) * scale


def merged(graphdef, lora, base, scale: float) -> dict[tuple, jax.Array]:
  """Every base parameter with its LoRA merged in: {Tunix path: array}, sharded as the base."""
  model = nnx.merge(graphdef, lora, base)
  out = _base_weights(model, base)
  pairs = {}
  for path, v in nnx.to_flat_state(lora):
    name = str(path[-1])
    weight, part = name.rsplit("_lora_", 1)
    pairs.setdefault((*path[:-1], weight), {})[part] = v.get_value()
  for path, ab in pairs.items():
    module = _module(model, path[:-1])
    w = out[path]
    strings = (getattr(module, f"{path[-1]}_lora_einsum_str", None),
               getattr(module, "einsum_str", None))
    out[path] = _merger(strings, w.shape, scale, w.sharding)(w, ab["a"], ab["b"])
  return out


def _base_weights(model, base) -> dict[tuple, jax.Array]:
  """{Tunix path: array} of the base; a kernel held quantised (`lora.base_qtype`) as qwix's
  dequantised W, in its scales' dtype (the model's) and sharded as its values: the weights the
  LoRA trained against, which is what the merge must add to."""
  out = {}
  for path, v in nnx.to_flat_state(base):
    if len(path) > 2 and path[-2] == "array":  # (..., 'w', 'array', 'qvalue' | 'scale')
      path = path[:-2]
      if path not in out:
        q = jax.tree.map(lambda x: x.get_value(), _module(model, path).array,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
        out[path] = jax.jit(qwix.dequantize, out_shardings=q.qvalue.sharding)(q)
    else:
      out[path] = v.get_value()
  return out


def _module(model, path: tuple):
  """What `model` holds at a state path (layer indices and attribute names): a submodule, or
  the attribute itself (a quantised kernel's qwix `WithAux`)."""
  for p in path:
    model = model[p] if isinstance(p, int) else getattr(model, p)
  return model


@functools.lru_cache(maxsize=None)
def _merger(strings: tuple, shape: tuple, scale: float, sharding: NamedSharding):
  """W + scale A B, computed in float32, in W's dtype and sharding (one compile per kind of
  projection: every layer's q_einsum shares one)."""

  def merge(w, a, b):
    d = lora_delta(strings, shape, a.astype(jnp.float32), b.astype(jnp.float32), scale)
    return (w.astype(jnp.float32) + d).astype(w.dtype)

  return jax.jit(merge, out_shardings=sharding)


def upstream_tree(family: str, params: dict[tuple, jax.Array]) -> dict[str, dict[str, jax.Array]]:
  """Tunix paths -> the upstream layout `kaggle.restore` reads (its mapping, inverted): the MLP's
  gate and up kernels [D, F] stacked into the gating einsum, [2, F, D] (Gemma 3) or [2, D, F]."""
  tree: dict[str, dict[str, jax.Array]] = {}
  for path, value in params.items():
    names = [str(p) for p in path]
    if names[-3:-1] == ["mlp", "up_proj"]:
      continue
    if names[-3:-1] == ["mlp", "gate_proj"]:
      up = params[(*path[:-2], "up_proj", path[-1])]
      tree.setdefault(f"transformer/layer_{names[1]}/mlp/gating_einsum", {})["w"] = (
          _gating(value, up, family == "gemma3"))
      continue
    key, leaf = kaggle.upstream_key(path)
    tree.setdefault(key, {})[leaf] = value
  return tree


def _gating(gate: jax.Array, up: jax.Array, transposed: bool) -> jax.Array:
  stack = jax.jit(lambda g, u: jnp.stack([g.T, u.T] if transposed else [g, u]),
                  out_shardings=mesh_lib.gating_sharding(gate.sharding, transposed))
  return stack(gate, up)


# ------------------------------------------------------------------------------ Hugging Face

def hf_tensors(params: dict[tuple, jax.Array]) -> dict[str, tuple]:
  """Hugging Face Gemma names -> (Tunix path, transform on the host array), the inverse of the
  GGUF mapping (reasoner/models/gguf.py; norms as stored, HF's RMSNorm also scales by 1 + w)."""
  out = {"model.embed_tokens.weight": (("embedder", "input_embedding"), lambda x: x),
         "model.norm.weight": (("final_norm", "scale"), lambda x: x)}
  heads = lambda x: x.transpose(0, 2, 1).reshape(-1, x.shape[1])  # (N, D, H) -> (N*H, D)
  norms = {"pre_attention_norm": "input_layernorm", "post_attention_norm":
           "post_attention_layernorm", "post_attn_norm": "post_attention_layernorm",
           "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm":
           "post_feedforward_layernorm"}
  for path in params:
    names = [str(p) for p in path]
    if names[0] != "layers":
      continue
    pre, rest = f"model.layers.{names[1]}.", names[2:]
    if rest == ["attn", "q_einsum", "w"]:
      out[pre + "self_attn.q_proj.weight"] = (path, heads)
    elif rest == ["attn", "kv_einsum", "w"]:
      out[pre + "self_attn.k_proj.weight"] = (path, lambda x: heads(x[0]))
      out[pre + "self_attn.v_proj.weight"] = (path, lambda x: heads(x[1]))
    elif rest == ["attn", "attn_vec_einsum", "w"]:  # (N, H, D) -> (D, N*H)
      out[pre + "self_attn.o_proj.weight"] = (path, lambda x: x.reshape(-1, x.shape[-1]).T)
    elif rest[0] == "mlp":
      out[pre + f"mlp.{rest[1]}.weight"] = (path, lambda x: x.T)
    elif rest[-2] in ("_query_norm", "_key_norm"):
      out[pre + f"self_attn.{rest[-2][1]}_norm.weight"] = (path, lambda x: x)
    elif rest[-2] in norms:
      out[pre + norms[rest[-2]] + ".weight"] = (path, lambda x: x)
    else:
      raise ExportError(f"no Hugging Face name for parameter {'.'.join(names)}")
  return out


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def write_safetensors(path: pathlib.Path, tensors: dict[str, tuple], params: dict) -> None:
  """A safetensors file written tensor by tensor: header from shapes, then each array's bytes
  (gathered to the host one at a time; only process 0 writes)."""
  shapes = {name: jax.eval_shape(fn, jax.ShapeDtypeStruct(params[p].shape, params[p].dtype))
            for name, (p, fn) in tensors.items()}
  header, offset = {}, 0
  for name in sorted(shapes):
    s = shapes[name]
    size = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
    header[name] = {"dtype": _ST_DTYPES[np.dtype(s.dtype).name], "shape": list(s.shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  writing = jax.process_index() == 0
  with (open(path, "wb") if writing else open("/dev/null", "wb")) as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name in sorted(shapes):
      p, fn = tensors[name]
      host = np.asarray(fn(mesh_lib.to_host(params[p])))
      if writing:
        f.write(np.ascontiguousarray(host).tobytes())
      del host


# ------------------------------------------------------------------------------ the command

def check_out(out: pathlib.Path) -> None:
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ExportError(f"--out '{out}' exists and is not an empty directory; choose a new "
                      "directory (nothing was written)")


def export(cfg: Config, out: str | pathlib.Path, step: int | None = None,
           formats: tuple[str, ...] = ("orbax",), log=print, setup=None) -> pathlib.Path:
  """Writes the run's checkpoint (latest, or `step`) merged into the base as DIR. `setup`: the
  run's, already built (the notebook's), else built from `cfg`."""
  out = pathlib.Path(out).absolute()
  check_out(out)
  setup = setup or build(cfg, with_judge=False)  # a judge of its own is not read to export
  lora, got = restore_lora(setup, step)
  params = merged(setup.graphdef, lora, setup.base, cfg.lora.alpha / cfg.lora.rank)
  family = gemma.model_spec(cfg.model).family
  variant = variant_name(cfg)
  tmp = out.with_name(f".{out.name}.partial")
  if jax.process_index() == 0:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
  _sync("export-start")
  try:
    with held_back():  # orbax's writer threads print what a failed write raises
      _write(tmp, setup, cfg, params, family, variant, got, formats)
  except Exception as e:
    if jax.process_index() == 0:  # a write still in flight may land after the failure
      remove_until_gone(tmp.parent, tmp.name)
    if is_write_failure(e):
      raise ConfigError(f"cannot export to {out}: {write_error(e, out.parent)}; nothing was "
                        f"left there") from e
    raise
  if jax.process_index() == 0:
    if out.exists():
      out.rmdir()  # empty (checked above)
    tmp.rename(out)
  _sync("export-done")
  log(f"exported step {got} of {cfg.run_path} ({cfg.model.name}, LoRA merged, {cfg.model.dtype}) "
      f"to {out}/{variant}" + (" and model.safetensors" if "safetensors" in formats else ""))
  return out


def _write(tmp: pathlib.Path, setup, cfg: Config, params, family: str, variant: str, got: int,
           formats: tuple[str, ...]) -> None:
  import orbax.checkpoint as ocp

  tree = upstream_tree(family, params)
  largest = max(x.nbytes for leaves in tree.values() for x in leaves.values())
  # Device -> host copies wait for earlier arrays' writes past this: about one parameter held.
  handler = ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=math.ceil(largest / 1e9))
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(tmp / variant, args=ocp.args.PyTreeSave(tree))
  if "safetensors" in formats:
    write_safetensors(tmp / "model.safetensors", hf_tensors(params), params)
  if jax.process_index() == 0:
    proto = getattr(setup.tokenizer, "model_proto", None)
    if proto is not None:
      (tmp / "tokenizer.model").write_bytes(proto)
    (tmp / "export.json").write_text(json.dumps({
        "model": cfg.model.name, "family": family, "variant": variant, "step": got,
        "run": str(cfg.run_path.absolute()), "lora": {"rank": cfg.lora.rank,
                                                      "alpha": cfg.lora.alpha},
        "dtype": cfg.model.dtype, "formats": list(formats),
        "tokenizer": "tokenizer.model" if proto is not None else "bytes (model.tokenizer=bytes)",
    }, indent=2) + "\n")


def variant_name(cfg: Config) -> str:
  """The checkpoint folder's name: the Kaggle variation trained from, else the model's name."""
  return kaggle.variant(cfg.model) or cfg.model.name


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------ the upload

HANDLE_PARTS = ("OWNER", "MODEL", "FRAMEWORK", "VARIATION")
LICENSE = "Apache 2.0"  # kagglehub's own example; Gemma's terms of use still bind the weights


class UploadError(UserError):
  """The export could not be uploaded (one line); the export itself stays on disk."""


def check_handle(handle: str) -> str:
  """`handle` if it is OWNER/MODEL/FRAMEWORK/VARIATION (a Kaggle model handle, no version), else
  an UploadError naming what is wrong."""
  from kagglehub.enum import to_enum
  from kagglesdk.models.types.model_enums import ModelFramework

  parts = handle.split("/")
  what = f"--upload {handle!r}"
  if len(parts) != len(HANDLE_PARTS):
    extra = "; a version is given by Kaggle, not in the handle" if len(parts) == 5 else ""
    raise UploadError(f"{what}: expected {'/'.join(HANDLE_PARTS)} (4 parts separated by '/'), "
                      f"got {len(parts)}{extra}")
  for name, part in zip(HANDLE_PARTS, parts):
    if not part:
      raise UploadError(f"{what}: its {name} is empty; expected {'/'.join(HANDLE_PARTS)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", part):
      raise UploadError(f"{what}: its {name} {part!r} may hold only letters, digits, '.', '_' and "
                        "'-', starting with a letter or digit")
  try:
    to_enum(ModelFramework, parts[2])
  except Exception:
    raise UploadError(f"{what}: its FRAMEWORK {parts[2]!r} is not one Kaggle knows; this export "
                      "is 'flax'") from None
  return handle


def version_notes(config: str, export_info: dict, results: dict, steps: int | None = None) -> str:
  """The version's notes, from the run: the config, the step exported, and the held-out figures
  (before -> after training; each category's mean reward) from its eval.json `results`."""
  step = export_info.get("step")
  lines = [f"{export_info.get('model', 'model')} with LoRA (rank "
           f"{export_info.get('lora', {}).get('rank', '?')}) merged in, trained by reasoner with "
           f"{config}: step {step}" + (f" of {steps}" if steps else "") + "."]
  before, after = results.get("before") or {}, results.get("after") or {}
  if not after and not before:
    return lines[0] + "\nNo held-out evaluation was recorded."
  fig = lambda key: " -> ".join(f"{r[key]:.3f}" for r in (before, after)
                                if isinstance(r.get(key), (int, float)))
  n = after.get("n", before.get("n"))
  head = [f"{name} {fig(key)}" for key, name in (("accuracy", "accuracy"), ("format_rate",
          "format rate"), ("mean_reward", "mean reward"), ("win_rate", "judge win rate"))
          if fig(key)]
  lines.append(f"Held-out ({n} records{', before -> after training' if before and after else ''}"
               f"): " + ", ".join(head) + ".")
  cats = sorted({k.split("/", 1)[1] for r in (before, after) for k in r
                 if k.startswith("mean_reward/")})
  if cats:
    lines.append("Mean reward by category: " + ", ".join(
        f"{c} {fig(f'mean_reward/{c}')}" for c in cats) + ".")
  return "\n".join(lines)


def upload(out: str | pathlib.Path, handle: str, notes: str, license_name: str = LICENSE,
           log=print) -> str:
  """Uploads the export folder `out` as a new version of the Kaggle model `handle`; returns the
  handle. No credentials, no network, or a refusal: an UploadError (one line, credentials
  never shown) and `out` as it was."""
  import kagglehub

  out = pathlib.Path(out)
  check_handle(handle)
  if not (out / "export.json").is_file():
    raise UploadError(f"{out} holds no export (no export.json): nothing was uploaded")
  keep = f"the export stays in {out}; re-run the same command to upload it"
  try:
    source = credentials.credential_source()
  except credentials.CredentialsError as e:
    raise UploadError(f"not uploaded: {e}; {keep}") from None
  if source is None:
    raise UploadError(f"not uploaded: {credentials.NO_CREDENTIALS}; {keep}")
  host, port = credentials.api_host()
  if not credentials.reachable(host, port):
    raise UploadError(f"not uploaded: {host}:{port} cannot be reached (offline, or the "
                      f"notebook's Internet is off); {keep}")
  log(f"uploading {out} to Kaggle model {handle} (credentials from {source})")
  try:
    kagglehub.model_upload(handle, str(out), license_name=license_name, version_notes=notes)
  except Exception as e:  # kagglehub's HTTP errors, a refused handle, a dropped connection
    text = credentials.scrub(" ".join(str(e).split()) or type(e).__name__)
    raise UploadError(f"not uploaded to {handle}: {text[:300]}; {keep}") from None
  log(f"uploaded: Kaggle model {handle} (https://www.kaggle.com/models/"
      f"{'/'.join(handle.split('/')[:2])})")
  return handle


def upload_run(cfg: Config, out: str | pathlib.Path, handle: str, config: str,
               log=print) -> str:
  """`upload` of the export in `out` with the notes of the run it came from (its eval.json)."""
  out = pathlib.Path(out)
  if jax.process_index() != 0:  # one upload of the folder process 0 wrote
    return handle
  try:
    info = json.loads((out / "export.json").read_text())
  except (OSError, ValueError):
    raise UploadError(f"{out} holds no readable export.json: nothing was uploaded") from None
  eval_json = pathlib.Path(info.get("run", cfg.run_path)) / "eval.json"
  results = json.loads(eval_json.read_text()) if eval_json.is_file() else {}
  return upload(out, handle, version_notes(config, info, results, cfg.train.steps), log=log)
