"""Tunix's Gemma modules, with a forward that stops at the final hidden states, born sharded.

The trainer and the sampler never call the model's ``__call__`` (which builds ``[B, T, V]``
logits); they call ``hidden_states`` and project only the positions they need through the tied
embedding (``reasoner.heads``). qwix's LoRA intercepts ``hidden_states``.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from reasoner import mesh as mesh_lib
from reasoner.config import ConfigError, ModelConfig
from reasoner.models import decode
from reasoner.models import layer as layer_lib

Cache = dict[str, dict[str, jax.Array]]


class _HiddenStates:
  """Mixin: the decoder stack of Tunix's Gemma without the vocabulary projection."""

  def hidden_states(
      self,
      tokens: jax.Array,  # [B, T] int32
      positions: jax.Array,  # [B, T] int32
      cache: Cache | decode.Cache | None,  # per layer {'k','v': [B, S, K, H], 'end_index': [B]}
      attention_mask: jax.Array,  # [B, T, S] bool (S = T without a cache); with step: [b, P]
      mesh: Mesh | None = None,
      local_mask: jax.Array | None = None,  # [B, T, S]: the sliding-window layers' mask
      tunix_attention: bool = False,
      step: jax.Array | None = None,  # one new token a row on a `decode.Cache` (Gemma 3)
  ) -> tuple[jax.Array, Cache | decode.Cache | None]:  # [B, T, D] after the final norm
    """`local_mask` replaces `attention_mask` in sliding-window layers; Tunix then multiplies
    in its own band (so it must hold the window already where that band is wider).

    Gemma 3 layers on more than one token run `layer.decoder_layer` (Tunix's forward, no
    [B, T, N, S] probabilities kept for the backward); `tunix_attention` runs Tunix's own
    layers instead: the dense reference of the tests and `bench/head.py`. It is a switch of
    this method, not a function beside it, because qwix's LoRA intercepts this method only.

    With `mesh`, the residual stream is pinned to rows over 'fsdp' between layers
    (`mesh.activation_placement`). Tunix's own activation constraints are no-ops outside a
    `with mesh:` block and whenever the first device is a CPU (so in every ahead-of-time plan);
    unpinned, XLA split the activations along the model dimension like the weights and formed
    every row's [T, 6912] MLP partial sums on every chip (Gemma3-1B, v5e:2x4)."""
    if step is not None:  # here, not beside: qwix's LoRA intercepts this method only
      return decode.hidden_states(self, tokens, positions, cache, step, attention_mask, mesh)
    pin = ((lambda x: x) if mesh is None else
           lambda x: jax.lax.with_sharding_constraint(x, mesh_lib.activation_placement(mesh,
                                                                                      x.shape)))
    x = pin(self.embedder.encode(tokens))
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      name = f"layer_{i}"
      mask = attention_mask if local_mask is None or not _sliding(layer) else local_mask
      call = layer
      if not tunix_attention and layer_lib.replaces(layer, tokens.shape[1]):
        call = functools.partial(layer_lib.decoder_layer, layer, tie=i > 0)
      layer_cache, x = call(x, positions, cache[name] if cache else None, mask)
      x = pin(x)
      if cache is not None:
        new_cache[name] = layer_cache
    return self.final_norm(x), new_cache

  @property
  def logit_softcap(self) -> float | None:
    return getattr(self, "final_logits_softcap", None)

  def embedding(self) -> jax.Array:  # [V, D], tied input embedding and output head
    return self.embedder.input_embedding.get_value()


def _sliding(layer) -> bool:
  kind = getattr(getattr(layer, "attn", None), "attn_type", None)
  return getattr(kind, "name", None) == "LOCAL_SLIDING"


def _model_classes():
  from tunix.models.gemma import model as gemma_lib
  from tunix.models.gemma3 import model as gemma3_lib

  class Gemma3(_HiddenStates, gemma3_lib.Gemma3):
    pass

  class Gemma2(_HiddenStates, gemma_lib.Gemma):
    pass

  return gemma3_lib, gemma_lib, Gemma3, Gemma2


_CLASSES: tuple | None = None


def classes():
  global _CLASSES
  if _CLASSES is None:
    _CLASSES = _model_classes()
  return _CLASSES


