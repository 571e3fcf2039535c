"""The GRPO step on this host's accelerator beside the planner's figures for it (issue 37).

    make bench BENCH=device          (python -m bench device; where a GPU is lent)

Two cases, each in a process of its own (so that the device's peak-memory counter is its own):
the embedded default (configs/embedded.yaml) and the 1B preset (configs/gemma3_1b.yaml), both at
full size: random weights of the real shapes, every layer, the config's lengths, batch, G, dtype
and remat. The arithmetic set stands in for GSM8K (which needs the network). Random weights
never stop early, so every completion runs to max_new_tokens: the planner's upper bound too.

Measured, on the run's own code (`build`, `Sampler.for_run`, `GRPOTrainer.for_run`,
`grpo.grpo_step`): the whole step (rollout, scoring, log-prob forwards, train step), the best of
the warm steps, and its rollout; then the log-prob forward and the train step alone, warm; rollout
and training tokens a second; the device's peak memory (`memory_stats`).

Planned: the programs that ran, as XLA compiled them (its dump, kept in BENCH_HLO_DIR or a
temporary folder), read by the planner (`hlo.analyse`) with the device's chip table
(`planner.chips`, `reasoner plan --topology local`): each part's time and what binds it, the
step as `step_seconds` adds the parts, and each program's memory (its buffer assignment). The
ratios measured / planned go in bench/results/device.json with a goal each: within 1.3x (issue
37: "mend the planner's model where it is off by more than 30%").

`BENCH_REPLAN=1` recomputes the planned figures without a device, from the cases' results
(bench/results/device_<case>.json) and the programs kept in BENCH_HLO_DIR: how a change to the
planner's model is checked against the last measurement. A host without the embedded GGUF (a
lent machine gets wheels, not the 250 MB model) passes the tokenizer alone:
`BENCH_TOKENIZER=path/to/tokenizer.model`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from bench import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = {"embedded": ("configs/embedded.yaml", []),
         "gemma3_1b": ("configs/gemma3_1b.yaml", ["data.source=arithmetic", "data.num_eval=8"])}
RANDOM = ["model.source=random", "data.num_train=256", "train.eval_before=false"]
PROGRAMS = {"rollout": "jit_generate", "logprobs": "jit__completion_logprobs",
            "train": "jit__train_step"}  # part -> the jitted function's module name in a dump
WARM = int(os.environ.get("BENCH_WARM_STEPS", "2"))  # warm whole steps after the first
TOLERANCE = 1.3


def _tokenizer() -> None:
  """The embedded tokenizer from BENCH_TOKENIZER's file where the GGUF package is absent."""
  path = os.environ.get("BENCH_TOKENIZER")
  if path:
    from reasoner.models import load
    from reasoner.models.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer.from_file(path)
    load.embedded_tokenizer = lambda: tok


def measure(cfg) -> dict:
  """The case's whole steps, then its log-prob forward and train step alone (seconds, warm)."""
  import jax

  from reasoner.build import build
  from reasoner.engine.sampler import Sampler
  from reasoner.objectives import grpo

  setup = build(cfg)
  trainer = grpo.GRPOTrainer.for_run(setup.graphdef, setup.base, cfg)
  sampler = Sampler.for_run(setup)
  state = trainer.init_state(setup.lora, jax.random.PRNGKey(0))
  data = grpo.STAGE.batches(setup)
  steps = []
  for step in range(1 + WARM):
    state, m = grpo.grpo_step(setup, sampler, trainer, state, data, step)
    steps.append({k: m[k] for k in ("step_time_s", "rollout_s", "reward_s", "rollout_tokens")})
  warm = min(steps[1:], key=lambda s: s["step_time_s"])
  batch, _ = grpo.rollout(setup, sampler, trainer, state.lora, next(data),
                          jax.random.PRNGKey(1))
  fwd = lambda: trainer.logprobs(state.lora, batch.prompt, batch.prompt_valid,
                                 batch.completion, batch.completion_mask)
  logprobs_s = common.timeit(fwd, 3)
  train = []
  for _ in range(3):
    t = time.perf_counter()
    state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    train.append(time.perf_counter() - t)
  rows = cfg.train.batch_size * cfg.rollout.num_generations
  # the host's time between programs: the warm step less what its programs took alone (the
  # rollout's own figure holds the sampler's tokenising and detokenising)
  forwards = (cfg.grpo.beta > 0) + (cfg.grpo.num_iterations > 1)
  host_s = (warm["step_time_s"] - warm["rollout_s"] - forwards * logprobs_s
            - cfg.grpo.num_iterations * min(train))
  tokens = rows * (batch.prompt.shape[1] + batch.completion.shape[1])
  device = jax.devices()[0]
  return {"device_kind": device.device_kind, "hbm": (device.memory_stats() or {}).get(
              "bytes_limit"), "first_step_s": steps[0]["step_time_s"], "steps": steps,
          "step_s": warm["step_time_s"], "rollout_s": warm["rollout_s"],
          "reward_s": warm["reward_s"],
          "rollout_tokens_per_s": warm["rollout_tokens"] / warm["rollout_s"],
          "logprobs_s": logprobs_s, "host_s": host_s, "train_s": min(train), "train_tokens_per_s":
          tokens / min(train), "peak_bytes": (device.memory_stats() or {}).get(
              "peak_bytes_in_use", 0), "rows": rows,
          "prompt_tokens": int(batch.prompt.shape[1]),
          "new_tokens": int(batch.completion.shape[1])}


