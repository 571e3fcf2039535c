"""The instruction checks (IFEval's kinds) against IFEval's own test examples
(google-research/instruction_following_eval/instructions_test.py), the loose variants, the
reward, the validation messages and IFEval's four numbers."""

from __future__ import annotations

import ast
import math
import pathlib

import pytest

from reasoner.errors import DataError
from reasoner.rewards import checks
from reasoner.rewards.instructions import (KINDS, answer_text, follows, ifeval_scores, instructions,
                                           judge, validate, variants)

PARIS_1 = """
  Paris is a city of beauty and romance. The romantic river Seine winds its way
  through the city, past iconic landmarks like the Eiffel Tower and the Louvre
  Museum, where the Mona Lisa resides."""
PARIS_2 = """
  Paris is a city of beauty, romance, and history. The city is also known for its romantic
  river cruises, its delicious food, and its stylish people."""
NAZIS = """
  The Nazis came to power in 1933 through a combination of legal and illegal
  means. By 1934, Hitler had become dictator of Germany."""
DINOSAURS = """
  Dinosaurs were a diverse group of reptiles that dominated the Earth for over
  160 million years."""
GPT = """
  GPT, or Generative Pre-trained Transformer, is a family of neural network
  models that uses the transformer architecture. GPT models are used for text generation
  by a variety of companies and organizations like Google."""
BULLETS_STAR = """
  A Markdown bullet point is a way of formatting text to create a list. To
  create a bullet point, start each line with an asterisk (*). For example:
  * This is a bullet point.
  *(no space required)Another bullet point.
  * (no newline ending required)Another bullet point.
  markdown bullet points are often used to create to-do lists."""
BULLETS_INLINE = """
  Check that inline asterisk (*), *, will not be counted. Only * that starts a
  bullet list will be counted:
    * This is a bullet point.
    * Another bullet point.
    . dot is not counted"""
BULLETS_DASH = """
  Here are three markdown bullets:
  - I am a large language model, also known as a conversational AI.
  - I am trained on a massive amount of text data, and I am able to communicate.
  -I am still under development, but I am learning new things every day."""
BULLETS_DIVIDERS = """
  Paragraph 1
  ***
  Paragraph 2
  ***
  Paragraph 3
  * only one bullet point
  """
HIGHLIGHT_1 = """
  To highlight text with Markdown, you can use the * character before and after
  the text you want to highlight. For example, if you want to highlight the
  word `hello`, you would type:*hello*, You can also use the ** character to
  create bold text. For example, if you want to bold the word `hello`, you
  would type: **hello** """
HIGHLIGHT_2 = """
  Sure, here are the numerical methods highlighted with Markdown:
  *Finite difference methods
  *Finite element methods*
  *Boundary element methods
  I hope this helps!"""
HIGHLIGHT_3 = """
  There is allowed to be *two different* highlighted *sections in the same*
  line. **This is also true** for **double markdown highlights.**
  """
SECTIONS_1 = """
  Your response must have multiple sections. Mark the beginning of each section
  with "Section X", such as:
  Section 1
  [content of section 1]
  Section 2
  [content of section 2]"""
SECTIONS_2 = """SECTION 1
  [content of section 1]
  SECTION 2
  [content of section 2]"""
PARAGRAPHS = ["\n  paragraph 1\n  ***\n  paragraph 2\n  ***\n  paragraph 3",
              "\n          ***\n  paragraph 1\n          ***\n      paragraph 2\n          ***\n"
              "      paragraph 3",
              "\n  paragraph 1\n          ***\n      paragraph 2\n          ***\n"
              "      paragraph 3\n          ***",
              "\n  paragraph 1\n          ***\n      paragraph 2\n          ***\n          ***"]
FIRST_WORD = ["\n  paragraph 1\n\n  I paragraph 2\n\n  paragraph 3",
              "\n  paragraph 1\n\n  I paragraph 2",
              "\n  paragraph 1\n\n  fail paragraph 2\n\n  paragraph 3"]
FIVE = ("\n  Wow this is a very long response.\n\n  I can't believe there is more than three "
        "paragraphs.\n\n  {}\n\n  I can't believe it but I guess I am living proof.\n\n  "
        "Haha, you go that right.")
