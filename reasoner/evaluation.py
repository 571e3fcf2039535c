"""Held-out evaluation: greedy decoding (mean reward, accuracy, format rate) and, with
`eval.samples` = n > 0, n sampled completions per question at the rollouts' settings: pass@k
for each k of `eval.pass_k` (the unbiased estimator of Chen et al. 2021) and majority-vote
accuracy (the most frequent extracted answer against the reference).

Each evaluation covers the held-out split (logged as eval/<metric>) and every named set of
`eval.sets` (eval/<name>/<metric>; its figures also under "sets" in the held-out result).
Where the records have categories, the mean reward of each (`mean_reward/<category>`); where
they carry constraints (`rewards.instructions`), IFEval's four numbers (`ifeval/...`: prompt- and
instruction-level, strict and loose), and such a row is correct when it follows all of its
constraints strictly (so its accuracy is the prompt-level strict figure, paired like any); where
the run has a judge, the trained model's win rate against the model before training, judged
pairwise in both orders (`win_rate`, and by category). `python -m reasoner eval` runs
`eval_only` (and `sample` prints completions for one question); the training loop logs
`evaluate_all` before, every `train.eval_every` steps and after training.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math

import jax
import numpy as np
from tqdm import tqdm

from reasoner.build import Setup, build
from reasoner.config import Config
from reasoner.data import prompts as prompts_lib
from reasoner.engine.checkpoint import restore_lora
from reasoner.engine.metrics import MetricsWriter
from reasoner.engine.sampler import Sampler, SamplingConfig
from reasoner.rewards import builtin as rewards_lib
from reasoner.rewards import instructions as instructions_lib
from reasoner.rewards import scoring
from reasoner.rewards.judge import Judge


def pass_at_k(n: int, c: int, k: int) -> float:
  """P(at least one of k completions drawn without replacement from n, c of them correct, is
  correct) = 1 - C(n - c, k) / C(n, k): unbiased for the model's pass@k given n samples."""
  if not 0 < k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(completions: list[str], reference: str) -> float:
  """1 when the most frequent extracted answer (ties: the first seen) matches the reference;
  completions without an answer do not vote."""
  answers = [a for a in map(rewards_lib.extract_answer, completions) if a]
  if not answers:
    return 0.0
  top = collections.Counter(answers).most_common(1)[0][0]
  return float(rewards_lib.answers_match(top, str(reference)))


def evaluate(setup: Setup, sampler: Sampler, lora, records: list[dict],
             max_new_tokens: int | None = None) -> tuple[dict, list]:
  """Greedy decoding on held-out records (at most `max_new_tokens`, default
  eval.max_new_tokens): mean reward, accuracy and format rate; with `eval.samples`, pass@k and
  majority-vote accuracy too. Rows: the greedy completions."""
  cfg = setup.cfg
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=True)
  if max_new_tokens:
    scfg = dataclasses.replace(scfg, max_new_tokens=max_new_tokens)
  totals, correct, fmt, rows = [], [], [], []
  for i in range(0, len(records), cfg.eval.batch_size):
    chunk = records[i:i + cfg.eval.batch_size]
    prompts = [prompts_lib.render_record(cfg.data.template, r) for r in chunk]
    comps, _, _ = sampler.sample((lora, setup.base), prompts, jax.random.PRNGKey(0), scfg)
    answers = [r["answer"] for r in chunk]
    total, _ = setup.rewards.score(prompts, comps.texts, chunk)
    totals += total.tolist()
    correct += rewards_lib.accuracy(comps.texts, answers).tolist()
    fmt += rewards_lib.format_exact(prompts, comps.texts)
    rows += [{"question": r["question"], "answer": r["answer"], "category": r.get("category"),
              "completion": t, "reward": float(v)}
             for r, t, v in zip(chunk, comps.texts, total)]
  checked = [i for i, r in enumerate(records) if r.get("constraints")]
  strict, loose = instructions_lib.judge([rows[i]["completion"] for i in checked],
                                         [records[i]["constraints"] for i in checked])
  for i, followed in zip(checked, strict):
    correct[i] = float(all(followed))
  for row, c in zip(rows, correct):
    row["correct"] = None if math.isnan(c) else float(c)
  result = {"mean_reward": float(np.mean(totals)), "accuracy": rewards_lib.nan_mean(correct),
            "format_rate": float(np.mean(fmt)), "n": len(records),
            "mean_reward_se": standard_error(totals), "accuracy_se": standard_error(correct),
            "format_rate_se": standard_error(fmt),
            **by_category(totals, [r.get("category") for r in records]),
            **({f"ifeval/{k}": v for k, v in instructions_lib.ifeval_scores(strict, loose).items()}
               if checked else {}),
            **setup.rewards.take_timeouts()}  # this evaluation's, not the next step's
  if cfg.eval.samples:
    result.update(sampled(setup, sampler, lora, records))
  return result, rows


