"""Verifiable instructions as a reward: IFEval's instruction types (Zhou et al. 2023,
arXiv 2311.07911; google-research/instruction_following_eval), checked by plain functions.

A record may carry `constraints: [{"kind": "length_constraints:number_words", "args":
{"num_words": 100, "relation": "less than"}}, ...]`, with IFEval's kind names and argument names
(`KINDS`; the checks themselves are in `checks`). An argument whose value is None counts as
absent, so that records read through a table (where every row has every argument) validate.
`validate` says in one line what is wrong with a record's constraints, before any model loads
(the reward says so with `needs_constraints`).

The text checked is the completion's answer: the text inside its last <answer>...</answer>
(stripped) when it has one, else the whole completion. A check passes strictly when the text is
not blank and follows the instruction; loosely, as in IFEval, when one of eight variants does:
the text, without its first line, without its last line, without both, and each of those four
with every asterisk removed (a model that opens with "Sure, here it is:" or writes **bold**).

`instructions` is the reward: the fraction of a row's constraints its completion follows
(strict); a row without constraints gets 0.0 (route such rows to other rewards by category).
`judge` and `ifeval_scores` give IFEval's four numbers for an evaluation.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from typing import Any, Callable, Sequence

import numpy as np

from reasoner.errors import DataError
from reasoner.rewards import checks

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

# An argument's check: what it must be, in words, and the test.
Spec = tuple[str, Callable[[Any], bool]]


def _count(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0


def _text(v) -> bool:
  return isinstance(v, str) and bool(v.strip())


COUNT: Spec = ("a non-negative integer", _count)
POSITION: Spec = ("a positive integer", lambda v: _count(v) and v >= 1)
TEXT: Spec = ("a non-empty string", _text)
WORDS: Spec = ("a non-empty list of non-empty strings",
               lambda v: isinstance(v, (list, tuple)) and bool(v) and all(map(_text, v)))
RELATION: Spec = (" or ".join(map(repr, checks.RELATIONS)), lambda v: v in checks.RELATIONS)
LETTER: Spec = ("a single character", lambda v: isinstance(v, str) and len(v.strip()) == 1)

# kind -> (check, {argument: spec}); every argument is required.
KINDS: dict[str, tuple[Callable[..., bool], dict[str, Spec]]] = {
    "keywords:existence": (checks.existence, {"keywords": WORDS}),
    "keywords:forbidden_words": (checks.forbidden_words, {"forbidden_words": WORDS}),
    "keywords:frequency": (checks.frequency,
                           {"keyword": TEXT, "frequency": COUNT, "relation": RELATION}),
    "keywords:letter_frequency": (checks.letter_frequency, {
        "letter": LETTER, "let_frequency": COUNT, "let_relation": RELATION}),
    "language:response_language": (checks.response_language, {"language": TEXT}),
    "length_constraints:number_sentences": (checks.number_sentences,
                                            {"num_sentences": COUNT, "relation": RELATION}),
    "length_constraints:number_words": (checks.number_words,
                                        {"num_words": COUNT, "relation": RELATION}),
    "length_constraints:number_paragraphs": (checks.number_paragraphs, {"num_paragraphs": COUNT}),
    "length_constraints:nth_paragraph_first_word": (checks.nth_paragraph_first_word, {
        "num_paragraphs": COUNT, "nth_paragraph": POSITION, "first_word": TEXT}),
    "detectable_content:number_placeholders": (checks.number_placeholders,
                                               {"num_placeholders": COUNT}),
    "detectable_content:postscript": (checks.postscript, {"postscript_marker": TEXT}),
    "detectable_format:number_bullet_lists": (checks.number_bullet_lists, {"num_bullets": COUNT}),
    "detectable_format:constrained_response": (checks.constrained_response, {}),
    "detectable_format:number_highlighted_sections": (checks.number_highlighted_sections,
                                                      {"num_highlights": COUNT}),
    "detectable_format:multiple_sections": (checks.multiple_sections,
                                            {"section_spliter": TEXT, "num_sections": COUNT}),
    "detectable_format:json_format": (checks.json_format, {}),
    "detectable_format:title": (checks.title, {}),
    "combination:two_responses": (checks.two_responses, {}),
    "combination:repeat_prompt": (checks.repeat_prompt, {"prompt_to_repeat": TEXT}),
    "startend:end_checker": (checks.end_checker, {"end_phrase": TEXT}),
    "startend:start_checker": (checks.start_checker, {"starter": TEXT}),
    "startend:quotation": (checks.quotation, {}),
    "change_case:capital_word_frequency": (checks.capital_word_frequency, {
        "capital_frequency": COUNT, "capital_relation": RELATION}),
    "change_case:english_capital": (checks.english_capital, {}),
    "change_case:english_lowercase": (checks.english_lowercase, {}),
    "punctuation:no_comma": (checks.no_comma, {}),
}


def validate(constraints, where: str) -> list[tuple[str, dict]]:
  """The constraints as [(kind, args)] (None-valued arguments dropped; None or [] for none);
  a `DataError` in one line for an unknown kind, a missing or unknown argument, or an argument
  of the wrong type or value."""
  if constraints is None:
    return []
  if not isinstance(constraints, (list, tuple)):
    raise DataError(f"{where}: constraints is a {type(constraints).__name__}, not a list of "
                    "{'kind': ..., 'args': {...}}")
  out = []
  for i, c in enumerate(constraints):
    if not isinstance(c, dict) or not isinstance(c.get("kind"), str):
      raise DataError(f"{where}: constraint {i} is {_short(c)}, not a {{'kind': ..., "
                      "'args': {...}} mapping")
    kind = c["kind"]
    if kind not in KINDS:
      tail = kind.rsplit(":", 1)[-1].strip().lower()
      close = difflib.get_close_matches(kind, KINDS, n=3, cutoff=0.8) or (
          [k for k in KINDS if tail and tail in k][:3])
      hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
              f"the kinds: {', '.join(KINDS)}")
      raise DataError(f"{where}: constraint {i} has kind {kind!r}, which is not a known kind "
                      f"({hint})")
    args = c.get("args") or {}
    if not isinstance(args, dict):
      raise DataError(f"{where}: constraint {i} ({kind}) has args {_short(args)}, not a mapping")
    args = {k: v for k, v in args.items() if v is not None}
    specs = KINDS[kind][1]
    for name in args:
      if name not in specs:
        takes = f"its arguments: {', '.join(specs)}" if specs else "it takes none"
        raise DataError(f"{where}: constraint {i} ({kind}) has an unknown argument {name!r} "
                        f"({takes})")
    for name, (what, ok) in specs.items():
      if name not in args:
        raise DataError(f"{where}: constraint {i} ({kind}) is missing argument {name!r}")
      if not ok(args[name]):
        raise DataError(f"{where}: constraint {i} ({kind}) has {name}={_short(args[name])}, "
                        f"which is not {what}")
    if args.get("nth_paragraph", 0) > args.get("num_paragraphs", math.inf):
      raise DataError(f"{where}: constraint {i} ({kind}) asks for paragraph "
                      f"{args['nth_paragraph']} of {args['num_paragraphs']}")
    out.append((kind, args))
  return out


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def answer_text(completion: str) -> str:
  """The text inside the completion's last <answer></answer> (stripped), else all of it."""
  found = ANSWER.findall(completion)
  return found[-1].strip() if found else completion


