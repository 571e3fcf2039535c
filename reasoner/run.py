"""The GRPO loop, evaluation and sampling: what `python -m reasoner train|eval|sample` runs."""

from __future__ import annotations

import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from reasoner import grpo, lora as lora_lib, mesh as mesh_lib, rewards as rewards_lib, session
from reasoner.build import Setup, build
from reasoner.checkpoint import CheckpointError, Checkpointer, find_checkpoints
from reasoner.config import Config, ConfigError
from reasoner.data import prompts as prompts_lib
from reasoner.data import sources
from reasoner.metrics import MetricsWriter
from reasoner.models import gemma
from reasoner.sampler import Sampler, SamplingConfig
from reasoner.trainer import Batch, Trainer, build_batch

log = logging.getLogger("reasoner")


def make_sampler(setup: Setup) -> Sampler:
  graphdef = setup.graphdef
  if setup.cfg.model.remat != "none":  # nothing to recompute without a gradient
    graphdef = gemma.without_remat(graphdef, setup.lora, setup.base)
  return Sampler(graphdef, setup.tokenizer, setup.mesh, setup.cfg.data.max_prompt_tokens,
                 setup.cfg.rollout.prompt_buckets)


def _agreed(value: int) -> int:
  """Process 0's value on every process: decisions that start collective work (resume step,
  whether to evaluate) must not depend on when each process looked at the run directory."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def sampling_config(cfg: Config, tokenizer, greedy: bool) -> SamplingConfig:
  stops = tuple(i for i in (tokenizer.eos_id, tokenizer.end_of_turn_id) if i is not None)
  r = cfg.rollout
  return SamplingConfig(
      max_new_tokens=cfg.eval.max_new_tokens if greedy else r.max_new_tokens,
      temperature=0.0 if greedy else r.temperature, top_k=None if greedy else r.top_k,
      top_p=None if greedy else r.top_p, vocab_chunk=r.vocab_chunk, stop_ids=stops,
      stop_sequences=(tuple(tokenizer.encode("</answer>")),), pad_id=tokenizer.pad_id)


def evaluate(setup: Setup, sampler: Sampler, lora, records: list[dict]) -> tuple[dict, list]:
  """Greedy decoding on held-out records: mean reward, accuracy and format rate."""
  cfg = setup.cfg
  scfg = sampling_config(cfg, setup.tokenizer, greedy=True)
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
  t0 = time.perf_counter()
  comps, p_tok, p_mask = sampler.sample((lora, setup.base), prompts, key,
                                        sampling_config(cfg, setup.tokenizer, greedy=False), g)
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


def _checkpoint_tree(state) -> dict:
  return {"step": state.step, "lora": state.lora, "opt_state": state.opt_state, "key": state.key}


def _eval_logged(setup: Setup, sampler: Sampler, lora, writer: MetricsWriter, step: int,
                 tag: str) -> dict:
  result, rows = evaluate(setup, sampler, lora, setup.eval_records)
  _print_eval(tag, result, rows, setup.cfg.train.num_log_samples)
  writer.samples(step, f"eval-{tag}", rows)
  writer.log(step, {f"eval/{k}": v for k, v in result.items()})
  return result


def _grpo_step(setup: Setup, sampler: Sampler, trainer: Trainer, state, records, step: int):
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


def train(cfg: Config, command: str | None = None) -> dict:
  """Runs (or resumes) GRPO; returns {'before': ..., 'after': ...} held-out results, and
  'stopped' ({'step', 'of', 'line'}) when the session's deadline stopped it early.
  `command` is what the user ran, repeated in the line that says how to continue."""
  clock = session.Clock(session.parse_deadline(cfg.train.deadline) if cfg.train.deadline
                        else None, cfg.train.checkpoint_minutes)
  if clock.left() <= 0:
    raise ConfigError(f"config key 'train.deadline' = {cfg.train.deadline!r}: already past "
                      f"({session.duration(-clock.left())} ago)")
  with clock.timed("load"):
    setup = build(cfg)
  run = cfg.run_path
  writer = MetricsWriter(run)
  writer.write_json("config.json", cfg.to_dict(), overwrite=False)
  trainer = Trainer(setup.graphdef, setup.base, cfg)
  sampler = make_sampler(setup)
  ckpt = Checkpointer(run / "checkpoints", cfg.train.keep_checkpoints)
  state = trainer.init_state(setup.lora, jax.random.PRNGKey(cfg.train.seed))
  # Every process draws the same global batch of questions (a few KB of text); placement
  # (mesh.put_batch) gives each process's devices only their rows.
  data = sources.train_iterator(setup.train_records, cfg.train.batch_size, cfg.train.seed)
  state, start, origin = _resume(cfg, ckpt, state, data)
  writer.start(start, carry_over=origin)

  results = _read_eval(run) if jax.process_index() == 0 else {}  # process 0 owns the files
  if cfg.train.eval_before and _agreed("before" not in results):
    with clock.timed("eval"):
      results["before"] = _eval_logged(setup, sampler, state.lora, writer, 0, "before")
    writer.write_json("eval.json", results)

  step, lora = _loop(setup, sampler, trainer, state, data, ckpt, writer, clock, start)
  stopped = step < cfg.train.steps
  if stopped and step == start:
    raise ConfigError(f"config key 'train.deadline' = {cfg.train.deadline!r}: too short for one "
                      f"step ({session.duration(clock.left())} left; the final save, evaluation "
                      f"and export alone take {session.duration(clock.reserve(True))})")
  tag = f"step-{step}" if stopped else "after"
  results["after"] = _eval_logged(setup, sampler, lora, writer, step, tag)
  writer.write_json("eval.json", results)
  plot = writer.plot()
  writer.close()
  ckpt.close()
  if "before" in results and jax.process_index() == 0:
    tqdm.write(f"held-out mean reward {results['before']['mean_reward']:.3f} -> "
               f"{results['after']['mean_reward']:.3f}; run in {run}"
               + (f", plot {plot}" if plot else ""))
  if stopped:
    results["stopped"] = _stop_line(cfg, step, command)
  return results


def _loop(setup: Setup, sampler: Sampler, trainer: Trainer, state, data, ckpt: Checkpointer,
          writer: MetricsWriter, clock: session.Clock, start: int):
  """Steps from `start` until train.steps or the deadline: (the step reached, saved; its LoRA
  weights)."""
  cfg = setup.cfg
  bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
             desc="GRPO", unit="step", disable=jax.process_index() != 0)
  step, saved = start, start
  for step in bar:
    if _agreed(clock.stop_before_next_step(eval_after=True)):
      break
    with clock.timed("step"):
      state, metrics = _grpo_step(setup, sampler, trainer, state, next(data), step)
    clock.times["eval_estimate"] = metrics["rollout_s"] * _eval_share(cfg)
    writer.samples(step + 1, "rollout", metrics.pop("samples"))
    writer.log(step + 1, metrics)
    bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                    fmt=f"{metrics['format_rate']:.2f}", s=f"{metrics['step_time_s']:.0f}")
    done = step + 1 == cfg.train.steps
    if (step + 1) % cfg.train.checkpoint_every == 0 or done or _agreed(clock.save_due()):
      with clock.timed("save"):
        ckpt.save(step + 1, _checkpoint_tree(state), data.get_state())
      saved = step + 1
    if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and not done:
      _eval_logged(setup, sampler, state.lora, writer, step + 1, f"step-{step + 1}")
  else:
    step = cfg.train.steps
  bar.close()
  if step != saved:  # stopped for the deadline after unsaved steps
    with clock.timed("save"):
      ckpt.save(step, _checkpoint_tree(state), data.get_state())
  return step, state.lora


def _eval_share(cfg: Config) -> float:
  """Held-out evaluation tokens over one rollout's tokens (an evaluation's time, estimated
  from the rollouts' while no evaluation has been timed in this process)."""
  return (cfg.data.num_eval * cfg.eval.max_new_tokens) / (
      cfg.train.batch_size * cfg.rollout.num_generations * cfg.rollout.max_new_tokens)


