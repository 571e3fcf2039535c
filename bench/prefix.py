"""Prompts that share a head: the sampler with the head run once against the full prefill, side
by side in one process.

    make bench BENCH=prefix        (python -m bench prefix)

The embedded Gemma 3 270M (float32) evaluating as `make general` does: 64 prompts of its
`combination` set (the few-shot header every instruction prompt starts with, then the task and
its constraints; left-padded to 256 tokens), greedy, up to 80 new tokens, stopping at
'</answer>'. One sampler finds the head the prompts share and runs it once
(`models.prompt.shared_head`: 128 tokens, then 96 slots a row); the other is told there is none
and prefills every slot of every row. Each is timed warm (`REPEATS` calls after the compiling
one, the best). The two must sample the same tokens on every row; their log-probs are
compared too.
"""

from __future__ import annotations

import time

import numpy as np

from bench import common

CONFIG, ROWS, REPEATS = "configs/embedded_general.yaml", 64, 1


def main() -> None:
  import jax

  from reasoner.build import build
  from reasoner.config import load_config
  from reasoner.data import prompts, sources
  from reasoner.engine.sampler import Sampler, SamplingConfig

  cfg = load_config(CONFIG, [])
  s = next(e for e in cfg.eval.sets if e.name == "combination")
  records = sources.load_eval_set(s, cfg.data, log=lambda *_: None)[:ROWS]
  texts = [prompts.render_record(cfg.data.template, r) for r in records]
  setup = build(cfg)
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=True)
  figures, out = {}, {}
  for name in ("shared_head", "full_prefill"):
    sampler = Sampler.for_run(setup)
    if name == "full_prefill":
      sampler.window = 0  # no head found: every slot of every row prefilled
    times = []
    for _ in range(REPEATS + 1):  # the first call compiles
      t = time.perf_counter()
      out[name], _, _ = sampler.sample((setup.lora, setup.base), texts, jax.random.PRNGKey(0),
                                       scfg)
      times.append(time.perf_counter() - t)
    head = sorted({shape[4] for shape in sampler.compiled_shapes})
    figures[name] = {"seconds": min(times[1:]), "compile_seconds": times[0] - min(times[1:]),
                     "head_then_slots": head, "tokens": int(out[name].mask.sum())}
    print(name, figures[name], flush=True)
  a, b = out["shared_head"], out["full_prefill"]
  same = int((a.tokens == b.tokens).all(1).sum())
  ratio = figures["shared_head"]["seconds"] / figures["full_prefill"]["seconds"]
  figures.update(rows=ROWS, rows_with_the_same_tokens=same, ratio=ratio,
                 max_logprob_difference=float(np.abs(a.logprobs - b.logprobs).max()))
  goals = [common.goal("rows sampling the same tokens (of 64)", same, ROWS, at_most=False),
           common.goal("time with the head shared / full prefill", ratio, 0.8)]
  path = common.write("prefix", figures, {"full_prefill": figures["full_prefill"]}, goals,
                      config=CONFIG)
  print(f"wrote {path}: ratio {ratio:.2f}, {same} of {ROWS} rows the same", flush=True)