POSTSCRIPT_1 = """
  I will do my best to follow your instructions and always start my responses
  with "My response is:".

  P.S. I hope this is what you were looking for."""
POSTSCRIPT_2 = """
  Sure, here is my response with a postscript starting with P.P.S.:

  P.P.S. I am always happy to answer any other questions you may have."""
POSTSCRIPT_3 = """
  The radius of a unit circle is 1. (not starting a new line) P.S. I hope you enjoyed
  my joke!"""
POSTSCRIPT_4 = "\n  If the length of a square is one.\n  p.p.s what if it was lower case?\n  "
POSTSCRIPT_5 = "\n  The mysteries of space.\n  P. S. Sometimes spaces come between P. and S..\n"
TEMPLATE_5 = ("Sure, here is a short template with 5 placeholders:\n[Name]\n[Email]\n[Phone]\n"
              "[Address]\n[Website]\nThis template can be used for a variety of purposes.")
TEMPLATE_6 = "My [adjective] [noun] is [adjective] [noun]. I [verb] and [verb]."
START_1 = """
  My response is: ASIC is a specialized chip for specific tasks in electronic
  devices, offering advantages in efficiency and processing speed."""
START_3 = """
  An ASIC, or Application-Specific Integrated Circuit, is a type of specialized
  chip that, my response is, is designed to perform specific tasks."""
WORDS_1 = "\n  d3sCRi7 lArge lAnguagE M0del w1tH 20 w0RdS."
WORDS_2 = """
  L4RGE L4NGU4GE M0DEL: AI syst3m th4t und3rstands, g3n3r4tes, or tr4nsforms
  l4ngu4g3 b4s3d on pr3vious l3arning & d4t4."""

