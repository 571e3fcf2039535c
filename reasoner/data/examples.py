"""Tokenised examples for the stages that learn from written responses (SFT's response, a
preference pair's chosen and rejected), and their length-bucketed batches.

An example is a record's prompt, rendered by `data.template` exactly as rollouts and evaluation
render it, and one or more responses, each followed by the end-of-turn (chat) or
end-of-sequence token: (prompt ids, response ids, ...). Batches sort examples by length
(prompt bucket, then the longest response) within windows of `window` batches and pad each
batch to its own longest prompt and response (rounded up to `bucket`), so that padding stays
small and few shapes compile.
"""

from __future__ import annotations

import math

import numpy as np

from reasoner.data import prompts as prompts_lib, sources
from reasoner.errors import DataError
from reasoner.models.prompt import common_prefix


def stop_id(template: str, tokenizer) -> int:
  """The token that ends a response: end of turn for the chat template, else end of sequence."""
  return tokenizer.end_of_turn_id if template == "chat" and tokenizer.end_of_turn_id else (
      tokenizer.eos_id)


def encode(records: list[dict], template: str, tokenizer, max_prompt: int, max_response: int,
           overlong: str, log=print, fields: tuple[str, ...] = ("response",),
           stage: str = "sft", limit_key: str = "sft.max_response_tokens",
           kept: list[int] | None = None) -> list[tuple[list[int], ...]]:
  """(prompt ids with BOS, each of `fields`' ids with the stop token) of each record that fits;
  the rest dropped with one line of counts, or refused ('error'), as data.overlong says. `kept`
  (a list) receives the kept records' indices."""
  stop = stop_id(template, tokenizer)
  out = []
  for i, r in enumerate(records):
    p = tokenizer.encode(prompts_lib.render_record(template, r), add_bos=True)
    ys = [[*tokenizer.encode(r[f]), stop] for f in fields]
    longest = max(map(len, ys))
    if len(p) <= max_prompt and longest <= max_response:
      out.append((p, *ys))
      if kept is not None:
        kept.append(i)
    elif overlong == "error":
      raise DataError(f"{stage}: record {i} has {len(p)} prompt and {longest} response tokens, "
                      f"over data.max_prompt_tokens = {max_prompt} or {limit_key} = "
                      f"{max_response} (data.overlong: error): {r['question'][:60]!r}")
  if len(out) < len(records):
    log(f"{stage}: dropped {len(records) - len(out)} of {len(records)} examples over "
        f"data.max_prompt_tokens = {max_prompt} or {limit_key} = {max_response}")
  return out


