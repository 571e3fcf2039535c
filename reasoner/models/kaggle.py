"""Gemma from a Kaggle Flax checkpoint, restored by orbax straight into its shards.

A Kaggle Flax download (``kagglehub.model_download('google/gemma-3/flax/gemma3-1b-it')``) is a
folder holding the orbax checkpoint, named after the variant (``gemma3-1b-it/``), and the
SentencePiece ``tokenizer.model``. The checkpoint's tree is the upstream (google-deepmind/gemma)
layout, flat module keys with one leaf each::

    'transformer/embedder'                 {'input_embedding': [V, D]}
    'transformer/layer_N/attn/q_einsum'    {'w': [N, D, H]}      (also kv_einsum, attn_vec_einsum)
    'transformer/layer_N/mlp/gating_einsum' {'w': [2, F, D]}     (Gemma 3; Gemma 2 2B: [2, D, F])
    'transformer/layer_N/mlp/linear'       {'w': [F, D]}
    'transformer/layer_N/pre_attention_norm' {'scale': [D]}      (and the other norms)

Every parameter of Tunix's module is read from its upstream leaf into the target's
``NamedSharding``, in one of two ways chosen per parameter from the stored chunk shape:

- **shards** (the stored chunks line up with the target's blocks): orbax reads each device's
  block straight into that device; a process reads only its own devices' blocks.
- **whole** (a chunk spans several target blocks, e.g. a checkpoint written from one host, where
  reading blocks would decode the same chunk once per device): orbax reads the parameter once
  onto the host and each device receives its block from that copy
  (``jax.make_array_from_callback``). Parameters are read a few at a time, the largest first
  while little else is resident, so the host holds at most about one parameter's full copy.

The one transform (the MLP gating einsum split into gate and up kernels, transposed) runs per
layer inside ``jax.jit`` with output shardings on the already sharded array (or on the host
copy), so no parameter is ever whole on one device. Compare Tunix's
``create_model_from_checkpoint``, which restores the whole tree to the host and then places it.

Downloading needs Kaggle credentials (``KAGGLE_USERNAME``/``KAGGLE_KEY`` or ``KAGGLE_API_TOKEN``
in the environment, ``~/.kaggle/kaggle.json``, or Kaggle notebook secrets) and the network, or an
earlier download in kagglehub's cache; ``model.path`` points at a local download instead. Every
problem is one ``KaggleError`` line; a key is never printed or logged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from reasoner import credentials, mesh as mesh_lib
from reasoner.config import ConfigError, ModelConfig
from reasoner.credentials import api_host, in_kaggle_notebook, reachable
from reasoner.models import gemma
from reasoner.models.tokenizer import SentencePieceTokenizer

log = logging.getLogger("reasoner")

_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "checkpoint")
_LAYOUT_HINT = ("a local Kaggle Flax download: a folder holding <variant>/ (the orbax checkpoint) "
                "and tokenizer.model")


class KaggleError(ConfigError):
  """The Kaggle checkpoint cannot be found, downloaded or read (one line, no secrets)."""


# ------------------------------------------------------------------------------ credentials

def credential_source() -> str | None:
  """Where kagglehub will find credentials (`credentials.credential_source`); a malformed
  kaggle.json is a KaggleError."""
  try:
    return credentials.credential_source()
  except credentials.CredentialsError as e:
    raise KaggleError(str(e)) from None


# ------------------------------------------------------------------------------ locating

@dataclasses.dataclass(frozen=True)
class Layout:
  params: pathlib.Path  # the orbax checkpoint folder, e.g. .../gemma3-1b-it
  tokenizer: pathlib.Path  # tokenizer.model


def _is_checkpoint(d: pathlib.Path) -> bool:
  return d.is_dir() and any((d / m).exists() for m in _MARKERS)


def find_layout(root: pathlib.Path, variant: str | None = None,
                key: str = "model.path", tokenizer: bool = True) -> Layout:
  """The checkpoint folder and tokenizer in a download (or the checkpoint folder itself)."""
  root = pathlib.Path(root).expanduser()
  if not root.is_dir():
    raise KaggleError(f"config key '{key}' = '{root}': the directory does not exist; expected "
                      + _LAYOUT_HINT)
  if _is_checkpoint(root):
    params = root
  else:
    found = sorted(d for d in root.iterdir() if _is_checkpoint(d))
    named = [d for d in found if d.name == variant]
    if not found:
      raise KaggleError(f"config key '{key}' = '{root}': no orbax checkpoint folder in it; "
                        f"expected {_LAYOUT_HINT}")
    if len(found) > 1 and not named:
      raise KaggleError(f"config key '{key}' = '{root}': several checkpoints "
                        f"({', '.join(d.name for d in found)}); point model.path at one of them")
    params = (named or found)[0]
  for tok in (params.parent / "tokenizer.model", params / "tokenizer.model"):
    if tok.is_file() or not tokenizer:
      return Layout(params, tok)
  raise KaggleError(f"config key '{key}' = '{root}': no tokenizer.model next to "
                    f"'{params.name}/'; expected {_LAYOUT_HINT}")


def _cached(handle: str) -> pathlib.Path | None:
  """The newest complete copy of `handle` in kagglehub's cache (usable offline), or None."""
  from kagglehub.handle import parse_model_handle

  hit = credentials.newest_cached(parse_model_handle(handle))
  return None if hit is None else hit[1]