def standard_error(values) -> float:
  """The standard error of the mean of `values` (NaNs left out): sample std / sqrt(n); NaN
  below two values."""
  v = np.asarray(values, float)
  v = v[~np.isnan(v)]
  return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def paired_change(before: list[dict], after: list[dict]) -> dict | None:
  """The change of one evaluation set from `before` to `after` (rows of `evaluate`), paired by
  question: accuracy where the rows have reference answers, else the mean reward; the
  difference's standard error is that of the per-question differences, so what the two share
  (a question's difficulty) cancels. Each question once, its latest row on each side: a run
  trained on past its end evaluates again, beside its earlier rows. None where no question is
  in both."""
  theirs, ours = ({r["question"]: r for r in rows} for rows in (before, after))
  pairs = [(theirs[q], r) for q, r in ours.items() if q in theirs]
  if not pairs:
    return None
  metric = ("accuracy" if all(a.get("correct") is not None and b.get("correct") is not None
                              for b, a in pairs) else "mean_reward")
  key = "correct" if metric == "accuracy" else "reward"
  b, a = (np.asarray([p[k][key] for p in pairs], float) for k in (0, 1))
  return {"metric": metric, "n": len(pairs), "before": float(b.mean()),
          "after": float(a.mean()), "change": float((a - b).mean()),
          "se": standard_error(a - b)}


def describe_change(name: str, c: dict) -> str:
  """'retention (256): accuracy 0.604 -> 0.406 (-0.198 +/- 0.035 SE, paired)'."""
  return (f"{name} ({c['n']}): {c['metric'].replace('_', ' ')} {c['before']:.3f} -> "
          f"{c['after']:.3f} ({c['change']:+.3f} +/- {c['se']:.3f} SE, paired)")


def by_category(totals: list[float], categories: list) -> dict[str, float]:
  """`mean_reward/<category>` for each category, where the records have two or more (a judge's
  rubric scores, category by category, as the people judging see them)."""
  names = sorted({c for c in categories if c})
  if len(names) < 2:
    return {}
  totals, categories = np.asarray(totals), np.asarray(categories, object)
  return {f"mean_reward/{c}": float(totals[categories == c].mean()) for c in names}


def sampled(setup: Setup, sampler: Sampler, lora, records: list[dict]) -> dict:
  """pass@k (each k of `eval.pass_k`) and majority-vote accuracy over `eval.samples`
  completions a question, sampled as rollouts are (temperature, top-k, top-p), on the questions
  with a reference answer (NaN when none has one)."""
  cfg, n = setup.cfg, setup.cfg.eval.samples
  records = [r for r in records if r["answer"] is not None]
  if not records:
    return {**{f"pass@{k}": float("nan") for k in cfg.eval.pass_k}, "majority": float("nan")}
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=False)
  scfg = dataclasses.replace(scfg, max_new_tokens=cfg.eval.max_new_tokens)
  per = max(1, cfg.eval.batch_size // n)
  hits, votes = [], []
  for i in range(0, len(records), per):
    chunk = records[i:i + per]
    prompts = [prompts_lib.render_record(cfg.data.template, r) for r in chunk]
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), i)
    comps, _, _ = sampler.sample((lora, setup.base), prompts, key, scfg, n)
    for j, r in enumerate(chunk):
      texts = comps.texts[j * n:(j + 1) * n]
      hits.append(int(sum(rewards_lib.correct(prompts, texts, answer=[r["answer"]] * n))))
      votes.append(majority_correct(texts, r["answer"]))
  out = {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in hits]))
         for k in cfg.eval.pass_k}
  return {**out, "majority": float(np.mean(votes))}


def print_eval(tag: str, result: dict, rows: list, n_samples: int, name: str = "held-out"
               ) -> None:
  if jax.process_index() != 0:
    return
  extra = "".join(f"  {k} {v:.3f}" for k, v in result.items()
                  if k.startswith("pass@") or k == "majority")
  se = lambda k: f" +/- {result[k + '_se']:.3f}" if result.get(k + "_se", math.nan) > 0 else ""
  tqdm.write(f"[{tag}] {name} ({result['n']}): mean reward {result['mean_reward']:.3f}  "
             f"accuracy {result['accuracy']:.3f}{se('accuracy')}  format rate "
             f"{result['format_rate']:.3f}{extra}")
  for what in ("mean_reward", "win_rate"):
    cats = [f"{k.split('/', 1)[1]} {v:.3f}" for k, v in result.items()
            if k.startswith(f"{what}/")]
    if cats:
      tqdm.write(f"  {what.replace('_', ' ')} by category: {', '.join(cats)}")
  if "ifeval/prompt_level_strict" in result:
    tqdm.write("  IFEval: prompt-level strict {prompt_level_strict:.3f} +/- "
               "{prompt_level_strict_se:.3f}, loose {prompt_level_loose:.3f}; instruction-level "
               "strict {instruction_level_strict:.3f}, loose {instruction_level_loose:.3f}".format(
                   **{k.split("/", 1)[1]: v for k, v in result.items()
                      if k.startswith("ifeval/")}))
  if "win_rate" in result:
    tqdm.write(f"  win rate against the model before training (the judge, both orders, "
               f"{result['win_rate_n']} questions): {result['win_rate']:.3f}")
  for r in rows[:n_samples]:
    tqdm.write(f"  Q: {r['question']}\n  A: {r['completion']!r}  (reward {r['reward']:.2f}, "
               f"reference {r['answer']})")


