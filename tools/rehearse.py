"""A dress rehearsal of a TPU preset on this machine: `make rehearse PRESET=gemma3_1b`.

There is no TPU and no Kaggle download here, so the preset runs on 8 fake CPU devices against a
random-weight checkpoint of the real shapes, written in the Kaggle Flax layout (parameters born
sharded, written by orbax shard by shard) with the embedded model's `tokenizer.model`. Lengths
are cut (steps, G, new tokens, held-out problems, and the first 4 of the decoder layers, read from
the full checkpoint) and GSM8K is replaced by the generated arithmetic set (it needs the
network; so do Hugging Face and Kaggle sources, and files not on this machine: a mixture's
become one source of data/general.jsonl, the records' schema by example, with their weight, its
other sources kept, each held-out part cut to 8 at most; `offline_data`; its code records
have no tests, so the judge scores them, `offline_rewards`). A preset with a
judge of its own (gemma3_1b_general: a Gemma 3 12B-it on 4 of the 8 chips) gets a random judge
checkpoint of the judge's real widths and vocabulary, its first 4 layers written and read, on
its own devices; a random judge cannot pass `judge.check`, so the rehearsal turns the check off
(tests/test_rubrics.py runs it). Everything else is the preset's: remat, dtype, mesh, LoRA rank,
micro-batches, deadline, checkpoints, resume from a read-only copy, export, and loading the
export back. Each phase runs in its own process; the table gives its wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from reasoner.config import load_config
from reasoner.config.data import Fields, Hub

ROOT = pathlib.Path(__file__).resolve().parents[1]
# XLA:CPU holds float32 copies of the gathered bf16 weights per fake device: the 1B train step
# with all 26 layers passed 24 GiB of host memory on 8 devices (and on 2 and 4). Four layers of
# the real widths and vocabulary keep every code path and every shape but depth.
CUT = ["model.layers=4", "train.steps=2", "train.checkpoint_every=1", "rollout.num_generations=2",
       "rollout.max_new_tokens=16", "eval.max_new_tokens=16", "eval.batch_size=8",
       "data.num_train=64", "train.deadline=8h45m",
       # the retention set's first 8 (the presets name 256: minutes each on fake devices)
       "eval.sets=[{name: retention, source: jsonl, path: data/retention.jsonl, num: 8, "
       "retention: true}]"]
JUDGE_CUT = ["judge.model.layers=4", "judge.check=false"]


def cuts(cfg, judge_dir: pathlib.Path) -> list[str]:
  """CUT, the data the rehearsal draws (`offline_data`) and, where the preset has a judge model
  of its own, the random judge's checkpoint and cuts."""
  out = list(CUT) + offline_data(cfg) + offline_rewards(cfg)
  if own_judge(cfg):
    out += [f"judge.model.path={judge_dir}", *JUDGE_CUT]
  return out


def offline_data(cfg) -> list[str]:
  """Overrides that point the preset's data at what is here. A source on this machine (generated,
  or a file or folder that exists, relative to the repository) stays; GSM8K becomes the
  arithmetic set; a Hub or Kaggle dataset, or a file that is not here (/kaggle/input/...),
  becomes data/general.jsonl (the records' schema by example; a single source that the rewards
  score as math: the arithmetic set), its dataset's keys (subset, split, eval_split, revision,
  streaming, file), fields and templates back to their defaults. Held-out parts are cut to 8."""
  d = cfg.data
  if d.mixture is None:
    if here(d):
      return ["data.num_eval=8"]
    math = d.source == "gsm8k" or any(r.categories is None or "math" in r.categories
                                      for r in cfg.rewards)
    return [*(f"data.{k}={json.dumps(v)}" for k, v in _reset(d).items()),
            *(["data.source=arithmetic", "data.num_eval=8"] if math else
              ["data.source=jsonl", "data.path=data/general.jsonl", "data.num_eval=4"])]
  mix, default = [], {f.name: f.default for f in dataclasses.fields(d.mixture[0])}
  gone = from_network(d)
  for m in d.mixture:
    if m.source == "gsm8k":
      mix.append({"name": m.name, "source": "arithmetic", "weight": m.weight, "category": "math",
                  "num_eval": min(m.num_eval, 8)})
    elif m not in gone:
      mix.append({**{k: v for k, v in dataclasses.asdict(m).items() if v != default[k]},
                  "name": m.name, "source": m.source, "num_eval": min(m.num_eval, 8)})
  if gone:  # the Hub's and Kaggle's datasets need the network: the schema's example instead
    name = "general" if all(m.name != "general" for m in d.mixture) else "rehearsal-general"
    mix.append({"name": name, "source": "jsonl", "path": "data/general.jsonl",
                "weight": sum(m.weight for m in gone), "num_eval": 4})
  return [f"data.mixture={json.dumps(mix)}"]