def _newest(folder: pathlib.Path, program: str, suffix: str) -> pathlib.Path | None:
  """The last compiled module of `program` in an XLA dump (module ids grow)."""
  found = [(int(m.group(1)), p) for p in folder.glob(f"module_*.{program}.*{suffix}")
           if (m := re.match(r"module_(\d+)\.", p.name))]
  return max(found)[1] if found else None


def planned(result: dict, folder: pathlib.Path) -> dict:
  """Each part's plan from the programs that ran (`folder`: the case's XLA dump), the step as
  `plan.step_seconds` adds them, with the chip table of the device that ran them."""
  from reasoner.config import load_config
  from reasoner import chips
  from reasoner.planner.hlo import analyse
  from reasoner.planner.plan import StepPlan, step_seconds

  m = result["measured"]
  chip = chips.chip_of(m["device_kind"], m.get("hbm"))
  cfg = load_config(ROOT / result["config"], result["overrides"])
  out, report = {}, {"cfg": cfg, "chip": chip}
  forwards = cfg.grpo.beta > 0 or cfg.grpo.num_iterations > 1  # the step's log-prob forwards
  for part, program in PROGRAMS.items():
    if part == "logprobs" and not forwards:
      continue
    text, memory = _newest(folder, program, "after_optimizations.txt"), _newest(
        folder, program, "buffer-assignment.txt")
    if text is None:
      continue
    c = analyse(text.read_text(), chip.flops / chip.bandwidth)
    allocated = sum(int(s) for s in re.findall(r"^allocation \d+: size (\d+)",
                                               memory.read_text(), re.M)) if memory else 0
    p = StepPlan(part, cfg.train.batch_size, m["rows"], flops=c.flops, bytes=c.bytes,
                 collectives=c.collectives, kernels=c.kernels, serial_flops=c.serial_flops,
                 serial_bytes=c.serial_bytes, temporaries=allocated)
    report[part] = p
    out[part] = {"s": p.seconds(chip), "bound": p.bound(chip), "times": p.times(chip),
                 "memory_bytes": allocated, "flops": c.flops, "hbm_bytes": c.bytes,
                 "kernels": c.kernels, "program": text.name}
  out["step_s"] = step_seconds(report)
  out["chip"] = {"name": chip.name, "hbm": chip.hbm, "flops": chip.flops,
                 "bandwidth": chip.bandwidth, "launch": chip.launch}
  return out


def ratios(r: dict) -> dict[str, float]:
  """measured / planned for each part both sides have, the step and peak memory."""
  m, p = r.get("measured", {}), r.get("planned", {})
  if "step_s" not in m or "step_s" not in p:
    return {}
  out = {"step": m["step_s"] / p["step_s"]}
  out.update({k: m[f"{k}_s"] / p[k]["s"] for k in PROGRAMS if k in p})
  largest = max(p[k]["memory_bytes"] for k in PROGRAMS if k in p)
  if largest:  # the programs' buffer assignments were kept
    out["memory"] = m["peak_bytes"] / largest
  return out


def case(name: str, out: pathlib.Path) -> None:
  """One case in this process (XLA's dump folder already set): measured, written to `out`."""
  from reasoner.config import load_config

  _tokenizer()
  path, extra = CASES[name]
  result: dict = {"config": path, "overrides": RANDOM + extra}
  t = time.perf_counter()
  result["measured"] = measure(load_config(ROOT / path, RANDOM + extra))
  print(f"{name} measured in {time.perf_counter() - t:.0f} s", flush=True)
  out.write_text(json.dumps(result, indent=2, default=float))


def main() -> None:
  import jax

  replan = os.environ.get("BENCH_REPLAN") == "1"
  if jax.default_backend() == "cpu" and not replan:
    print("bench device: no accelerator here (jax sees only the CPU); run it where a GPU is "
          "lent, or replan the last run's programs with BENCH_REPLAN=1. Nothing written.")
    return
  dumps = pathlib.Path(os.environ.get("BENCH_HLO_DIR") or tempfile.mkdtemp(prefix="hlo"))
  common.RESULTS.mkdir(parents=True, exist_ok=True)
  results, goals = {}, []
  for name in os.environ.get("BENCH_CASES", ",".join(CASES)).split(","):
    out = common.RESULTS / f"device_{name}.json"
    if not replan:
      flags = f" --xla_dump_hlo_as_text --xla_dump_to={dumps / name}"
      env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + flags}
      subprocess.run([sys.executable, "-m", "bench.device", name, str(out)], cwd=ROOT, env=env,
                     check=False)
    if not out.exists():
      results[name] = {"error": "the case wrote nothing (its output above)"}
      continue
    results[name] = json.loads(out.read_text())
    results[name]["planned"] = planned(results[name], dumps / name)
    results[name]["ratios"] = ratios(results[name])
    for part, v in results[name]["ratios"].items():  # off by at most 30% either way
      goals.append(common.goal(f"{name} {part}: measured / planned, or its inverse if below 1",
                               max(v, 1 / v), TOLERANCE))
  path = common.write("device", results, {"planner": "hlo.analyse of the programs that ran, "
                                                     "the chip table of reasoner plan "
                                                     "--topology local"}, goals)
  print(common.table([{"case": n, **{k: round(v, 3) for k, v in r.get("ratios", {}).items()}}
                      for n, r in results.items()]))
  print(f"wrote {path}")


if __name__ == "__main__":
  case(sys.argv[1], pathlib.Path(sys.argv[2]))
