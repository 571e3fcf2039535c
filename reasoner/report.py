"""`python -m reasoner report RUN`: a run's write-up, from its own files only, in RUN/report/:
report.md and its plots (PNG).

What it reads: metrics.jsonl (a row a training step, and the evaluations' rows `eval/<metric>`
and `eval/<set>/<metric>` at the step they ran at), samples.jsonl (the evaluations' completions,
tagged eval-before, eval-after, eval-step-<n>, eval-<set>-...), eval.json (the held-out figures
before and after training, with standard errors, the judge's win rate and the paired "changes"),
run.json (the stage, the config and `lora.init_from`, the earlier run this one started from,
whose own folder gives the earlier stage's figures) and the checkpoints folder. A step logged
twice (a resumed run's) appears once: its last training row wins. Runs keep no plan: a
`plan.txt` saved in the run folder (`python -m reasoner plan ... > RUN/plan.txt`) is quoted.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

from reasoner.data.files import read_jsonl
from reasoner.engine import manifest
from reasoner.errors import DataError

STAGES = {"grpo": "GRPO", "sft": "SFT", "prefer": "preference", "distill": "distillation"}
# the figures a result holds that are not before/after table rows of their own
_NOT_ROWS = ("n", "seconds", "sets", "win_rate", "win_rate_n")


def _reward(k: str) -> bool:
  return k.startswith("reward/") and k.count("/") == 1 and k != "reward/std"


def _category(k: str) -> bool:  # reward/<fn>/<category>, not a reward's timeouts
  return k.startswith("reward/") and k.count("/") >= 2 and not k.endswith("/timeouts")


# (file, title, y label, which series it draws)
PLOTS = (
    ("reward.png", "Rollout reward", "reward", _reward),
    ("reward_by_category.png", "Rollout reward by category", "reward", _category),
    ("completion_length.png", "Completion length", "tokens",
     lambda k: k in ("completion_length", "completion_length/stopped")),
    ("kl.png", "KL to the reference", "KL (token mean)",
     lambda k: k in ("kl", "distill/reverse_kl")),
    ("entropy.png", "Entropy", "nats a token", lambda k: k == "entropy"),
    ("clip_fraction.png", "Clip fraction", "share of tokens clipped",
     lambda k: k == "clip_fraction"),
    ("loss.png", "Training loss", "loss", lambda k: k == "loss"),
    ("held_out.png", "Held-out evaluations", "figure (0-1)",
     lambda k: k in ("eval/mean_reward", "eval/accuracy")),
)


def read_rows(path: pathlib.Path) -> list[dict]:
  """The rows of a run's JSONL log ([] where there is none): a last row a kill cut short is
  dropped, any other line that is not a JSON object is one line."""
  return read_jsonl(path, torn_tail_ok=True) if path.is_file() else []


def by_step(rows: list[dict]) -> tuple[dict[int, dict], dict[int, dict]]:
  """({step: its training row}, {step: its evaluations' figures}): a step's last training row
  wins (a resumed run's step logged twice); evaluation rows of a step (one a set) merge."""
  train, evals = {}, {}
  for r in rows:
    keys = [k for k in r if k != "step"]
    if keys and all(k.startswith("eval/") for k in keys):
      evals.setdefault(r["step"], {}).update(r)
    elif keys:
      train[r["step"]] = r
  return train, evals


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
  """{metric: [(step, value)] by step, each step once}: metrics.jsonl's numbers."""
  out: dict[str, list] = {}
  for table in by_step(rows):
    for step in sorted(table):
      for k, v in table[step].items():
        if k != "step" and _number(v):
          out.setdefault(k, []).append((step, float(v)))
  return out


def plot_data(run_dir) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{plot file: {series: [(step, value)]}}: what each plot draws, for the plots whose
  metrics the run logged."""
  return plots(read_rows(pathlib.Path(run_dir) / "metrics.jsonl"))


def plots(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """`plot_data` from the rows of metrics.jsonl, already read."""
  found = series(rows)
  out = {}
  for name, _, _, wanted in PLOTS:
    lines = {k: v for k, v in sorted(found.items()) if wanted(k)}
    if lines:
      out[name] = lines
  return out


def draw(data: dict[str, dict[str, list]], out: pathlib.Path) -> list[tuple[str, str]]:
  """Writes each plot of `data` (`plot_data`'s) into `out`: [(file, title)]."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  made = []
  for name, title, ylabel, _ in PLOTS:
    if name not in data:
      continue
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in data[name].items():
      steps, values = zip(*points)
      ax.plot(steps, values, "o-" if len(steps) <= 40 else "-", ms=3, label=label)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    made.append((name, title))
  return made


def report(run_dir) -> pathlib.Path:
  """Writes RUN/report/ (report.md and its plots) and returns report.md's path."""
  run = pathlib.Path(run_dir)
  if not run.is_dir():
    raise DataError(f"{run}: no such run folder")
  if not (run / "metrics.jsonl").is_file():
    raise DataError(f"{run}: not a run folder (no metrics.jsonl: a run writes it at its first "
                    "step or evaluation)")
  out = run / "report"
  out.mkdir(exist_ok=True)
  rows = read_rows(run / "metrics.jsonl")
  made = draw(plots(rows), out)
  results = _read_json(run / "eval.json")
  samples = _by_tag(read_rows(run / "samples.jsonl"))
  parts = [_header(run, rows), _before_after(results, samples), _curves(made),
           _completions(samples), _plan_and_time(run, rows, results), _stages(run)]
  path = out / "report.md"
  path.write_text("\n\n".join(p for p in parts if p) + "\n")
  return path


def main(run_dir) -> pathlib.Path:
  """`python -m reasoner report RUN`: writes the report and prints report.md's path."""
  path = report(run_dir)
  print(path)
  return path


def _header(run: pathlib.Path, rows: list[dict]) -> str:
  m = manifest.read(run) or {}
  cfg = m.get("config", {})
  stage = STAGES.get(m.get("stage", "grpo"), m.get("stage"))
  train, _ = by_step(rows)
  total = cfg.get("train", {}).get("steps")
  what = f"{'An' if stage == 'SFT' else 'A'} {stage} run"
  if cfg.get("model"):
    what += f" of {cfg['model']['name']}"
  if train:
    what += f", {len(train)} steps logged ({min(train)}-{max(train)}"
    what += f" of {total})." if total else ")."
  else:
    what += ", no training step logged."
  lines = [f"# Run {run.name}", "", what]
  ckpts = _checkpoints(run)
  lines.append(f"Newest checkpoint: step {ckpts[-1]} ({run / 'checkpoints' / str(ckpts[-1])})."
               if ckpts else "No checkpoint in the run folder.")
  for h in m.get("history", []):
    if "continued_from" in h:
      lines.append(f"Continued at step {h['step']} from {h['continued_from']} "
                   "(train.resume_from; its logs carried over).")
  return "\n".join(lines)


def _before_after(results: dict, samples: dict[str, list]) -> str:
  before, after = results.get("before", {}), results.get("after", {})
  if not before and not after:
    return "## Held-out before and after\n\nNo eval.json: the run was not evaluated."
  lines = ["## Held-out before and after", "",
           f"Greedy decoding on {after.get('n', before.get('n', '?'))} held-out questions "
           "(+/- one standard error).", "", "| figure | before | after |", "|---|---|---|"]
  keys = [k for k in {**before, **after} if k not in _NOT_ROWS and not k.endswith("_se")
          and "/" not in k.replace("ifeval/", "") and (_number(before.get(k)) or
                                                       _number(after.get(k)))]
  for k in keys:
    lines.append(f"| {k.replace('_', ' ')} | {_fmt(before, k)} | {_fmt(after, k)} |")
  changes = results.get("changes", {})
  if changes:
    lines += ["", "Paired by question (the change's standard error is that of the per-question "
              "differences):", "", "| set | figure | questions | before | after | change |",
              "|---|---|---|---|---|---|"]
    for name, c in changes.items():
      fell = " (fell beyond noise)" if c.get("fell") else ""
      lines.append(f"| {name} | {c['metric'].replace('_', ' ')} | {c['n']} | "
                   f"{c['before']:.3f} | {c['after']:.3f} | {_pm(c['change'], c['se'])}{fell} |")
  lines += _categories(before, after, samples)
  if _number(after.get("win_rate")):
    cats = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in after.items()
                     if k.startswith("win_rate/"))
    lines += ["", f"The judge's win rate against the model before training (both orders, "
              f"{after.get('win_rate_n', '?')} questions): **{after['win_rate']:.3f}**" +
              (f"; by category: {cats}." if cats else ".")]
  return "\n".join(lines)


def _categories(before: dict, after: dict, samples: dict[str, list]) -> list[str]:
  """The mean reward by category, before and after, with each category's paired change from
  the evaluations' completions where samples.jsonl holds them."""
  cats = sorted({k.split("/", 1)[1] for k in {**before, **after} if k.startswith("mean_reward/")})
  if not cats:
    return []
  pairs = _pairs(samples)
  lines = ["", "Mean reward by category:", "",
           "| category | before | after | change (paired) |", "|---|---|---|---|"]
  for c in cats:
    diffs = [a["reward"] - b["reward"] for b, a in pairs if b.get("category") == c]
    change = (f"{_pm(_mean(diffs), _se(diffs))} ({len(diffs)} questions)" if diffs else "")
    lines.append(f"| {c} | {_fmt(before, 'mean_reward/' + c)} | "
                 f"{_fmt(after, 'mean_reward/' + c)} | {change} |")
  return lines


def _curves(made: list[tuple[str, str]]) -> str:
  if not made:
    return "## Training curves\n\nNo metric to plot was logged."
  lines = ["## Training curves"]
  for name, title in made:
    lines += ["", f"![{title}]({name})"]
  plotted = {n for n, _ in made}
  missing = [t if t.startswith("KL") else t.lower() for n, t, _, _ in PLOTS if n not in plotted]
  if missing:
    lines += ["", f"Not logged by this run: {', '.join(missing)}."]
  return "\n".join(lines)


def _completions(samples: dict[str, list], few: int = 3, limit: int = 1200) -> str:
  """A few held-out questions' completions before and after training (those whose reward
  moved most)."""
  pairs = _pairs(samples)
  lines = ["## Completions before and after"]
  if not pairs:
    return "\n".join(lines + ["", "No held-out completions both before and after training in "
                              "samples.jsonl."])
  pairs = sorted(pairs, key=lambda p: -abs(p[1]["reward"] - p[0]["reward"]))[:few]
  lines += ["", f"The {len(pairs)} held-out questions whose reward moved most (of "
            f"{len(_pairs(samples))} in both evaluations), greedy decoding:"]
  for b, a in pairs:
    lines += ["", f"### {_cut(b['question'], 300)}"]
    if b.get("answer") is not None:
      lines += ["", f"Reference answer: {_cut(b['answer'], 300)}"]
    for when, r in (("Before", b), ("After", a)):
      lines += ["", f"{when} (reward {r['reward']:.2f}):", "", _block(_cut(r["completion"], limit))]
  return "\n".join(lines)


def _plan_and_time(run: pathlib.Path, rows: list[dict], results: dict) -> str:
  lines = ["## Plan and time", ""]
  plan = run / "plan.txt"
  lines += ([f"The plan saved with the run ({plan.name}):", "", _block(plan.read_text().strip())]
            if plan.is_file() else
            ["No plan was saved with this run (`python -m reasoner plan` prints one; a run keeps "
             "none)."])
  train, _ = by_step(rows)
  times = [r["step_time_s"] for r in train.values() if _number(r.get("step_time_s"))]
  if times:
    lines += ["", f"Training steps: {_hours(sum(times))} of wall time over {len(times)} steps "
              f"(the steps' step_time_s; loading, saving and evaluations not counted)."]
  evals = [f"{w} {_hours(results[w]['seconds'])}" for w in ("before", "after")
           if _number(results.get(w, {}).get("seconds"))]
  if evals:
    lines += ["", f"Held-out evaluation: {', '.join(evals)}."]
  return "\n".join(lines)


def _stages(run: pathlib.Path, most: int = 8) -> str:
  """The stages this run came from, earliest first, through `lora.init_from`."""
  chain, seen, note = [], set(), ""
  here: pathlib.Path | None = run
  while here is not None and len(chain) < most:
    if here.resolve() in seen:
      note = f"{here}: already in the chain (lora.init_from loops)"
      break
    seen.add(here.resolve())
    m = manifest.read(here) or {}
    chain.append((here, m))
    source = m.get("config", {}).get("lora", {}).get("init_from") or m.get("lora", {}).get(
        "init_from")
    here = _run_of(source, here) if source else None
    if source and here is None:
      note = f"lora.init_from = {source}: that run folder is not on this machine"
  lines = ["## Stages", ""]
  if note:
    lines += [f"Earliest found; before it: {note}.", ""]
  for i, (path, m) in enumerate(reversed(chain), 1):
    stage = STAGES.get(m.get("stage", "grpo"), m.get("stage"))
    this = " (this run)" if path == run else ""
    lines.append(f"{i}. {stage}: {path}{this}: {_held_out(_read_json(path / 'eval.json'))}")
  return "\n".join(lines)


def _held_out(results: dict) -> str:
  """One stage's held-out figures, in a line."""
  b, a = results.get("before", {}), results.get("after", {})
  if not b and not a:
    return "not evaluated (no eval.json)"
  key = "accuracy" if _number(a.get("accuracy", b.get("accuracy"))) else "mean_reward"
  text = f"held-out {key.replace('_', ' ')} {_fmt(b, key)} -> {_fmt(a, key)}"
  c = results.get("changes", {}).get("held-out")
  if c:
    text += (f" (paired {c['metric'].replace('_', ' ')} {_pm(c['change'], c['se'])} SE, "
             f"{c['n']} questions)")
  if _number(a.get("win_rate")):
    text += f"; the judge's win rate {a['win_rate']:.3f}"
  return text


def _run_of(value: str, near: pathlib.Path) -> pathlib.Path | None:
  """The run folder `lora.init_from` = `value` names (a run folder, its checkpoints folder or
  a folder holding one run), as given or beside `near` (relative paths, copied runs)."""
  p = pathlib.Path(value).expanduser()
  for cand in ([p] if p.is_absolute() else [p, near.parent / p, near.parent / p.name]):
    for d in (cand, cand.parent if cand.name == "checkpoints" else None):
      if d is not None and any((d / f).is_file() for f in ("run.json", "metrics.jsonl")):
        return d
    found = sorted({f.parent for pat in ("*/run.json", "*/*/run.json") for f in cand.glob(pat)}
                   ) if cand.is_dir() else []
    if len(found) == 1:
      return found[0]
  return None


def _pairs(samples: dict[str, list]) -> list[tuple[dict, dict]]:
  """The held-out completions before and after training (the latest evaluation: eval-after,
  else the last eval-step-<n>), paired by question."""
  steps = sorted((int(t.rsplit("-", 1)[1]), t) for t in samples if re.fullmatch(
      r"eval-step-\d+", t))
  tag = "eval-after" if "eval-after" in samples else (steps[-1][1] if steps else None)
  if tag is None or "eval-before" not in samples:
    return []
  theirs = {r["question"]: r for r in samples["eval-before"]}
  return [(theirs[r["question"]], r) for r in samples[tag] if r.get("question") in theirs
          and _number(r.get("reward")) and _number(theirs[r["question"]].get("reward"))]


def _by_tag(rows: list[dict]) -> dict[str, list[dict]]:
  out: dict[str, list] = {}
  for r in rows:
    if str(r.get("tag", "")).startswith("eval-"):
      out.setdefault(r["tag"], []).append(r)
  return out


def _read_json(path: pathlib.Path) -> dict:
  if not path.is_file():
    return {}
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None


def _checkpoints(run: pathlib.Path) -> list[int]:
  folder = run / "checkpoints"
  return sorted(int(c.name) for c in folder.iterdir() if c.name.isdigit()) if (
      folder.is_dir()) else []


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(v: list[float]) -> float:
  return sum(v) / len(v)


def _se(v: list[float]) -> float:
  """The standard error of the mean (sample std / sqrt(n)); NaN below two values."""
  if len(v) < 2:
    return math.nan
  m = _mean(v)
  return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v))


def _pm(value: float, se: float) -> str:
  return f"{value:+.3f} +/- {se:.3f}" if _number(se) else f"{value:+.3f}"


def _fmt(result: dict, key: str) -> str:
  """'0.512 +/- 0.031' (its standard error where the result has one), '-' where none."""
  v, se = result.get(key), result.get(key + "_se")
  if not _number(v):
    return "-"
  return f"{v:.3f} +/- {se:.3f}" if _number(se) else f"{v:.3f}"


def _hours(seconds: float) -> str:
  return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def _cut(text, limit: int) -> str:
  text = str(text)
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _block(text: str) -> str:
  """`text` fenced, the fence longer than any run of backticks in it."""
  fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
  return f"{fence}\n{text}\n{fence}"
