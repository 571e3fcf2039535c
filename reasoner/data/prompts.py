"""Prompt templates: a plain few-shot prompt for base models, Gemma's chat template for -it ones.

All ask for `<reasoning>...</reasoning><answer>...</answer>`; `plain` only asks, for a model
that SFT taught the format. The embedded model is a
pretrained base model: it does not follow the chat template, but it continues a few-shot
pattern, so that is the honest way to show it the format GRPO then reinforces.

What a prompt asks for follows the record's category: a math record (or one with no category)
asks for the final number and its few shots are arithmetic; any other (instructions, creative
writing, summaries, science, code) asks for the answer, and its shots are requests answered
under an instruction each, in the generated instructions' wording (`data.instructions`), on
tasks that set never draws. An instruction prompt that asked for "the final number" after two
sums showed the base model nothing it could follow (docs/LOG.md, issue 54).
"""

from __future__ import annotations

from reasoner.errors import DataError

INSTRUCTION = ("Solve the problem. Write your reasoning inside <reasoning></reasoning> and the "
               "final number inside <answer></answer>.")
GENERAL_INSTRUCTION = ("Answer the request and follow every instruction in it. Write your "
                       "reasoning inside <reasoning></reasoning> and the answer inside "
                       "<answer></answer>.")
MATH = (None, "math")  # the categories that ask for a number

EXAMPLES = [
    ("Sam has 3 bags with 4 pens in each bag. How many pens does Sam have?",
     "3 bags with 4 pens each is 3 * 4 = 12 pens.", "12"),
    ("Mia had 15 stickers and gave away 6. How many stickers does Mia have left?",
     "15 - 6 = 9 stickers are left.", "9"),
]
# tasks the instruction generator never draws, one instruction each
GENERAL_EXAMPLES = [
    ("Name two things you can find on a beach. Your answer must contain exactly 2 bullet points "
     "in markdown format, such as: * This is a point.",
     "Name two things on a beach: exactly 2 bullet points.", "* Sand\n* Shells"),
    ("Say what bees make. Your entire response should be in English capital letters.",
     "Say what bees make: all in capital letters.", "BEES MAKE HONEY."),
]


def instruction(category: str | None = None) -> str:
  """What a prompt asks of a record of `category` (a number for math, else an answer)."""
  return INSTRUCTION if category in MATH else GENERAL_INSTRUCTION


def fewshot(question: str, category: str | None = None) -> str:
  examples = EXAMPLES if category in MATH else GENERAL_EXAMPLES
  shots = "".join(f"Question: {q}\n<reasoning>{r}</reasoning>\n<answer>{a}</answer>\n\n"
                  for q, r, a in examples)
  return f"{instruction(category)}\n\n{shots}Question: {question}\n"


def plain(question: str, category: str | None = None) -> str:
  return f"{instruction(category)}\n\nQuestion: {question}\n"


def chat(question: str, category: str | None = None) -> str:
  return (f"<start_of_turn>user\n{instruction(category)}\n\n{question}<end_of_turn>\n"
          "<start_of_turn>model\n")


TEMPLATES = {"fewshot": fewshot, "chat": chat, "plain": plain}


def render(template: str, question: str, category: str | None = None) -> str:
  """`question` in `template`, asking what a record of `category` needs (`instruction`)."""
  return TEMPLATES[template](question, category)


def render_record(template: str, record: dict) -> str:
  """A record's prompt: its question in `template`, as its category asks."""
  return render(template, record["question"], record.get("category"))


def within_limit(records: list[dict], split: str, template: str, tokenizer, limit: int,
                 overlong: str, log=print) -> list[dict]:
  """The records whose rendered prompt fits in `limit` tokens (BOS included), checked when the
  data is loaded rather than when a batch reaches the sampler hours in. overlong='drop' drops
  the others with one line of counts; 'error' names the first."""
  keep = []
  for i, r in enumerate(records):
    n = len(tokenizer.encode(render_record(template, r), add_bos=True))
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