def _missing(handle: str, what: str) -> KaggleError:
  return KaggleError(f"model.source 'kaggle' downloads {handle}, but {what}; or set "
                     f"model.path to {_LAYOUT_HINT}")


def resolve(m: ModelConfig) -> tuple[str, pathlib.Path | str]:
  """Where the checkpoint will come from, checked in seconds without downloading anything:
  ('path', dir) for model.path or an offline cached copy, ('download', handle) otherwise."""
  if m.path:
    find_layout(pathlib.Path(m.path), tokenizer=m.tokenizer != "bytes")
    return "path", pathlib.Path(m.path)
  handle = m.kaggle_handle or ""
  creds = credential_source()
  host, port = api_host()
  online = creds is not None and reachable(host, port)
  if online or in_kaggle_notebook():  # notebooks may use the notebook's own Kaggle identity
    return "download", handle
  cached = _cached(handle)
  if cached is not None:
    log.info("using the cached download of %s at %s (no network or no credentials)", handle, cached)
    return "path", cached
  if creds is None:
    raise _missing(handle, credentials.NO_CREDENTIALS)
  raise _missing(handle, f"{host}:{port} cannot be reached (offline?); connect to the network")


def variant(m: ModelConfig) -> str | None:
  """A Kaggle model's variation, its checkpoint folder's name (google/gemma-3/flax/gemma3-1b-it
  -> gemma3-1b-it); None for other sources or without a handle."""
  return m.kaggle_handle.split("/")[3] if m.source == "kaggle" and m.kaggle_handle else None


def fetch(m: ModelConfig) -> Layout:
  """The checkpoint on local disk: model.path, kagglehub's cache, or a fresh download."""
  kind, where = resolve(m)
  if kind == "path":
    return find_layout(pathlib.Path(where), variant(m), tokenizer=m.tokenizer != "bytes")
  import kagglehub

  log.info("downloading %s with kagglehub (credentials: %s) ...", where,
           credential_source() or "Kaggle notebook")
  try:
    local = kagglehub.model_download(str(where))
  except Exception as e:  # kagglehub raises HTTP, auth and connection errors of many types
    raise KaggleError(_download_error(str(where), e)) from None
  return find_layout(pathlib.Path(local), variant(m), key="model.kaggle_handle")


def _download_error(handle: str, e: Exception) -> str:
  text = credentials.scrub(" ".join(str(e).split()))[:300]
  hint = ""
  if "403" in text or "401" in text:
    hint = ("; check the credentials and accept the Gemma license on kaggle.com/models/"
            f"{'/'.join(handle.split('/')[:2])} with the same account")
  return f"downloading {handle} failed: {type(e).__name__}: {text}{hint}"


def tokenizer(layout: Layout) -> SentencePieceTokenizer:
  try:
    return SentencePieceTokenizer.from_file(str(layout.tokenizer))
  except (OSError, RuntimeError) as e:
    raise KaggleError(f"{layout.tokenizer}: not a SentencePiece model ({e})") from None


# ------------------------------------------------------------------------------ sharded restore

@dataclasses.dataclass(frozen=True)
class Leaf:
  """One stored array, from the checkpoint's metadata."""

  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]  # stored chunk shape (the whole array when the metadata has none)


Meta = dict[tuple[str, str], Leaf]  # (module key, leaf name) -> Leaf


@dataclasses.dataclass(frozen=True)
class Source:
  """One upstream leaf and the parameters of Tunix's module it fills."""

  key: str  # 'transformer/layer_3/mlp/gating_einsum'
  leaf: str  # 'w'
  targets: tuple[tuple, ...]  # one path, or (gate, up) for the gating einsum
  shape: tuple[int, ...]  # its shape in the checkpoint
  transposed: bool = False  # gating einsum stored [2, F, D] (Gemma 3) rather than [2, D, F]


