"""Prompt templates: a plain few-shot prompt for base models, Gemma's chat template for -it ones.

All ask for `<reasoning>...</reasoning><answer>...</answer>`; `plain` only asks, for a model
that SFT taught the format. The embedded model is a
pretrained base model: it does not follow the chat template, but it continues a few-shot
pattern, so that is the honest way to show it the format GRPO then reinforces.
"""

from __future__ import annotations

from reasoner.errors import DataError

INSTRUCTION = ("Solve the problem. Write your reasoning inside <reasoning></reasoning> and the "
               "final number inside <answer></answer>.")

EXAMPLES = [
    ("Sam has 3 bags with 4 pens in each bag. How many pens does Sam have?",
     "3 bags with 4 pens each is 3 * 4 = 12 pens.", "12"),
    ("Mia had 15 stickers and gave away 6. How many stickers does Mia have left?",
     "15 - 6 = 9 stickers are left.", "9"),
]


def fewshot(question: str) -> str:
  shots = "".join(f"Question: {q}\n<reasoning>{r}</reasoning>\n<answer>{a}</answer>\n\n"
                  for q, r, a in EXAMPLES)
  return f"{INSTRUCTION}\n\n{shots}Question: {question}\n"


def plain(question: str) -> str:
  return f"{INSTRUCTION}\n\nQuestion: {question}\n"


def chat(question: str) -> str:
  return (f"<start_of_turn>user\n{INSTRUCTION}\n\n{question}<end_of_turn>\n"
          "<start_of_turn>model\n")


TEMPLATES = {"fewshot": fewshot, "chat": chat, "plain": plain}


def render(template: str, question: str) -> str:
  return TEMPLATES[template](question)


def within_limit(records: list[dict], split: str, template: str, tokenizer, limit: int,
                 overlong: str, log=print) -> list[dict]:
  """The records whose rendered prompt fits in `limit` tokens (BOS included), checked when the
  data is loaded rather than when a batch reaches the sampler hours in. overlong='drop' drops
  the others with one line of counts; 'error' names the first."""
  keep = []
  for i, r in enumerate(records):
    n = len(tokenizer.encode(render(template, r["question"]), add_bos=True))
    if n <= limit:
      keep.append(r)
    elif overlong == "error":
      raise DataError(f"record {i} of the {split} split: its prompt has {n} tokens, more than "
                      f"data.max_prompt_tokens = {limit} (data.overlong: error; 'drop' skips "
                      f"such records): {r['question'][:60]!r}")
  if records and not keep:
    raise DataError(f"every {split} prompt is longer than data.max_prompt_tokens = {limit} "
                    f"tokens; raise it")
  if len(keep) < len(records):
    log(f"data: dropped {len(records) - len(keep)} of {len(records)} {split} records whose "
        f"prompt is longer than data.max_prompt_tokens = {limit} tokens (data.overlong: drop)")
  return keep
