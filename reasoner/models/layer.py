"""Gemma 3's decoder layer, Tunix's forward, with what the backward keeps chosen by name.

Left to autodiff, Tunix's layer keeps every intermediate the backward reads: per layer the
gelu's four [T, hidden] pieces and its product beside the two projections, each RMSNorm's
normalised input, the rotary tables, the residual sums. Here the layer runs under `nnx.remat`
with a policy that saves only named matmul outputs (`SAVED`); everything elementwise between
them (norms, rotary embedding, gelu, residual adds) is formed again in the backward. Per remat
setting:

- none: every projection's output and the attention core's: no projection runs twice (only
  LoRA's rank-r x @ A products do, r columns each); the [T, hidden] arrays kept fall from
  seven a layer to two.
- block: Tunix's arrangement, attention and MLP each under a plain `nnx.remat`. (A whole-layer
  policy keeping only the output projections saved a little memory but moved more bytes.)
- decoder: nothing (Tunix's decoder remat): the whole layer runs again.

With block and decoder remat, past the first layer, each layer's backward also finishes its
LoRA gradients before the layer below starts (`tied_gradients`). Left free, XLA formed the
input cotangents of all layers first and most of their LoRA gradients in a second sweep,
beside the prompt's backward (`models.prompt.completion_hidden` calls the model twice),
holding two [rows, T, hidden] arrays a layer from one sweep to the next. With no remat every
projection's output is kept anyway, and tying there only constrains XLA's own
rematerialisation, so none stays untied. The figures behind each choice are in docs/LOG.md
(2026-11-25, "measurements moved from module docstrings").

Only calls of more than one token take this path (training, prefill); decode steps and
Gemma 2 keep Tunix's code (`reasoner.models.gemma.hidden_states`).
"""

from __future__ import annotations

import jax
from flax import nnx

from reasoner.models import attention

FFW = ("ffw_gate", "ffw_up", "ffw_out")
SAVED = {  # remat setting -> the named outputs the backward keeps (block: see above)
    "none": attention.NAMES + FFW,
    "decoder": (),
}


def feed_forward(mlp, x):
  """Tunix's `FeedForward.block`, its projections named."""
  from jax.ad_checkpoint import checkpoint_name
  from tunix.models.gemma3 import model as gemma3_lib

  gate = checkpoint_name(mlp.gate_proj(x), FFW[0])
  up = checkpoint_name(mlp.up_proj(x), FFW[1])
  act = gemma3_lib.sharding_utils.shard(nnx.gelu(gate) * up, mlp.config.shd_config.act_btf)
  return checkpoint_name(mlp.down_proj(act), FFW[2])


def _layer_block(layer, x, segment_pos, cache, attn_mask):
  """Tunix's `DecoderLayer.block` (with block remat, Tunix's `nnx.remat` on each half)."""
  attend, ffw = attention.attention_block, feed_forward
  if remat(layer) == "block":
    attend, ffw = nnx.remat(attend), nnx.remat(ffw)
  cache, attn_output = attend(layer.attn, layer.pre_attention_norm(x), segment_pos, cache,
                              attn_mask)
  attn_output = layer.post_attention_norm(attn_output) + x
  outputs = layer.post_ffw_norm(ffw(layer.mlp, layer.pre_ffw_norm(attn_output)))
  return cache, outputs + attn_output


def decoder_layer(layer, x, segment_pos, cache, attn_mask, tie: bool = True):
  """Tunix's `DecoderLayer.__call__`, the backward keeping what `SAVED` names. `nnx.remat`, not
  `jax.checkpoint`: qwix sets attributes on the projections as it runs, which nnx allows only
  at the module's own trace level; differentiate with nnx's transforms (as the trainer does).
  `tie`: `tied_gradients` where the backward forms anything again (block, decoder), not in
  the first layer (its input carries no gradient: tied, its cotangent would be formed only to
  be dropped)."""
  if remat(layer) == "block":
    call = _layer_block
  else:
    policy = jax.checkpoint_policies.save_only_these_names(*SAVED[remat(layer)])
    call = nnx.remat(_layer_block, policy=policy)
  run = lambda x: call(layer, x, segment_pos, cache, attn_mask)
  return tied_gradients(layer, x, run) if tie and remat(layer) != "none" else run(x)


@jax.custom_vjp
def _tie(leaves, x):
  return leaves, x


def _tie_fwd(leaves, x):
  return (leaves, x), None


def _tie_bwd(_, cts):
  return jax.lax.optimization_barrier(cts)


_tie.defvjp(_tie_fwd, _tie_bwd)


def tied_gradients(layer, x, call):
  """`call(x)` with the layer's LoRA weights and its input passed through an identity whose
  backward holds the input's cotangent behind an optimization barrier with the LoRA weights'
  gradients: the layer below waits for this layer's weight gradients (see the module's
  docstring). The module holds the tied weights for the call only."""
  lora = nnx.state(layer, nnx.LoRAParam)
  leaves, tree = jax.tree.flatten(lora)
  if not leaves:
    return call(x)
  tied, x = _tie(leaves, x)
  nnx.update(layer, jax.tree.unflatten(tree, tied))
  try:
    return call(x)
  finally:
    nnx.update(layer, lora)


def remat(layer) -> str:
  return layer.config.remat_config.name.lower()


def replaces(layer, tokens: int) -> bool:
  """Whether `decoder_layer` runs in place of Tunix's call: Gemma 3 layers on more than one
  token."""
  from tunix.models.gemma3 import model as gemma3_lib

  return tokens > 1 and isinstance(layer, gemma3_lib.DecoderLayer)
