"""Learning beyond arithmetic: `make general`'s run (the base model's own right answers to 512
arithmetic problems, then SFT on the generated instructions beside them,
configs/embedded_general_sft.yaml) beside SFT on the own answers alone, GRPO alone (the mixture
of configs/embedded_general.yaml: arithmetic, instructions and data/general.jsonl) and GRPO after
`make general`'s SFT.

    make bench BENCH=general        (python -m bench general; about 1.5 hours on 2 cores: the
                                     general run 25 min, arithmetic alone 20, GRPO alone 25 to
                                     30, SFT -> GRPO 20)

Each stage of a run is its own process (`python -m reasoner`, or tools/own_answers.py). The
first run is `make general` itself, its evaluations included, so its wall time is `make
general`'s and its "before" rows (samples.jsonl) are the base model's on every set. The other
runs evaluate once after (GRPO alone before too), on the same sets:
- `combination` (128): instructions in constraint combinations never trained on, on training's
  tasks; `task` (128): tasks never trained on, under training's combinations. Accuracy here is
  IFEval's prompt-level strict: a prompt counts when its answer follows every constraint;
- `arithmetic` (256): problems in the wordings held out of training;
- `retention` (256): data/retention.jsonl, what the base model could already do.
Changes are paired by question (the standard error of the per-question differences). Each run
also gives, on the instruction sets, the fraction of a prompt's constraints its answer follows
(`followed`: the `instructions` reward, paired by prompt) and the pass counts by kind
(`by_kind`): what moves where the prompt-level figure, which needs every constraint, does not.

Runs (`RUNS`): `general` (`make general`); `arithmetic` (its SFT on the own answers alone: what
the instructions cost the arithmetic); `grpo` (GRPO alone, configs/embedded_general.yaml, 16
steps); `sft_grpo` (that GRPO from the general run's LoRA). Asked for by name only: `seed1`,
`arithmetic_seed1` (the SFTs from another train.seed: training's own noise, which no paired
standard error holds); and GRPO variants, each beside `grpo`: `grpo_arithmetic` (the arithmetic
alone in the mixture), `grpo_seed1`, `explore`, `explore_seed1` (instructions weighted 3 : 1 :
1, samples at temperature 1.0, learning rate 3e-5, from two seeds), `long` (explore for 64
steps, evaluated at step 32 too, `at_32`), `guided` (`grpo.guidance` on the instructions: a
group none of whose samples follows everything trains on the generator's response in place of
its worst sample) and `prefer_grpo` (DPO on the generator's pairs, then GRPO from its LoRA; its
GRPO stage evaluates before it trains: `prefer_alone`). `GENERAL_RUNS=general` runs a subset;
`GENERAL_DIR` keeps the runs (default: a temporary folder); `GENERAL_ARGS="train.steps=2 ..."`
adds overrides to every stage (a quick look, not a figure).

Goals (issue 54): the general run's prompt-level strict accuracy on new combinations up by at
least 0.10 and 2 standard errors; its arithmetic within 2 standard errors of the arithmetic-only
run (paired; with `seed1` and `arithmetic_seed1` run too, also each side the mean of its two
seeds, question by question: training's own noise, which one run's paired error does not
hold, docs/general.md); its retention change within 1 standard error of zero, or positive;
`make general` at most 25 minutes on 2 cores (its `.venv` made). SFT -> GRPO against GRPO
alone is reported (`sft_grpo_vs_grpo`), not a goal.

The floor (`floor`): the FLOPs that the general run's matmuls must run, counted from the tokens
it actually read and wrote, over this machine's own float32 matmul rate (measured in the same
process): what no program could beat here, beside the 25 minutes asked.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

import yaml

from bench import common

CONFIG = "configs/embedded_general.yaml"  # the GRPO mixture; the evaluation sets of every run
SFT_CONFIG = "configs/embedded_general_sft.yaml"  # `make general`'s SFT: every `sft` stage's
SETS = ("combination", "task", "arithmetic", "retention")
AFTER_ONLY = ["train.eval_before=false", "train.checkpoint_every=1000"]  # evaluated once, after
ARITHMETIC = "[{name: arithmetic, source: arithmetic, weight: 1, num_eval: 8}]"
# the base model's own right answers to 512 arithmetic problems (tools/own_answers.py, as `make
# general` runs it): greedy, so every run's are the same file, `{own}`
OWN = ["--category", "math", "--num", "512", "--max-new-tokens", "40"]
ATTENTION = "lora.module_path=.*(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum)"
# DPO on the generator's pairs (each instruction record's response against one that breaks
# exactly one of its constraints; arithmetic's worked solution against the wrong operation)
PREFER = ["prefer.loss=dpo", "prefer.beta=0.1", "prefer.pairs=file",
          "prefer.max_response_tokens=96", "optim.learning_rate=5e-5", "optim.warmup_steps=2",
          "train.steps=32", "train.batch_size=8", "train.eval_before=false", "eval.sets=[]",
          "data.mixture=[{name: arithmetic, source: arithmetic, weight: 1, num_eval: 2}, "
          "{name: instructions, source: instructions, weight: 1, num_eval: 2}]"]
EXPLORE = ["data.mixture=[{name: arithmetic, source: arithmetic, weight: 1, num_eval: 8}, "
           "{name: instructions, source: instructions, weight: 3, num_eval: 8}, "
           "{name: general, source: jsonl, path: data/general.jsonl, weight: 1, num_eval: 4}]",
           "rollout.temperature=1.0", "optim.learning_rate=3e-5"]
OWN_ALONE = ("data.mixture=[{name: arithmetic, source: jsonl, path: '{own}', weight: 1, "
             "num_eval: 2}]")
# each run's stages: (command, overrides); `{prev}` is the stage before's folder, `{own}` the
# own answers, `{general}` the general run's folder
RUNS = {"general": [("own_answers", OWN), ("sft", [])],
        "arithmetic": [("own_answers", OWN), ("sft", [*AFTER_ONLY, OWN_ALONE])],
        "arithmetic_seed1": [("own_answers", OWN), ("sft", [*AFTER_ONLY, OWN_ALONE,
                                                            "train.seed=1"])],
        "seed1": [("own_answers", OWN), ("sft", [*AFTER_ONLY, "train.seed=1"])],
        "grpo": [("train", [])],
        "sft_grpo": [("train", [*AFTER_ONLY, "lora.init_from={general}", ATTENTION])],
        "grpo_arithmetic": [("train", [*AFTER_ONLY, f"data.mixture={ARITHMETIC}"])],
        "prefer_grpo": [("prefer", PREFER), ("train", ["train.checkpoint_every=1000",
                                                       "lora.init_from={prev}"])],
        "grpo_seed1": [("train", [*AFTER_ONLY, "train.seed=1"])],
        "explore": [("train", [*AFTER_ONLY, *EXPLORE])],
        "explore_seed1": [("train", [*AFTER_ONLY, *EXPLORE, "train.seed=1"])],
        "long": [("train", [*AFTER_ONLY, *EXPLORE, "train.steps=64", "train.eval_every=32"])],
        "guided": [("train", [*AFTER_ONLY, "grpo.guidance=true",
                              "grpo.guidance_categories=[instructions]"])]}
DEFAULT = ("general", "arithmetic", "grpo", "sft_grpo")  # `make bench BENCH=general`'s runs
GRPO_RUNS = ("grpo_seed1", "prefer_grpo", "explore", "explore_seed1", "long", "guided")


def own_mixture(path: str) -> str:
  """`make general`'s mixture (the SFT preset's) with its own answers read from `path`."""
  mixture = yaml.safe_load(pathlib.Path(SFT_CONFIG).read_text())["data"]["mixture"]
  for source in mixture:
    if source.get("path", "").endswith("_own.jsonl"):
      source["path"] = path
  return "data.mixture=" + yaml.safe_dump(mixture, default_flow_style=True, width=10**6).strip()


def run(root: pathlib.Path, name: str) -> float:
  """Each stage of run `name` as its own process (`python -m reasoner`, `sft` stages on
  `SFT_CONFIG` and the others on `CONFIG`, or tools/own_answers.py, whose file is `{own}`,
  written once for every run: a rerun in GENERAL_DIR reads it); the wall seconds."""
  t, prev, own = time.perf_counter(), None, root / "own_answers.jsonl"
  extra = shlex.split(os.environ.get("GENERAL_ARGS", ""))
  fill = {"{own}": str(own), "{general}": str(root / "general")}
  for i, (command, overrides) in enumerate(RUNS[name]):
    folder = name if i == len(RUNS[name]) - 1 else f"{name}_{command}"
    where = [f"train.run_dir={root}", f"train.run_name={folder}"]
    if command == "own_answers":  # the base's own right answers (no checkpoint in `folder`)
      if not own.exists():  # written whole (a rename), greedy: the same for every run
        subprocess.run([sys.executable, "tools/own_answers.py", "--config", CONFIG, *overrides,
                        "--out", str(own), *where, *extra], check=True)
      continue
    if command == "sft" and not any(o.startswith("data.mixture=") for o in overrides):
      overrides = [*overrides, own_mixture("{own}")]
    for key, value in {**fill, "{prev}": str(prev)}.items():
      overrides = [o.replace(key, value) for o in overrides]
    subprocess.run([sys.executable, "-m", "reasoner", command, "--config",
                    SFT_CONFIG if command == "sft" else CONFIG, *where, *overrides, *extra],
                   check=True)
    prev = root / folder
  return time.perf_counter() - t


def rows(folder: pathlib.Path, tag: str) -> dict[str, list[dict]]:
  """Each set's evaluation rows logged under `tag` (before, after) in the run's samples."""
  from reasoner.engine.metrics import read_jsonl

  out = {s: [] for s in SETS}
  for r in read_jsonl(folder / "samples.jsonl"):
    for s in SETS:
      if r["tag"] == f"eval-{s}-{tag}":
        out[s].append(r)
  return out


def main() -> None:
  from reasoner.evaluation import paired_change

  root = pathlib.Path(os.environ.get("GENERAL_DIR") or tempfile.mkdtemp(prefix="general-"))
  names = [n for n in os.environ.get("GENERAL_RUNS", ",".join(DEFAULT)).split(",") if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    raise SystemExit(f"GENERAL_RUNS: no run {', '.join(unknown)} (runs: {', '.join(RUNS)})")
  again = [n for n in names if (root / n).exists()]
  if again:  # found when a rerun of `general` timed its resume (2026-12-07, stop 81)
    raise SystemExit(f"GENERAL_RUNS: {', '.join(again)} already in {root}: run there again, it "
                     "would resume from its last checkpoint (its figures the old run's, its time "
                     "a resume's); move those folders away or name another GENERAL_DIR")
  if names[0] != "general" and not (root / "general" / "samples.jsonl").exists():
    raise SystemExit(f"GENERAL_RUNS: the general run comes first (its evaluation before "
                     f"training is every run's base); {root} holds none")
  figures = _earlier(root)
  for name in names:
    seconds = run(root, name)
    base, after = rows(root / "general", "before"), rows(root / name, "after")
    figures["runs"][name] = {"seconds": seconds, "stages": [" ".join((c, *o))
                                                            for c, o in RUNS[name]],
                             **{s: paired_change(base[s], after[s]) for s in SETS},
                             **instruction_figures(root / name)}
    if name == "long":  # its evaluation half-way
      mid = rows(root / name, "step-32")
      figures["runs"][name]["at_32"] = {
          **{s: paired_change(base[s], mid[s]) for s in SETS},
          "followed": instruction_figures(root / name, "step-32")["followed"]}
    if len(RUNS[name]) > 1 and RUNS[name][-2][0] != "own_answers":
      # its GRPO stage's evaluation before: the stage before's alone
      first = rows(root / name, "before")
      figures["runs"][name][f"{RUNS[name][-2][0]}_alone"] = {
          **{s: paired_change(base[s], first[s]) for s in SETS},
          **instruction_figures(root / name, "before")}
    print(json.dumps({name: figures["runs"][name]}, indent=1), flush=True)
  figures["base"] = {s: {"accuracy": sum(r["correct"] for r in rs) / len(rs), "n": len(rs)}
                     for s, rs in rows(root / "general", "before").items()}
  if "general" in names:  # its rate measured beside the run, not beside a later subset's
    figures["floor"] = floor(root / "general", figures["runs"]["general"]["seconds"])
    print(json.dumps({"floor": figures["floor"]}, indent=1), flush=True)
  if "general" in figures["runs"] and "arithmetic" in figures["runs"]:
    # the mixture's arithmetic against the arithmetic-only run's, paired by question
    figures["mixture_vs_arithmetic_only"] = paired_change(
        rows(root / "arithmetic", "after")["arithmetic"],
        rows(root / "general", "after")["arithmetic"])
  if "arithmetic" in figures["runs"] and "arithmetic_seed1" in figures["runs"]:
    seeds(figures, root)
  # paired by question on every set: against `make general`'s SFT, the same from another seed
  # (training's noise and the evaluation's), SFT -> GRPO and GRPO alone; against GRPO alone,
  # SFT -> GRPO and the GRPO variants
  against = {"general": ("seed1", "sft_grpo", "grpo"),
             "grpo": ("sft_grpo", "grpo_arithmetic", *GRPO_RUNS)}
  for ref, others in against.items():
    ref_rows = rows(root / ref, "after") if (root / ref / "samples.jsonl").exists() else {}
    if any(ref_rows.values()):  # run now or before in GENERAL_DIR, and evaluated after training
      for name in (n for n in others if n in figures["runs"]):
        after = rows(root / name, "after")
        figures[f"{name}_vs_{ref}"] = {s: paired_change(ref_rows[s], after[s]) for s in SETS}
  _write(figures, root)


def seeds(figures: dict, root: pathlib.Path) -> None:
  """Arithmetic alone from two seeds: their distance (training's own noise, which no paired
  standard error holds) and the mixture's from each and from their mean, question by question
  (a question's accuracy the two seeds' average)."""
  from reasoner.evaluation import paired_change

  a0, a1 = rows(root / "arithmetic", "after"), rows(root / "arithmetic_seed1", "after")
  figures["arithmetic_seed1_vs_seed0"] = {s: paired_change(a0[s], a1[s]) for s in SETS}
  if "general" not in figures["runs"]:
    return
  mix = rows(root / "general", "after")["arithmetic"]
  mean = _mean(a0["arithmetic"], a1["arithmetic"])
  figures["mixture_vs_arithmetic_only_seed1"] = paired_change(a1["arithmetic"], mix)
  figures["mixture_vs_arithmetic_only_seeds"] = paired_change(mean, mix)
  if "seed1" in figures["runs"]:  # both sides from both seeds
    m1 = rows(root / "seed1", "after")["arithmetic"]
    figures["mixture_seed1_vs_arithmetic_only_seed1"] = paired_change(a1["arithmetic"], m1)
    figures["mixture_seeds_vs_arithmetic_only_seeds"] = paired_change(mean, _mean(mix, m1))


def _mean(a: list[dict], b: list[dict]) -> list[dict]:
  """Two runs' rows as one, question by question: a question's accuracy their average."""
  other = {r["question"]: r for r in b}
  return [{"question": r["question"], "correct": (r["correct"] + other[r["question"]]["correct"])
           / 2} for r in a if r["question"] in other]


def _instruction_sets() -> dict[str, dict[str, dict]]:
  """Each instruction evaluation set's held-out records by question, regenerated by the run's
  own loader (the rows hold questions and completions, not constraints)."""
  from reasoner.config import load_config
  from reasoner.data import sources

  cfg = load_config(CONFIG, [])
  return {s.name: {r["question"]: r for r in sources.load_eval_set(s, cfg.data,
                                                                   log=lambda *_: None)}
          for s in cfg.eval.sets if s.source == "instructions"}


def _judged(tag_rows: list[dict], records: dict) -> tuple[list, list[list[bool]]]:
  """The rows' constraints and, strict, whether each was followed."""
  from reasoner.rewards import instructions

  cons = [records[r["question"]]["constraints"] for r in tag_rows]
  return cons, instructions.judge([r["completion"] for r in tag_rows], cons)[0]


