"""One GRPO step (rollout, rewards, advantages, train_step), held-out evaluation and sampling:
the pieces `reasoner.loop` runs, and what `python -m reasoner eval|sample` run."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from reasoner import grpo, lora as lora_lib, mesh as mesh_lib, rewards as rewards_lib
from reasoner.build import Setup, build
from reasoner.checkpoint import CheckpointError, Checkpointer
from reasoner.config import Config
from reasoner.data import prompts as prompts_lib
from reasoner.metrics import MetricsWriter
from reasoner.sampler import Sampler, SamplingConfig
from reasoner.trainer import Batch, Trainer, build_batch

log = logging.getLogger("reasoner")


def evaluate(setup: Setup, sampler: Sampler, lora, records: list[dict]) -> tuple[dict, list]:
  """Greedy decoding on held-out records: mean reward, accuracy and format rate."""
  cfg = setup.cfg
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=True)
  totals, correct, fmt, rows = [], [], [], []
  for i in range(0, len(records), cfg.eval.batch_size):
    chunk = records[i:i + cfg.eval.batch_size]
    prompts = [prompts_lib.render(cfg.data.template, r["question"]) for r in chunk]
    comps, _, _ = sampler.sample((lora, setup.base), prompts, jax.random.PRNGKey(0), scfg)
    answers = [r["answer"] for r in chunk]
    total, _ = setup.rewards(prompts, comps.texts, answer=answers)
    totals += total.tolist()
    correct += rewards_lib.correct(prompts, comps.texts, answer=answers)
    fmt += rewards_lib.format_exact(prompts, comps.texts)
    rows += [{"question": r["question"], "answer": r["answer"], "completion": t,
              "reward": float(v)} for r, t, v in zip(chunk, comps.texts, total)]
  result = {"mean_reward": float(np.mean(totals)), "accuracy": float(np.mean(correct)),
            "format_rate": float(np.mean(fmt)), "n": len(records)}
  return result, rows


def _print_eval(tag: str, result: dict, rows: list, n_samples: int) -> None:
  if jax.process_index() != 0:
    return
  tqdm.write(f"[{tag}] held-out ({result['n']}): mean reward {result['mean_reward']:.3f}  "
             f"accuracy {result['accuracy']:.3f}  format rate {result['format_rate']:.3f}")
  for r in rows[:n_samples]:
    tqdm.write(f"  Q: {r['question']}\n  A: {r['completion']!r}  (reward {r['reward']:.2f}, "
               f"reference {r['answer']})")


def rollout(setup: Setup, sampler: Sampler, trainer: Trainer, lora, records: list[dict],
            key: jax.Array) -> tuple[Batch, dict]:
  """Samples G completions per prompt, scores them and builds the training batch."""
  cfg, g = setup.cfg, setup.cfg.rollout.num_generations
  prompts = [prompts_lib.render(cfg.data.template, r["question"]) for r in records]
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  t0 = time.perf_counter()
  comps, p_tok, p_mask = sampler.sample((lora, setup.base), prompts, key, scfg, g)
  t_sample = time.perf_counter() - t0
  rep = lambda xs: [x for x in xs for _ in range(g)]
  answers = rep([r["answer"] for r in records])
  total, per_fn = setup.rewards(rep(prompts), comps.texts, answer=answers)
  adv = np.asarray(grpo.group_advantages(jnp.asarray(total), g, cfg.grpo.scale_rewards))
  host = build_batch(p_tok, p_mask, comps, adv)
  batch = {k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()}
  fwd = lambda lora: trainer.logprobs(lora, batch["prompt"], batch["prompt_valid"],
                                      batch["completion"], batch["completion_mask"])
  if cfg.grpo.num_iterations > 1:  # pi_old from the trainer's own forward
    batch["old_logp"] = fwd(lora)
  batch["ref_logp"] = (fwd(lora_lib.zeros_like(lora)) if cfg.grpo.beta > 0
                       else jnp.zeros_like(batch["old_logp"]))
  correct = rewards_lib.correct(prompts, comps.texts, answer=answers)
  metrics = {"reward/mean": float(total.mean()), "reward/std": float(total.std()),
             **{f"reward/{k}": float(v.mean()) for k, v in per_fn.items()},
             **{f"reward_std/{k}": float(v.std()) for k, v in per_fn.items()},
             "accuracy": float(np.mean(correct)),
             "format_rate": float(np.mean(rewards_lib.format_exact(prompts, comps.texts))),
             "completion_length": float(comps.mask.sum(1).mean()),
             "rollout_tokens_per_s": float(comps.mask.sum() / t_sample),
             "rollout_s": t_sample,
             "tokens": int(host["prompt_valid"].sum() * g + comps.mask.sum())}
  metrics["samples"] = [{"question": records[i // g]["question"], "completion": comps.texts[i],
                         "reward": float(total[i])} for i in range(0, len(comps.texts), g)]
  return Batch(**batch), metrics


def checkpoint_tree(state) -> dict:
  return {"step": state.step, "lora": state.lora, "opt_state": state.opt_state, "key": state.key}


def eval_logged(setup: Setup, sampler: Sampler, lora, writer: MetricsWriter, step: int,
                 tag: str) -> dict:
  result, rows = evaluate(setup, sampler, lora, setup.eval_records)
  _print_eval(tag, result, rows, setup.cfg.train.num_log_samples)
  writer.samples(step, f"eval-{tag}", rows)
  writer.log(step, {f"eval/{k}": v for k, v in result.items()})
  return result


def grpo_step(setup: Setup, sampler: Sampler, trainer: Trainer, state, records, step: int):
  """Rollout, then mu optimisation passes on it: (state, metrics)."""
  t0 = time.perf_counter()
  batch, metrics = rollout(setup, sampler, trainer, state.lora, records,
                           jax.random.fold_in(state.key, step))
  for _ in range(setup.cfg.grpo.num_iterations):
    state, step_metrics = trainer.train_step(state, batch)
  step_metrics = jax.device_get(step_metrics)
  if not np.isfinite(step_metrics["loss"]):
    raise FloatingPointError(f"step {step + 1}: the loss is {step_metrics['loss']}; "
                             "stopping without saving (the last checkpoint is intact)")
  dt = time.perf_counter() - t0
  tokens = metrics.pop("tokens")  # counted on the host: the batch spans every process
  metrics.update({k: float(v) for k, v in step_metrics.items()}, step_time_s=dt,
                 tokens_per_s=float(tokens / dt))
  return state, metrics


def restore_lora(setup: Setup, step: int | None = None):
  """(LoRA weights, step) of the run's checkpoint at `step` (default: the newest that reads,
  each unreadable one named on the way), read-only; (the initial LoRA, 0) when the run has no
  checkpoint and no step was asked for."""
  folder = setup.cfg.run_path / "checkpoints"
  ckpt = Checkpointer(folder, 1, read_only=True) if folder.is_dir() else None
  steps = ckpt.all_steps() if ckpt else []
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step}: no such checkpoint in {folder} (it has "
                          f"{', '.join(map(str, steps)) or 'none'})")
  if not steps:
    return setup.lora, 0
  trainer = Trainer.for_run(setup.graphdef, setup.base, setup.cfg)
  target = checkpoint_tree(trainer.init_state(setup.lora, jax.random.PRNGKey(0)))
  if step is not None:
    return ckpt.restore(step, target)[0]["lora"], step
  found = ckpt.restore_latest(target, lambda line: tqdm.write(line) if jax.process_index() == 0
                              else None)
  if found is None:
    raise CheckpointError(f"no checkpoint in {folder} can be read")
  return found[1]["lora"], found[0]


def eval_only(cfg: Config) -> dict:
  setup = build(cfg)
  lora, step = restore_lora(setup)
  sampler = Sampler.for_run(setup)
  result, rows = evaluate(setup, sampler, lora, setup.eval_records)
  _print_eval(f"checkpoint {step}" if step else "no checkpoint: base model", result, rows,
              cfg.train.num_log_samples)
  return result


def sample(cfg: Config, question: str, n: int) -> list[str]:
  setup = build(cfg)
  lora, _ = restore_lora(setup)
  sampler = Sampler.for_run(setup)
  prompt = prompts_lib.render(cfg.data.template, question)
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=n == 1)
  comps, _, _ = sampler.sample((lora, setup.base), [prompt], jax.random.PRNGKey(cfg.train.seed),
                               scfg, max(n, 1) if n > 1 else 1)
  return comps.texts