def win_rate(setup: Setup, rows: list[dict], versus: list[dict]) -> dict[str, float]:
  """`win_rate` (and `win_rate/<category>`): the judge's mean probability that each of `rows`'
  completions beats `versus`' for the same question (`Judge.pairwise`, both orders); {} where
  the run has no judge or no completion to compare, and on several hosts (the completions
  before training are in process 0's samples.jsonl alone, and the judge's forward spans them
  all). The judge has its reward's time limit (`rewards[].timeout_s`): past it, one line and
  no win rate; a signal meanwhile stops waiting (`RewardInterrupted`), as for a reward."""
  if jax.process_count() > 1:
    return {}
  k = next((k for k, f in enumerate(setup.rewards.fns) if isinstance(f, Judge)), None)
  theirs = {r["question"]: r["completion"] for r in versus}
  rows = [r for r in rows if r["question"] in theirs]
  if k is None or not rows:
    return {}
  judge, limit = setup.rewards.fns[k], setup.rewards.specs[k].timeout_s
  future = scoring.in_thread(lambda: judge.pairwise(
      [r["completion"] for r in rows], [theirs[r["question"]] for r in rows],
      [r["question"] for r in rows], [r["answer"] for r in rows]))
  try:
    p = scoring.wait(future, limit, setup.rewards.cancel, "the judge compared completions")
  except concurrent.futures.TimeoutError:
    tqdm.write(f"  win rate: the judge did not return within {limit:g} s "
               f"(rewards[{k}].timeout_s); no win rate this evaluation")
    return {}
  cats = np.asarray([r.get("category") for r in rows], object)
  return {"win_rate": float(p.mean()), "win_rate_n": len(rows),
          **{f"win_rate/{c}": float(p[cats == c].mean())
             for c in sorted({c for c in cats if c}) if len(set(cats) - {None}) > 1}}


def evaluate_all(setup: Setup, sampler: Sampler, lora, tag: str,
                 writer: MetricsWriter | None = None, step: int = 0,
                 versus: list[dict] | None = None) -> dict:
  """The held-out split and each named set evaluated, printed (the held-out's first samples
  too) and, with `writer`, logged with their completions. The held-out result, with the named
  sets' under "sets". `versus`: another model's held-out completions (the model before
  training's), which the judge compares with these (`win_rate`)."""
  sets = {"held-out": setup.eval_records, **setup.eval_sets}
  budgets = {s.name: s.max_new_tokens for s in setup.cfg.eval.sets}
  out = {}
  for name, records in sets.items():
    result, rows = evaluate(setup, sampler, lora, records, budgets.get(name))
    held_out = name == "held-out"
    if held_out and versus:
      result.update(win_rate(setup, rows, versus))
    print_eval(tag, result, rows, setup.cfg.train.num_log_samples if held_out else 0, name)
    if writer is not None:
      prefix = "eval/" if held_out else f"eval/{name}/"
      writer.samples(step, f"eval-{tag}" if held_out else f"eval-{name}-{tag}", rows)
      writer.log(step, {f"{prefix}{k}": v for k, v in result.items()})
    out[name] = result
  result = out.pop("held-out")
  return {**result, "sets": out} if out else result


def eval_only(cfg: Config) -> dict:
  setup = build(cfg)
  lora, step = restore_lora(setup)
  sampler = Sampler.for_run(setup)
  return evaluate_all(setup, sampler, lora,
                      f"checkpoint {step}" if step else "no checkpoint: base model")


def sample(cfg: Config, question: str, n: int, category: str | None = None) -> list[str]:
  """`python -m reasoner sample`: n completions (1: greedy) of the run's newest LoRA, the
  question asked as a record of `category` asks (None: math's prompt)."""
  setup = build(cfg)
  lora, _ = restore_lora(setup)
  sampler = Sampler.for_run(setup)
  prompt = prompts_lib.render(cfg.data.template, question, category)
  scfg = SamplingConfig.for_run(cfg, setup.tokenizer, greedy=n == 1)
  comps, _, _ = sampler.sample((lora, setup.base), [prompt], jax.random.PRNGKey(cfg.train.seed),
                               scfg, max(n, 1) if n > 1 else 1)
  return comps.texts
