"""Where records come from, how prompts are written, and what they are evaluated on."""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Literal

from reasoner.config.typed import fail as _fail


Source = Literal["arithmetic", "instructions", "jsonl", "parquet", "csv", "hf", "kaggle", "gsm8k",
                 "ifeval"]
READ = ("jsonl", "parquet", "csv", "hf", "kaggle", "gsm8k", "ifeval")  # rows, mapped by Fields
# hf sources under a preset mapping of their own (data/sources.py PRESETS): the Hub id, subset,
# splits and fields are the preset's, so `path` is optional (a local copy) and `subset`,
# `split` and `eval_split` are not set
PRESET_SOURCES = ("gsm8k", "ifeval")
_PATHS = {"hf": "a Hugging Face dataset id (OWNER/NAME) or a local folder or file",
          "kaggle": "a Kaggle dataset, OWNER/DATASET or OWNER/DATASET/versions/N"}
_TEMPLATES = ("question_template", "response_template", "chosen_template", "rejected_template")
# the data files read (jsonl, parquet and csv sources, a Kaggle dataset's file, an hf local
# file or folder), by suffix: each one's kind, as data/files.py reads it
FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_either = lambda items: ", ".join(items[:-1]) + " or " + items[-1]
# for messages: ".jsonl, .json, .parquet or .csv" and "jsonl, json, parquet or csv"
SUFFIXES, KINDS = _either(list(FILE_KINDS)), _either(list(dict.fromkeys(FILE_KINDS.values())))


def final_answer(text: str) -> str:
  """What follows '####' (GSM8K-style answers end '#### 1,234'), commas dropped; else the text."""
  m = re.search(r"####\s*(.+)\s*$", text)
  return m.group(1).replace(",", "").strip() if m else text.strip()


def worked_steps(text: str) -> str:
  """What comes before '####', its calculator notes <<3*4=12>> dropped (GSM8K's steps)."""
  return re.sub(r"<<[^>]*>>", "", text.split("####")[0]).strip()


def lines(value) -> str:
  """A list's items one per line (MBPP's `test_list`); anything else as its text."""
  return "\n".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


# a template's field transforms, {field:name}: GSM8K's answer "3*4=<<3*4=12>>12.\n#### 12" is
# {answer:steps} "3*4=12." and {answer:final} "12" (as every record's answer_field is read);
# {test_list:lines} a list one item a line
TRANSFORMS = {"final": lambda v: final_answer(str(v)), "steps": lambda v: worked_steps(str(v)),
              "lines": lines}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fields:
  """The names of a record's fields, and templates writing responses from them (data.*,
  data.mixture[], eval.sets[])."""

  question_field: str = "question"  # a record's question (or its chat `messages`' user turn)
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
  # IFEval's layout: constraints_field names a list of kinds (instruction_id_list) and this a
  # list of their arguments, one a kind (kwargs); null: constraints_field holds {kind, args}
  constraint_args_field: str | None = None
  # optional in a record: the tests its code must pass, Python asserts (a string), a list of
  # them (a program each) or of {input, output} stdin/stdout pairs (the `tests_pass` reward;
  # rewards/sandbox.py)
  tests_field: str = "tests"
  # the question written from a record's fields instead of question_field (as
  # response_template), e.g. MBPP's task and the tests its code must pass, which name its
  # function: "{text}\nYour code should pass these tests:\n{test_list:lines}"
  question_template: str | None = None
  # SFT's target written from a record's fields instead of response_field (str.format_map), e.g.
  # "<reasoning>{thinking}</reasoning>\n<answer>{solution}</answer>" ({{ and }}: a brace); a
  # record without a field it names (or with null) is dropped and counted, or one error line
  # with data.overlong: error. {field:final} is what follows a GSM8K-style '####', {field:steps}
  # what comes before it without the <<...>> calculator notes
  response_template: str | None = None
  chosen_template: str | None = None  # the same for a pair's better response (chosen_field)
  rejected_template: str | None = None  # and for its worse one (rejected_field)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hub:
  """Where an hf or kaggle source's records are, beside its `path` (data.*, data.mixture[],
  eval.sets[])."""

  subset: str | None = None  # hf: the dataset's configuration, `name` in datasets (GSM8K: main)
  split: str = "train"  # hf: the split read (eval.sets[]: the set's records)
  # hf: the held-out split (e.g. test); null: the last num_eval records of `split` are held
  # out, as for files
  eval_split: str | None = None
  revision: str | None = None  # hf: a branch, tag or commit of a Hub dataset
  # hf (and gsm8k): read only the first data.num_train records (+ num_eval without an
  # eval_split; eval.sets[]: num) as they stream, rather than downloading the whole dataset
  streaming: bool = False
  # kaggle: the jsonl, json, parquet or csv file inside the dataset (path: OWNER/DATASET)
  file: str | None = None