LT, GE = "less than", "at least"
CASES = [  # (kind, args, text, strictly followed)
    ("keywords:existence", {"keywords": ["romantic", "river", "Mona Lisa"]}, PARIS_1, True),
    ("keywords:existence", {"keywords": ["romantic", "river", "Mona Lisa"]}, PARIS_2, False),
    ("keywords:forbidden_words", {"forbidden_words": ["HOUSE", "POWER", "BECOME"]}, NAZIS, False),
    ("keywords:forbidden_words", {"forbidden_words": ["HOUSE", "POWER", "BECOME"]}, DINOSAURS,
     True),
    ("keywords:forbidden_words", {"forbidden_words": ["GOOGLE", "TEXT"]}, GPT, False),
    ("keywords:forbidden_words", {"forbidden_words": ["GENE", "TRANSFORM"]}, GPT, True),
    ("keywords:frequency", {"keyword": "  keyword ", "frequency": 4, "relation": LT},
     "\n  keyword, Keyword, KEYWORD\n", True),
    ("keywords:frequency", {"keyword": "keyword", "frequency": 3, "relation": GE},
     "\n  keyword, Keyword, KEYWORD\n", True),
    ("keywords:frequency", {"keyword": "KEYWORD", "frequency": 4, "relation": GE},
     "\n  *keyword\n  *Keyword\n  *KEYWORD\n", False),
    ("keywords:letter_frequency", {"letter": "T", "let_frequency": 4, "let_relation": GE},
     "\n  There is the T. Four T's.\n", True),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 4, "let_relation": LT},
     "\n  asdfghjkl!!aA\n", True),
    ("keywords:letter_frequency", {"letter": "p", "let_frequency": 4, "let_relation": GE},
     "\n  asdfghjkl!!aA\n", False),
    ("length_constraints:number_sentences", {"num_sentences": 4, "relation": LT},
     "xx,x. xx,x! xx/x. x{x}x?", False),
    ("length_constraints:number_sentences", {"num_sentences": 5, "relation": LT},
     "xxxx. xx,x! xxxx. x(x)x?", True),
    ("length_constraints:number_sentences", {"num_sentences": 4, "relation": GE},
     "xxxx. xx,x! xx|x. x&x x?", True),
    ("length_constraints:number_sentences", {"num_sentences": 5, "relation": GE},
     "xx-x. xx,x! xx}x. x,xx?", False),
    ("length_constraints:number_words", {"num_words": 8, "relation": LT}, WORDS_1, True),
    ("length_constraints:number_words", {"num_words": 16, "relation": LT}, WORDS_2, False),
    ("length_constraints:number_words", {"num_words": 16, "relation": GE}, WORDS_2, True),
    *[("length_constraints:number_paragraphs", {"num_paragraphs": 3}, p, True)
      for p in PARAGRAPHS[:3]],
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, PARAGRAPHS[3], False),
    *[("length_constraints:nth_paragraph_first_word",
       {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "I"}, p, ok)
      for p, ok in zip(FIRST_WORD, (True, False, False))],
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 5, "nth_paragraph": 5, "first_word": "haha"},
     FIVE.format("Really more than three? No way!"), True),
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 5, "nth_paragraph": 3, "first_word": "Really"},
     FIVE.format('"Really?! more than three? No way!"'), True),
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 5, "nth_paragraph": 3, "first_word": "Really"},
     FIVE.format("Rea!lly more than three? No way!"), False),
    ("detectable_content:number_placeholders", {"num_placeholders": 5}, TEMPLATE_5, True),
    ("detectable_content:number_placeholders", {"num_placeholders": 7}, TEMPLATE_6, False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, POSTSCRIPT_1, True),
    ("detectable_content:postscript", {"postscript_marker": "PS:"}, POSTSCRIPT_1, False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, POSTSCRIPT_2, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, POSTSCRIPT_3, True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, POSTSCRIPT_4, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, POSTSCRIPT_5, True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, POSTSCRIPT_1, False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 3}, BULLETS_STAR, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, BULLETS_INLINE, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 3}, BULLETS_DASH, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 1}, BULLETS_DIVIDERS, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, BULLETS_DASH, False),
    ("detectable_format:constrained_response", {}, "\n My answer is no.\n", True),
    ("detectable_format:constrained_response", {}, "My answer is no.   ", True),
    ("detectable_format:constrained_response", {}, "\n  My answer is no. I am still learning.",
     True),
    ("detectable_format:constrained_response", {}, "My answer is probably no.", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, HIGHLIGHT_1, True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, HIGHLIGHT_2, False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 4}, HIGHLIGHT_3, True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 3},
     SECTIONS_1, False),
    ("detectable_format:multiple_sections", {"section_spliter": "SECTION", "num_sections": 2},
     SECTIONS_2, True),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', True),
    ("detectable_format:json_format", {}, '  {"a": 1}  ', True),
    ("detectable_format:json_format", {}, 'Here is the JSON: {"a": 1}', False),
    ("detectable_format:title", {}, "\n  <<Song of Joy>>\n  La la la. Happy song.\n", True),
    ("detectable_format:title", {}, "\n  Title at the end?\n  <<This is the title>>\n", True),
    ("detectable_format:title", {}, "\n  << >>\n  There is no title.\n", False),
    ("detectable_format:title", {}, "\n  <<This is not a title.\n  This is a paragraph.>>\n",
     False),
    ("combination:two_responses", {}, "\n  This is response 1.\n  ******\n  This is response 2.\n",
     True),
    ("combination:two_responses", {}, "\n  This is response 1.\n  ******\n  This is response 1.\n",
     False),
    ("combination:two_responses", {}, "\n  One.\n  ******\n  Two.\n  ******\n  Three.\n", False),
    ("combination:two_responses", {}, "\n  ******\n  Response 1.\n  ******\n  ******\n  "
     "Response 2.\n  ******\n", False),
    ("combination:two_responses", {},
     "\n  ******\n  Response 1\n  ******\n  Response 2\n  ******\n", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a CL description."},
     "Write a CL description. Hi, Le and TJ, please\n  check this out. Thanks.\n", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a CL description."},
     "Hi, Le and TJ. Write a CL description. Thanks.\n", False),
    ("startend:end_checker", {"end_phrase": "\n  Any more questions?\n  "},
     "\n  The answer is 7. Any more questions?\n  ", True),
    ("startend:end_checker", {"end_phrase": "This is the end."},
     "\n  I am required to say that this is the end.\n  ", True),
    ("startend:end_checker", {"end_phrase": "This will fail."},
     "\n  This will fail. Paris is cool.\n  ", False),
    ("startend:start_checker", {"starter": "My response is:"}, START_1, True),
    ("startend:start_checker", {"starter": "my response is"}, START_3, False),
    ("startend:quotation", {}, '\n  "This entire message is wrapped in double quotation marks."\n',
     True),
    ("startend:quotation", {}, '\n  "This message is wrapped in quotes." But not everything.\n',
     False),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": GE},
     "\n  HERE there are THREE FUlly CAPITAL words.\n", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 5, "capital_relation": LT},
     "\n  THERE are Four FULLY CAPITAL WORDS. Many Others Are Only Partially So.\n", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 4, "capital_relation": LT},
     "\n  THERE are Four FULLY CAPITAL WORDS. Many Others Are Only Partially So.\n", False),
    ("change_case:english_capital", {},
     "\n  THIS IS AN ENGLISH SENTENCE. EVERY LETTER IS CAPITALIZED!!! AMAZING.\n", True),
    ("change_case:english_capital", {}, "\n  Every Word Is Capitalized.\n", False),
    ("change_case:english_lowercase", {}, "\n  every letter is lowercase.\n", True),
    ("change_case:english_lowercase", {}, "\n  Almost every letter is lowercase.\n", False),
    ("punctuation:no_comma", {}, "\n  Every sentence is short. There is no need for a comma.\n",
     True),
    ("punctuation:no_comma", {}, "\n  Since the start of time, people have found a way.\n", False),
]


