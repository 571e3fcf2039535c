"""Peak host memory while loading a Gemma3-1B-shaped Kaggle checkpoint: ours vs Tunix's loader.

    make bench BENCH=load        (python -m bench load)

A checkpoint with Gemma 3 1B's exact upstream tree (google-deepmind/gemma names and shapes,
random bfloat16 values, 2.0 GB) is written into a temporary folder twice: from host arrays (one
stored chunk per array, as a single-host converter writes it), and from 8 devices with every
array split along its largest axis (a chunk per shard, as a sharded job writes it; only some of
those chunks line up with our fsdp blocks). Each loader then runs in its own fresh subprocess
on 8 fake CPU devices (so peaks never mix), both into bfloat16 with fsdp = 8:
``reasoner.models.kaggle.restore`` and Tunix's ``gemma3.params.create_model_from_checkpoint``.
A loader that fails is reported with its error, not retried.

The figure is (peak RSS during the load - RSS just before it) / checkpoint bytes. On CPU the
"devices" are host memory, so the loaded model itself counts 1.0; what lies above 1.0 is what
the loader held on the host beyond the model (read buffers, whole copies). On an accelerator the
model would not count at all.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

from bench import common

VARIANT = "gemma3-1b-it"
LAYOUTS = ("host", "sharded")
LOADERS = ("ours", "tunix")


def upstream_shapes() -> dict[str, dict[str, tuple[int, ...]]]:
  """Gemma 3 1B in the upstream layout (Tunix gemma3/params.py documents it)."""
  d, f, n, k, h, v, layers = 1152, 6912, 4, 1, 256, 262144, 26
  t = {"transformer/embedder": {"input_embedding": (v, d)},
       "transformer/final_norm": {"scale": (d,)}}
  for i in range(layers):
    p = f"transformer/layer_{i}/"
    t |= {p + "attn/q_einsum": {"w": (n, d, h)}, p + "attn/kv_einsum": {"w": (2, k, d, h)},
          p + "attn/attn_vec_einsum": {"w": (n, h, d)}, p + "attn/_query_norm": {"scale": (h,)},
          p + "attn/_key_norm": {"scale": (h,)}, p + "mlp/gating_einsum": {"w": (2, f, d)},
          p + "mlp/linear": {"w": (f, d)}}
    t |= {p + norm: {"scale": (d,)} for norm in ("pre_attention_norm", "post_attention_norm",
                                                  "pre_ffw_norm", "post_ffw_norm")}
  return t


def write(folder: pathlib.Path, layout: str) -> None:
  """Random bf16 arrays, kept on the host or split over 8 devices, then saved."""
  import jax
  import ml_dtypes
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  rng = np.random.default_rng(0)
  mesh = Mesh(np.asarray(jax.devices()), ("x",))
  tree = {}
  for key, leaves in upstream_shapes().items():
    tree[key] = {}
    for leaf, shape in leaves.items():
      host = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
      axis = max(range(len(shape)), key=lambda a: shape[a] if shape[a] % 8 == 0 else 0)
      spec = [None] * len(shape)
      if layout == "sharded" and shape[axis] % 8 == 0:
        spec[axis] = "x"
      if layout == "sharded":
        sharding = NamedSharding(mesh, P(*spec))
        host = jax.make_array_from_callback(shape, sharding, lambda i, a=host: a[i])
      tree[key][leaf] = host
      del host
  ocp.PyTreeCheckpointer().save(folder / VARIANT, tree)


def measure(loader: str, folder: pathlib.Path) -> dict:
  """Loads in this (fresh) process; RSS from /proc and getrusage."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from reasoner import mesh as mesh_lib
  from reasoner.config import MeshConfig, ModelConfig
  from reasoner.models import gemma, kaggle
  from tunix.models.gemma3 import params as tunix_params

  mesh = mesh_lib.make_mesh(MeshConfig())
  spec = gemma.model_spec(ModelConfig(source="kaggle", name="gemma3-1b", dtype="bfloat16",
                                      kaggle_handle=f"google/gemma-3/flax/{VARIANT}"))
  jax.block_until_ready(jnp.zeros(8) + 1)  # backend up before the baseline
  before = _rss()
  t0 = time.perf_counter()
  if loader == "ours":
    model = kaggle.restore(spec, mesh, folder / VARIANT)
  else:
    model = tunix_params.create_model_from_checkpoint(str(folder / VARIANT), spec.tunix_config,
                                                      mesh=mesh, dtype=jnp.bfloat16)
  state = nnx.state(model)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - t0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  leaves = jax.tree.leaves(state)
  split = sum(a.addressable_shards[0].data.size * 8 == a.size for a in leaves)
  return {"before_bytes": before, "peak_bytes": peak, "after_bytes": _rss(),
          "seconds": seconds, "model_bytes": sum(a.nbytes for a in leaves),
          "arrays_split_8_ways": split, "arrays": len(leaves)}