def instruction_figures(folder: pathlib.Path, tag: str = "after") -> dict:
  """Each instruction set's figures from the base (the general run's rows before) to this run's
  rows under `tag`, judged once (strict): `followed`, the fraction of its constraints a prompt's
  answer follows (the `instructions` reward), paired by prompt ({set: `paired_change`}: where
  the prompt-level figure needs every constraint of a prompt, this counts each, with the prompt
  as the unit of the standard error, since a prompt's constraints are not independent); and
  `by_kind`, the pass counts by constraint kind ({set: {kind: [before, after, of]}})."""
  from reasoner.evaluation import paired_change

  followed, kinds = {}, {}
  both = (rows(folder.parent / "general", "before"), rows(folder, tag))
  for name, records in _instruction_sets().items():
    counts: dict[str, list[int]] = {}
    sides = []
    for i, tag_rows in enumerate(side[name] for side in both):
      cons, strict = _judged(tag_rows, records)
      sides.append([{"question": r["question"], "correct": sum(p) / len(p)}
                    for r, p in zip(tag_rows, strict)])
      for row, passed in zip(cons, strict):
        for c, ok in zip(row, passed):
          counts.setdefault(c["kind"], [0, 0, 0])[i] += int(ok)
          counts[c["kind"]][2] += i == 0
    followed[name], kinds[name] = paired_change(*sides), dict(sorted(counts.items()))
  return {"followed": followed, "by_kind": kinds}


