"""The LoRA's per-step moves on the host's side, now and as they were: what a GRPO step does
between its programs each step besides tokenising and scoring.

    make bench BENCH=host        (python -m bench host; about 2 minutes on 2 cores)

The embedded model (random weights of its shapes) on 8 fake CPU devices, placed as the
gemma3_1b preset is on a v5e-8: the weights whole on every chip, decoding in tp8. Each step
with a KL to the reference (`grpo.beta > 0`, and DPO's reference) makes a zeroed LoRA, and each
step moves the LoRA into the decode layout (`Sampler.in_layout`). Timed (best of 3 x 10,
alternated), now and before (`_before`): the zeroed LoRA was a `jnp.zeros_like` per array, each
sent from the host, and is now one cached program on the devices; the move was a `device_put`
per array and is now one batched call. (A step with beta 0, the embedded default's, made the
zeroed LoRA too, and now makes none.)

Whole steps are not compared here: on XLA:CPU the programs take seconds on the same two cores,
so milliseconds of host work are inside their noise. A lent H200 measured 234 ms a step outside
the 1B preset's programs (`make bench BENCH=device`, `host_s`).
"""

from __future__ import annotations

import os
import subprocess
import sys

from bench import common

CONFIG = "configs/embedded.yaml"
OVERRIDES = ["model.source=random", "data.num_train=64", "mesh.weights=replicated",
             "rollout.layout=tp8", "grpo.beta=0.04"]


def _before():
  """The two moves as they were: a zeros_like and a device_put per array."""
  import jax
  import jax.numpy as jnp

  from reasoner import mesh as mesh_lib

  zeros = lambda lora: jax.tree.map(jnp.zeros_like, lora)
  shared = lambda state, shardings: jax.tree.map(
      lambda x, s: x if mesh_lib.placed_alike(x.sharding, s, x.ndim) else jax.device_put(x, s),
      state, shardings)
  return zeros, shared


def run() -> None:
  """In the subprocess with 8 fake devices: the figures, written."""
  import jax

  from reasoner import mesh as mesh_lib
  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.engine import sampler as sampler_lib
  from reasoner.models import lora as lora_lib

  cfg = load_config(CONFIG, OVERRIDES)
  setup = build(cfg)
  sampler = sampler_lib.Sampler.for_run(setup)
  variants = {"now": (lora_lib.zeros_like, mesh_lib.moved), "before": _before()}
  moves = {name: {"zeroed_lora_ms": [], "lora_to_decode_ms": []} for name in variants}
  for _ in range(3):  # alternated, the best of each
    for name, (zeros, shared) in variants.items():
      lora_lib.zeros_like, mesh_lib.moved = zeros, shared
      moves[name]["zeroed_lora_ms"].append(1e3 * common.timeit(lambda: zeros(setup.lora), 10))
      moves[name]["lora_to_decode_ms"].append(1e3 * common.timeit(
          lambda: sampler.in_layout((setup.lora, setup.base)), 10))
  moves = {name: {k: min(v) for k, v in m.items()} for name, m in moves.items()}
  lora_lib.zeros_like, mesh_lib.moved = variants["now"]
  figures = {**moves, "lora_arrays": len(jax.tree.leaves(setup.lora)),
             "lora_bytes": sum(x.nbytes for x in jax.tree.leaves(setup.lora))}
  ratio = lambda k: moves["now"][k] / moves["before"][k]
  goals = [common.goal("zeroed LoRA, now / before", ratio("zeroed_lora_ms"), 0.5),
           common.goal("LoRA into the decode layout, now / before", ratio("lora_to_decode_ms"),
                       1.0)]
  path = common.write("host", figures, {"before": "the per-array moves (see the module)"},
                      goals, config=CONFIG, overrides=OVERRIDES)
  print(common.table([{"variant": n, **moves[n]} for n in variants]))
  print(f"wrote {path}")


def main() -> None:
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
         + " --xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-m", "bench.host"], env=env, check=True,
                 cwd=common.RESULTS.parents[1])


if __name__ == "__main__":
  run()