def _rss() -> int:
  for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def _child(*args: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  root = pathlib.Path(__file__).resolve().parents[1]
  p = subprocess.run([sys.executable, "-m", "bench.load", *args], cwd=root, env=env,
                     capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"bench.load {' '.join(args)} failed:\n{p.stderr[-3000:]}")
  return p.stdout


def _run(loader: str, folder: pathlib.Path, ckpt_bytes: int) -> dict:
  """One load in a fresh process; a loader that fails is reported, not fatal."""
  try:
    r = json.loads(_child("measure", loader, str(folder)).splitlines()[-1])
  except RuntimeError as e:
    lines = str(e).strip().splitlines()
    why = [l for l in lines if re.search(r"Error|Termination timeout|Exception", l)] or lines
    return {"error": why[-1].strip()[:240]}
  r["increase_bytes"] = r["peak_bytes"] - r["before_bytes"]
  r["ratio"] = r["increase_bytes"] / ckpt_bytes
  return r


def main() -> None:
  shapes = upstream_shapes()
  ckpt_bytes = sum(2 * math.prod(s) for leaves in shapes.values() for s in leaves.values())
  rows, runs = [], {}
  with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
    for layout in LAYOUTS:
      folder = pathlib.Path(tmp) / layout
      t0 = time.perf_counter()
      _child("write", str(folder), layout)
      print(f"wrote the {layout} checkpoint ({ckpt_bytes / 1e9:.2f} GB) in "
            f"{time.perf_counter() - t0:.0f} s", flush=True)
      for loader in LOADERS:
        runs[f"{loader}/{layout}"] = r = _run(loader, folder, ckpt_bytes)
        rows.append({"loader": loader, "checkpoint": layout, "load s": r.get("seconds", "-"),
                     "peak - before GB": r["increase_bytes"] / 1e9 if "ratio" in r else "-",
                     "ratio": r.get("ratio", "failed"),
                     "split 1/8": f"{r['arrays_split_8_ways']}/{r['arrays']}" if "ratio" in r
                     else r["error"][:60]})
        print(common.table(rows[-1:]), flush=True)
  worst = max(runs[f"ours/{l}"].get("ratio", float("inf")) for l in LAYOUTS)
  goals = [common.goal("peak host RSS during load / checkpoint bytes, ours (worst layout)",
                       worst, 1.2)]
  path = common.write(
      "load", {k: v for k, v in runs.items() if k.startswith("ours")},
      {k: v for k, v in runs.items() if k.startswith("tunix")}, goals,
      checkpoint={"shape": "gemma3-1b (upstream layout)", "dtype": "bfloat16",
                  "bytes": ckpt_bytes, "layouts": list(LAYOUTS)},
      method="(peak RSS - RSS before load) / checkpoint bytes; each load in a fresh process on "
             "8 fake CPU devices, fsdp=8; on CPU the loaded model itself is 1.0")
  print(common.table(rows))
  print(f"goal: ours <= 1.2x -> {worst:.3f} ({'met' if goals[0]['met'] else 'NOT met'}); {path}")


if __name__ == "__main__":
  if sys.argv[1] == "write":
    write(pathlib.Path(sys.argv[2]), sys.argv[3])
  else:
    print(json.dumps(measure(sys.argv[2], pathlib.Path(sys.argv[3]))))