NAMES = "gemma3-270m, gemma3-1b, gemma3-4b, gemma3-12b, gemma3-27b, gemma2-2b, tiny"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What to build: the Tunix config and the module class."""

  family: str  # gemma3 | gemma2
  tunix_config: Any
  cls: type
  dtype: Any = None  # model.dtype: what floating parameters are loaded as (None: the module's)

  def param_dtype(self, default: Any) -> np.dtype:
    """The dtype a parameter is held in: model.dtype for floating ones (Tunix's Gemma 2 config
    has no dtype of its own), the module's dtype otherwise."""
    if self.dtype is None or not jnp.issubdtype(default, jnp.floating):
      return np.dtype(default)
    return np.dtype(self.dtype)

  @property
  def num_kv_heads(self) -> int:
    return self.tunix_config.num_kv_heads

  @property
  def num_layers(self) -> int:
    return self.tunix_config.num_layers

  @property
  def head_dim(self) -> int:
    return self.tunix_config.head_dim


def model_spec(cfg: ModelConfig, vocab_size: int | None = None) -> ModelSpec:
  """Maps `model.name` onto Tunix's config, with our dtype, remat and sharding rules."""
  gemma3_lib, gemma_lib, Gemma3, Gemma2 = classes()
  dtype = jnp.dtype(cfg.dtype)
  if cfg.name.startswith("gemma2"):
    # Not gemma2-9b: Tunix 0.1.7's preset has hidden_dim 28672, upstream's is 14336.
    presets = {"gemma2-2b": gemma_lib.ModelConfig.gemma2_2b}
    lib, cls, family = gemma_lib, Gemma2, "gemma2"
  else:
    presets = {
        "gemma3-270m": gemma3_lib.ModelConfig.gemma3_270m,
        "gemma3-1b": gemma3_lib.ModelConfig.gemma3_1b_it,
        "gemma3-4b": gemma3_lib.ModelConfig.gemma3_4b_it,  # text only: no vision encoder
        "gemma3-12b": gemma3_lib.ModelConfig.gemma3_12b_it,
        "gemma3-27b": gemma3_lib.ModelConfig.gemma3_27b_it,
        "tiny": None,
    }
    lib, cls, family = gemma3_lib, Gemma3, "gemma3"
  if cfg.name not in presets:
    raise ConfigError(f"config key 'model.name' = {cfg.name!r}: expected one of {NAMES}")
  if cfg.name == "tiny":
    tcfg = gemma3_lib.ModelConfig(
        num_layers=cfg.tiny_layers, num_embed=vocab_size or cfg.tiny_vocab,
        embed_dim=cfg.tiny_embed_dim, hidden_dim=cfg.tiny_hidden_dim, num_heads=cfg.tiny_heads,
        head_dim=cfg.tiny_head_dim, num_kv_heads=cfg.tiny_kv_heads, sliding_window_size=16,
        global_base_frequency=1_000_000)
  else:
    tcfg = presets[cfg.name]()
  changes = {"remat_config": getattr(lib.RematConfig, cfg.remat.upper()),
             "shd_config": mesh_lib.param_rules(lib)}
  if cfg.layers is not None and cfg.layers < tcfg.num_layers:
    changes["num_layers"] = cfg.layers
    if hasattr(tcfg, "attention_types"):  # Gemma 2 lists one type a layer
      changes["attention_types"] = tuple(tcfg.attention_types)[:cfg.layers]
  if hasattr(tcfg, "param_dtype"):  # Tunix's Gemma2 config has no dtype field (always bf16)
    changes["param_dtype"] = dtype
  tcfg = dataclasses.replace(tcfg, **changes)
  return ModelSpec(family=family, tunix_config=tcfg, cls=cls, dtype=dtype)


def new_model(spec: ModelSpec, seed: int) -> nnx.Module:
  """Tunix's module of `spec`, its floating parameters in the dtype a run holds them in
  (`param_dtype`, as the Kaggle restore casts them): Tunix's Gemma 2 creates them in float32
  whatever model.dtype says, and the planner saw gemma2_2b's bf16 base as 9.74 GiB."""
  model = spec.cls(spec.tunix_config, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)
  if all(spec.param_dtype(x.dtype) == x.dtype for x in jax.tree.leaves(state)):
    return model
  return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(spec.param_dtype(x.dtype)), state))


