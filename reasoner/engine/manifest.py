"""The run manifest, `run.json`: what a run was started with and what changed since, so that a
run's directory says how each of its steps was trained.

Written at a run's first start: the model, the LoRA settings, the optimizer, the data (its source
and a fingerprint of the records), the package versions, and the whole config. A later start (the
same run again, or a new run that continues another's weights through `train.resume_from`, which
carries that run's manifest over) compares its settings with the ones in effect. A key that
changes what a checkpoint holds stops the start before anything is loaded, one line per key;
any other change is allowed, printed, and appended to `history` with the step it takes effect at.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import pathlib
from typing import Any, Callable

from reasoner.config import Config, ConfigError

NAME = "run.json"
# What a checkpoint holds (the LoRA's shapes and what its weights mean) depends on these.
FIXED = ("model.name", "model.layers", "model.tiny_layers", "model.tiny_embed_dim",
         "model.tiny_hidden_dim", "model.tiny_heads", "model.tiny_kv_heads",
         "model.tiny_head_dim", "model.tiny_vocab",
         "lora.rank", "lora.alpha", "lora.module_path")
# Where and for how long this session runs, and where it logs: not settings of the run.
SESSION = ("train.deadline", "train.resume_from", "train.run_dir", "train.run_name",
           "train.loggers", "train.compile_cache", "lora.init_from")
STAGE_NAMES = {"grpo": "a GRPO", "sft": "an SFT", "prefer": "a preference",
               "distill": "a distillation"}
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "qwix", "google-tunix",
            "reasoner")


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
  """{'lora.rank': 4, ...}: nested dicts to dotted keys (lists stay values)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def read(run: pathlib.Path) -> dict | None:
  """The manifest of a run directory; for a run from before manifests, one made of its
  config.json; None when neither exists (a bare checkpoints folder)."""
  for name in (NAME, "config.json"):
    p = pathlib.Path(run) / name
    if p.is_file():
      m = json.loads(p.read_text())
      return m if name == NAME else {"config": m, "history": []}
  return None


def in_effect(m: dict) -> dict[str, Any]:
  """The settings in effect after the manifest's history: {dotted key: value}."""
  now = {**flat(m["config"]), **{f"versions.{k}": v for k, v in m.get("versions", {}).items()}}
  if "data" in m:
    now["data.fingerprint"] = m["data"]["fingerprint"]
  for entry in m.get("history", []):
    now.update({k: new for k, (_, new) in entry.get("changes", {}).items()})
  return now


def check(cfg: Config, run: pathlib.Path, stage: str | None = None, via: str | None = None
          ) -> None:
  """Raises ConfigError, one line per key, when `cfg` changes what `run`'s checkpoints hold, or
  when `run` is another stage's (an SFT run continued as GRPO); `via`: the config key that
  points at `run` (train.resume_from, lora.init_from, distill.teacher_lora) when it is not
  this run's directory."""
  m = read(run)
  if m is None:
    return
  was = m.get("stage", "grpo")
  if stage is not None and was != stage:
    raise ConfigError(f"run {run} is {STAGE_NAMES.get(was, was)} run, and this is "
                      f"{STAGE_NAMES.get(stage, stage)} run: start it under a new "
                      f"train.run_name with lora.init_from={run}")
  old, new = in_effect(m), flat(_plain(cfg))
  lines = []
  for key in FIXED:
    if key in old and old[key] != new[key]:
      if via:
        lines.append(f"config key '{key}' = {new[key]!r}: the run in {via} ({run}) was trained "
                     f"with {old[key]!r}; set it back to use its weights")
      else:
        lines.append(f"config key '{key}' = {new[key]!r}: run {run} was trained with "
                     f"{old[key]!r}; set it back to continue it (or to branch off its weights: "
                     f"train.run_name=<new> train.resume_from={run}), or start afresh under a "
                     f"new train.run_name")
  if lines:
    raise ConfigError("\n".join(lines))


def record(cfg: Config, run: pathlib.Path, step: int, records: list[dict],
           origin: pathlib.Path | None = None, log: Callable[[str], None] = print,
           stage: str = "grpo") -> dict:
  """Writes or updates `run`/run.json at the start of a session that begins at `step` (origin:
  the run it continues through train.resume_from) and returns it. Changed settings are printed
  in one line and appended to its history."""
  path = pathlib.Path(run) / NAME
  m = read(run) if path.is_file() else None
  if m is None and origin is not None:
    m = copy.deepcopy(read(origin))
  fresh = {**_fresh(cfg, records), "stage": stage}
  if m is None:
    m = fresh
  elif "versions" not in m:  # made of an old run's config.json: this start's summary, its config
    m = {**fresh, "config": m["config"], "history": m["history"]}
  old, new = in_effect(m), in_effect(fresh)
  changes = {k: [old[k], v] for k, v in new.items()  # keys the old run had (not newer options)
             if k in old and k not in SESSION and k not in FIXED and old[k] != v}
  entry = {"step": step, "changes": changes}
  if origin is not None and not path.is_file():
    entry["continued_from"] = str(origin)
  if changes or "continued_from" in entry:
    m.setdefault("history", []).append(entry)
  if changes:
    log(f"settings changed at step {step} (recorded in {path}): " + "; ".join(
        f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
  _write(path, m)
  return m


def _plain(cfg: Config) -> dict:
  """The config as it reads back from JSON (tuples as lists)."""
  return json.loads(json.dumps(cfg.to_dict(), default=str))


def _fresh(cfg: Config, records: list[dict]) -> dict:
  c = _plain(cfg)
  text = json.dumps(records, sort_keys=True, ensure_ascii=False).encode()
  return {"model": c["model"], "lora": c["lora"], "optim": c["optim"],
          "data": {"source": c["data"]["source"], "path": c["data"]["path"],
                   "records": len(records),
                   "fingerprint": hashlib.sha256(text).hexdigest()[:16]},
          "versions": {p: _version(p) for p in PACKAGES}, "config": c, "history": []}


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _write(path: pathlib.Path, m: dict) -> None:
  """Whole or not at all: a temporary file renamed over the old one."""
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(m, indent=1, default=str) + "\n")
  os.replace(tmp, path)
