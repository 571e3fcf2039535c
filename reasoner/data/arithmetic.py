"""Generated arithmetic word problems: deterministic by seed, with a disjoint held-out split;
each with a worked solution (SFT's response, a preference pair's chosen) and the same solution
with the wrong operation (the pair's rejected).

Twelve wordings an operation (`TEMPLATES`), after how such problems are written on school
worksheets and in GSM8K's easiest problems: a scene and a verb each (boxes, shelves, buses,
scores, money, pages, rows, teams, prices), questions before or after the facts, two people
compared. The split (`data.held_out_by`):
- `record`: every wording in both splits, no question in both (a held-out problem is a new
  question in a wording training saw: it measures fit);
- `template`: a third of each operation's wordings held out whole (`split_templates`), so the
  held-out split asks in wordings training never saw. The wordings of the few-shot prompt's
  examples (`FEWSHOT_TEMPLATES`) always train: a held-out wording must be new to the prompt too.
  `held_out(..., "record")` gives, beside it, new questions in the training wordings.
"""

from __future__ import annotations

import random

NAMES = ["Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva", "Raj", "Kim"]
ITEMS = ["apples", "pens", "stickers", "books", "coins", "cards", "shells", "marbles", "cookies",
         "stamps", "blocks", "flowers"]
PRONOUN = {"Raj": "They", "Kim": "They", **{n: "He" for n in ("Sam", "Tom", "Leo", "Ben", "Max")}}

# name -> (operation, wording); {n} and {m} are two people, {p} the first's pronoun (a past
# tense verb follows it), {x} the items, {a} and {b} the operands (a >= b for a difference).
TEMPLATES = {
    "add-gets": ("+", "{n} has {a} {x}. {p} gets {b} more. How many {x} does {n} have now?"),
    "add-finds": ("+", "{n} has {a} {x} and finds {b} more. How many {x} does {n} have in "
                       "total?"),
    "add-box": ("+", "There are {a} {x} in a box. {n} puts {b} more {x} into the box. How many "
                     "{x} are in the box now?"),
    "add-picked": ("+", "{n} picked {a} {x} in the morning and {b} {x} in the afternoon. How "
                        "many {x} did {n} pick altogether?"),
    "add-together": ("+", "{n} has {a} {x} and {m} has {b} {x}. How many {x} do they have "
                          "together?"),
    "add-shelf": ("+", "A shelf holds {a} {x}. Then {b} more {x} are put on it. How many {x} "
                       "are on the shelf?"),
    "add-bought": ("+", "What is the total number of {x} if {n} buys {a} {x} on Monday and {b} "
                        "{x} on Tuesday?"),
    "add-pages": ("+", "{n} read {a} pages yesterday and {b} pages today. How many pages has "
                       "{n} read in all?"),
    "add-bus": ("+", "There were {a} children on the bus. At the next stop, {b} more children "
                     "got on. How many children are on the bus now?"),
    "add-given": ("+", "{n} received {a} {x} from {m} and {b} {x} from a friend. How many {x} "
                       "did {n} receive?"),
    "add-score": ("+", "{n} scored {a} points in the first game and {b} points in the second. "
                       "What was {n}'s total score?"),
    "add-saved": ("+", "If {n} saves {a} dollars one week and {b} dollars the next, how much "
                       "money has {n} saved?"),
    "sub-gave": ("-", "{n} had {a} {x} and gave away {b}. How many {x} does {n} have left?"),
    "sub-loses": ("-", "{n} has {a} {x} and loses {b} of them. How many {x} are left?"),
    "sub-table": ("-", "There were {a} {x} on the table. {n} took {b} of them away. How many "
                       "{x} are still on the table?"),
    "sub-more-than": ("-", "{n} has {a} {x}. {m} has {b} {x}. How many more {x} does {n} have "
                           "than {m}?"),
    "sub-jar": ("-", "A jar held {a} {x}. After {n} took out {b}, how many {x} remained in the "
                     "jar?"),
    "sub-needs": ("-", "{n} wants to collect {a} {x} and already has {b}. How many more {x} "
                       "does {n} need?"),
    "sub-spent": ("-", "{n} had {a} dollars and spent {b} dollars on lunch. How much money does "
                       "{n} have now?"),
    "sub-seats": ("-", "There are {a} seats in a room and {b} of them are taken. How many seats "
                       "are empty?"),
    "sub-pages": ("-", "A book has {a} pages. {n} has read {b} pages. How many pages are left "
                       "to read?"),
    "sub-sold": ("-", "{n} baked {a} cookies and sold {b}. How many cookies were not sold?"),
    "sub-older": ("-", "{n} is {a} years old and {m} is {b} years old. How much older is {n} "
                       "than {m}?"),
    "sub-broken": ("-", "Out of {a} {x}, {b} were broken. How many {x} were not broken?"),
    "mul-bags": ("*", "{n} has {a} bags with {b} {x} in each bag. How many {x} does {n} have?"),
    "mul-rows": ("*", "There are {a} rows of chairs with {b} chairs in each row. How many "
                      "chairs are there?"),
    "mul-boxes": ("*", "Each box holds {b} {x}. How many {x} are in {a} boxes?"),
    "mul-packs": ("*", "{n} buys {a} packs of {x}. Each pack has {b} {x}. How many {x} did {n} "
                       "buy?"),
    "mul-tickets": ("*", "A ticket costs {b} dollars. How much do {a} tickets cost?"),
    "mul-days": ("*", "{n} reads {b} pages every day for {a} days. How many pages does {n} "
                      "read?"),
    "mul-times": ("*", "{m} has {b} {x}. {n} has {a} times as many. How many {x} does {n} "
                       "have?"),
    "mul-teams": ("*", "There are {a} teams with {b} players on each team. How many players are "
                       "there in all?"),
    "mul-planted": ("*", "{n} planted {a} rows of flowers with {b} flowers in every row. How "
                         "many flowers did {n} plant?"),
    "mul-hours": ("*", "What does {n} earn working {a} hours at {b} dollars an hour?"),
    "mul-friends": ("*", "{a} friends each bring {b} {x} to a party. How many {x} are at the "
                         "party?"),
    "mul-stacks": ("*", "{n} makes {a} stacks of {x}, with {b} {x} in each stack. How many {x} "
                        "are there altogether?"),
}
# the wordings of `prompts.EXAMPLES` (a product in bags, a difference given away)
FEWSHOT_TEMPLATES = ("mul-bags", "sub-gave")
HELD_OUT_SHARE = 3  # `template`: one wording in three of each operation held out
RANGES = {"easy": (1, 9, 2, 5), "medium": (1, 20, 2, 9), "hard": (10, 99, 2, 12)}