def read_metadata(params: pathlib.Path) -> Meta:
  """Shapes, dtypes and chunks of the checkpoint's leaves, without reading any array."""
  import orbax.checkpoint as ocp

  try:
    tree = ocp.PyTreeCheckpointHandler().metadata(pathlib.Path(params))
  except Exception as e:  # orbax raises several types for unreadable folders
    raise KaggleError(f"{params}: not a readable orbax checkpoint ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]})") from None
  out: Meta = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if len(keys) == 2 and hasattr(leaf, "shape"):
      shape = tuple(leaf.shape)
      chunk = getattr(getattr(leaf, "storage", None), "chunk_shape", None)
      out[(keys[0], keys[1])] = Leaf(shape, np.dtype(leaf.dtype), tuple(chunk or shape))
  if not out:
    raise KaggleError(f"{params}: no 'module/key' {{leaf: array}} entries; not an upstream "
                      "Gemma Flax checkpoint")
  return out


def vocab_size(meta: Meta) -> int:
  """Rows of the checkpoint's embedding (sizes the tiny test model; real presets fix it)."""
  if ("transformer/embedder", "input_embedding") not in meta:
    raise KaggleError("the checkpoint has no 'transformer/embedder' {'input_embedding'}; not an "
                      "upstream Gemma Flax checkpoint")
  return meta[("transformer/embedder", "input_embedding")].shape[0]


def upstream_key(path: tuple) -> tuple[str, str]:
  """Tunix parameter path -> (upstream module key, leaf), for the parameters copied as is."""
  *module, leaf = (str(p) for p in path)
  if module[0] == "layers":
    module = [f"layer_{module[1]}", *module[2:]]
  module = ["post_attention_norm" if m == "post_attn_norm" else m for m in module]  # Gemma 2
  if module[-2:] == ["mlp", "down_proj"]:
    module, leaf = [*module[:-1], "linear"], "w"
  return "/".join(["transformer", *module]), leaf


def plan(family: str, targets: dict[tuple, jax.ShapeDtypeStruct], meta: Meta,
         where: pathlib.Path) -> list[Source]:
  """Which upstream leaf fills each parameter; shapes checked against the checkpoint."""
  sources = []
  for path, t in targets.items():
    names = [str(p) for p in path]
    if names[-3:-1] == ["mlp", "up_proj"]:
      continue  # filled with its gate_proj from the gating einsum
    if names[-3:-1] == ["mlp", "gate_proj"]:
      d, f = t.shape
      key = f"transformer/layer_{names[1]}/mlp/gating_einsum"
      shape = _stored(meta, key, "w", where, ((2, f, d), (2, d, f)))
      transposed = shape == (2, f, d) and (d != f or family == "gemma3")
      up = (*path[:-2], "up_proj", path[-1])
      sources.append(Source(key, "w", (path, up), shape, transposed))
    else:
      key, leaf = upstream_key(path)
      sources.append(Source(key, leaf, (path,), _stored(meta, key, leaf, where, (t.shape,))))
  return sources


