"""LoRA applied in place with qwix: the base weights stay as they are and are never copied.

The KL reference is the same model with the LoRA weights zeroed ((x A) B = 0 exactly), so
the reference policy is the base weights themselves, not a second model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import Mesh

from reasoner.config import LoraConfig


def with_lora(model: nnx.Module, cfg: LoraConfig, seed: int) -> nnx.Module:
  """qwix's LoRA on `hidden_states` (traced on a one-token input), without entering a mesh:
  callable inside `nnx.eval_shape` (the planner), where `jax.set_mesh` is not allowed."""
  provider = qwix.LoraProvider(module_path=cfg.module_path, rank=cfg.rank, alpha=cfg.alpha)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return qwix.apply_lora_to_model(model, provider, tokens, tokens, None,
                                  jnp.ones((1, 1, 1), bool), methods=("hidden_states",),
                                  rngs=nnx.Rngs(seed))


def apply_lora(model: nnx.Module, cfg: LoraConfig, mesh: Mesh, seed: int) -> nnx.Module:
  """Adds LoRA A/B (nnx.LoRAParam) to every matching projection; B starts at zero.

  The LoRA weights are placed by their partition rules (those of the kernels they adapt), as
  `build(cfg, abstract=True)` places them for the planner: under Tunix's block or decoder
  remat qwix creates them inside `nnx.remat`'s trace, where the rules are not applied, and they
  came out replicated on every chip (with their AdamW moments)."""
  with jax.set_mesh(mesh):
    lora_model = with_lora(model, cfg, seed)
  lora = nnx.state(lora_model, nnx.LoRAParam)
  if not jax.tree.leaves(lora):
    raise ValueError(f"lora.module_path {cfg.module_path!r} matched no projection of the model")
  placed = jax.jit(lambda x: x, out_shardings=nnx.get_named_sharding(lora, mesh))(lora)
  nnx.update(lora_model, placed)
  return lora_model


def split(model: nnx.Module):
  """(graphdef, lora_state, base_state): what trains and what stays frozen."""
  return nnx.split(model, nnx.LoRAParam, ...)


def zeros_like(lora_state):
  return jax.tree.map(jnp.zeros_like, lora_state)