@pytest.mark.parametrize("kind,args,text,expected", CASES)
def test_ifeval_examples(kind, args, text, expected):
  assert validate([{"kind": kind, "args": args}], "test") == [(kind, args)]
  assert follows(kind, args, text) is expected


def test_every_kind_has_a_positive_and_a_negative_example():
  seen = {(kind, expected) for kind, _, _, expected in CASES}
  seen |= {("language:response_language", True), ("language:response_language", False)}
  assert seen == {(kind, ok) for kind in KINDS for ok in (True, False)}


def test_response_language():
  pytest.importorskip("langdetect")
  kind = "language:response_language"
  assert follows(kind, {"language": "en"}, "The response is English")
  assert follows(kind, {"language": "es"}, "Desayunamos en McDonald's hoy")
  assert follows(kind, {"language": "en"}, "Today we visit the Louvre")
  assert not follows(kind, {"language": "en"}, "Ich helfe dir gerne dabei.")
  assert follows(kind, {"language": "de"}, "Ich helfe dir gerne dabei.")
  assert follows(kind, {"language": "fr"}, "42")  # nothing to read: followed, as in IFEval


def test_sentences_and_words_are_counted_without_nltk():
  assert [len(checks.split_sentences(t)) for t in (
      "xx,x. xx,x! xx/x. x{x}x? x.", "xx,x! xxxx. x(x)x?", "xxxx. xx,x! xx|x. x&x x?",
      "xx-x]xx,x! x{x}xx,x.")] == [5, 3, 4, 2]
  assert checks.split_sentences("\n  The U.S.A has many Ph.D. students. They will often have a "
                                ".com website\nsharing their research.\n") == [
      "The U.S.A has many Ph.D. students.",
      "They will often have a .com website sharing their research."]
  assert checks.split_sentences(
      'Mr. Smith paid $3.5 million, e.g. for the U.S.A. office. He said "Stop." Then he left... '
      "and came back! Apples, pears, etc. are fruit. My answer is A. Why?!") == [
      "Mr. Smith paid $3.5 million, e.g. for the U.S.A. office.", 'He said "Stop."',
      "Then he left... and came back!", "Apples, pears, etc. are fruit.", "My answer is A.",
      "Why?!"]
  assert checks.split_sentences("  \n") == []
  assert checks.count_words("word1, word2, word3, word4.") == 4
  assert checks.count_words("\n  Hyphenated-word has two word counts.\n") == 6