def split_templates(seed: int) -> tuple[list[str], list[str]]:
  """(training wordings, held-out wordings): a third of each operation's held out, chosen by
  `seed`, never one of the few-shot prompt's (`FEWSHOT_TEMPLATES`)."""
  rng = random.Random(f"arithmetic-templates-{seed}")
  held = []
  for op in "+-*":
    names = sorted(k for k, (o, _) in TEMPLATES.items() if o == op and k not in FEWSHOT_TEMPLATES)
    held += rng.sample(names, len([k for k, (o, _) in TEMPLATES.items() if o == op])
                       // HELD_OUT_SHARE)
  return [k for k in TEMPLATES if k not in held], [k for k in TEMPLATES if k in held]


def _problem(rng: random.Random, difficulty: str, names: list[str]) -> dict:
  lo, hi, mlo, mhi = RANGES[difficulty]
  name = rng.choice(names)
  op, template = TEMPLATES[name]
  n, m = rng.sample(NAMES, 2)
  item = rng.choice(ITEMS)
  if op == "*":
    a, b = rng.randint(mlo, mhi), rng.randint(mlo, mhi)
  else:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "-" and b > a:
      a, b = b, a
  answer = {"+": a + b, "-": a - b, "*": a * b}[op]
  question = template.format(n=n, m=m, a=a, b=b, x=item, p=PRONOUN.get(n, "She"))
  worked = solution(op, a, b, answer)
  return {"question": question, "answer": str(answer), "category": "math", "template": name,
          "response": worked, "chosen": worked, "rejected": wrong_operation(op, a, b)}


def solution(op: str, a: int, b: int, answer: int) -> str:
  """A short worked solution in the prompts' format (SFT's target): why this operation, then
  the sum, as the few-shot examples of `prompts` do."""
  why = {"+": f"{b} more: {a} + {b} = {answer}", "-": f"{b} fewer: {a} - {b} = {answer}",
         "*": f"{a} groups of {b}: {a} * {b} = {answer}"}[op]
  return f"<reasoning>{why}</reasoning>\n<answer>{answer}</answer>"


def wrong_operation(op: str, a: int, b: int) -> str:
  """The worked solution with the wrong operation, the base model's typical mistake (it copies
  the few-shot examples' product and difference): a sum for a difference or a product, a
  difference for a sum (a preference pair's rejected response)."""
  wrong = {"+": "-", "-": "+", "*": "+"}[op]
  return solution(wrong, a, b, {"+": a + b, "-": a - b}[wrong])


def _distinct(rng: random.Random, n: int, difficulty: str, names: list[str], seen: set[str]
              ) -> list[dict]:
  out: list[dict] = []
  for _ in range(50 * max(n, 1)):
    if len(out) == n:
      return out
    p = _problem(rng, difficulty, names)
    if p["question"] not in seen:
      seen.add(p["question"])
      out.append({**p, "difficulty": difficulty})
  raise ValueError(f"cannot generate {n} distinct {difficulty} problems in {len(names)} "
                   "wordings; lower data.num_train or data.num_eval")


def held_out(num_train: int, num: int, seed: int, difficulty: str = "easy",
             held_out_by: str = "record", kind: str | None = None
             ) -> tuple[list[dict], list[dict]]:
  """(train, `num` held-out problems). The training problems depend only on (num_train, seed,
  difficulty, held_out_by), never on `num`. `kind` (default: `held_out_by`) is what is held out:
  `record`, new questions in the training wordings; `template`, questions in the held-out
  wordings (`held_out_by: template` only)."""
  kind = kind or held_out_by
  if kind == "template" and held_out_by != "template":
    raise ValueError("problems in held-out wordings need data.held_out_by: template")
  rng = random.Random(f"arithmetic-{seed}-{difficulty}")
  if held_out_by == "record":  # one stream, as it always was
    out = _distinct(rng, num_train + num, difficulty, list(TEMPLATES), set())
    return out[:num_train], out[num_train:]
  train_names, held_names = split_templates(seed)
  seen: set[str] = set()
  train = _distinct(rng, num_train, difficulty, train_names, seen)
  if kind == "record":
    return train, _distinct(rng, num, difficulty, train_names, seen)
  other = random.Random(f"arithmetic-held-out-{seed}-{difficulty}")
  return train, _distinct(other, num, difficulty, held_names, seen)


def generate(num_train: int, num_eval: int, seed: int, difficulty: str = "easy",
             held_out_by: str = "record") -> tuple[list[dict], list[dict]]:
  """(train, held_out): distinct questions, none shared between the two splits; with
  held_out_by='template', none of the held-out split's wordings in training either."""
  return held_out(num_train, num_eval, seed, difficulty, held_out_by)