def offline_rewards(cfg) -> list[str]:
  """Where a mixture's Hub datasets become data/general.jsonl (`offline_data`), whose code
  records carry no tests: `tests_pass`'s categories go to the judge, so that every record is
  scored (the rehearsal's shapes, not its scores; the judge reads more rows, not fewer)."""
  rewards = [dataclasses.asdict(r) for r in cfg.rewards]
  tested = [r for r in rewards if r["fn"] == "tests_pass"]
  judge = next((r for r in rewards if r["fn"] == "judge"), None)
  if cfg.data.mixture is None or not tested or judge is None or not from_network(cfg.data):
    return []
  moved = [r["categories"] for r in tested]
  judge["categories"] = None if None in moved or judge["categories"] is None else [
      *judge["categories"], *(c for cats in moved for c in cats)]
  return [f"rewards={json.dumps([r for r in rewards if r['fn'] != 'tests_pass'])}"]


def from_network(d) -> list:
  """A mixture's sources that `offline_data` replaces by data/general.jsonl: the Hub's and
  Kaggle's datasets and files not here (GSM8K becomes the arithmetic set)."""
  return [m for m in d.mixture if m.source != "gsm8k" and not here(m)]


def here(c) -> bool:
  """Whether data source `c` (data, or a mixture's) reads nothing from the network."""
  if c.source in ("arithmetic", "instructions"):
    return True
  paths = [p for p in (c.path, getattr(c, "eval_path", None)) if p is not None]
  return c.source not in ("kaggle", "gsm8k") and c.path is not None and all(
      (ROOT / p).exists() for p in paths)


def _reset(c) -> dict:
  """{key: its default} for each of c's keys that places or maps its dataset's records."""
  keep = {f.name: f.default for f in (*dataclasses.fields(Fields), *dataclasses.fields(Hub))}
  return {k: v for k, v in {**keep, "path": None, "eval_path": None}.items()
          if getattr(c, k) != v}


def own_judge(cfg) -> bool:
  uses = any(r.fn == "judge" for r in cfg.rewards)
  return uses and cfg.judge.model is not None and cfg.judge.model.source == "kaggle"


def write_checkpoint(preset: str, out: pathlib.Path, section: str) -> None:
  """Random weights of the preset's model (or its judge's, 4 layers) in the upstream layout, and
  the embedded tokenizer."""
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  from reasoner import export, mesh as mesh_lib
  from reasoner.models import gemma, gguf, kaggle

  cfg = load_config(ROOT / "configs" / f"{preset}.yaml", JUDGE_CUT if section == "judge" else [])
  m = cfg.model if section == "model" else cfg.judge.model
  mesh = mesh_lib.make_mesh(cfg.mesh)
  spec = gemma.model_spec(m)
  model = gemma.init_random(spec, mesh, 0)
  params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  with ocp.PyTreeCheckpointer() as c:
    c.save(out / (kaggle.variant(m) or m.name), export.upstream_tree(spec.family, params))
  tok = gguf.GGUFCheckpoint(gguf.embedded_gguf_path()).tokenizer()
  (out / "tokenizer.model").write_bytes(tok.model_proto)
  del model, params
  jax.clear_caches()