def test_loose_variants_drop_first_and_last_lines_and_asterisks():
  assert variants("Sure:\n**a**\nbye") == ["Sure:\n**a**\nbye", "**a**\nbye", "Sure:\n**a**",
                                           "**a**", "Sure:\na\nbye", "a\nbye", "Sure:\na", "a"]
  loose_only = [
      ("startend:quotation", {}, 'Sure, here it is:\n"The whole answer."'),
      ("startend:end_checker", {"end_phrase": "Any other questions?"},
       "The answer is 7. Any other questions?\nI hope this helps."),
      ("startend:end_checker", {"end_phrase": "Any other questions?"},
       "The answer is 7. **Any other questions?**"),
      ("detectable_format:json_format", {}, 'Here is the JSON:\n```json\n{"a": 1}\n```'),
      ("punctuation:no_comma", {}, "Sure, here it is:\nNo commas here"),
      ("change_case:english_lowercase", {}, "Here It Is:\nall lower case\nHope It Helps"),
      ("startend:start_checker", {"starter": "I think"}, "Sure!\nI think so."),
  ]
  for kind, args, text in loose_only:
    assert not follows(kind, args, text), kind
    assert follows(kind, args, text, loose=True), kind
  assert not follows("punctuation:no_comma", {}, "One\nTwo, three\nFour", loose=True)
  assert not follows("punctuation:no_comma", {}, "  \n ", loose=True)  # blank: never followed
  assert not follows("punctuation:no_comma", {}, "")


def test_the_reward_is_the_fraction_followed_in_the_last_answer():
  words2 = {"kind": "length_constraints:number_words", "args": {"num_words": 2, "relation": GE}}
  comma = {"kind": "punctuation:no_comma"}
  lower = {"kind": "change_case:english_lowercase", "args": {}}
  goodbye = {"kind": "keywords:existence", "args": {"keywords": ["goodbye"]}}
  completions = [
      "<reasoning>First, think. Then, answer.</reasoning>\n<answer>hello world</answer>",
      "Hello, world",
      "anything",
      "anything",
      "<answer>FIRST, ANSWER</answer> then <answer> second answer </answer>",
      'Sure, here it is:\n"quoted"',
  ]
  constraints = [[words2, comma, lower, goodbye], [comma], None, [], [lower, comma],
                 [{"kind": "startend:quotation"}]]
  assert instructions(["p"] * 6, completions, constraints=constraints) == [
      0.75, 0.0, 0.0, 0.0, 1.0, 0.0]
  assert instructions.needs_constraints is True
  assert answer_text(completions[4]) == "second answer"
  assert answer_text("<answer>cut off") == "<answer>cut off"
  with pytest.raises(DataError, match="^row 1: constraint 0 has kind 'no_comma'"):
    instructions(["p", "p"], ["a", "b"], [[comma], [{"kind": "no_comma"}]])


def _message(constraints) -> str:
  with pytest.raises(DataError) as e:
    validate(constraints, "data.jsonl, record 3")
  assert "\n" not in str(e.value)
  return str(e.value)


