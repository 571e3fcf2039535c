"""The one place that knows the device mesh and how arrays map onto it: every partition rule
is here, as data the rest of the code asks for.

Axes: 'fsdp' (data parallel + parameter sharding) and 'tp' (tensor parallel).
- Parameters: Tunix's default ShardingConfig (`param_rules`), LoRA weights and a quantised
  base kernel's values and scales carrying their kernel's (`shardings`); the loaders' stacked
  gating kernel follows its gate kernel (`gating_sharding`).
- Batches and activations: rows over 'fsdp' where they divide evenly, else replicated
  (`batch_placement`, `activation_placement`, `micro_placement`).
- The KV cache: rows over 'fsdp', KV heads over 'tp' where they divide (`kv_cache_spec`,
  `prompt_cache_sharding`, `slot_major_sharding`); in decoding, rows over 'tp' too where the
  heads do not (`attention_over_rows`, `decode_rows`).
- The chunked head: token chunks over 'fsdp', the vocabulary over 'tp' or over both
  (`vocab_axis`, `vocab_axes`).
- Decoding (`rollout.layout`): the same devices as rows x tp (`decode_mesh`), each parameter
  split over 'tp' only, Megatron-style (`decode_shardings`): heads, MLP columns then rows and
  the vocabulary over 'tp', nothing over 'fsdp', which holds rows alone. 'replicated' is tp 1:
  every chip holds the whole model and decodes its own rows with no collective at all. Where
  'tp' cannot split the KV heads (Gemma 3 1B has one), the attention weights are whole on every
  chip instead and attention runs data-parallel over all the chips, each on its own rows.
- A model that only runs forwards on chips of its own (the judge): 'tp' over them
  (`forward_mesh`), no weight gathered in a pass.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from reasoner.config import ConfigError, MeshConfig

AXES = ("fsdp", "tp")


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int]:
  """Resolves -1 and checks that fsdp * tp equals the device count."""
  fsdp, tp = cfg.fsdp, cfg.tp
  if fsdp == -1:
    if n_devices % tp:
      raise ConfigError(f"config key 'mesh.tp' = {tp}: expected a divisor of the "
                        f"{n_devices} devices")
    fsdp = n_devices // tp
  elif tp == -1:
    if n_devices % fsdp:
      raise ConfigError(f"config key 'mesh.fsdp' = {fsdp}: expected a divisor of the "
                        f"{n_devices} devices")
    tp = n_devices // fsdp
  if fsdp * tp != n_devices:
    raise ConfigError(f"config key 'mesh' = fsdp {fsdp} x tp {tp}: expected a product equal to "
                      f"the {n_devices} devices")
  return fsdp, tp


def make_mesh(cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), AXES)


def forward_mesh(devices: list[Any], tcfg: Any) -> Mesh:
  """The mesh of a model that only runs forward passes, on chips of its own (`judge.devices`):
  'tp' over them, so that every pass reads each chip's share of the weights where it lies: the
  largest power of two, at most 8, that divides their count and every width `param_rules`
  splits over 'tp' (query and KV heads, model and MLP widths, vocabulary, of Tunix's config
  `tcfg`; Gemma 3 12B on 4 chips: tp 4), 'fsdp' over the rest. Over 'fsdp' each pass would
  gather the whole model onto every chip first, and the judge's criteria pass runs
  1 + `judge.max_criteria` passes (the prefix, then each suffix): Gemma 3 12B on 4 v5e chips,
  16 completions x 20 criteria, 5.51 s a pass over 'fsdp', 1.02 s over 'tp' (`reasoner plan`,
  docs/LOG.md)."""
  n = len(devices)
  widths = (tcfg.num_heads, tcfg.num_kv_heads, tcfg.embed_dim, tcfg.hidden_dim, tcfg.num_embed)
  tp = math.gcd(n & -n, 8, *widths)  # a divisor of n's largest power of two: a power of two
  return make_mesh(MeshConfig(fsdp=n // tp, tp=tp), devices)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) axis over 'fsdp', the rest replicated."""
  return NamedSharding(mesh, P("fsdp", *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def row_axis(mesh: Mesh, rows: int) -> str | None:
  """'fsdp' where `rows` divide evenly over it; otherwise (a few prompts shared by their G
  completions) None: replicated."""
  return "fsdp" if rows % mesh.shape["fsdp"] == 0 else None


def batch_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Rows split over 'fsdp' where they divide evenly (`row_axis`), otherwise replicated."""
  return batch_sharding(mesh, len(shape)) if row_axis(mesh, shape[0]) else replicated(mesh)


def activation_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """[B, T, D] activations: rows over 'fsdp' where they divide evenly (`row_axis`), the model
  dimension over 'tp' where it divides (Tunix's act_btd for training)."""
  rows = row_axis(mesh, shape[0])
  model = "tp" if mesh.shape["tp"] > 1 and shape[-1] % mesh.shape["tp"] == 0 else None
  return NamedSharding(mesh, P(rows, *([None] * (len(shape) - 2)), model))


def micro_placement(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Micro-batches stacked on a leading axis, [K, rows, ...]: each placed as `batch_placement`
  places a batch of its own shape."""
  return NamedSharding(mesh, P(None, *batch_placement(mesh, shape[1:]).spec))


def batch_struct(mesh: Mesh, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
  """An abstract batch array placed as `put_batch` places it (the planner's inputs)."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_placement(mesh, shape))


def shardings(state: Any, mesh: Mesh) -> Any:
  """The NamedShardings the parameters' rules give an nnx.State's arrays on `mesh`. An array
  carries its parameter's rule: a quantised kernel's values and its scales (QLoRA) both; a mesh
  axis stays off a dimension it does not divide (a scale's one-tile input axis)."""
  from flax import nnx

  def fit(a, s: NamedSharding) -> NamedSharding:
    spec = [ax if ax is None or a.shape[i] % _size(mesh, ax) == 0 else None
            for i, ax in enumerate(tuple(s.spec)[:len(a.shape)])]
    return NamedSharding(mesh, P(*spec))

  return jax.tree.map(fit, state, nnx.get_named_sharding(state, mesh))


def _size(mesh: Mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def placed(state: Any, mesh: Mesh, rule: Callable[[Any, Mesh], Any] | None = None) -> Any:
  """An abstract nnx.State as ShapeDtypeStructs carrying the NamedShardings `rule` gives them on
  `mesh`: by default their parameters' rules (`shardings`), or e.g. `decode_shardings`."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                      (rule or shardings)(state, mesh))


def whole(state: Any, mesh: Mesh) -> Any:
  """Every array of `state` whole on every chip of `mesh` (`mesh.weights: replicated`)."""
  return jax.tree.map(lambda _: replicated(mesh), state)


def placed_alike(a, b, ndim: int) -> bool:
  """Whether shardings `a` and `b` place an array alike, on the same mesh (a program takes its
  arguments on one): an array placed by `a` needs no copy to be placed by `b`."""
  return getattr(a, "mesh", None) == b.mesh and a.is_equivalent_to(b, ndim)


def moved(state: Any, shardings: Any, exact: bool = False) -> Any:
  """`state` placed by `shardings` (a tree of its structure): an array placed so already is
  itself, never a copy (a whole base in the replicated decode layout); the others are moved by
  one identity compiled to their shardings, a program on the chips, where source and target
  share their devices in one order (the LoRA into the decode layout, every step). Elsewhere
  (chips of their own) one batched `device_put`, which reshards array by array from the host:
  the 1B's LoRA (312 arrays) into tp8 took 154 ms of host time a step on 8 XLA:CPU devices, the
  program's dispatch 54 (`make bench BENCH=host`). `exact`: an array placed only equivalently is
  moved too, so that each takes exactly its own placement: the LoRA's by rule, which the
  planner's abstract build (placed by the rules) must match."""
  leaves, tree = jax.tree.flatten(state)
  want = tree.flatten_up_to(shardings)
  move = [i for i, (x, s) in enumerate(zip(leaves, want))
          if (x.sharding != s if exact else not placed_alike(x.sharding, s, x.ndim))]
  if not move:
    return state
  xs, ss = [leaves[i] for i in move], tuple(want[i] for i in move)
  one = exact or _one_order([x.sharding for x in xs] + list(ss))
  for i, x in zip(move, _identity(ss)(xs) if one else jax.device_put(xs, list(ss))):
    leaves[i] = x
  return tree.unflatten(leaves)


@functools.lru_cache(maxsize=32)
def _identity(shardings: tuple) -> Callable:
  """The program that copies arrays to `shardings` (one compiled per placement and shapes)."""
  return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def _one_order(shardings: list) -> bool:
  """Whether every sharding is over the same devices in the same order (one program can take
  arrays from each to each)."""
  order = lambda s: tuple(s.mesh.devices.flat) if isinstance(s, NamedSharding) else None
  first = order(shardings[0])
  return first is not None and all(order(s) == first for s in shardings)


def weight_rule(weights: str) -> Callable[[Any, Mesh], Any]:
  """The training weights' placement rule for `mesh.weights`."""
  return whole if weights == "replicated" else shardings


def gathered_whole(state: Any, mesh: Mesh) -> Any:
  """`state` (placed by its rules) gathered whole onto every chip, once: an identity compiled
  to replicated outputs, which works across hosts where a device_put would not."""
  return jax.jit(lambda t: t, out_shardings=whole(state, mesh))(state)


def param_rules(tunix_lib: Any) -> Any:
  """The parameters' partition rules: Tunix's default ShardingConfig for the model family
  (`tunix_lib`: Tunix's gemma or gemma3 model module), e.g. embeddings ('tp', 'fsdp'), q/kv
  einsums (_, 'fsdp', 'tp'), MLP kernels ('fsdp', 'tp'); LoRA weights follow their kernels."""
  return tunix_lib.ShardingConfig.get_default_sharding()


def gating_sharding(kernel: NamedSharding, transposed: bool) -> NamedSharding:
  """A [D, F] gate / up kernel's sharding carried onto the stacked gating einsum: [2, F, D]
  (`transposed`, Gemma 3) or [2, D, F] (Gemma 2 2B)."""
  d_ax, f_ax = (tuple(kernel.spec) + (None, None))[:2]
  return NamedSharding(kernel.mesh, P(None, f_ax, d_ax) if transposed else P(None, d_ax, f_ax))


def kv_cache_spec(num_kv_heads: int, mesh: Mesh) -> P:
  """KV cache [rows, slots, kv_heads, head_dim]: rows over 'fsdp', heads over 'tp' where they
  divide (Gemma 3 1B has a single KV head: it is then replicated over 'tp')."""
  tp = mesh.shape["tp"]
  return P("fsdp", None, "tp" if tp > 1 and num_kv_heads % tp == 0 else None, None)


def prompt_cache_sharding(num_kv_heads: int, mesh: Mesh) -> NamedSharding:
  """`kv_cache_spec` for the prompt part of Gemma 3's decode cache (keys [prompts, K, H, P],
  values [prompts, K, P, H], `models.decode`): prompts over 'fsdp', KV heads over 'tp' where
  they divide; the last two axes whole, so one sharding places both."""
  rows, slots, heads, dim = kv_cache_spec(num_kv_heads, mesh)
  return NamedSharding(mesh, P(rows, heads, slots, dim))


def slot_major_sharding(num_kv_heads: int, mesh: Mesh,
                        rows: tuple[str, ...] = ("fsdp",)) -> NamedSharding:
  """`kv_cache_spec` for the new part of Gemma 3's decode cache ([slots, rows, K, H],
  `models.decode`), its rows over `rows` (`decode_rows`)."""
  _, slots, heads, dim = kv_cache_spec(num_kv_heads, mesh)
  return NamedSharding(mesh, P(slots, rows if len(rows) > 1 else rows[0],
                               None if "tp" in rows else heads, dim))


def attention_over_rows(num_kv_heads: int, mesh: Mesh) -> bool:
  """Whether decoding on `mesh` runs attention data-parallel over every chip rather than
  Megatron-style over 'tp': where 'tp' cannot split the KV heads, each chip of a tp group would
  otherwise hold and read the whole KV cache of the group's rows (Gemma 3 1B, one KV head:
  at 32 rows x 1024 slots more bytes a token than the chip's share of the weights). Over rows,
  each chip holds and reads its own rows' cache; the attention weights are then whole on
  every chip (`decode_shardings`), the residual stream stays on each chip's rows, and a layer
  takes an all-gather of the MLP's input and an all-to-all of its output's shares
  (`models.decode`) instead of two all-reduces."""
  return mesh.shape["tp"] > 1 and num_kv_heads % mesh.shape["tp"] != 0


def decode_rows(mesh: Mesh, rows: int, g: int, over_rows: bool) -> tuple[str, ...]:
  """The axes a decode step splits its `rows` (prompt groups of `g`) over in attention and in
  the new part of the KV cache: 'fsdp', and 'tp' with `over_rows` (`attention_over_rows`) where
  the rows divide over every chip and each chip's rows are whole groups or one group's part
  (so that its prompt is one slice of its 'fsdp' block's prompts)."""
  chips = mesh.shape["fsdp"] * mesh.shape["tp"]
  c = rows // chips
  if not over_rows or mesh.shape["tp"] == 1 or rows % chips or not (c % g == 0 or g % c == 0):
    return ("fsdp",)
  return ("fsdp", "tp")


def vocab_axis(mesh: Mesh | None, vocab: int) -> str | None:
  """The head's embedding when every chip needs it whole along D: the vocabulary over 'tp'
  where it divides."""
  tp = int(mesh.shape.get("tp", 1)) if mesh is not None else 1
  return "tp" if tp > 1 and vocab % tp == 0 else None


def vocab_axes(mesh: Mesh | None, vocab: int, shards: int) -> tuple[str, ...]:
  """The axes that split the vocabulary in the log-prob heads when `shards` token shards feed
  each step: 'fsdp' (and 'tp') where the vocabulary divides over them all, else `vocab_axis`."""
  if mesh is None:
    return ()
  tp = int(mesh.shape.get("tp", 1))
  if vocab % (shards * tp) == 0:
    return ("fsdp", "tp") if tp > 1 else ("fsdp",)
  axis = vocab_axis(mesh, vocab)
  return (axis,) if axis else ()


def decode_tp(layout: str) -> int | None:
  """The 'tp' size of a decode layout name: 'replicated' 1, 'tp<k>' k, 'train' None (the
  training mesh and placement)."""
  if layout == "train":
    return None
  return 1 if layout == "replicated" else int(layout[2:])


def decode_mesh(mesh: Mesh, layout: str) -> Mesh:
  """The training mesh's devices as (rows, tp) for decoding in `layout`, in their order (a tp
  group is a run of neighbours, as the training mesh's 'tp' is)."""
  tp = decode_tp(layout)
  if tp is None:
    return mesh
  devices = mesh.devices.reshape(-1)
  if len(devices) % tp:
    raise ConfigError(f"config key 'rollout.layout' = {layout!r}: tp {tp} does not divide the "
                      f"{len(devices)} devices")
  return Mesh(devices.reshape(len(devices) // tp, tp), AXES)


def in_attention(path: tuple) -> bool:
  """Whether a state leaf's tree path is under an attention module ('attn')."""
  return any(getattr(k, "key", None) == "attn" for k in path)


def decode_shardings(state: Any, mesh: Mesh, attention_whole: bool = False) -> Any:
  """Each parameter's rule on a decode mesh with 'fsdp' dropped (Tunix's own rules for
  sampling), and vectors (norm scales, biases) whole on every chip: one all-reduce after the
  attention output and one after the MLP's down projection, none in a norm. `attention_whole`
  (`attention_over_rows`): the attention's parameters (LoRA included) whole on every chip."""
  def decode(path, a, s: NamedSharding) -> NamedSharding:
    if len(a.shape) <= 1 or attention_whole and in_attention(path):
      return NamedSharding(mesh, P())
    spec = [None if ax is None else tuple(x for x in ((ax,) if isinstance(ax, str) else ax)
                                          if x != "fsdp" and mesh.shape[x] > 1) or None
            for ax in s.spec]
    return NamedSharding(mesh, P(*[ax[0] if isinstance(ax, tuple) and len(ax) == 1 else ax
                                   for ax in spec]))

  return jax.tree_util.tree_map_with_path(decode, state, shardings(state, mesh))


def put_batch(mesh: Mesh, host: np.ndarray) -> jax.Array:
  """Places a host batch (the same on every process) as `batch_placement` says, built from
  each host's copy, never device_put."""
  return array_from_host(host.shape, batch_placement(mesh, host.shape), lambda idx: host[idx])


def replicate_unplaced(tree: Any, mesh: Mesh) -> Any:
  """Small arrays not yet on the mesh (step counters, PRNG keys) replicated over it, built from
  each host's copy, so that checkpoints restore them onto the mesh too."""
  rep = replicated(mesh)

  def place(x):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      return x
    host = np.asarray(x)
    return array_from_host(host.shape, rep, lambda idx: host[idx])

  return jax.tree.map(place, tree)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole array on this host; on several hosts, gathered from all processes (every
  process takes part)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def array_from_host(shape: tuple[int, ...], sharding: NamedSharding,
                    read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """Builds a global array shard by shard: `read(index)` returns only that shard's block.

  Never `device_put` of a whole host array onto a replicated sharding (on several hosts that
  runs an equality check that allgathers the tensor); each device gets just its slice.
  """
  return jax.make_array_from_callback(shape, sharding, read)


def agreed(value: int) -> int:
  """Process 0's value on every process: decisions that start collective work (resume step,
  whether to evaluate) must not depend on when each process looked at the run directory."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def largest(value: int) -> int:
  """The largest of the processes' values, on every process: a signal that reached one host
  stops all of them at the same step (a TPU VM's hosts are not signalled at the same instant)."""
  return int(largest_each(np.int32(value)))


def largest_each(values: np.ndarray) -> np.ndarray:
  """`largest`, elementwise over an int array of the same shape on every process."""
  if jax.process_count() == 1:
    return values
  return np.max(multihost_utils.process_allgather(values), axis=0)


def from_process_0(values: np.ndarray) -> np.ndarray:
  """Process 0's array on every process (the same shape on each)."""
  if jax.process_count() == 1:
    return values
  return np.asarray(multihost_utils.broadcast_one_to_all(values))