def _stop_line(cfg: Config, step: int, command: str | None) -> str:
  run = cfg.run_path
  again = command or f"python -m reasoner train {' '.join(_overrides(cfg))}".strip()
  line = (f"stopped for the deadline at step {step} of {cfg.train.steps} (saved in "
          f"{run / 'checkpoints' / str(step)}); continue with: {again} "
          f"(in a new session, with its new deadline and train.resume_from=<this run's "
          f"output, e.g. {run.absolute()}>)")
  if jax.process_index() == 0:
    tqdm.write(line)
  return line


def _overrides(cfg: Config) -> list[str]:
  return [f"train.run_dir={cfg.train.run_dir}", f"train.run_name={cfg.train.run_name}"]


def _resume(cfg: Config, ckpt: Checkpointer, state, data):
  """(state, step, origin): from this run's latest checkpoint, else from train.resume_from's
  (origin: that run's directory, whose logs this run carries on), else step 0."""
  own = _agreed(ckpt.latest_step() or 0)
  src, origin = ckpt, None
  if not own and cfg.train.resume_from:
    folder = find_checkpoints(cfg.train.resume_from)
    _check_compatible(cfg, folder.parent)
    src, origin = Checkpointer(folder, 1, read_only=True), folder.parent
  start = _agreed(src.latest_step() or 0)
  if not start:
    return state, 0, None
  tree, data_state = src.restore(start, _checkpoint_tree(state))
  data.set_state(data_state)
  if jax.process_index() == 0:
    tqdm.write(f"resumed from {src.directory}/{start} (step {start} of {cfg.train.steps})")
  return state.replace(**tree), start, origin