class Batches:
  """An endless, deterministic iterator of length-bucketed host batches. Epoch e shuffles the
  examples (seed, e) (a mixture's epoch draws its examples by their sources' weights instead,
  `sources.draw_weights`), sorts each window of `window` batches by length, cuts it into batches and
  shuffles the epoch's batches; the state is the number of batches drawn (`get_state`), so a
  resumed run draws exactly the batches it would have drawn. A batch holds `prompt`,
  `prompt_valid` [B, P] (left-padded) and `response`, `response_mask` [B * k, N] (right-padded),
  the k responses of each example in consecutive rows."""

  def __init__(self, examples: list, batch_size: int, seed: int, window: int, bucket: int,
               pad_id: int, stage: str = "SFT", weights: np.ndarray | None = None,
               heads: "Heads | None" = None):
    if len(examples) < batch_size:
      raise DataError(f"{stage.lower()}: {len(examples)} examples, fewer than "
                      f"train.batch_size = {batch_size}")
    self.examples, self.batch_size, self.seed = examples, batch_size, seed
    self.window, self.bucket, self.pad_id, self.stage = window, bucket, pad_id, stage
    self.per_epoch = len(examples) // batch_size
    # a mixture's: each example's chance of a draw (`sources.draw_weights`); None: each once
    self.p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    self.position, self._cached = 0, (None, None)
    self.heads = heads  # each batch's prompts split into shared heads and their rests

  def _size(self, i: int) -> tuple[int, int]:
    ex = self.examples[i]  # by prompt bucket, then the longest response
    return math.ceil(len(ex[0]) / self.bucket), max(len(y) for y in ex[1:])

  def epoch(self, e: int) -> np.ndarray:
    """The batches of epoch e, as arrays of example indices."""
    if self._cached[0] != e:
      rng = np.random.default_rng([self.seed, e])
      n = self.per_epoch * self.batch_size
      order = (rng.permutation(len(self.examples))[:n] if self.p is None
               else rng.choice(len(self.examples), n, p=self.p))
      span = self.window * self.batch_size
      order = np.concatenate([sorted(order[k:k + span], key=self._size)
                              for k in range(0, len(order), span)])
      batches = order.reshape(self.per_epoch, self.batch_size)
      self._cached = (e, batches[rng.permutation(self.per_epoch)])
    return self._cached[1]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    e, i = divmod(self.position, self.per_epoch)
    self.position += 1
    rows = self.epoch(e)[i]
    if self.heads is None:
      return self.pad([self.examples[j] for j in rows])
    return self.heads.pad([self.examples[j] for j in rows], rows)

  def get_state(self) -> dict:
    return {"position": self.position}

  def set_state(self, state: dict) -> None:
    if set(state) != {"position"}:
      raise DataError(f"{self.stage.lower()}: the checkpoint's data state {sorted(state)} is "
                      f"not {'an' if self.stage == 'SFT' else 'a'} {self.stage} run's")
    self.position = int(state["position"])

  def padding(self) -> float:
    """The padded share of the tokens of the first epoch's batches."""
    real = sum(sum(map(len, ex)) for ex in self.examples[:self.per_epoch * self.batch_size])
    total = 0
    for b in self.epoch(0):
      width, n = widths([self.examples[j] for j in b], self.bucket)
      total += len(b) * (width + n * (len(self.examples[b[0]]) - 1))
    return 1.0 - real / total

  def pad(self, examples: list) -> dict[str, np.ndarray]:
    return pad(examples, self.pad_id, self.bucket)


def for_run(setup, max_response: int, log=None, fields: tuple[str, ...] = ("response",),
            stage: str = "sft", limit_key: str = "sft.max_response_tokens", cls=None,
            noun: str = "examples", shared_heads: bool = False) -> "Batches":
  """A stage's batches of the run's training records (`cls`, default `Batches`): encoded,
  drawn by a mixture's shares (`sources.draw_weights`) where there is one, length-bucketed as
  `sft.window` / `sft.bucket` say; the padding share logged. `shared_heads`: each category's
  shared prompt head split off (`Heads.of_examples`), logged too."""
  cfg = setup.cfg
  kept: list[int] = []
  examples = encode(setup.train_records, cfg.data.template, setup.tokenizer,
                    cfg.data.max_prompt_tokens, max_response, cfg.data.overlong,
                    log or (lambda _: None), fields, stage, limit_key, kept)
  records = [setup.train_records[i] for i in kept]
  weights = sources.draw_weights(records, cfg.data.mixture)
  heads = (Heads.of_examples(examples, [r.get("category") for r in records],
                             setup.tokenizer.pad_id, cfg.sft.bucket) if shared_heads else None)
  out = (cls or Batches)(examples, cfg.train.batch_size, cfg.train.seed, cfg.sft.window,
                         cfg.sft.bucket, setup.tokenizer.pad_id,
                         "SFT" if stage == "sft" else "preference", weights, heads)
  if log:
    log(f"{stage}: {len(examples)} {noun}, {out.per_epoch} batches an epoch, "
        f"{out.padding():.1%} of their tokens padding")
    if heads is not None:
      log(f"{stage}: {heads.describe(examples)}")
  return out


