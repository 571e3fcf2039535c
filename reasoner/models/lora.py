"""LoRA applied in place with qwix: the base weights stay as they are and are never copied.

The reference policy (GRPO's KL, DPO's) is the same model under another LoRA, never a second
model: the LoRA the run started from (lora.init_from's, kept in <run>/reference by the loop),
or none, the LoRA weights zeroed ((x A) B = 0 exactly): the base weights themselves.

QLoRA (`lora.base_qtype`): qwix's PTQ under the LoRA replaces each adapted kernel by its
quantised values and scales (the float kernel is freed once the build drops the float model),
and each matmul dequantises it; the reference is then the quantised base.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import Mesh

from reasoner import mesh as mesh_lib
from reasoner.config import ConfigError, LoraConfig


def with_lora(model: nnx.Module, cfg: LoraConfig, seed: int) -> nnx.Module:
  """qwix's LoRA on `hidden_states` (traced on a one-token input), without entering a mesh:
  callable inside `nnx.eval_shape` (the planner), where `jax.set_mesh` is not allowed."""
  quant = {} if cfg.base_qtype == "none" else {"weight_qtype": cfg.base_qtype,
                                                 "tile_size": cfg.base_tile_size}
  provider = qwix.LoraProvider(module_path=cfg.module_path, rank=cfg.rank, alpha=cfg.alpha,
                               **quant)
  tokens = jnp.zeros((1, 1), jnp.int32)
  try:
    return qwix.apply_lora_to_model(model, provider, tokens, tokens, None,
                                    jnp.ones((1, 1, 1), bool), methods=("hidden_states",),
                                    rngs=nnx.Rngs(seed))
  except ValueError as e:
    if "cannot be tiled" not in str(e):
      raise
    raise ConfigError(f"config key 'lora.base_tile_size' = {cfg.base_tile_size}: expected a "
                      f"divisor of each quantised kernel's input size (qwix: {e})") from None


def apply_lora(model: nnx.Module, cfg: LoraConfig, mesh: Mesh, seed: int) -> nnx.Module:
  """Adds LoRA A/B (nnx.LoRAParam) to every matching projection; B starts at zero.

  The LoRA weights are placed by their partition rules (those of the kernels they adapt), as
  `build(cfg, abstract=True)` places them for the planner: under Tunix's block or decoder
  remat qwix creates them inside `nnx.remat`'s trace, where the rules are not applied, and they
  came out replicated on every chip (with their AdamW moments). With `lora.base_qtype`, qwix
  quantises each matching base kernel as the trace reaches it (W is replaced in the module by
  its values and scales); they are placed by the kernel's rule in the same way."""
  with jax.set_mesh(mesh):
    lora_model = with_lora(model, cfg, seed)
  lora = nnx.state(lora_model, nnx.LoRAParam)
  if not jax.tree.leaves(lora):
    raise ValueError(f"lora.module_path {cfg.module_path!r} matched no projection of the model")
  # the LoRA weights and, with `base_qtype`, the quantised kernels qwix computed, placed by
  # exactly their rules (the float base, placed so already, is left as it is, never copied)
  state = nnx.state(lora_model)
  nnx.update(lora_model, mesh_lib.moved(state, mesh_lib.shardings(state, mesh), exact=True))
  return lora_model


def split(model: nnx.Module):
  """(graphdef, lora_state, base_state): what trains and what stays frozen."""
  return nnx.split(model, nnx.LoRAParam, ...)


def zeros_like(lora_state):
  """`lora_state` zeroed (the reference: the base weights themselves), placed alike: made on
  the devices by one program, then kept, so that each step's reference forward reuses it (one
  LoRA's bytes held for the run). Made afresh each step it cost the 1B's LoRA 89 ms of host time
  on 8 XLA:CPU devices, most of it rebuilding the tree (`make bench BENCH=host`)."""
  leaves, tree = jax.tree.flatten(lora_state)
  if not all(isinstance(x, jax.Array) for x in leaves):  # abstract (a planner's)
    return jax.tree.map(jnp.zeros_like, lora_state)
  key = (tree, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
  if _zeroed.get("key") != key:  # the last LoRA's alone
    _zeroed.update(key=key, state=tree.unflatten(_zeros(key[1])()))
  return _zeroed["state"]


_zeroed: dict = {}  # the zeroed LoRA last made, and its key (tree, specs)


@functools.cache
def _zeros(specs: tuple):
  """The program that makes zero arrays of `specs`, (shape, dtype, sharding) each."""
  return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype, _ in specs],
                 out_shardings=[s for *_, s in specs])