def _stored(meta: Meta, key: str, leaf: str, where: pathlib.Path,
            expected: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
  if (key, leaf) not in meta:
    raise KaggleError(f"{where}: the checkpoint has no '{key}' {{'{leaf}'}}; is model.name "
                      "right for this checkpoint?")
  shape = meta[(key, leaf)].shape
  if shape not in expected:
    raise KaggleError(f"{where}: '{key}' {{'{leaf}'}} has shape {shape}, expected "
                      f"{expected[0]}; is model.name right for this checkpoint?")
  return shape


def _read_sharding(s: Source, target: NamedSharding) -> NamedSharding:
  """The target's sharding carried onto the stored array (gating: [2, F, D] or [2, D, F])."""
  return target if len(s.targets) == 1 else mesh_lib.gating_sharding(target, s.transposed)


@functools.lru_cache(maxsize=None)
def _gating_splitter(transposed: bool, sharding: NamedSharding):
  """[2, F, D] or [2, D, F] -> gate, up kernels [D, F], compiled with output shardings: each
  device transposes its own block (the read sharding mirrors the output's), nothing moves."""

  def split(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return (g[0].T, g[1].T) if transposed else (g[0], g[1])

  return jax.jit(split, out_shardings=(sharding, sharding))


def _orbax_read(params: pathlib.Path, item: dict, restore_args: dict, budget: int) -> dict:
  """One partial orbax restore; at most `budget` bytes of reads in flight (and at least one
  whole stored chunk, or orbax refuses the read)."""
  import orbax.checkpoint as ocp

  handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=(1.1 * budget + 2**20) / 1e9)
  args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
  with ocp.Checkpointer(handler) as ckptr:
    out = ckptr.restore(params, args=args)
  return {(k, leaf): v for k, leaves in out.items() for leaf, v in leaves.items()}


def _from_shards(params: pathlib.Path, group: list[Source], nbytes: dict[Source, int],
                 targets: dict[tuple, jax.ShapeDtypeStruct]) -> dict[tuple, jax.Array]:
  """Each device's block read straight into it; gating einsums split one layer at a time."""
  import orbax.checkpoint as ocp

  item: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
  for s in group:
    t = targets[s.targets[0]]
    item.setdefault(s.key, {})[s.leaf] = jax.ShapeDtypeStruct(
        s.shape, t.dtype, sharding=_read_sharding(s, t.sharding))
  read = _orbax_read(params, item, ocp.checkpoint_utils.construct_restore_args(item),
                     max(nbytes[s] for s in group))
  values = {}
  for s in group:
    arr = read.pop((s.key, s.leaf))
    if len(s.targets) == 1:
      values[s.targets[0]] = arr
      continue
    pair = _gating_splitter(s.transposed, targets[s.targets[0]].sharding)(arr)
    del arr  # waiting frees this layer's einsum before the next layer's outputs exist
    values.update(zip(s.targets, jax.block_until_ready(pair)))
  return values


def _from_host(params: pathlib.Path, group: list[Source],
               targets: dict[tuple, jax.ShapeDtypeStruct], budget: int) -> dict[tuple, jax.Array]:
  """`group` read whole onto the host once, then each device receives only its block."""
  import orbax.checkpoint as ocp

  item, args = {}, {}
  for s in group:
    item.setdefault(s.key, {})[s.leaf] = np.empty(0)
    args.setdefault(s.key, {})[s.leaf] = ocp.RestoreArgs(restore_type=np.ndarray,
                                                         dtype=targets[s.targets[0]].dtype)
  read = _orbax_read(params, item, args, budget)
  values = {}
  for s in group:
    host = read.pop((s.key, s.leaf))
    views = [host] if len(s.targets) == 1 else [host[0].T, host[1].T] if s.transposed else host
    for path, view in zip(s.targets, views):
      t = targets[path]
      values[path] = mesh_lib.array_from_host(t.shape, t.sharding, lambda i, v=view: v[i])
    del host, views
  return values


def _host_groups(sources: list[Source], nbytes: dict[Source, int], budget: int):
  """Largest first, packed into groups of at most `budget` bytes (a bigger one alone)."""
  groups: list[list[Source]] = []
  size = budget
  for s in sorted(sources, key=nbytes.get, reverse=True):
    if size + nbytes[s] > budget:
      groups.append([])
      size = 0
    groups[-1].append(s)
    size += nbytes[s]
  return groups


def restore(spec: gemma.ModelSpec, mesh: Mesh, params: pathlib.Path,
            meta: Meta | None = None) -> nnx.Module:
  """Tunix's Gemma with every parameter restored from the upstream checkpoint into its shards."""
  graphdef, abs_state, shardings = gemma.abstract_model(spec, mesh)
  flat_abs = dict(nnx.to_flat_state(abs_state))
  flat_shd = dict(nnx.to_flat_state(shardings))
  targets = {p: jax.ShapeDtypeStruct(v.get_value().shape, spec.param_dtype(v.get_value().dtype),
                                     sharding=flat_shd[p].get_value()) for p, v in flat_abs.items()}
  meta = read_metadata(params) if meta is None else meta
  sources = plan(spec.family, targets, meta, params)
  nbytes = {s: math.prod(s.shape) * max(np.dtype(targets[s.targets[0]].dtype).itemsize,
                                        meta[(s.key, s.leaf)].dtype.itemsize) for s in sources}
  whole = [s for s in sources if gemma.decoded_fraction(
      s.shape, meta[(s.key, s.leaf)].chunk,
      _read_sharding(s, targets[s.targets[0]].sharding)) > 1.25]
  shards = [s for s in sources if s not in set(whole)]
  log.info("restoring %d parameters from their shards, %d whole on the host first (their stored "
           "chunks span several shards)", len(shards), len(whole))
  values: dict[tuple, jax.Array] = {}
  budget = max(16 << 20, sum(nbytes.values()) // 16)
  for group in _host_groups(whole, nbytes, budget):
    values.update(_from_host(params, group, targets, max(budget, nbytes[group[0]])))
    gemma.release_freed_memory()
  if shards:
    values.update(_from_shards(params, shards, nbytes, targets))
    gemma.release_freed_memory()
  state = nnx.from_flat_state([(p, v.replace(values.pop(p))) for p, v in flat_abs.items()])
  return nnx.merge(graphdef, state)
