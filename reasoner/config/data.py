"""Where records come from, how prompts are written, and what they are evaluated on."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from reasoner.config.typed import fail as _fail


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Where questions and reference answers come from, and how prompts are written."""

  source: Literal["arithmetic", "jsonl", "parquet", "gsm8k"] = "arithmetic"
  path: str | None = None  # file for jsonl / parquet
  eval_path: str | None = None  # held-out file; default: the last num_eval records of `path`
  question_field: str = "question"
  answer_field: str = "answer"  # optional in a record: the reference answer
  category_field: str = "category"  # optional in a record: routes rewards (rewards[].categories)
  # SFT: the target text of a record (or a `messages` list ending in the model's turn)
  response_field: str = "response"
  # preference pairs (`prefer.pairs: file`): the better and the worse response (texts, or chat
  # `messages` lists ending in the model's turn)
  chosen_field: str = "chosen"
  rejected_field: str = "rejected"
  num_train: int = 2000  # arithmetic: problems generated for training
  num_eval: int = 64  # held-out problems
  seed: int = 0
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only
  # fewshot (two worked examples) for base models, chat for -it models, plain: the instruction and
  # the question only (a model SFT taught the format needs no examples)
  template: Literal["fewshot", "chat", "plain"] = "fewshot"
  max_prompt_tokens: int = 256
  overlong: Literal["drop", "error"] = "drop"  # prompts over max_prompt_tokens, found at load

  def __post_init__(self):
    if self.source in ("jsonl", "parquet") and not self.path:
      _fail("data.path", self.path, f"a file path when data.source is '{self.source}'")
    for f in ("num_train", "num_eval", "max_prompt_tokens"):
      if getattr(self, f) < 1:
        _fail(f"data.{f}", getattr(self, f), "a positive integer")



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSet:
  """A named evaluation set beside the held-out split, e.g. a benchmark's test file:
  {name: gsm8k, source: gsm8k} or {name: mine, source: jsonl, path: eval.jsonl, num: 200}."""

  name: str
  source: Literal["arithmetic", "jsonl", "parquet", "gsm8k"]
  path: str | None = None  # file for jsonl / parquet
  question_field: str = "question"
  answer_field: str = "answer"
  category_field: str = "category"
  num: int = 64  # the first `num` records (arithmetic: generated beside the training problems)
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) or self.name == "held-out":
      _fail("eval.sets[].name", self.name, "letters, digits, '_', '.' or '-', not 'held-out'")
    if self.source in ("jsonl", "parquet") and not self.path:
      _fail(f"eval.sets[{self.name}].path", self.path,
            f"a file path when its source is '{self.source}'")
    if self.num < 1:
      _fail(f"eval.sets[{self.name}].num", self.num, "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """Evaluation on the held-out split and on any named `sets`: greedy, and optionally sampled
  (pass@k, majority)."""

  batch_size: int = 32
  max_new_tokens: int = 64
  # Completions sampled per question at the rollouts' settings, for pass@k and majority-vote
  # accuracy beside the greedy figures; 0: greedy only.
  samples: int = 0
  pass_k: tuple[int, ...] = (1,)  # each at most `samples`
  sets: tuple[EvalSet, ...] = ()  # logged as eval/<name>/<metric>; the held-out as eval/<metric>

  def __post_init__(self):
    names = [s.name for s in self.sets]
    if len(set(names)) < len(names):
      _fail("eval.sets", names, "distinct names")
    if self.samples < 0:
      _fail("eval.samples", self.samples, "a non-negative integer")
    if self.samples and not all(1 <= k <= self.samples for k in self.pass_k):
      _fail("eval.pass_k", list(self.pass_k), f"values from 1 to eval.samples = {self.samples}")
    if self.batch_size < 1:
      _fail("eval.batch_size", self.batch_size, "a positive integer")
    if self.max_new_tokens < 1:
      _fail("eval.max_new_tokens", self.max_new_tokens, "a positive integer")

