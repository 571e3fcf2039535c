"""IFEval's instruction checks (Zhou et al. 2023, arXiv 2311.07911), each a pure function
`(text, **args) -> bool` named after its kind's second half; `instructions` registers them
under IFEval's kind names and argument names.

They follow google-research/instruction_following_eval's `check_following`, with these
differences: keywords are matched literally (IFEval reads them as regular expressions, the same
for plain words); sentences are counted by `split_sentences`, a small regex splitter, and
capitalised words by a regex tokenizer, where IFEval needs nltk's punkt data (a download);
`english_capital` and `english_lowercase` check the case only (IFEval also asks langdetect for
English: a constraint `language:response_language` asks for that); `start_checker` is the
mirror of `end_checker` (IFEval's registry has no start check: its `multi-turn:constrained_start`
is switched off). `response_language` needs `langdetect` (its language profiles ship inside the
package), imported when first used: it is reliable from a short sentence on, not on a word or
two ("Yes." reads as French).
"""

from __future__ import annotations

import collections
import json
import re

RELATIONS = ("less than", "at least")
CONSTRAINED_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")

# A period that ends no sentence: one after a title (Mr., Dr., e.g.), and one after an
# abbreviation, an initial or a dotted acronym (etc., U.S.A., Ph.D.) or an ellipsis when a
# lower-case word or a number follows. A period followed by a letter or digit (3.5, example.com)
# never ends one: a sentence ends at [.!?] followed by white space or the end.
_TITLES = re.compile(r"(?<!\S)(?:mr|mrs|ms|dr|prof|st|sr|jr|vs|cf|e\.g|i\.e)\.", re.I)
_BEFORE_LOWER = re.compile(
    r"(?:(?<!\S)(?i:etc|inc|ltd|co|approx|[a-z]|[a-z]+(?:\.[a-z]+)+)\.|\.{2,}|…)(?=\s+[a-z0-9])")
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s|$)")
_HIDDEN = "\x00"


def compare(count: int, threshold: int, relation: str) -> bool:
  """IFEval's relations: 'less than' is count < threshold, 'at least' count >= threshold."""
  return count < threshold if relation == "less than" else count >= threshold


def split_sentences(text: str) -> list[str]:
  """The sentences of `text`: split after . ! ? (and closing quotes) that a space or the end
  follows, except after titles, abbreviations, initials and decimals."""
  text = _BEFORE_LOWER.sub(_hide, _TITLES.sub(_hide, text))
  pieces, start = [], 0
  for m in _SENTENCE_END.finditer(text):
    pieces.append(text[start:m.end()])
    start = m.end()
  pieces.append(text[start:])
  return [" ".join(p.replace(_HIDDEN, ".").split()) for p in pieces if re.search(r"\w", p)]


def _hide(m: re.Match) -> str:
  return m.group().replace(".", _HIDDEN)


def count_words(text: str) -> int:
  """Runs of word characters, as IFEval's `\\w+` tokenizer counts them."""
  return len(re.findall(r"\w+", text))


# keywords:


def existence(text: str, keywords: list[str]) -> bool:
  """Every keyword appears (case-insensitive, anywhere)."""
  return all(re.search(re.escape(k.strip()), text, re.I) for k in keywords)


def forbidden_words(text: str, forbidden_words: list[str]) -> bool:
  """No forbidden word appears as a whole word (case-insensitive)."""
  return not any(re.search(rf"\b{re.escape(w.strip())}\b", text, re.I) for w in forbidden_words)


def frequency(text: str, keyword: str, frequency: int, relation: str) -> bool:
  """The keyword's occurrences (case-insensitive) compared with `frequency`."""
  return compare(len(re.findall(re.escape(keyword.strip()), text, re.I)), frequency, relation)


def letter_frequency(text: str, letter: str, let_frequency: int, let_relation: str) -> bool:
  """The letter's occurrences (case-insensitive) compared with `let_frequency`."""
  count = collections.Counter(text.lower())[letter.strip().lower()]
  return compare(count, let_frequency, let_relation)


# language:


def response_language(text: str, language: str) -> bool:
  """langdetect (seed 0) reads the text as `language` (an ISO 639-1 code); text it cannot read
  (no letters) passes, as in IFEval."""
  import langdetect

  langdetect.DetectorFactory.seed = 0
  try:
    return langdetect.detect(text) == language
  except langdetect.LangDetectException:
    return True


# length_constraints:


def number_sentences(text: str, num_sentences: int, relation: str) -> bool:
  """The number of sentences compared with `num_sentences`."""
  return compare(len(split_sentences(text)), num_sentences, relation)


def number_words(text: str, num_words: int, relation: str) -> bool:
  """The number of words compared with `num_words`."""
  return compare(count_words(text), num_words, relation)


def number_paragraphs(text: str, num_paragraphs: int) -> bool:
  """Exactly `num_paragraphs` paragraphs separated by the markdown divider ***; an empty one is
  allowed only before the first divider or after the last."""
  paragraphs = re.split(r"\s?\*\*\*\s?", text)
  count = len(paragraphs)
  for i, p in enumerate(paragraphs):
    if not p.strip():
      if 0 < i < len(paragraphs) - 1:
        return False
      count -= 1
  return count == num_paragraphs


