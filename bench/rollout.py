"""Rollout throughput: our sampler against Tunix's `Sampler`, side by side in one run.

    make bench BENCH=rollout        (python -m bench rollout)

Same model object (the embedded Gemma 3 270M, float32), same prompts (64 tokens with <bos>),
G = 8 completions per prompt, 128 new tokens, the Kaggle preset's sampling (temperature 0.9,
top-k 64, top-p 0.95), the same stop token (<eos>), log-probs returned by both. Tunix gets each
prompt G times (it has no notion of groups); ours prefills each prompt once and repeats its
KV cache to the G rows. Generated tokens per second count the tokens each sampler actually
produced (up to the stop token), over the wall time of a warm call; compile time is the first
call's time minus a warm call's.

Equal output distribution is checked two ways: greedy decoding of the same prompts gives the
same tokens, and the mean log-probability and length of the sampled completions agree.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from bench import common

G, PROMPT, NEW = 8, 64, 128
BATCHES = tuple(int(b) for b in os.environ.get("ROLLOUT_BATCHES", "4,16").split(","))
SAMPLING = dict(temperature=0.9, top_k=64, top_p=0.95)
TEXT = ("Question: A farmer has {a} sheep and buys {b} more, then sells {c} of them at the "
        "market on a rainy Tuesday morning before walking home along the river. How many sheep "
        "does the farmer have now? Think it through step by step, then give the answer in the "
        "format shown. Remember that the sheep that were sold are no longer on the farm, and "
        "that the sheep that were bought are.")


def load():
  from flax import nnx

  from reasoner import mesh as mesh_lib
  from reasoner.config import MeshConfig, ModelConfig
  from reasoner.models import gemma, gguf

  mesh = mesh_lib.make_mesh(MeshConfig())
  ckpt = gguf.GGUFCheckpoint(gguf.embedded_gguf_path())
  tok = ckpt.tokenizer()
  spec = gemma.model_spec(ModelConfig(), tok.vocab_size)
  model = gemma.from_host(spec, mesh, ckpt.reader())
  graphdef, state = nnx.split(model)
  return model, graphdef, state, tok, mesh


def make_prompts(tok, n: int) -> list[str]:
  """n distinct prompts of PROMPT - 4 to PROMPT tokens once <bos> is added (both samplers pad
  them to PROMPT)."""
  out = []
  for i in range(n):
    text = tok.decode(tok.encode(TEXT.format(a=11 + i, b=3 + 2 * i, c=5 + i))[:PROMPT - 1])
    while len(tok.encode(text, add_bos=True)) > PROMPT:
      text = text[:-1]
    if len(tok.encode(text, add_bos=True)) < PROMPT - 4:
      raise RuntimeError(f"prompt {i} is shorter than {PROMPT - 4} tokens")
    out.append(text)
  return out


class Ours:
  name = "reasoner"

  def __init__(self, graphdef, state, tok, mesh):
    from reasoner.engine.sampler import Sampler

    self.sampler = Sampler(graphdef, (state,), tok, mesh, PROMPT)
    self.states, self.tok = (state,), tok

  def run(self, prompts, g, new, seed, greedy=False):
    from reasoner.engine.sampler import SamplingConfig

    cfg = SamplingConfig(max_new_tokens=new, stop_ids=(self.tok.eos_id,), pad_id=self.tok.pad_id,
                         **({"temperature": 0.0} if greedy else SAMPLING))
    c, _, _ = self.sampler.sample(self.states, prompts, jax.random.PRNGKey(seed), cfg, g)
    # Tunix's output stops before <eos>; so does this one, for equal counts.
    keep = c.mask & (c.tokens != self.tok.eos_id)
    return [t[m].tolist() for t, m in zip(c.tokens, keep)], c.logprobs[keep]


class Tunix:
  name = "tunix"

  def __init__(self, model, tok):
    from tunix.generate import sampler as tunix_sampler

    c = model.config
    cache = tunix_sampler.CacheConfig(cache_size=PROMPT + NEW, num_layers=c.num_layers,
                                      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    self.sampler = tunix_sampler.Sampler(model, tok._sp, cache)
    self.tok = tok

  def run(self, prompts, g, new, seed, greedy=False):
    out = self.sampler(
        [p for p in prompts for _ in range(g)], max_generation_steps=new,
        max_prompt_length=PROMPT, eos_tokens=[self.tok.eos_id], return_logprobs=True,
        seed=seed, **({"temperature": 0.0} if greedy else SAMPLING))
    toks = [list(map(int, t)) for t in out.tokens]
    logps = np.concatenate([np.asarray(lp)[:len(t)] for lp, t in zip(out.logprobs, toks)])
    return toks, logps


def _timed(sampler, prompts, seed):
  t = time.perf_counter()
  toks, logps = sampler.run(prompts, G, NEW, seed)
  return time.perf_counter() - t, toks, logps


def measure(samplers, prompts) -> dict[str, dict]:
  """First (compiling) call of each, then a warm call of each, interleaved."""
  first = {s.name: _timed(s, prompts, 0)[0] for s in samplers}
  out = {}
  for s in samplers:
    wall, toks, logps = _timed(s, prompts, 1)
    n = sum(len(t) for t in toks)
    out[s.name] = {"prompts": len(prompts), "rows": len(toks), "wall_s": wall,
                   "tokens": n, "tokens_per_s": n / wall,
                   "compile_s": max(0.0, first[s.name] - wall),
                   "mean_len": n / len(toks), "mean_logp": float(np.mean(logps))}
  return out


def greedy_agreement(ours, tunix, prompts, new=32) -> float:
  a, _ = ours.run(prompts, 1, new, 0, greedy=True)
  b, _ = tunix.run(prompts, 1, new, 0, greedy=True)
  return float(np.mean([x == y for x, y in zip(a, b)]))


def main() -> None:
  model, graphdef, state, tok, mesh = load()
  ours, tunix = Ours(graphdef, state, tok, mesh), Tunix(model, tok)
  agree = greedy_agreement(ours, tunix, make_prompts(tok, 4))
  rows, figures, reference, goals = [], {}, {}, []
  for b in BATCHES:
    res = measure([ours, tunix], make_prompts(tok, b))
    figures[f"batch{b}"], reference[f"batch{b}"] = res["reasoner"], res["tunix"]
    ratio = res["reasoner"]["tokens_per_s"] / res["tunix"]["tokens_per_s"]
    goals.append(common.goal(f"tokens/s vs Tunix, {b} prompts x G={G}", ratio, 1.5,
                             at_most=False))
    for name, r in res.items():
      rows.append({"sampler": name, "prompts": b, "rows": r["rows"], "tok/s": r["tokens_per_s"],
                   "wall s": r["wall_s"], "compile s": r["compile_s"],
                   "mean len": r["mean_len"], "mean logp": r["mean_logp"]})
  print(common.table(rows))
  print(f"greedy outputs identical on {agree:.0%} of rows; goals: "
        + ", ".join(f"{g['name']}: {g['value']:.2f} ({'met' if g['met'] else 'NOT met'})"
                    for g in goals))
  path = common.write("rollout", figures, reference, goals, greedy_agreement=agree,
                      settings={"G": G, "prompt_tokens": PROMPT, "new_tokens": NEW,
                                "dtype": "float32", **SAMPLING})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