class Heads:
  """The prompt heads that a category's prompts share (a few-shot header: its common prefix,
  less the last token, which must run), each example's head (`of`; the empty head where its
  category has none of at least `least` tokens), and the batches that hold each prompt as its
  head and its rest (`pad`): the train step runs each head once (`models.prompt.Heads`). The
  heads' arrays `tokens`, `valid` [K, H] (right-padded, H rounded up to `bucket`) are every
  batch's, made once."""

  def __init__(self, heads: list[list[int]], of: np.ndarray, pad_id: int, bucket: int):
    self.heads, self.of, self.pad_id, self.bucket = heads, of, pad_id, bucket
    h = math.ceil(max(map(len, heads)) / bucket) * bucket
    self.tokens = np.full((len(heads), h), pad_id, np.int32)
    self.valid = np.zeros((len(heads), h), bool)
    for k, head in enumerate(heads):
      self.tokens[k, :len(head)], self.valid[k, :len(head)] = head, True

  @classmethod
  def of_examples(cls, examples: list, groups: list, pad_id: int, bucket: int,
                  least: int = 32) -> "Heads":
    prompts: dict = {}
    for ex, g in zip(examples, groups):
      prompts.setdefault(g, []).append(ex[0])
    found = {}
    for g, ps in prompts.items():
      n = min(common_prefix(ps), min(map(len, ps)) - 1) if len(ps) > 1 else 0
      if n >= least:
        found[g] = ps[0][:n]
    heads = list(found.values())
    index = {g: i for i, g in enumerate(found)}
    if len(index) < len(prompts):
      heads.append([])  # the prompts of a category without a head
    of = np.asarray([index.get(g, len(heads) - 1) for g in groups], np.int32)
    return cls(heads, of, pad_id, bucket)

  def describe(self, examples: list) -> str:
    """How many heads, their lengths and the share of the prompts' tokens they hold."""
    held = sum(len(self.heads[k]) for k in self.of)
    lengths = ", ".join(str(len(h)) for h in self.heads if h) or "none"
    return (f"{sum(1 for h in self.heads if h)} shared prompt heads ({lengths} tokens), each "
            f"run once a batch: {held / sum(len(ex[0]) for ex in examples):.0%} of the prompts' "
            "tokens")

  def pad(self, examples: list, rows) -> dict[str, np.ndarray]:
    """`pad` of the examples (those at `rows`) as their rests after their heads, with
    `head_of` [B] and the heads `head_tokens`, `head_valid` [K, H]."""
    of = self.of[np.asarray(rows)]
    rests = [(ex[0][len(self.heads[k]):], *ex[1:]) for ex, k in zip(examples, of)]
    return {**pad(rests, self.pad_id, self.bucket), "head_of": of, "head_tokens": self.tokens,
            "head_valid": self.valid}


def widths(examples: list, bucket: int) -> tuple[int, int]:
  """The longest prompt and the longest response of `examples`, rounded up to `bucket`."""
  up = lambda n: math.ceil(n / bucket) * bucket
  return up(max(len(ex[0]) for ex in examples)), up(max(len(y) for ex in examples
                                                        for y in ex[1:]))


def pad(examples: list, pad_id: int, bucket: int) -> dict[str, np.ndarray]:
  """Host arrays of (prompt, response, ...) examples: `prompt`, `prompt_valid` [B, P]
  left-padded; `response`, `response_mask` [B * k, N] right-padded, an example's k responses in
  consecutive rows; both widths rounded up to `bucket`."""
  width, n = widths(examples, bucket)
  k = len(examples[0]) - 1
  out = {"prompt": np.full((len(examples), width), pad_id, np.int32),
         "prompt_valid": np.zeros((len(examples), width), bool),
         "response": np.full((len(examples) * k, n), pad_id, np.int32),
         "response_mask": np.zeros((len(examples) * k, n), bool)}
  for e, (p, *ys) in enumerate(examples):
    out["prompt"][e, width - len(p):], out["prompt_valid"][e, width - len(p):] = p, True
    for j, y in enumerate(ys):
      out["response"][e * k + j, :len(y)], out["response_mask"][e * k + j, :len(y)] = y, True
  return out
