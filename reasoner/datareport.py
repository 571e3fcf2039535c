"""`python -m reasoner data`: what the model will be shown, before any chip time.

No model is loaded. The records are read as a run reads them (`sources.load_splits`,
`sources.load_eval_set`, each source's summary line printed) and counted with the run's
tokenizer, read on its own: the byte tokenizer; the embedded GGUF's (its 262,144-entry
vocabulary parsed: 15-20 s on a 2-core CPU, the bulk of the command's time); a Kaggle model's
tokenizer.model from model.path or kagglehub's cache. Nothing is downloaded: where a Kaggle
model's tokenizer.model is not on this machine, a Gemma 3 model is counted with the embedded
Gemma 3 tokenizer (the vocabulary Gemma 3 models share, `load.vocabulary`) and any other (Gemma
2) by characters / 4, labelled an estimate.

For each training source (data.source, or each data.mixture[] entry) and each eval.sets[] entry:
its records (training, held out) and their share of the draws (`sources.draw_weights`) by
category; its prompt and response lengths in tokens (median, 95th percentile by nearest rank,
maximum) against their budgets and how many exceed them; and two examples, the prompt
rendered by data.template exactly as the model reads it (printed between a `---` line and a
line `--- ...` after one newline of its own, so that a trailing newline shows as an empty line).
A prompt counts its BOS, a response its stop token, as `prompts.within_limit` and
`examples.encode` do.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import time

from reasoner import credentials
from reasoner.config import Config, ModelConfig
from reasoner.data import prompts, sources
from reasoner.models import kaggle, load
from reasoner.models.tokenizer import ByteTokenizer

# stage: (its response budget's key, the record's texts it counts: a record's longest)
STAGES = {"grpo": ("rollout.max_new_tokens", ("response",)),
          "distill": ("rollout.max_new_tokens", ("response",)),
          "sft": ("sft.max_response_tokens", ("response",)),
          "prefer": ("prefer.max_response_tokens", ("chosen", "rejected"))}


@dataclasses.dataclass(frozen=True)
class Counter:
  """Token counts by the run's tokenizer, or by characters / 4 where it is not at hand."""

  label: str
  tokenizer: object | None = None  # None: characters / 4, an estimate

  def count(self, text: str) -> int:
    """The tokens of `text` and one more: a prompt's BOS, or a response's stop token."""
    if self.tokenizer is None:
      return math.ceil(len(text) / 4) + 1
    return len(self.tokenizer.encode(text)) + 1


def counter(m: ModelConfig) -> Counter:
  """The run's tokenizer for model section `m`, read without the model's weights."""
  if m.tokenizer == "bytes":
    return Counter("the byte tokenizer (a token a UTF-8 byte)", ByteTokenizer())
  why = "the embedded Gemma 3 tokenizer"
  if m.source == "kaggle":
    local = _kaggle_tokenizer(m)
    if local is not None:
      return Counter(f"{m.name}'s {local}", kaggle.tokenizer(kaggle.Layout(local.parent, local)))
    missing = (f"{m.name}'s tokenizer.model is not on this machine (no model.path, no complete "
               "copy in kagglehub's cache; nothing is downloaded)")
    if load.vocabulary(m)[0] != "gemma3":
      return Counter(f"an ESTIMATE, characters / 4: {missing}")
    why = f"{missing}: the embedded Gemma 3 270M's, the vocabulary every Gemma 3 shares"
  start = time.perf_counter()
  tokenizer = load.embedded_tokenizer()
  return Counter(f"{why} (read in {time.perf_counter() - start:.1f} s)", tokenizer)


def _kaggle_tokenizer(m: ModelConfig) -> pathlib.Path | None:
  """A Kaggle model's tokenizer.model on this machine: model.path's (a bad one is one line), or
  that of the newest complete download in kagglehub's cache; None otherwise."""
  if m.path:
    return kaggle.find_layout(pathlib.Path(m.path), kaggle.variant(m)).tokenizer
  if not m.kaggle_handle:
    return None
  from kagglehub.handle import parse_model_handle

  hit = credentials.newest_cached(parse_model_handle(m.kaggle_handle))
  return None if hit is None else kaggle.find_layout(hit[1], kaggle.variant(m)).tokenizer


def _budget(cfg: Config, key: str) -> int:
  section, name = key.split(".")
  return getattr(getattr(cfg, section), name)


