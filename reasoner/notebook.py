"""What the Kaggle notebook's cells call (notebooks/grpo_kaggle.py): each cell is one of these.

Kaggle is detected, not assumed (`session.on_kaggle`): there, runs are written under
/kaggle/working (the inputs under /kaggle/input are read-only) and the session's deadline
defaults to 8h30m from the kernel's start, half an hour inside Kaggle's 9 hours for the cells
after training. Elsewhere the same notebook runs as it is, with neither default.

The cells that train, plan and export import what they run when they run (`Run`, the planner,
`export`): jax and the model code load only once a config has been read and printed, so that a
bad config in the parameters cell is one line, as on the command line.
"""

from __future__ import annotations

import pathlib
import time

from reasoner.engine import session
from reasoner.config import Config, load_config
from reasoner.config.loop import parse_deadline
from reasoner.data.files import read_jsonl

KAGGLE_DEADLINE = "8h30m"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def configure(config: str, overrides: list[str]) -> Config:
  """The preset (a path from here or from the repository) with the overrides and, on Kaggle,
  the run directory and deadline defaults; prints what will run."""
  path = _path(config)
  keys = {o.split("=", 1)[0].strip() for o in overrides}
  extra = []
  if session.on_kaggle():
    extra += [] if "train.run_dir" in keys else [f"train.run_dir={session.writable_root()}/runs"]
    extra += [] if "train.deadline" in keys else [f"train.deadline={KAGGLE_DEADLINE}"]
  cfg = load_config(path, [*overrides, *extra])
  r, t = cfg.rollout, cfg.train
  print(f"{cfg.model.name} ({cfg.model.source}, {cfg.model.dtype}, remat {cfg.model.remat}), "
        f"LoRA rank {cfg.lora.rank}; data {cfg.data.source} ({cfg.data.template} prompts); "
        f"{t.steps} steps of {t.batch_size} prompts x G = {r.num_generations}, up to "
        f"{r.max_new_tokens} new tokens; run {cfg.run_path}"
        + (f"; deadline {t.deadline}" if t.deadline else "")
        + ("; on Kaggle" if session.on_kaggle() else ""))
  return cfg


def stage(config: str, overrides: list[str], name: str, extra: list[str] | None) -> list[str]:
  """With `extra` (stage `name`'s overrides on top of `overrides`; None: no such stage), runs
  that stage (sft, prefer) to the end under run name <run_name>-<name> and returns the next
  stage's overrides, which start from its LoRA (`lora.init_from`); its model is freed before the
  next stage loads its own."""
  if extra is None:
    return list(overrides)
  import gc

  from reasoner.loop import Run  # jax only once a cell trains (the module's docstring)

  run_name = load_config(_path(config), list(overrides)).train.run_name
  cfg = configure(config, [*overrides, f"train.run_name={run_name}-{name}", *extra])
  run = Run(cfg, command="re-run this notebook", stage=name)
  if cfg.train.eval_before:
    run.evaluate_before()
  run.train()
  run.evaluate_after()
  run.close()
  del run
  gc.collect()
  return [*[o for o in overrides if not o.startswith("lora.init_from=")],
          f"lora.init_from={cfg.run_path}"]


def _path(config: str) -> pathlib.Path:
  path = pathlib.Path(config)
  return ROOT / config if not path.is_file() and (ROOT / config).is_file() else path


