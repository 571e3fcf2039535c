"""Where records come from, how prompts are written, and what they are evaluated on."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from reasoner.config.typed import fail as _fail


Source = Literal["arithmetic", "instructions", "jsonl", "parquet", "gsm8k"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fields:
  """The names of a file record's fields (data.*, data.mixture[], eval.sets[])."""

  question_field: str = "question"
  answer_field: str = "answer"  # optional in a record: the reference answer
  category_field: str = "category"  # optional in a record: routes rewards (rewards[].categories)
  # SFT: the target text of a record (or a `messages` list ending in the model's turn)
  response_field: str = "response"
  # preference pairs (`prefer.pairs: file`): the better and the worse response (texts, or chat
  # `messages` lists ending in the model's turn)
  chosen_field: str = "chosen"
  rejected_field: str = "rejected"
  # optional in a record: the judge's criteria for it, a list of {criterion, weight} (negative
  # weights are pitfalls) or of strings (weight 1); records without one get `judge.rubric`
  rubric_field: str = "rubric"
  # optional in a record: instructions code can check, a list of {kind, args} with IFEval's
  # kind names (the `instructions` reward; rewards/instructions.py)
  constraints_field: str = "constraints"
  # optional in a record: the tests its code must pass, Python asserts (a string) or a list of
  # {input, output} stdin/stdout pairs (the `tests_pass` reward; rewards/sandbox.py)
  tests_field: str = "tests"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSource(Fields):
  """One source of a mixture (`data.mixture`): its records are drawn in proportion to `weight`
  (grain's weighted mix), each keeping its category; `num_eval` of them are held out."""

  name: str
  weight: float = 1.0
  source: Source = "jsonl"
  path: str | None = None
  eval_path: str | None = None
  num_eval: int = 16
  category: str | None = None  # for its records that name none (e.g. math for the arithmetic)
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only

  def __post_init__(self):
    key = f"data.mixture[{self.name}]"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
      _fail("data.mixture[].name", self.name, "letters, digits, '_', '.' or '-'")
    if not self.weight > 0:
      _fail(f"{key}.weight", self.weight, "a positive number (its share of the draws)")
    if self.source in ("jsonl", "parquet") and not self.path:
      _fail(f"{key}.path", self.path, f"a file path when its source is '{self.source}'")
    if self.num_eval < 0:
      _fail(f"{key}.num_eval", self.num_eval, "0 or a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
  """From step `from_step` on, the records whose curriculum field is one of `values`."""

  from_step: int
  values: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
  """Which records the RL stages draw, step by step (data/curriculum.py): by a record field on a
  schedule, and/or adaptively, prompts solved in every sample or in none set aside a while."""

  field: str | None = None  # a record field, e.g. difficulty; records without it always drawn
  schedule: tuple[Phase, ...] = ()  # [{from_step: 0, values: [easy]}, {from_step: 50, ...}]
  set_aside_steps: int = 0  # adaptive: 0 off; N: a prompt solved or failed by all G, N steps out
  solved_at: float = 1.0  # a group solves its prompt when every reward is at least this
  failed_at: float = 0.0  # and fails it when every reward is at most this

  def __post_init__(self):
    if (self.field is None) != (not self.schedule):
      _fail("data.curriculum.field", self.field, "a field together with a schedule, or "
            "neither")
    steps = [p.from_step for p in self.schedule]
    if self.schedule and (steps[0] != 0 or steps != sorted(set(steps))):
      _fail("data.curriculum.schedule", steps, "phases from step 0 on, in increasing order")
    for k, p in enumerate(self.schedule):
      if not p.values:
        _fail(f"data.curriculum.schedule[{k}].values", list(p.values), "one value or more")
    if self.set_aside_steps < 0:
      _fail("data.curriculum.set_aside_steps", self.set_aside_steps, "0 (off) or more")
    if not self.schedule and not self.set_aside_steps:
      _fail("data.curriculum", "{}", "a field and schedule, set_aside_steps, or both (or null)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(Fields):
  """Where questions and reference answers come from, and how prompts are written."""

  source: Source = "arithmetic"
  path: str | None = None  # file for jsonl / parquet
  eval_path: str | None = None  # held-out file; default: the last num_eval records of `path`
  # several sources, drawn by weight (source and path then unused): [{name, weight, source,
  # path, category, ...}, ...]
  mixture: tuple[MixtureSource, ...] | None = None
  curriculum: CurriculumConfig | None = None  # the RL stages' order (data/curriculum.py)
  num_train: int = 2000  # arithmetic: problems generated for training
  num_eval: int = 64  # held-out problems
  seed: int = 0
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only
  # arithmetic: what the held-out split holds out. record: new questions in the wordings
  # training saw (fit); template: whole wordings, a third of each operation's (a new wording);
  # instructions: whole tasks and whole constraint combinations (the held-out split: the
  # combinations; eval.sets[].held_out_by: task, the tasks)
  held_out_by: Literal["record", "template"] = "record"
  # fewshot (two worked examples) for base models, chat for -it models, plain: the instruction and
  # the question only (a model SFT taught the format needs no examples)
  template: Literal["fewshot", "chat", "plain"] = "fewshot"
  max_prompt_tokens: int = 256
  overlong: Literal["drop", "error"] = "drop"  # prompts over max_prompt_tokens, found at load

  def __post_init__(self):
    if self.mixture is not None:
      names = [m.name for m in self.mixture]
      if not names or len(set(names)) < len(names):
        _fail("data.mixture", names, "a list of sources with distinct names")
      if self.path or self.eval_path:
        _fail("data.path", self.path or self.eval_path, "null when data.mixture is set (each "
              "source names its own path)")
    elif self.source in ("jsonl", "parquet") and not self.path:
      _fail("data.path", self.path, f"a file path when data.source is '{self.source}'")
    for f in ("num_train", "num_eval", "max_prompt_tokens"):
      if getattr(self, f) < 1:
        _fail(f"data.{f}", getattr(self, f), "a positive integer")



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSet(Fields):
  """A named evaluation set beside the held-out split, e.g. a benchmark's test file:
  {name: gsm8k, source: gsm8k} or {name: mine, source: jsonl, path: eval.jsonl, num: 200}."""

  name: str
  source: Source
  path: str | None = None  # file for jsonl / parquet
  num: int = 64  # the first `num` records (arithmetic: generated beside the training problems)
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only
  # generated sets only (data.held_out_by: template): record, new questions in the training
  # wordings; template, questions in the wordings held out of training (instructions: the
  # constraint combinations never trained on); task (instructions): tasks never trained on, with
  # the trained combinations; null: data.held_out_by's
  held_out_by: Literal["record", "template", "task"] | None = None
  # what the model could do before training, outside the training distribution: evaluated
  # before and after, the paired change reported with its standard error, and a fall beyond
  # noise (more than eval.retention_se standard errors) ends the run with a warning line
  retention: bool = False

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
  # a retention set (eval.sets[].retention) has fallen when its paired change in accuracy (mean
  # reward where it has no answers) is below -retention_se standard errors
  retention_se: float = 2.0

  def __post_init__(self):
    names = [s.name for s in self.sets]
    if len(set(names)) < len(names):
      _fail("eval.sets", names, "distinct names")
    if self.samples < 0:
      _fail("eval.samples", self.samples, "a non-negative integer")
    if self.samples and not all(1 <= k <= self.samples for k in self.pass_k):
      _fail("eval.pass_k", list(self.pass_k), f"values from 1 to eval.samples = {self.samples}")
    if not self.retention_se > 0:
      _fail("eval.retention_se", self.retention_se, "a positive number of standard errors")
    if self.batch_size < 1:
      _fail("eval.batch_size", self.batch_size, "a positive integer")
    if self.max_new_tokens < 1:
      _fail("eval.max_new_tokens", self.max_new_tokens, "a positive integer")