def phase(name: str, argv: list[str], rows: list, env: dict) -> None:
  """Runs one phase in its own process under /usr/bin/time (its peak RSS)."""
  print(f"== {name}: {' '.join(argv)}", flush=True)
  t0 = time.time()
  log = tempfile.NamedTemporaryFile("w+", suffix=".rss", delete=False)
  p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", log.name, *argv], cwd=ROOT, env=env)
  wall = time.time() - t0
  rss = int(pathlib.Path(log.name).read_text().split()[-1]) / 2**20  # KiB -> GiB
  rows.append((name, wall, rss, p.returncode))
  print(f"== {name}: {wall:.0f} s, peak RSS {rss:.2f} GiB, exit {p.returncode}", flush=True)
  if p.returncode:
    report(rows)
    sys.exit(f"rehearsal failed in phase '{name}'")


def report(rows: list) -> None:
  print(f"\n{'phase':<34}{'wall':>10}{'peak RSS':>12}{'exit':>6}")
  for name, wall, rss, code in rows:
    print(f"{name:<34}{wall:>9.0f}s{rss:>9.2f} GiB{code:>6}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("preset", help="gemma3_1b, gemma2_2b or gemma3_1b_general (configs/<preset>"
                  ".yaml)")
  ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (the mesh's size)")
  ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
  ap.add_argument("--write-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
  ap.add_argument("--section", default="model", choices=["model", "judge"], help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.write_checkpoint:
    return write_checkpoint(args.preset, pathlib.Path(args.write_checkpoint), args.section)
  work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix=f"rehearse-{args.preset}-"))
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
             JAX_PLATFORMS="cpu")
  py, cfg = sys.executable, str(ROOT / "configs" / f"{args.preset}.yaml")
  ckpt, runs, judge = work / "kaggle", work / "runs", work / "judge"
  preset = load_config(cfg)
  common = [f"model.path={ckpt}", f"train.run_dir={runs}", *cuts(preset, judge)]
  rows: list = []
  phase("write random checkpoint", [py, __file__, args.preset, "--write-checkpoint", str(ckpt)],
        rows, env)
  if own_judge(preset):
    phase("write random judge (4 layers)", [py, __file__, args.preset, "--write-checkpoint",
                                            str(judge), "--section", "judge"], rows, env)
  phase("plan (CPU devices)", [py, "-m", "reasoner", "plan", "--config", cfg, "--topology", "cpu",
                               "--no-search", *common], rows, env)
  phase("session 1: train 2 steps", [py, "-m", "reasoner", "train", "--config", cfg, *common,
                                     "train.run_name=s1"], rows, env)
  copy = work / "input" / "s1"  # the next session reads it as Kaggle mounts it: a copy, read-only
  shutil.copytree(runs / "s1", copy)
  for p in [copy, *copy.rglob("*")]:
    p.chmod(p.stat().st_mode & ~0o222)
  phase("session 2: resume, 1 more step", [py, "-m", "reasoner", "train", "--config", cfg,
                                           *common, "train.run_name=s2", "train.steps=3",
                                           f"train.resume_from={copy}"], rows, env)
  phase("export", [py, "-m", "reasoner", "export", "--config", cfg, *common,
                   "train.run_name=s2", "train.steps=3", "--out", str(work / "export")],
        rows, env)
  phase("load the export back, evaluate", [py, "-m", "reasoner", "eval", "--config", cfg,
                                           *common, f"model.path={work / 'export'}",
                                           "train.run_name=fresh"], rows, env)
  report(rows)
  if not args.dir:
    for p in [copy, *copy.rglob("*")]:
      p.chmod(p.stat().st_mode | 0o200)
    shutil.rmtree(work)


if __name__ == "__main__":
  main()