def show_plan(cfg: Config) -> dict:
  """Per-chip HBM and FLOPs of the train and rollout steps, compiled for this machine's chips
  (v5e limits on a CPU), and how many steps the session's time holds at that estimate."""
  import jax

  from reasoner.planner import plan, report  # jax only once a cell plans

  topology = "v5e:2x4" if jax.default_backend() == "tpu" else "cpu"
  plan_report = plan.plan(cfg, topology, search=False)
  print(report.format_report(plan_report))
  step_s = plan.step_seconds(plan_report)
  deadline = cfg.train.deadline and parse_deadline(cfg.train.deadline)
  if deadline:
    left = deadline - time.time()
    fit = int(left // step_s) if step_s > 0 else cfg.train.steps
    print(f"estimated step {step_s:.3g} s (a lower bound); {session.duration(left)} "
          f"left in this session hold at most {fit} steps; train.steps = {cfg.train.steps} "
          "(the deadline stops the loop in time whatever the estimate)")
  else:
    print(f"estimated step {step_s:.3g} s (a lower bound); no deadline set")
  return plan_report


def table(rows: list[dict], n: int = 4):
  """A few evaluation rows as a table (question, reference answer, completion, reward)."""
  import pandas as pd

  return pd.DataFrame([{"question": r["question"], "reference": r["answer"],
                        "completion": r["completion"], "reward": round(r["reward"], 2)}
                       for r in rows[:n]])


def eval_rows(run_path: pathlib.Path, tag: str) -> list[dict]:
  """The rows of the latest evaluation tagged `tag` ('before', 'after', 'step-N') in the run."""
  p = pathlib.Path(run_path) / "samples.jsonl"
  rows = read_jsonl(p, torn_tail_ok=True) if p.is_file() else []
  rows = [r for r in rows if r["tag"] == f"eval-{tag}"]
  last = max((r["step"] for r in rows), default=None)
  return [r for r in rows if r["step"] == last]


def compare(run, n: int = 6):
  """Before / after: mean reward, accuracy and format rate, and the first `n` held-out questions
  with both completions side by side."""
  import pandas as pd

  after_tag = f"step-{run.step}" if run.stopped else "after"
  before, after = eval_rows(run.path, "before"), eval_rows(run.path, after_tag)
  summary = pd.DataFrame({k: {m: run.results[k][m] for m in ("mean_reward", "accuracy",
                                                              "format_rate")}
                          for k in ("before", "after") if k in run.results}).T
  by_q = {r["question"]: r for r in after}
  pairs = pd.DataFrame([{"question": b["question"], "reference": b["answer"],
                         "before": b["completion"], "reward before": round(b["reward"], 2),
                         "after": by_q[b["question"]]["completion"],
                         "reward after": round(by_q[b["question"]]["reward"], 2)}
                        for b in before[:n] if b["question"] in by_q])
  return summary, pairs


def changes(results: dict):
  """Each evaluation set's paired change from before training (eval.json's "changes"): the
  metric, before, after, the change with its standard error, the problems, and whether a
  retention set fell beyond noise; None before the evaluation after training."""
  import pandas as pd

  found = results.get("changes")
  if not found:
    print("no paired changes: evaluate before and after training (train.eval_before: true)")
    return None
  return pd.DataFrame({name: {"metric": c["metric"], "before": round(c["before"], 3),
                              "after": round(c["after"], 3), "change": round(c["change"], 3),
                              "SE": round(c["se"], 3), "n": c["n"], "fell": c.get("fell", False)}
                       for name, c in found.items()}).T


def by_category(results: dict):
  """Per category (where the held-out records have two or more): the mean reward before and
  after training (the judge's rubric scores where the judge scores the category) and the
  judge's win rate of the model after against the model before; then, for each evaluation set
  whose records carry checkable instructions, IFEval's prompt- and instruction-level strict
  accuracy before and after. None where there is neither."""
  import pandas as pd

  before, after = results.get("before", {}), results.get("after", {})
  cats = sorted({k.split("/", 1)[1] for r in (before, after) for k in r
                 if k.startswith("mean_reward/")})
  row = lambda b, a, key, win=None: {"before": b.get(key), "after": a.get(key),
                                     "win rate": a.get(win) if win else None}
  table = {c: row(before, after, f"mean_reward/{c}", f"win_rate/{c}") for c in cats}
  if cats:
    table["all"] = row(before, after, "mean_reward", "win_rate")
  sets = {"held-out": (before, after), **{
      name: (before.get("sets", {}).get(name, {}), r)
      for name, r in after.get("sets", {}).items()}}
  for name, (b, a) in sets.items():
    for level in ("prompt", "instruction"):
      key = f"ifeval/{level}_level_strict"
      if key in a or key in b:
        table[f"{name}: instructions followed ({level}-level, strict)"] = row(b, a, key)
  if not table:
    print("the held-out records have no categories (or one) and no checkable instructions: "
          "no table by category")
    return None
  return pd.DataFrame(table).T


def show_plot(path: pathlib.Path | None):
  """reward.png inline (IPython), or its path where there is no display."""
  if path is None or not pathlib.Path(path).is_file():
    print("no reward plot: no step was logged")
    return None
  from IPython.display import Image

  return Image(filename=str(path))


def export(run, formats: tuple[str, ...] = ("orbax",)) -> pathlib.Path:
  """The run's latest checkpoint merged into the base as <run>/export-step-<N> (a Kaggle Flax
  folder: upload it as a Kaggle model, or load it with Tunix); kept if already written."""
  from reasoner import export as export_lib  # jax only once a cell exports

  out = run.path / f"export-step-{run.step}"
  if (out / "export.json").is_file():
    print(f"{out} already holds the export of step {run.step}")
    return out
  return export_lib.export(run.cfg, out, run.step, ("orbax", *formats), setup=run.setup)