def test_validation_errors_are_one_line():
  w = "data.jsonl, record 3"
  assert _message([{"kind": "keywords:existance", "args": {"keywords": ["a"]}}]) == (
      f"{w}: constraint 0 has kind 'keywords:existance', which is not a known kind (did you "
      "mean 'keywords:existence'?)")
  assert _message([{"kind": "punctuation:no_comma"}, {"kind": "json"}]) == (
      f"{w}: constraint 1 has kind 'json', which is not a known kind (did you mean "
      "'detectable_format:json_format'?)")
  assert _message([{"kind": "zzz"}]).startswith(
      f"{w}: constraint 0 has kind 'zzz', which is not a known kind (the kinds: "
      "keywords:existence, keywords:forbidden_words, ")
  words = "length_constraints:number_words"
  assert _message([{"kind": words, "args": {"num_words": 100}}]) == (
      f"{w}: constraint 0 ({words}) is missing argument 'relation'")
  assert _message([{"kind": words, "args": {"num_words": "100", "relation": LT}}]) == (
      f"{w}: constraint 0 ({words}) has num_words='100', which is not a non-negative integer")
  assert _message([{"kind": words, "args": {"num_words": True, "relation": LT}}]) == (
      f"{w}: constraint 0 ({words}) has num_words=True, which is not a non-negative integer")
  assert _message([{"kind": words, "args": {"num_words": 100, "relation": "at most"}}]) == (
      f"{w}: constraint 0 ({words}) has relation='at most', which is not 'less than' or "
      "'at least'")
  assert _message([{"kind": words, "args": {"num_word": 100, "relation": LT}}]) == (
      f"{w}: constraint 0 ({words}) has an unknown argument 'num_word' (its arguments: "
      "num_words, relation)")
  assert _message([{"kind": "punctuation:no_comma", "args": {"x": 1}}]) == (
      f"{w}: constraint 0 (punctuation:no_comma) has an unknown argument 'x' (it takes none)")
  assert _message([{"kind": "keywords:existence", "args": {"keywords": "romantic"}}]) == (
      f"{w}: constraint 0 (keywords:existence) has keywords='romantic', which is not a "
      "non-empty list of non-empty strings")
  assert _message([{"kind": "keywords:letter_frequency", "args": {
      "letter": "ab", "let_frequency": 1, "let_relation": GE}}]) == (
      f"{w}: constraint 0 (keywords:letter_frequency) has letter='ab', which is not a single "
      "character")
  assert _message([{"kind": "length_constraints:nth_paragraph_first_word", "args": {
      "num_paragraphs": 2, "nth_paragraph": 3, "first_word": "so"}}]) == (
      f"{w}: constraint 0 (length_constraints:nth_paragraph_first_word) asks for paragraph 3 "
      "of 2")
  assert _message([{"args": {}}]) == (
      f"{w}: constraint 0 is {{'args': {{}}}}, not a {{'kind': ..., 'args': {{...}}}} mapping")
  assert _message({"kind": "punctuation:no_comma"}) == (
      f"{w}: constraints is a dict, not a list of {{'kind': ..., 'args': {{...}}}}")


def test_validation_drops_absent_arguments():
  """A table gives every row every argument, None where a kind does not take it."""
  row = [{"kind": "punctuation:no_comma", "args": {"num_words": None, "relation": None}},
         {"kind": "detectable_format:title", "args": None}]
  assert validate(row, "t") == [("punctuation:no_comma", {}), ("detectable_format:title", {})]
  assert validate(None, "t") == [] and validate([], "t") == []


def test_ifeval_four_numbers_by_hand():
  lower, comma = {"kind": "change_case:english_lowercase"}, {"kind": "punctuation:no_comma"}
  strict, loose = judge(
      ["hello world", 'Sure, here it is:\n"quoted text"', "ALL CAPS", "x"],
      [[lower, comma], [comma, {"kind": "startend:quotation"}], [lower], None])
  assert strict == [[True, True], [False, False], [False], []]
  assert loose == [[True, True], [True, True], [False], []]
  scores = ifeval_scores(strict, loose)
  se = math.sqrt((1 / 3) * (2 / 3) / 3)  # both prompt-level rates are 1/3 or 2/3 of 3 rows
  assert scores == pytest.approx({
      "prompt_level_strict": 1 / 3, "prompt_level_strict_se": se,
      "instruction_level_strict": 2 / 5,
      "prompt_level_loose": 2 / 3, "prompt_level_loose_se": se,
      "instruction_level_loose": 4 / 5})
  empty = ifeval_scores([[]], [[]])
  assert all(math.isnan(v) for v in empty.values()) and len(empty) == 6
  with pytest.raises(ValueError, match="2 strict rows but 1 loose"):
    ifeval_scores([[True], [True]], [[True]])


def test_the_modules_import_only_the_rewards_floor():
  allowed = {"__future__", "collections", "difflib", "json", "math", "numbers", "re", "typing",
             "numpy", "langdetect", "reasoner.errors", "reasoner.rewards"}
  root = pathlib.Path(__file__).resolve().parents[1] / "reasoner" / "rewards"
  for name in ("instructions.py", "checks.py"):
    tree = ast.parse((root / name).read_text())
    found = {n.module if isinstance(n, ast.ImportFrom) else a.name
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    assert found <= allowed, (name, found - allowed)