def abstract_model(spec: ModelSpec, mesh: Mesh):
  """(graphdef, abstract state with NamedShardings): shapes only, nothing allocated."""
  with jax.set_mesh(mesh):
    abs_model = nnx.eval_shape(lambda: new_model(spec, 0))
  graphdef, abs_state = nnx.split(abs_model)
  shardings = nnx.get_named_sharding(abs_state, mesh)
  return graphdef, abs_state, shardings


def init_random(spec: ModelSpec, mesh: Mesh, seed: int):
  """Random init compiled with output shardings: every parameter is born in its shards."""
  graphdef, _, shardings = abstract_model(spec, mesh)

  def create():
    return nnx.state(new_model(spec, seed))

  with jax.set_mesh(mesh):
    state = jax.jit(create, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def from_host(spec: ModelSpec, mesh: Mesh,
              read: Callable[[str, tuple[int, ...]], np.ndarray]):
  """Builds the model parameter by parameter from host arrays.

  `read(path, shape)` returns one parameter as a host array ('layers.3.attn.q_einsum.w'); it is
  cut into shards with `make_array_from_callback`, so each device receives only its block and
  the host holds one parameter at a time.
  """
  graphdef, abs_state, shardings = abstract_model(spec, mesh)
  flat_abs = dict(nnx.to_flat_state(abs_state))
  flat_shd = dict(nnx.to_flat_state(shardings))
  leaves = []
  for path, var in flat_abs.items():
    name = ".".join(str(p) for p in path)
    shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
    host = np.asarray(read(name, shape))
    if host.shape != shape:
      raise ValueError(f"parameter {name}: expected shape {shape}, the checkpoint has "
                       f"{host.shape}")
    host = host.astype(dtype)
    sharding: NamedSharding = flat_shd[path].get_value()
    arr = mesh_lib.array_from_host(shape, sharding, lambda idx, h=host: h[idx])
    leaves.append((path, var.replace(arr)))
    del host
  state = nnx.from_flat_state(leaves)
  return nnx.merge(graphdef, state)


def without_remat(graphdef, *states):
  """The same model's graphdef with Tunix's remat off everywhere, for the sampler: remat does
  nothing without a gradient, and Tunix's `nnx.remat` (in each attention, MLP or layer call
  under block or decoder remat) cannot run inside the decode loop, where the module was merged
  outside the `while_loop` (TraceContextError). `states`: those `graphdef` was split with
  (arrays or ShapeDtypeStructs, nothing is copied); they merge with the graphdef returned.
  `graphdef` itself is left as it was: merging shares its static attributes with the module
  built, so the module is built from a copy (static data only, no arrays). A graph without
  remat comes back as it is."""
  model = nnx.merge(copy.deepcopy(graphdef), *states)
  changed = False
  for _, node in nnx.iter_graph(model):
    none = lambda rc: type(rc).NONE
    if hasattr(node, "remat_config") and node.remat_config != none(node.remat_config):
      node.remat_config = none(node.remat_config)  # Tunix's Attention keeps its own
      changed = True
    cfg = getattr(node, "config", None)
    if (dataclasses.is_dataclass(cfg) and hasattr(cfg, "remat_config")
        and cfg.remat_config != none(cfg.remat_config)):
      node.config = dataclasses.replace(cfg, remat_config=none(cfg.remat_config))
      changed = True
  if not changed:
    return graphdef
  filters = (nnx.LoRAParam, ...) if len(states) == 2 else ()  # (lora, base) as `lora.split`
  return nnx.split(model, *filters)[0]


def decoded_fraction(shape: tuple[int, ...], chunk: tuple[int, ...],
                     sharding: NamedSharding) -> float:
  """Elements this process would decode reading its blocks of `shape` (each read decodes every
  stored chunk it touches; equal blocks are read once), over the array's size."""
  blocks = {tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
            for index in sharding.addressable_devices_indices_map(shape).values()}
  decoded = sum(math.prod(min(n, -(-b // c) * c) - a // c * c
                          for (a, b), c, n in zip(block, chunk, shape)) for block in blocks)
  return decoded / max(1, math.prod(shape))


def release_freed_memory() -> None:
  """Hands freed host read buffers back to the OS after a load: glibc keeps medium-sized freed
  blocks in its heap (0.17x of a 2 GB checkpoint stayed resident after the Kaggle load)."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to do
    pass