def variants(text: str) -> list[str]:
  """IFEval's loose variants: the text, without its first line, its last line, both; each of
  the four also without asterisks."""
  lines = text.split("\n")
  cut = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(),
         "\n".join(lines[1:-1]).strip()]
  return cut + [t.replace("*", "") for t in cut]


def follows(kind: str, args: dict, text: str, loose: bool = False) -> bool:
  """Whether the text follows the instruction: strictly, or (loose) in any of `variants`."""
  check = KINDS[kind][0]
  return any(t.strip() and check(t, **args) for t in (variants(text) if loose else [text]))


def instructions(prompts, completions: Sequence[str], constraints: Sequence, **_) -> list[float]:
  """The fraction of each row's constraints that its answer follows (strict); 0.0 for a row
  without constraints."""
  out = []
  for i, (completion, row) in enumerate(zip(completions, constraints)):
    pairs = validate(row, f"row {i}")
    text = answer_text(completion)
    out.append(sum(follows(k, a, text) for k, a in pairs) / len(pairs) if pairs else 0.0)
  return out


instructions.needs_constraints = True  # the records are checked for it before any model loads


def judge(completions: Sequence[str], constraints: Sequence,
          where: str = "constraints") -> tuple[list[list[bool]], list[list[bool]]]:
  """Per row, whether its answer follows each of its constraints: (strict, loose)."""
  strict, loose = [], []
  for i, (completion, row) in enumerate(zip(completions, constraints)):
    pairs = validate(row, f"{where}, row {i}")
    text = answer_text(completion)
    strict.append([follows(k, a, text) for k, a in pairs])
    loose.append([follows(k, a, text, loose=True) for k, a in pairs])
  return strict, loose


def ifeval_scores(strict: Sequence[Sequence[bool]],
                  loose: Sequence[Sequence[bool]]) -> dict[str, float]:
  """IFEval's four numbers from `judge`'s lists: prompt-level (a row counts when it follows all
  its instructions) and instruction-level (each instruction counts), strict and loose, with the
  standard error sqrt(p(1-p)/n) of the prompt-level ones. Rows without instructions are left
  out; NaN when none is left."""
  if len(strict) != len(loose):
    raise ValueError(f"{len(strict)} strict rows but {len(loose)} loose ones")
  out = {}
  for name, rows in (("strict", strict), ("loose", loose)):
    rows = [list(r) for r in rows if len(r)]
    prompt = float(np.mean([all(r) for r in rows])) if rows else math.nan
    flat = [x for r in rows for x in r]
    out[f"prompt_level_{name}"] = prompt
    out[f"prompt_level_{name}_se"] = math.sqrt(prompt * (1 - prompt) / len(rows)) if rows else (
        math.nan)
    out[f"instruction_level_{name}"] = float(np.mean(flat)) if flat else math.nan
  return out
