"""The host's work in a GRPO step, and how much of it the chips wait for (issue 56, item 4).

    make bench BENCH=host        (python -m bench host; about 15 minutes on 2 cores)

Two shapes: the 1B preset's step (configs/gemma3_1b.yaml: 4 prompts x 8 completions x 768 new
tokens) and the long preset's (configs/gemma3_1b_long.yaml: 4,096). Each runs the run's own
step (`grpo.grpo_step`) with random weights of the 1B's shapes on 8 fake CPU devices (weights
sharded, decoding in tp8 as on a v5e-8), the real tokenizer, the preset's rewards, and the
arithmetic set in the chat template standing in for GSM8K.

The step's three programs (the rollout, the log-prob forward, the train step) are replaced by
their outputs, for a 1B decode takes minutes on XLA:CPU and a CPU's programs say nothing of a
TPU's. Each is given its planned time on a v5e-8 instead, on a clock of the chips: a program
starts when it is dispatched and the chips are free, and the host waits where it reads a result
(the completions, the advantages, the step's metrics). The step's time on that clock, less its
programs' planned time, is the host's work that the chips waited for: not hidden. Planned
times: the 768-token preset's compiled plan (bench/results/grpo_step_tpu.json); the long
preset's analytic plan (`reasoner plan --analytic`), its log-prob forward a third of its train
step (one of the three passes, remat's recompute left out: a shorter window to hide behind).
The small programs that stay real (the LoRA into the decode layout, the zeroed LoRA, the batch's
transfers, the step's key) run on the same two cores, so the figures bound the host's time from
above.

Each case runs twice in one go: with this tree's `reasoner` and with BASE's (a git worktree at
the commit before the host's work was hidden), the same harness. Figures: each part's host time
(medians of 8 warm steps) and the time not hidden. Goal: not hidden at most 10% of the planned
step, each preset, now.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.append(str(pathlib.Path(__file__).parents[1]))  # run by path: `reasoner` from PYTHONPATH
from bench import common  # noqa: E402

BASE = "a2cdc1c"  # before: the LoRA moved by device_put, the reference's zeros made each step,
#                   the log-prob forwards dispatched after the rewards
CASES = {"1b": "configs/gemma3_1b.yaml", "1b_long": "configs/gemma3_1b_long.yaml"}
OVERRIDES = ["model.source=random", "data.source=arithmetic", "data.num_train=64",
             "data.template=chat", "mesh.weights=sharded", "rollout.layout=tp8"]
STEPS = 8  # measured, after one to warm up


class Clock:
  """The chips' clock: programs run one after another from their dispatch; the host's reads
  wait for the last (`wait`)."""

  def __init__(self):
    self.offset = self.free = self.busy = 0.0

  def now(self) -> float:
    return time.perf_counter() + self.offset

  def run(self, seconds: float) -> None:
    self.free = max(self.now(), self.free) + seconds
    self.busy += seconds

  def wait(self) -> None:
    self.offset += max(0.0, self.free - self.now())


def planned(case: str) -> dict:
  """The case's programs' planned seconds on a v5e-8 (see the module's docstring)."""
  if case == "1b":
    step = json.loads((common.RESULTS / "grpo_step_tpu.json").read_text())["figures"]["steps"][0]
    return {k: step[f"{k} ms"] / 1e3 for k in ("rollout", "logprobs", "train")}
  out = subprocess.run([sys.executable, "-m", "reasoner", "plan", "--config", CASES[case],
                        "--analytic", "--no-search"], capture_output=True, text=True, check=True,
                       cwd=common.RESULTS.parents[1]).stdout
  est = lambda part: float(out.split(f"  {part} ", 1)[1].split("est. ", 1)[1].split(" ms")[0])
  train = est("train") / 1e3
  return {"rollout": est("rollout") / 1e3, "logprobs": train / 3, "train": train}


def measure(case: str, plan: dict) -> dict:
  """In a subprocess (8 fake devices; `reasoner` as PYTHONPATH gives it): the case's steps."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from reasoner import mesh as mesh_lib
  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.engine import rollout as rollout_lib, sampler as sampler_lib
  from reasoner.models import lora as lora_lib
  from reasoner.objectives import grpo

  cfg = load_config(CASES[case], OVERRIDES)
  setup = build(cfg)
  sampler = sampler_lib.Sampler.for_run(setup)
  trainer = grpo.GRPOTrainer.for_run(setup.graphdef, setup.base, cfg)
  state = trainer.init_state(setup.lora, jax.random.PRNGKey(0))
  clock, parts = Clock(), collections.defaultdict(float)
  tok, n = setup.tokenizer, cfg.rollout.max_new_tokens
  words = tok.encode("<reasoning>" + "Each basket holds 3 apples, so 12 / 3 = 4 baskets; with "
                     "the 5 extra baskets that makes 4 + 5 = 9 baskets in all. " * (n // 20))
  stop = tok.encode("</reasoning>\n<answer>9</answer>")

  @functools.cache
  def completions(rows: int):
    """Half the rows stop at half the length with an answer, half run to the end."""
    toks, valid = np.full((rows, n), tok.pad_id, np.int32), np.zeros((rows, n), bool)
    for i in range(rows):
      seq = words[:n] if i % 2 else words[:n // 2 - len(stop)] + stop
      toks[i, :len(seq)], valid[i, :len(seq)] = seq, True
    put = lambda x: mesh_lib.put_batch(sampler.mesh, x)
    return jax.block_until_ready((put(toks), put(valid), put(np.where(valid, -1.0, 0.0).astype(
        np.float32)), put(np.arange(rows) % 2 == 0)))

  def generate(states, prompt, mask, key, *, cfg, num_generations):
    clock.run(plan["rollout"])
    return completions(prompt.shape[0] * num_generations)

  @functools.cache
  def zeros(shape, sharding):
    return jax.block_until_ready(jnp.zeros(shape, jnp.float32, device=sharding))

  def logprobs(lora, prompt, prompt_valid, completion, mask):
    clock.run(plan["logprobs"])
    return zeros(completion.shape, completion.sharding)

  scalars = {k: jnp.float32(0.5) for k in ("loss", "grad_norm", "learning_rate", "kl",
                                            "clip_fraction", "entropy")}

  # the train step's new LoRA each step: the same arrays in one of two trees, by turns (a
  # sampler keeps what it moved by the tree's identity)
  loras = [state.lora, jax.tree.map(lambda x: x, state.lora)]

  def train_step(state, batch):
    clock.run(plan["train"])
    return state.replace(lora=loras[state.lora is loras[0]]), dict(scalars)

  sampler.generate, trainer.logprobs, trainer.train_step = generate, logprobs, train_step

  def timed(owner, name: str, part: str, kind: str = "host"):
    """`owner.name` with its wall time added to `part`. `kind` "reads": the host reads a
    program's result there, so it waits for the chips; "small": it dispatches a small program
    that stays real, whose run on the CPU's devices is taken off the clock (on a v5e-8 each
    takes under a millisecond: the LoRA's bytes a chip over 819 GB/s)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
      t = time.perf_counter()
      out = fn(*args, **kwargs)
      parts[part] += time.perf_counter() - t
      if kind == "small":
        t = time.perf_counter()
        jax.block_until_ready(out)
        clock.offset -= time.perf_counter() - t
      if kind == "reads":
        clock.wait()
      return out
    setattr(owner, name, wrapper)

  for owner, name, part, kind in (
      (sampler, "encode_prompts", "tokenise", "host"), (tok, "decode", "detokenise", "host"),
      (setup.rewards, "score", "rewards", "host"), (rollout_lib, "assemble", "assemble", "host"),
      (rollout_lib, "metrics", "metrics", "host"), (rollout_lib, "samples", "metrics", "host"),
      (sampler, "in_layout", "LoRA to decode", "small"),
      (lora_lib, "zeros_like", "zeroed LoRA", "small"),
      (mesh_lib, "put_batch", "to chips", "small"), (jax.random, "fold_in", "key", "small"),
      (mesh_lib, "to_host", "from chips", "reads"),
      (grpo, "group_advantages", "advantages", "reads")):
    timed(owner, name, part, kind)
  # the step's metrics: read where a step settles them (jax.device_get)
  timed(jax, "device_get", "from chips", "reads")
  data = grpo.STAGE.batches(setup)
  steps = []
  for step in range(1 + STEPS):
    parts.clear()
    clock.wait()
    t0, busy0 = clock.now(), clock.busy
    state, _ = grpo.grpo_step(setup, sampler, trainer, state, data, step)
    clock.wait()
    wall = clock.now() - t0
    steps.append({"step_ms": 1e3 * wall, "not_hidden_ms": 1e3 * (wall - clock.busy + busy0),
                  **{f"{k}_ms": 1e3 * v for k, v in parts.items()}})
  warm = steps[1:]
  import reasoner
  return {"reasoner": str(pathlib.Path(reasoner.__file__).parent),
          **{k: statistics.median(s.get(k, 0.0) for s in warm) for k in warm[0]}}


def main() -> None:
  root = common.RESULTS.parents[1]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
         + " --xla_force_host_platform_device_count=8"}
  with common.worktree(BASE, "host") as (tmp, base):
    figures, goals = {}, []
    for case in CASES:
      plan = planned(case)
      figures[case] = {"planned_s": plan, "step_planned_ms": 1e3 * sum(plan.values())}
      for label, tree in (("now", root), ("before", base)):
        out = tmp / f"{case}-{label}.json"
        subprocess.run([sys.executable, __file__, case, json.dumps(plan), str(out)], check=True,
                       env={**env, "PYTHONPATH": str(tree)}, cwd=root)
        figures[case][label] = json.loads(out.read_text())
        print(case, label, json.dumps(figures[case][label]), flush=True)
      share = figures[case]["now"]["not_hidden_ms"] / figures[case]["step_planned_ms"]
      goals.append(common.goal(f"{case}: host time not hidden / planned step, now", share, 0.10))
  rows = [{"case": c, "code": label, **{k: f[label][k] for k in ("step_ms", "not_hidden_ms")}}
          for c, f in figures.items() for label in ("now", "before")]
  path = common.write("host", figures, {"before": f"the same step at {BASE}"}, goals,
                      overrides=OVERRIDES, configs=CASES)
  print(common.table(rows))
  print(f"wrote {path}")


if __name__ == "__main__":
  case, plan, out = sys.argv[1:]
  pathlib.Path(out).write_text(json.dumps(measure(case, json.loads(plan))))
