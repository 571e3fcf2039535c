"""What the `auto` placements pick. The decode layout (`rollout.layout`): the bytes a chip holds
of the weights in each layout (`copy_bytes`), the time of one decoded token in it, bound by HBM
or the interconnect (`decode_estimate`), and the fastest layout whose copy takes at most a
quarter of a chip's memory (`decode_layout`). The training weights (`mesh.weights`): whole on
every chip where the base takes at most that quarter (`weights_placement`). The build and the
sampler ask at run time, the planner for a topology (and compiles both to check).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from reasoner import mesh as mesh_lib
from reasoner.chips import CHIPS, Chip, Collective, collective_seconds
from reasoner.models.cache import kv_cache_bytes
from reasoner.models.prompt import prompt_layout


def nbytes(state, where: Callable[[Any], bool] = lambda path: True) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if where(path))


def _decode_mesh(setup, tp: int):  # (the decode mesh of `tp`, whether attention is over rows)
  mesh = mesh_lib.decode_mesh(setup.mesh, "replicated" if tp == 1 else f"tp{tp}")
  return mesh, setup.spec.family == "gemma3" and mesh_lib.attention_over_rows(
      setup.spec.tunix_config.num_kv_heads, mesh)


def copy_bytes(setup, state, tp: int) -> float:
  """Bytes a chip holds of `state` in the decode layout of `tp` (`mesh.decode_shardings`):
  1 / tp of each parameter, the attention's whole where attention runs over rows."""
  whole = nbytes(state, mesh_lib.in_attention) if _decode_mesh(setup, tp)[1] else 0
  return (nbytes(state) - whole) / tp + whole


def decode_estimate(setup, tp: int, chip: Chip) -> dict[str, float]:
  """Seconds of one decoded token (all rows) in the decode layout of `tp`, bound by HBM (the
  chip's copy of the weights, its rows' KV cache) or by the interconnect (two collectives of
  the rows' hidden states a layer over `tp` chips, and the head's top-k candidates)."""
  cfg, t, (mesh, over_rows) = setup.cfg, setup.spec.tunix_config, _decode_mesh(setup, tp)
  g, prompts = cfg.rollout.num_generations, cfg.train.batch_size
  c, extra = prompt_layout(mesh, prompts, g)
  kv = kv_cache_bytes(t, prompts * c + extra, g // c, cfg.data.max_prompt_tokens,
                      cfg.rollout.max_new_tokens, cfg.model.dtype, mesh,
                      setup.spec.family == "gemma3", over_rows)
  rows = -(-prompts * g // (setup.mesh.size // tp))  # a chip's rows
  hidden = lambda kind: collective_seconds(Collective(kind, tp, rows * t.embed_dim * 4), chip)
  topk = Collective("all-gather", tp, rows * tp * (cfg.rollout.top_k or 1) * 8)
  weights = copy_bytes(setup, setup.base, tp) + copy_bytes(setup, setup.lora, tp)
  if over_rows:  # the MLP's input gathered, its output's shares sent to their rows' chips
    layers = (t.num_layers * (hidden("all-gather") + hidden("all-to-all"))  # (the last layer's
              - hidden("all-to-all") + hidden("all-reduce"))  # reduced whole for the head)
  else:  # the attention's output and the MLP's reduced
    layers = t.num_layers * 2 * hidden("all-reduce")
  return {"HBM": (weights + kv) / chip.bandwidth,
          "interconnect": layers + collective_seconds(topk, chip)}


SHARE = 4  # an auto placement may put at most 1 / SHARE of a chip's memory into weights


def chip_hbm(devices) -> int | None:
  """The memory of this process's chips among `devices` (another host's has no figure), or
  None where the device gives none (XLA:CPU, a topology's compile-only devices)."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  return ((local[0].memory_stats() if local else None) or {}).get("bytes_limit")


def weights_placement(weights: str, chips: int, base_bytes: float, hbm: int | None
                      ) -> tuple[str, str]:
  """`mesh.weights`, with 'auto' resolved, and why. `replicated` where more than one chip
  trains and the whole base (`base_bytes`) takes at most 1 / SHARE of a chip's memory (`hbm`):
  a LoRA step then reads and computes what it would sharded, and gathers no weights; else
  `sharded` (XLA:CPU's fake devices have no memory figure: a copy each would cost the host's)."""
  if weights != "auto":
    return weights, "set in the config"
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  if chips == 1:
    return "sharded", "one chip: sharded and replicated are the same"
  if not hbm:
    return "sharded", "the chips' memory is unknown (XLA:CPU)"
  if base_bytes > hbm / SHARE:
    return "sharded", (f"the whole base ({gib(base_bytes)}) takes more than 1/{SHARE} of a "
                       f"chip's {gib(hbm)}")
  return "replicated", (f"the whole base ({gib(base_bytes)}) takes at most 1/{SHARE} of a "
                        f"chip's {gib(hbm)}: a LoRA step then gathers no weights")


def decode_layout(setup, hbm: int | None = None, chip: Chip | None = None) -> str:
  """`rollout.layout`, with 'auto' resolved: of the layouts whose copy of the base weights
  (`copy_bytes`) takes at most 1 / SHARE of a chip's memory (`hbm`, else the device's), the
  one whose decoded token `decode_estimate` finds fastest; 'train' on one device or where a
  chip's memory is unknown (XLA:CPU: a copy per fake device would cost the host's memory)."""
  layout, n = setup.cfg.rollout.layout, setup.mesh.size
  if layout != "auto":
    return layout
  if hbm is None and n > 1:
    hbm = chip_hbm(setup.mesh.devices.flat)
  if n == 1 or not hbm:
    return "train"
  chip = chip or CHIPS["v5e"]
  fits = [k for k in range(1, n + 1)
          if n % k == 0 and copy_bytes(setup, setup.base, k) <= hbm / SHARE]
  if not fits:
    return "train"
  best = min(fits, key=lambda k: max(decode_estimate(setup, k, chip).values()))
  return "replicated" if best == 1 else f"tp{best}"