def floor(folder: pathlib.Path, seconds: float) -> dict:
  """The general run's FLOPs floor on this machine. A token through the layers costs 2 x their
  weights (q, k, v, o and the MLP: attention's own products, 7% at 200 tokens, are left out, so
  this is a lower bound); a token the model writes also costs the head (2 x V x D). Each
  evaluation set: the head its prompts share once (the few-shot header), then each row's rest
  of the prompt and its completion. Each GRPO step, from its logged groups
  (one `rollout` row a prompt) and `rollout_tokens` (every row's completion): one forward F =
  the prompts once and the completions; the step must run 4 F (the rollout, the reference's
  log-probs, and the train step's forward and backward: the activations' gradients cost a
  forward's matmuls again, the frozen weights get none). Each SFT step, from its metrics: its
  real tokens through the layers (with `sft.shared_heads`, each shared head once) and its
  targets through the head, twice (forward, backward). The own answers (a stage before the
  run's process) are not counted: a floor may leave out. The rate: the best of this machine's
  float32 matmuls at the run's shapes (a layer's MLP on 512 tokens, the head on 64 rows)."""
  import jax
  import jax.numpy as jnp

  from reasoner.config import load_config
  from reasoner.data import prompts
  from reasoner.engine.metrics import read_jsonl
  from reasoner.models import gemma, load
  from reasoner.models.prompt import common_prefix

  cfg = load_config(CONFIG, [])
  t = gemma.model_spec(cfg.model, None).tunix_config
  d, q, kv = t.embed_dim, t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
  layers = 2 * t.num_layers * (2 * d * q + 2 * d * kv + 3 * d * t.hidden_dim)
  head = 2 * t.num_embed * d
  count = load.embedded_tokenizer().encode
  ids = lambda r: count(prompts.render_record(cfg.data.template, r), add_bos=True)
  samples = list(read_jsonl(folder / "samples.jsonl"))
  evals = [r for r in samples if r["tag"].startswith("eval-")]  # every set, before and after
  written = sum(len(count(r["completion"])) for r in evals)
  read = 0
  for tag in {r["tag"] for r in evals}:
    rows = [ids(r) for r in evals if r["tag"] == tag]
    shared = common_prefix(rows)
    read += shared + sum(len(i) - shared for i in rows)
  flops = {"evaluations": layers * (read + written) + head * written}
  metrics = list(read_jsonl(folder / "metrics.jsonl"))
  steps = [m for m in metrics if "rollout_tokens" in m]
  read = sum(len(ids(r)) for r in samples if r["tag"] == "rollout")
  wrote = sum(m["rollout_tokens"] for m in steps)
  flops["grpo_steps"] = 4 * (layers * (read + wrote) + head * wrote)
  sft = [m for m in metrics if "response_tokens" in m and "rollout_tokens" not in m]
  real = sum(round(m["tokens_per_s"] * m["step_time_s"]) for m in sft)  # prompts and targets
  flops["sft_steps"] = 2 * (layers * real + head * sum(m["response_tokens"] for m in sft))
  steps += sft

  def rate(m: int, k: int, n_: int) -> float:
    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n_), jnp.float32)
    f = jax.jit(jnp.matmul)
    return 2 * m * k * n_ / common.timeit(lambda: f(a, b), repeats=5)

  best = max(rate(512, d, t.hidden_dim), rate(64, d, t.num_embed))
  total = sum(flops.values())
  return {"tflop": {k: v / 1e12 for k, v in flops.items()}, "matmul_gflop_s": best / 1e9,
          "minutes": total / best / 60, "run_over_floor": seconds / (total / best),
          "steps": len(steps), "evaluation_rows": len(evals)}