# What a checkpoint holds depends on these; a run of other values cannot continue from it.
_SHAPE_KEYS = (("model", "name"), ("lora", "rank"), ("lora", "alpha"), ("lora", "module_path"))


def _check_compatible(cfg: Config, other_run) -> None:
  p = other_run / "config.json"
  if not p.is_file():
    return  # a bare checkpoints folder: the restore checks the shapes
  old, new = json.loads(p.read_text()), cfg.to_dict()
  diff = [f"{a}.{b}: {old.get(a, {}).get(b)!r} -> {new[a][b]!r}" for a, b in _SHAPE_KEYS
          if old.get(a, {}).get(b) != new[a][b]]
  if diff:
    raise CheckpointError(f"config key 'train.resume_from' = '{cfg.train.resume_from}': that run "
                          f"differs in {'; '.join(diff)}; set them as it had them")


def _read_eval(run) -> dict:
  p = run / "eval.json"
  return json.loads(p.read_text()) if p.exists() else {}


def restore_lora(setup: Setup, step: int | None = None):
  """(LoRA weights, step) of the run's checkpoint at `step` (default: the latest), read-only;
  (the initial LoRA, 0) when the run has no checkpoint and no step was asked for."""
  folder = setup.cfg.run_path / "checkpoints"
  ckpt = Checkpointer(folder, 1, read_only=True) if folder.is_dir() else None
  steps = ckpt.all_steps() if ckpt else []
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step}: no such checkpoint in {folder} (it has "
                          f"{', '.join(map(str, steps)) or 'none'})")
  step = step if step is not None else max(steps, default=None)
  if step is None:
    return setup.lora, 0
  trainer = Trainer(setup.graphdef, setup.base, setup.cfg)
  state = trainer.init_state(setup.lora, jax.random.PRNGKey(0))
  tree, _ = ckpt.restore(step, _checkpoint_tree(state))
  return tree["lora"], step


def eval_only(cfg: Config) -> dict:
  setup = build(cfg)
  lora, step = restore_lora(setup)
  sampler = make_sampler(setup)
  result, rows = evaluate(setup, sampler, lora, setup.eval_records)
  _print_eval(f"checkpoint {step}" if step else "no checkpoint: base model", result, rows,
              cfg.train.num_log_samples)
  return result


def sample(cfg: Config, question: str, n: int) -> list[str]:
  setup = build(cfg)
  lora, _ = restore_lora(setup)
  sampler = make_sampler(setup)
  prompt = prompts_lib.render(cfg.data.template, question)
  scfg = sampling_config(cfg, setup.tokenizer, greedy=n == 1)
  comps, _, _ = sampler.sample((lora, setup.base), [prompt], jax.random.PRNGKey(cfg.train.seed),
                               scfg, max(n, 1) if n > 1 else 1)
  return comps.texts