def report(cfg: Config, stage: str = "grpo", out=print, tokens: Counter | None = None) -> None:
  """Prints what `stage` will show the model of cfg's data (`out`: where each line goes;
  `tokens`: the counter, default the run's tokenizer)."""
  key, fields = STAGES[stage]
  d = cfg.data
  sets = {s.name: sources.load_eval_set(s, d, log=out) for s in cfg.eval.sets}
  train, held = sources.load_splits(d, log=out, evaluated=sets)
  tokens = tokens or counter(cfg.model)
  out(f"tokens: {tokens.label}; a prompt's count includes its BOS, a response's its stop token")
  out(f"budgets: prompts data.max_prompt_tokens = {d.max_prompt_tokens} (data.template: "
      f"{d.template}, data.overlong: {d.overlong}); responses, stage {stage}: {key} = "
      f"{_budget(cfg, key)}" + ("; evaluation sets' answers: eval.max_new_tokens = "
                                f"{cfg.eval.max_new_tokens}" if sets else "")
      + "".join(f", {s.name}'s {s.max_new_tokens}" for s in cfg.eval.sets if s.max_new_tokens))
  weights = sources.draw_weights(train, d.mixture) or [1.0] * len(train)
  if d.curriculum is not None:
    out("data.curriculum: the draws below change over the run as the curriculum orders them")
  label = lambda c: c.source if c.path is None else f"{c.source} {c.path}"
  groups = [(None, label(d))] if d.mixture is None else [(m.name, label(m)) for m in d.mixture]
  if d.mixture is not None and len(d.mixture) > 1:
    out("")
    out(f"the mixture: {len(train)} training, {len(held)} held out, drawn by weight "
        + ", ".join(f"{m.name} {m.weight:g}" for m in d.mixture))
    _categories(train, held, weights, sum(weights), out)
  for name, where in groups:
    mine = lambda rs: [i for i, r in enumerate(rs) if name is None or r["source"] == name]
    t, h = mine(train), mine(held)
    share = sum(weights[i] for i in t) / sum(weights)
    out("")
    out(f"== {'data' if name is None else f'data.mixture {name!r}'} ({where}): {len(t)} "
        f"training, {len(h)} held out; {share:.1%} of the draws")
    _categories([train[i] for i in t], [held[i] for i in h], [weights[i] for i in t],
                sum(weights), out)
    _source(cfg, [train[i] for i in t], [held[i] for i in h], tokens, key, fields, stage, out)
  for s in cfg.eval.sets:
    out("")
    out(f"== evaluation set {s.name!r} ({label(s)}): {len(sets[s.name])} evaluated")
    _categories(sets[s.name], None, None, None, out)
    key = (f"eval.sets[{s.name}].max_new_tokens" if s.max_new_tokens else
           "eval.max_new_tokens")
    _source(cfg, sets[s.name], [], tokens, key, ("response",), "eval", out,
            s.max_new_tokens or cfg.eval.max_new_tokens)


def _categories(records: list[dict], held: list[dict] | None, weights: list[float] | None,
                total: float | None, out) -> None:
  """A table by category: the records (with `held`: the training and the held-out ones, and
  the training records' share of all the draws, by their `weights` of `total`)."""
  cat = lambda r: r["category"] or "(none)"
  rows = [("category", "records")] if held is None else [
      ("category", "training", "held out", "draws")]
  for c in sorted({cat(r) for r in records + (held or [])}):
    row = (c, str(sum(cat(r) == c for r in records)))
    if held is not None:
      drawn = sum(w for r, w in zip(records, weights) if cat(r) == c) / total
      row += (str(sum(cat(r) == c for r in held)), f"{drawn:.1%}")
    rows.append(row)
  width = max(len(r[0]) for r in rows)
  for r in rows:
    out("  " + r[0].ljust(width) + "".join(x.rjust(10) for x in r[1:]))


def _source(cfg: Config, train: list[dict], held: list[dict], tokens: Counter, key: str,
            fields: tuple[str, ...], stage: str, out, budget: int | None = None) -> None:
  """A source's prompt and response lengths against their budgets (the response's: `budget`,
  else config key `key`'s), and two examples."""
  d = cfg.data
  render = lambda r: prompts.render_record(d.template, r)
  lengths = [tokens.count(render(r)) for r in train + held]
  limit = d.max_prompt_tokens
  fate = f"dropped at load (data.overlong: {d.overlong})" if d.overlong == "drop" else (
      "refused at load (data.overlong: error)")
  out(f"  prompt tokens ({'training and held out' if held else 'every record'}): "
      f"{_spread(lengths)}; {_over(lengths, limit)} over data.max_prompt_tokens = {limit}"
      + (f", {fate}" if max(lengths) > limit else ""))
  texts = [[r[f] for f in fields if r.get(f) is not None] for r in train]
  answered = [max(tokens.count(x) for x in ts) for ts in texts if ts]
  budget = budget or _budget(cfg, key)
  what = " and ".join(fields)
  if not answered:
    out(f"  {what}: no record has one")
  else:
    past = {"sft": f", {fate}", "prefer": f", {fate}", "eval": ""}.get(
        stage, " (reference texts longer than a rollout may write)")
    out(f"  {what} tokens ({len(answered)} of {len(train)} records have one): "
        f"{_spread(answered)}; {_over(answered, budget)} over {key} = {budget}"
        + (past if max(answered) > budget else ""))
  _examples(train, lengths[:len(train)], limit, render, fields, tokens, out)


def _examples(records: list[dict], lengths: list[int], limit: int, render, fields, tokens,
              out) -> None:
  """The first record whose prompt fits `limit`, and the longest that fits: the prompt as
  `render` writes it and each of `fields` it has, verbatim, each after a `---` line."""
  fit = [i for i, n in enumerate(lengths) if n <= limit]
  longest = max(fit[1:], key=lambda i: lengths[i], default=None)
  shown = fit[:1] + ([] if longest is None else [longest])
  for k, i in enumerate(shown):
    note = "the first that fits" if k == 0 else "the longest prompt that fits"
    out(f"--- example {k + 1} ({note}: record {i}): prompt, {lengths[i]} tokens ---")
    out(render(records[i]))
    for f in fields:
      if records[i].get(f) is not None:
        out(f"--- {f}, {tokens.count(records[i][f])} tokens ---")
        out(records[i][f])
    out("--- end ---")
  if not fit:
    out(f"  (no prompt fits in {limit} tokens: no example)")


def _spread(values: list[int]) -> str:
  """'median m, p95 p, max x': the 95th percentile by nearest rank (the least value at least
  95% of them are at or below)."""
  ordered = sorted(values)
  p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]
  return f"median {statistics.median(ordered):g}, p95 {p95}, max {ordered[-1]}"


def _over(values: list[int], limit: int) -> str:
  return f"{sum(v > limit for v in values)} of {len(values)}"