def _in_se(c: dict) -> float:
  """A paired change in standard errors (a change with no spread at all: infinitely many)."""
  if c["se"]:
    return c["change"] / c["se"]
  return math.copysign(math.inf, c["change"]) if c["change"] else 0.0


def _earlier(root: pathlib.Path) -> dict:
  """The runs (and the floor) of the last results file when they lie in `root` too (the same
  base): a subset rerun adds to them rather than erasing them."""
  path = common.RESULTS / "general.json"
  old = json.loads(path.read_text()) if path.exists() else {}
  if old.get("runs") != str(root):
    return {"runs": {}}
  kept = {"runs": dict(old["figures"]["runs"])}
  if "floor" in old["figures"]:
    kept["floor"] = old["figures"]["floor"]
  return kept


def _write(figures: dict, root: pathlib.Path) -> None:
  runs, goals = figures["runs"], []
  if "general" in runs:
    g = runs["general"]
    c, r = g["combination"], g["retention"]
    goals += [common.goal("general run: prompt-level strict gain on new combinations",
                          c["change"], 0.10, at_most=False),
              common.goal("general run: that gain in standard errors", _in_se(c), 2.0,
                          at_most=False),
              common.goal("general run: retention change in standard errors (>= -1)",
                          _in_se(r), -1.0, at_most=False),
              common.goal("make general: minutes on 2 cores", g["seconds"] / 60, 25.0)]
    if "floor" in figures:
      goals.append(common.goal("make general's FLOPs floor on this machine: minutes (25 is "
                               "within reach only where this is below it)",
                               figures["floor"]["minutes"], 25.0))
  if "mixture_vs_arithmetic_only" in figures:
    m = figures["mixture_vs_arithmetic_only"]
    goals.append(common.goal("arithmetic: |mixture - arithmetic only| in standard errors",
                             abs(_in_se(m)), 2.0))
  if "mixture_vs_arithmetic_only_seeds" in figures:
    m = figures["mixture_vs_arithmetic_only_seeds"]
    goals.append(common.goal("arithmetic: |mixture - arithmetic only, the mean of seeds 0 and "
                             "1| in standard errors", abs(_in_se(m)), 2.0))
  if "mixture_seeds_vs_arithmetic_only_seeds" in figures:
    m = figures["mixture_seeds_vs_arithmetic_only_seeds"]
    goals.append(common.goal("arithmetic: |mixture - arithmetic only|, each the mean of seeds 0 "
                             "and 1, in standard errors", abs(_in_se(m)), 2.0))
  path = common.write("general", figures, {"base": figures.get("base")}, goals, runs=str(root),
                      config=SFT_CONFIG, commands="make general (the general run)")
  print(f"wrote {path}", flush=True)