def template_fields(template: str, key: str) -> tuple[str, ...]:
  """The record fields a response template names, its syntax checked (`key`: its config key)."""
  expected = ("a template of record fields in braces, e.g. '<answer>{solution}</answer>' ({{ "
              "and }} for a brace)")
  try:
    parts = [(n, spec, conv) for _, n, spec, conv in string.Formatter().parse(template)
             if n is not None]
  except ValueError as e:
    _fail(key, template, f"{expected}: {e}")
  for n, spec, conv in parts:
    if not re.fullmatch(r"[^.\[\]]+", n) or n.isdigit():
      _fail(key, template, f"{expected}: {{{n}}} is not a field name")
    if conv is not None or spec not in ("", *TRANSFORMS):
      shown = n + (f"!{conv}" if conv is not None else "") + (f":{spec}" if spec else "")
      _fail(key, template, f"{expected}: {{{shown}}} is neither a field nor a transform of one ("
            + ", ".join(f"{{{n}:{t}}}" for t in TRANSFORMS) + ")")
  return tuple(dict.fromkeys(n for n, _, _ in parts))


def check_source(c, key: str) -> None:
  """A source's path, reading options and templates (`c`: data, a mixture source or an
  evaluation set; `key`: its section, e.g. data.mixture[name])."""
  own = "data.source" if key == "data" else "its source"
  if c.source in READ and c.source not in PRESET_SOURCES and not c.path:
    _fail(f"{key}.path", c.path, f"{_PATHS.get(c.source, 'a file path')} when {own} is "
          f"'{c.source}'")
  if c.source == "kaggle":
    if not re.fullmatch(r"[\w.-]+/[\w.-]+(/versions/\d+)?", c.path):
      _fail(f"{key}.path", c.path, _PATHS["kaggle"])
    if not c.file or not c.file.endswith(tuple(FILE_KINDS)):
      _fail(f"{key}.file", c.file, f"a {SUFFIXES} file in the Kaggle dataset")
  elif c.file is not None:
    _fail(f"{key}.file", c.file, f"null unless {own} is 'kaggle'")
  if getattr(c, "eval_path", None) is not None and c.source in ("hf", "kaggle",
                                                                 *PRESET_SOURCES):
    _fail(f"{key}.eval_path", c.eval_path, "null unless the source is a file (jsonl, parquet, "
          "csv); hf holds out its eval_split or the last num_eval records")
  hf = ("hf", *PRESET_SOURCES)
  for k, default, allowed in (("subset", None, ("hf",)), ("split", "train", ("hf",)),
                              ("eval_split", None, ("hf",)), ("revision", None, hf),
                              ("streaming", False, hf)):
    if getattr(c, k) != default and c.source not in allowed:
      shown = {None: "null", False: "false"}.get(default, repr(default))
      _fail(f"{key}.{k}", getattr(c, k), f"{shown} unless {own} is "
            + " or ".join(repr(a) for a in allowed))
  for k in _TEMPLATES:
    if getattr(c, k) is not None:
      template_fields(getattr(c, k), f"{key}.{k}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSource(Hub, Fields):
  """One source of a mixture (`data.mixture`): its records are drawn in proportion to `weight`
  (grain's weighted mix), each keeping its category; `num_eval` of them are held out."""

  name: str
  weight: float = 1.0
  source: Source = "jsonl"
  path: str | None = None  # as data.path, for its source
  eval_path: str | None = None  # as data.eval_path
  num_eval: int = 16
  category: str | None = None  # for its records that name none (e.g. math for the arithmetic)
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only

  def __post_init__(self):
    key = f"data.mixture[{self.name}]"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
      _fail("data.mixture[].name", self.name, "letters, digits, '_', '.' or '-'")
    if not self.weight > 0:
      _fail(f"{key}.weight", self.weight, "a positive number (its share of the draws)")
    check_source(self, key)
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
class DataConfig(Hub, Fields):
  """Where questions and reference answers come from, and how prompts are written."""

  # arithmetic and instructions: generated; jsonl, parquet, csv: a file; hf: a Hugging Face
  # dataset; kaggle: a file in a Kaggle dataset; gsm8k: hf with GSM8K's mapping (openai/gsm8k,
  # main, train and test, its worked solutions as responses)
  source: Source = "arithmetic"
  # jsonl / parquet / csv: the file; hf: a dataset id or a local folder (Dataset.save_to_disk,
  # or parquet, json, jsonl or csv files) or file; kaggle: OWNER/DATASET[/versions/N]; gsm8k: a
  # local copy of it (default: openai/gsm8k)
  path: str | None = None
  eval_path: str | None = None  # held-out file; default: the last num_eval records of `path`
  # several sources, drawn by weight (source and path then unused): [{name, weight, source,
  # path, category, ...}, ...]
  mixture: tuple[MixtureSource, ...] | None = None
  curriculum: CurriculumConfig | None = None  # the RL stages' order (data/curriculum.py)
  # arithmetic: problems generated for training; a streamed hf source: records read for it
  num_train: int = 2000
  num_eval: int = 64  # held-out problems
  seed: int = 0
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only
  # arithmetic: what the held-out split holds out. record: new questions in the wordings
  # training saw (fit); template: whole wordings, a third of each operation's (a new wording);
  # instructions: whole tasks and whole constraint combinations (the held-out split: the
  # combinations; eval.sets[].held_out_by: task, the tasks)
  held_out_by: Literal["record", "template"] = "record"
  # fewshot (two worked examples) for base models, chat for -it models, plain: the instruction and
  # the question only (a model SFT taught the format needs no examples). Each asks what the
  # record's category needs: math (or none) the final number, after arithmetic examples; any
  # other category an answer, after two examples that each follow an instruction
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
    check_source(self, "data")
    for f in ("num_train", "num_eval", "max_prompt_tokens"):
      if getattr(self, f) < 1:
        _fail(f"data.{f}", getattr(self, f), "a positive integer")



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSet(Hub, Fields):
  """A named evaluation set beside the held-out split, e.g. a benchmark's test file:
  {name: gsm8k, source: gsm8k} or {name: mine, source: jsonl, path: eval.jsonl, num: 200}."""

  name: str
  source: Source
  path: str | None = None  # as data.path, for its source
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
  # the greedy answer's budget for this set (null: eval.max_new_tokens): a short-answer set
  # beside long ones decodes no further than its answers need
  max_new_tokens: int | None = None

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) or self.name == "held-out":
      _fail("eval.sets[].name", self.name, "letters, digits, '_', '.' or '-', not 'held-out'")
    check_source(self, f"eval.sets[{self.name}]")
    if self.eval_split is not None:
      _fail(f"eval.sets[{self.name}].eval_split", self.eval_split, "null: a set reads its `split`")
    if self.num < 1:
      _fail(f"eval.sets[{self.name}].num", self.num, "a positive integer")
    if self.max_new_tokens is not None and self.max_new_tokens < 1:
      _fail(f"eval.sets[{self.name}].max_new_tokens", self.max_new_tokens,
            "a positive integer, or null for eval.max_new_tokens")


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