def nth_paragraph_first_word(text: str, num_paragraphs: int, nth_paragraph: int,
                             first_word: str) -> bool:
  """Exactly `num_paragraphs` paragraphs separated by blank lines ("\\n\\n"), the
  `nth_paragraph`-th (from 1) starting with `first_word` (case-insensitive, punctuation off)."""
  paragraphs = text.split("\n\n")
  count = sum(1 for p in paragraphs if p.strip())
  if not 1 <= nth_paragraph <= count or not paragraphs[nth_paragraph - 1].strip():
    return False
  word = paragraphs[nth_paragraph - 1].split()[0].lstrip("'\"")
  word = re.split(r"[.,?!'\"]", word)[0].lower()
  return count == num_paragraphs and word == first_word.strip().lower()


# detectable_content:


def number_placeholders(text: str, num_placeholders: int) -> bool:
  """At least `num_placeholders` placeholders in square brackets, such as [address]."""
  return len(re.findall(r"\[.*?\]", text)) >= num_placeholders


def postscript(text: str, postscript_marker: str) -> bool:
  """A postscript starting with the marker; "P.S." and "P.P.S" also match with spaces
  between their letters and in lower case."""
  marker = postscript_marker.strip()
  pattern = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}.get(marker, re.escape(marker))
  return re.search(pattern, text, re.I) is not None


# detectable_format:


def number_bullet_lists(text: str, num_bullets: int) -> bool:
  """Exactly `num_bullets` markdown bullets: lines starting with "*" (not "**") or "-"."""
  stars = re.findall(r"^\s*\*[^*].*$", text, re.M)
  dashes = re.findall(r"^\s*-.*$", text, re.M)
  return len(stars) + len(dashes) == num_bullets


def constrained_response(text: str) -> bool:
  """Contains one of "My answer is yes.", "My answer is no.", "My answer is maybe."."""
  return any(option in text for option in CONSTRAINED_OPTIONS)


def number_highlighted_sections(text: str, num_highlights: int) -> bool:
  """At least `num_highlights` non-empty markdown highlights on one line: *like this* or
  **like this**."""
  single = [h for h in re.findall(r"\*[^\n*]*\*", text) if h.strip("*").strip()]
  double = [h for h in re.findall(r"\*\*[^\n*]*\*\*", text) if h[2:-2].strip()]
  return len(single) + len(double) >= num_highlights


def multiple_sections(text: str, section_spliter: str, num_sections: int) -> bool:
  """At least `num_sections` sections, each opened by the splitter and a number ("Section 1";
  the splitter's case counts)."""
  pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
  return len(re.split(pattern, text)) - 1 >= num_sections


def json_format(text: str) -> bool:
  """The whole text is JSON, optionally in a ``` (or ```json) fence."""
  text = text.strip()
  for fence in ("```json", "```Json", "```JSON", "```"):
    text = text.removeprefix(fence)
  text = text.removesuffix("```").strip()
  try:
    json.loads(text)
  except ValueError:
    return False
  return True


def title(text: str) -> bool:
  """A non-empty title in double angular brackets on one line, such as <<poem of joy>>."""
  return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


# combination:


def two_responses(text: str) -> bool:
  """Two different responses separated by six asterisks ******, nothing else between dividers
  (a divider may open or close the text)."""
  parts = text.split("******")
  kept = []
  for i, part in enumerate(parts):
    if part.strip():
      kept.append(part.strip())
    elif 0 < i < len(parts) - 1:
      return False
  return len(kept) == 2 and kept[0] != kept[1]


def repeat_prompt(text: str, prompt_to_repeat: str) -> bool:
  """The text starts with the request, repeated word for word (case-insensitive)."""
  return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


# startend:


def end_checker(text: str, end_phrase: str) -> bool:
  """The text (outer double quotes off) ends with the phrase (case-insensitive)."""
  return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def start_checker(text: str, starter: str) -> bool:
  """The text (outer double quotes off) starts with the phrase (case-insensitive)."""
  return text.strip().strip('"').lower().startswith(starter.strip().lower())


def quotation(text: str) -> bool:
  """The whole text is wrapped in double quotation marks."""
  text = text.strip()
  return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# change_case:


def english_capital(text: str) -> bool:
  """Every cased letter is upper case (and there is one)."""
  return text.isupper()


def english_lowercase(text: str) -> bool:
  """Every cased letter is lower case (and there is one)."""
  return text.islower()


def capital_word_frequency(text: str, capital_frequency: int, capital_relation: str) -> bool:
  """The number of all-capital words (a hyphenated or dotted word is one: U.S., STATE-OF-THE-ART)
  compared with `capital_frequency`."""
  words = re.findall(r"\w+(?:[-.]\w+)*", text)
  return compare(sum(1 for w in words if w.isupper()), capital_frequency, capital_relation)


# punctuation:


def no_comma(text: str) -> bool:
  """No comma anywhere."""
  return "," not in text
