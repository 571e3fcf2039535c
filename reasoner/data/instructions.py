"""Generated instruction-following problems (`data.source: instructions`), after IFEval (Zhou et
al. 2023, arXiv 2311.07911): a small task (a fact, a list, a description, a summary, a title, a
message) under one to three verifiable constraints, deterministic by seed.

A record's `constraints` use IFEval's kinds and argument names (`reasoner.rewards.instructions`
checks them); its prompt states the task and each constraint in words (several phrasings a
kind). Its `response` (SFT's target, a pair's chosen) is a reasoning line, then an answer built
from the content written here (`ROWS`, `LISTS`) that follows every constraint; its `rejected`
breaks exactly one of them and keeps the others. Kinds that cannot hold together never meet
(`CONFLICTS`).

The split (`data.held_out_by`) says what a held-out score measures:
- `record`: one stream, every task and combination in both splits, no prompt in both: fit;
- `template`: one task of each family and one in `HELD_OUT_SHARE` combinations of two or more
  kinds held out of training (`split`); `held_out(..., kind)` gives `task` (the held-out tasks
  under training's combinations: does following an instruction carry to a new task?),
  `combination` (held-out combinations of kinds training saw alone, on training tasks: do known
  instructions compose?) or `record` (new prompts from training's tasks and combinations: fit).
"""

from __future__ import annotations

import itertools
import json
import random
import re

LOWER, CAPITAL = "change_case:english_lowercase", "change_case:english_capital"
KEYWORD, FORBIDDEN = "keywords:existence", "keywords:forbidden_words"
NO_COMMA, END, QUOTE = "punctuation:no_comma", "startend:end_checker", "startend:quotation"
TITLE, JSON = "detectable_format:title", "detectable_format:json_format"
BULLETS, WORDS = "detectable_format:number_bullet_lists", "length_constraints:number_words"
HIGHLIGHTS, SENTENCES = ("detectable_format:number_highlighted_sections",
                         "length_constraints:number_sentences")
POSTSCRIPT, PLACEHOLDERS = "detectable_content:postscript", "detectable_content:number_placeholders"

# kind -> the prompt's phrasings; {n} a count, {s} its plural, {w} the quoted words, {p} the end
# phrase, {m} the postscript's marker
PHRASES = {
    LOWER: ("Your entire response should be in lowercase letters.",
            "Use only lowercase letters in your answer.", "Write it all in lowercase letters."),
    CAPITAL: ("Your entire response should be in English capital letters.",
              "Write your whole answer in uppercase letters.", "Use only capital letters."),
    KEYWORD: ("Include the keyword {w} in your response.", "Make sure to use the word {w}."),
    FORBIDDEN: ("Do not include the word{s} {w} in the response.", "Avoid the word{s} {w}."),
    NO_COMMA: ("Do not use any commas.", "Refrain from using any commas in your response."),
    END: ("End your response with the phrase '{p}'. No other words should follow.",
          "Finish your answer with the exact phrase '{p}'."),
    QUOTE: ("Wrap your entire response in double quotation marks.",
            "Put your whole answer inside double quotes."),
    TITLE: ("Your answer must contain a title, wrapped in double angular brackets, such as "
            "<<poem of joy>>.", "Give your answer a title in double angular brackets: <<title>>."),
    BULLETS: ("Your answer must contain exactly {n} bullet points in markdown format, such as: "
              "* This is a point.", "Use exactly {n} markdown bullet points, like: * point."),
    WORDS: ("Answer with less than {n} words.", "Keep your response under {n} words."),
    SENTENCES: ("Your response should contain less than {n} sentences.",
                "Answer in fewer than {n} sentences."),
    POSTSCRIPT: ("At the end of your response, please add a postscript starting with '{m}'.",
                 "Add a postscript that begins with '{m}'."),
    PLACEHOLDERS: ("The response must contain at least {n} placeholder{s} represented by square "
                   "brackets, such as [address].", "Include at least {n} placeholder{s} in "
                   "square brackets, like [name]."),
    HIGHLIGHTS: ("Highlight at least {n} section{s} in your answer with markdown, i.e. "
                 "*highlighted section*.", "Highlight at least {n} part{s} in markdown: *part*."),
    JSON: ("Wrap your entire output in JSON format.", "Give your whole answer as valid JSON."),
}
# kind -> what the answer must do, for the response's reasoning line
MUSTS = {
    LOWER: "all in lowercase", CAPITAL: "all in capital letters", KEYWORD: "use the word {w}",
    FORBIDDEN: "never use {w}", NO_COMMA: "no commas", END: "end with '{p}'",
    QUOTE: "wrapped in double quotes", TITLE: "a title in double angular brackets",
    BULLETS: "exactly {n} bullet points", WORDS: "fewer than {n} words",
    SENTENCES: "fewer than {n} sentences", POSTSCRIPT: "a postscript ('{m}')",
    PLACEHOLDERS: "at least {n} placeholder{s} in square brackets",
    HIGHLIGHTS: "at least {n} highlighted part{s}", JSON: "all of it as JSON",
}
# Pairs that contradict each other (lowercase and capitals; JSON, the whole text, and what sits
# outside it), or whose checks read each other's marks: a quote before a bullet, a highlight's
# asterisks in a bullet line, "P.S." read as a sentence or not, the filler sentences that break
# one length breaking the other. Bullets are for lists, placeholders for messages.
CONFLICTS = {frozenset(p) for p in [
    (LOWER, CAPITAL), (JSON, TITLE), (JSON, BULLETS), (JSON, POSTSCRIPT), (JSON, END),
    (JSON, QUOTE), (JSON, SENTENCES), (SENTENCES, BULLETS), (SENTENCES, POSTSCRIPT),
    (SENTENCES, WORDS), (BULLETS, QUOTE), (BULLETS, HIGHLIGHTS), (BULLETS, PLACEHOLDERS)]}
FAMILY_KINDS = {BULLETS: "list", PLACEHOLDERS: "message"}  # kinds only one family can follow
FORBIDDEN_WORDS = ("actually", "basically", "honestly", "clearly", "certainly", "obviously",
                   "literally", "simply", "really", "totally")
END_PHRASES = ("Is there anything else I can help with?", "Any other questions?",
               "Let me know if you have additional questions.", "That is all for now.")
NOTES = ("I hope this helps.", "Thanks for asking.", "Have a nice day.")
FILLERS = ("I hope this answer is useful.", "Thank you for the good question.",
           "It was fun to think about this.", "I am always glad to help.")
# slot -> (placeholder, values) in messages
SLOTS = {"name": ("[name]", ("Sam", "Mia", "Tom", "Ana", "Leo", "Zoe")),
         "day": ("[day]", ("Saturday", "Sunday", "Friday", "Monday")),
         "time": ("[time]", ("noon", "six", "four")), "me": ("[your name]", ("Ben", "Ivy", "Max")),
         "place": ("[place]", ("the park", "my house", "the cafe", "the library"))}
STAND_IN = "something"  # what a broken keywords:existence writes instead of the keyword
# a keyword is never part of these (the rejected answer would keep it)
FIXED = " ".join(END_PHRASES + NOTES + FILLERS + FORBIDDEN_WORDS + (STAND_IN, "of course answer")
                 + tuple(p for p, _ in SLOTS.values())).lower()
STOP = set("that with from have their then than what when where there will your into over each "
           "like would could three four five".split())  # no keywords
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six")


def _rows(text: str) -> list[tuple[str, ...]]:
  return [tuple(r.split("|")) for r in text.split("; ")]


def _pools(text: str) -> dict[str, list[str]]:
  return {t: items.split("|") for t, items in (p.split(": ") for p in text.split("; "))}


CAPITALS = _rows(
    "France|Paris; Japan|Tokyo; Italy|Rome; Spain|Madrid; Egypt|Cairo; Canada|Ottawa; Kenya|"
    "Nairobi; Peru|Lima; Norway|Oslo; Greece|Athens; Germany|Berlin; Ireland|Dublin; Portugal|"
    "Lisbon; Austria|Vienna; Poland|Warsaw; Sweden|Stockholm; Chile|Santiago; Cuba|Havana; "
    "Thailand|Bangkok; Argentina|Buenos Aires")
COLOURS = _rows(
    "grass|green; snow|white; coal|black; a ripe banana|yellow; a ripe tomato|red; a carrot|"
    "orange; milk|white; a lemon|yellow; a lime|green; a strawberry|red; a pumpkin|orange; "
    "chocolate|brown; a polar bear|white; a flamingo|pink; a crow|black; the sky on a clear "
    "day|blue")
SOUNDS = _rows(
    "dog|barks; cat|meows; cow|moos; duck|quacks; sheep|bleats; lion|roars; horse|neighs; pig|"
    "oinks; goose|honks; snake|hisses; frog|croaks; bee|buzzes; mouse|squeaks; wolf|howls; "
    "donkey|brays; rooster|crows")
OPPOSITES = _rows(
    "hot|cold; big|small; fast|slow; day|night; happy|sad; open|closed; full|empty; early|late; "
    "wet|dry; loud|quiet; hard|soft; high|low; strong|weak; thick|thin; heavy|light; inside|"
    "outside; up|down; first|last; push|pull; win|lose")
BIGGER = _rows(
    "an elephant|a mouse; the sun|the moon; a bus|a bicycle; a whale|a goldfish; a mountain|a "
    "hill; an ocean|a pond; a horse|a cat; a tree|a flower; a city|a village; a house|a tent; a "
    "giraffe|a rabbit; the earth|the moon; a lion|an ant; a ship|a canoe")
DESCRIPTIONS = _rows(
    "the sea|The sea is wide and salty. Its waves roll onto the shore.; a cat|A cat is a small "
    "furry animal. It likes to sleep in warm places.; a forest|A forest is full of tall trees. "
    "The air there is cool and fresh.; rain|Rain falls from grey clouds. It makes the streets "
    "shine.; a city at night|A city at night glows with lights. Cars still move through the "
    "streets.; a library|A library is a quiet room full of books. People read and study there.; a "
    "desert|A desert is hot and dry. Few plants grow there.; snow|Snow is cold and white. It "
    "covers the ground like a blanket.; a garden|A garden is full of flowers. Bees hum among the "
    "plants.; the moon|The moon is a pale light in the night sky. It changes shape through the "
    "month.; a mountain|A mountain is a huge mass of rock. Its top is often covered in snow.; a "
    "beach|A beach is a strip of sand beside the sea. People swim there in summer.; autumn|Autumn "
    "is the season when leaves fall. The days grow shorter and cooler.")
DEFINITIONS = _rows(
    "a volcano|A volcano is a mountain that can throw out hot melted rock.; an island|An island "
    "is land with water all around it.; a bridge|A bridge lets people cross over a river or a "
    "road.; a recipe|A recipe is a set of steps for cooking a dish.; a calendar|A calendar shows "
    "the days and months of a year.; a planet|A planet is a large round body that travels around "
    "a star.; a dictionary|A dictionary is a book that explains what words mean.; a map|A map is "
    "a drawing that shows where places are.; a thermometer|A thermometer is a tool that measures "
    "temperature.; a museum|A museum is a building where people see old or rare objects.; a "
    "glacier|A glacier is a slow river of ice.; a compass|A compass is a tool with a needle that "
    "points north.; a telescope|A telescope makes faraway things look closer.")
TEXTS = _rows(  # text|one-sentence summary|title
    "Bees fly from flower to flower. They carry pollen that helps plants make fruit.|Bees carry "
    "pollen that helps plants make fruit.|Busy Bees; The moon makes no light of its own. It "
    "shines by reflecting sunlight.|The moon shines with reflected sunlight.|Borrowed Light; "
    "Camels can walk for days in the desert. They need very little water.|Camels cross deserts "
    "with little water.|Desert Walkers; Maple leaves turn red and gold in autumn. Then they fall "
    "to the ground.|Maple leaves change colour and fall in autumn.|Autumn Leaves; Penguins cannot "
    "fly. Their wings work like flippers in the sea.|Penguins use their wings to swim.|Swimming "
    "Birds; Bread rises because of yeast. The yeast fills the dough with tiny bubbles.|Yeast "
    "makes bread rise with bubbles of gas.|Why Bread Rises; Rainbows appear when sunlight passes "
    "through raindrops. Each drop splits the light.|Raindrops split sunlight into a "
    "rainbow.|Colours in the Rain; Owls hunt at night. Their sharp eyes and ears help them find "
    "mice.|Owls use sharp senses to hunt at night.|Night Hunters; A library lends books for free. "
    "People read there or take books home.|A library lends books to read or borrow.|Free Books "
    "for All; Snow forms when water in clouds freezes. Every snowflake has six sides.|Snowflakes "
    "are ice crystals from cold clouds.|How Snow Forms; Ants live in large colonies. Each ant has "
    "a job to do.|Ants live in colonies where every ant works.|Life in a Colony; The kettle "
    "boiled. Tom poured the tea and sat by the window.|Tom made tea and sat by the window.|A "
    "Quiet Cup of Tea; Exercise makes the heart stronger. Even a short daily walk helps.|Daily "
    "walks keep the heart strong.|Walk for Your Heart; Volcanoes form where melted rock rises "
    "from below. When they erupt, lava flows out.|Volcanoes erupt when melted rock rises.|Fire "
    "from Below; Trains carry many people at once. They are a cleaner way to travel than "
    "cars.|Trains are a clean way to move many people.|Travel by Train; Frogs start life as "
    "tadpoles in ponds. They grow legs and lose their tails.|Tadpoles grow legs and turn into "
    "frogs.|From Tadpole to Frog; Young sunflowers turn to face the sun. Birds and people eat "
    "their seeds.|Young sunflowers follow the sun.|Following the Sun; Mia planted tomato seeds in "
    "spring. By summer her garden was full of fruit.|Mia grew tomatoes from seeds.|A Summer "
    "Garden; Whales are mammals, not fish. They breathe air through a blowhole.|Whales are "
    "mammals that breathe air.|Giants That Breathe Air; Recycling paper saves trees. Old paper is "
    "made into new sheets.|Recycling turns old paper into new paper.|Paper Again")
MESSAGES = _rows(  # purpose|title|the message with {slots}
    "invite a friend to your party|An Invitation|Hi {name}! Please come to my party on {day} at "
    "{time}. It will be at {place}. Love from {me}.; thank a neighbour for their help|Thank "
    "You|Hello {name}! Thank you for helping me on {day}. I will bake you a cake soon. From "
    "{me}.; tell a friend you will be late|Running Late|Hi {name}! I will be late on {day}. I "
    "will reach {place} at {time}. From {me}.; wish a friend luck in an exam|Good Luck|Hi {name}! "
    "Good luck with your exam on {day}. You will do well. From {me}.; ask a friend to lunch|Lunch "
    "Soon|Hi {name}! Would you like to have lunch on {day}? We could meet at {place} at {time}. "
    "From {me}.; welcome a new neighbour|Welcome|Hello {name}! Welcome to the street. Come for "
    "tea at {place} on {day}. From {me}.")
GREETINGS = _rows(
    "a birthday|Happy Birthday|Happy birthday {name}! I hope your day is full of joy. Love from "
    "{me}.; the New Year|Happy New Year|Happy New Year {name}! May the year bring you health and "
    "joy. From {me}.; a wedding|For the Happy Couple|Congratulations on your wedding {name}! I "
    "wish you a lifetime of love. From {me}.; a graduation|Well Done|Well done on your graduation "
    "{name}! We are so proud of you. From {me}.; a new baby|A New Arrival|Congratulations on your "
    "new baby {name}! I hope to meet the little one on {day}. From {me}.; a friend who is ill|Get "
    "Well Soon|Get well soon {name}! I hope you feel better by {day}. From {me}.")
# name -> (family, rows, asks, answer, title, aim): {a} {b} {c} a row's fields, {A} the first
# capitalised; the answer's sentences are its parts
ROWS = {
    "capital": ("fact", CAPITALS, ("What is the capital of {a}?", "Name the capital of {a}."),
                "The capital of {a} is {b}.", "The capital of {a}", "Name the capital of {a}"),
    "colour": ("fact", COLOURS, ("What colour is {a}?", "What is the colour of {a}?"),
               "{A} is {b}.", "The colour of {a}", "Say what colour {a} is"),
    "sound": ("fact", SOUNDS, ("What sound does a {a} make?", "What noise does a {a} make?"),
              "A {a} {b}.", "The sound of a {a}", "Say what sound a {a} makes"),
    "opposite": ("fact", OPPOSITES, ("What is the opposite of '{a}'?", "Give the opposite of "
                 "'{a}'."), "The opposite of {a} is {b}.", "Opposites", "Give the opposite"),
    "bigger": ("fact", BIGGER, ("Which is bigger: {a} or {b}?", "Which is bigger: {b} or {a}?"),
               "{A} is bigger than {b}.", "{A} and {b}", "Say which is bigger"),
    "describe": ("write", DESCRIPTIONS, ("Describe {a} in a few words.", "Write a short "
                 "description of {a}."), "{b}", "About {a}", "Describe {a} briefly"),
    "define": ("write", DEFINITIONS, ("Explain what {a} is.", "What is {a}? Explain briefly."),
               "{b}", "What is {a}", "Explain what {a} is"),
    "summary": ("write", TEXTS, ("Summarize this text in one sentence: {a}", "Sum up this text "
                "in one sentence: {a}"), "{b}", "{c}", "Sum up the text in one sentence"),
    "title": ("write", TEXTS, ("Suggest a title for this text: {a}", "Give this text a title: "
              "{a}"), "I would call it {c}.", "{c}", "Suggest a title for the text"),
    "message": ("message", MESSAGES, ("Write a short message to {a}.", "Write a brief note to "
                "{a}."), "{c}", "{b}", "Write a short message to {a}"),
    "greeting": ("message", GREETINGS, ("Write a short greeting for {a}.", "Write a card for "
                 "{a}."), "{c}", "{b}", "Write a short greeting for {a}"),
}
# name -> (topic -> items, asks, answer as prose, title, aim): {n} the count, {nw} in words
# ({N} capitalised), {t} the topic, {x} the items joined
LISTS = {
    "list-nature": (_pools(
        "animals that live in the sea: whales|dolphins|sharks|octopuses|crabs|seals|squid; farm "
        "animals: cows|pigs|sheep|goats|horses|chickens|ducks|donkeys; birds: eagles|owls|robins|"
        "parrots|penguins|swans|crows|sparrows; trees: oaks|pines|maples|birches|willows|palms|"
        "elms|cedars; flowers: roses|tulips|daisies|lilies|sunflowers|orchids|poppies|daffodils; "
        "insects: ants|bees|beetles|butterflies|moths|ladybirds|grasshoppers|wasps"),
        ("Name {n} {t}.", "List {n} {t}."), "{N} {t} are {x}.", "{N} {t}", "Name {n} {t}"),
    "list-things": (_pools(
        "fruits: apples|pears|bananas|cherries|grapes|mangoes|peaches|plums; vegetables: carrots|"
        "potatoes|onions|peas|cabbages|leeks|peppers|beans; musical instruments: pianos|guitars|"
        "violins|drums|flutes|trumpets|harps|cellos; sports played with a ball: football|tennis|"
        "golf|rugby|cricket|volleyball|baseball; things found in a kitchen: spoons|forks|kettles|"
        "ovens|pans|plates|cups|fridges; school subjects: history|maths|music|science|art|"
        "geography|biology|chemistry; colours of the rainbow: red|orange|yellow|green|blue|"
        "indigo|violet"),
        ("List {n} {t}.", "Name {n} {t}.", "Give me {n} {t}."), "{N} {t} are {x}.", "{N} {t}",
        "List {n} {t}"),
    "tips": (_pools(
        "sleeping well: go to bed at the same time|keep the bedroom dark|avoid screens at night|"
        "get daylight in the morning|skip coffee in the evening|keep the room cool; saving money: "
        "make a monthly budget|cook at home|compare prices|avoid buying on impulse|save a little "
        "each week|cancel unused subscriptions; studying for a test: start early|study in short "
        "sessions|test yourself often|sleep well the night before|take regular breaks|explain "
        "the ideas aloud; keeping a plant alive: water it when the soil is dry|give it enough "
        "light|use a pot with drainage|remove dead leaves|feed it in spring|turn it now and "
        "then; staying healthy: eat plenty of vegetables|drink enough water|walk every day|sleep "
        "eight hours|wash your hands often|take time to rest; making friends: join a club|ask "
        "people questions|be a good listener|say yes to invitations|keep in touch|smile often"),
        ("Give {n} tips for {t}.", "Share {n} tips for {t}."), "My {nw} tips for {t} are to {x}.",
        "Tips for {t}", "Give {n} tips for {t}"),
}
TASKS = {**{k: v[0] for k, v in ROWS.items()}, **{k: "list" for k in LISTS}}  # name -> family
FAMILIES = ("fact", "write", "list", "message")
HELD_OUT_SHARE = 5  # `template`: one combination of two or more kinds in five held out
SIZES = (1, 2, 2, 3, 3)  # how many constraints a record draws
MAX_PROMPT_WORDS = 60
# every combination of one to three kinds that can hold together
COMBINATIONS = ["+".join(c) for n in (1, 2, 3) for c in itertools.combinations(sorted(PHRASES), n)
                if not any(frozenset(p) in CONFLICTS for p in itertools.combinations(c, 2))]


def _fits(task: str, combination: str) -> bool:
  return all(FAMILY_KINDS.get(k, TASKS[task]) == TASKS[task] for k in combination.split("+"))


def _count(text: str) -> int:  # words, as IFEval counts them
  return len(re.findall(r"\w+", text))


def _content(task: str, rng: random.Random) -> dict:
  """One instance of a task: its ask, aim, title and answer sentences or list items."""
  if task in LISTS:
    pools, asks, answer, title, aim = LISTS[task]
    topic = rng.choice(sorted(pools))
    n = rng.randint(2, 5)
    items = rng.sample(pools[topic], n + 1)
    f = {"n": n, "nw": NUMBERS[n], "N": NUMBERS[n].capitalize(), "t": topic, "x": "{x}"}
    return {"ask": rng.choice(asks).format(**f), "aim": aim.format(**f),
            "title": title.format(**f), "prose": answer.format(**f), "items": items[:n],
            "extra": items[n], "slots": {}}
  _, rows, asks, answer, title, aim = ROWS[task]
  row = rng.choice(rows)
  f = {**dict(zip("abc", row)), "A": row[0][0].upper() + row[0][1:]}
  units = re.split(r"(?<=[.!?]) ", answer.format(**f))
  slots = {k: (SLOTS[k][0], rng.choice(SLOTS[k][1]))
           for k in re.findall(r"\{(\w+)\}", " ".join(units))}
  return {"ask": rng.choice(asks).format(**f), "aim": aim.format(**f),
          "title": title.format(**f), "units": units, "items": None, "slots": slots}


def _parts(c: dict, kinds: set[str], broken: str | None = None) -> list[str]:
  """The answer's sentences, or its bullets' items (one too many when bullets are `broken`)."""
  on = kinds - {broken}
  if c["items"]:
    items = c["items"] + [c["extra"]] * (broken == BULLETS)
    if BULLETS in kinds:
      return items
    x = " and ".join(items) if NO_COMMA in on else ", ".join(items[:-1]) + " and " + items[-1]
    return [c["prose"].format(x=x)]
  filled = {k: v[0 if PLACEHOLDERS in on else 1] for k, v in c["slots"].items()}
  return [u.format(**filled) for u in c["units"]]


def _spots(parts: list[str]) -> list[tuple[int, int]]:
  """(part, word) of the words a highlight may wrap, longest first: no part's first word."""
  cores = [[w.rstrip(".!?") for w in p.split(" ")] for p in parts]
  spots = [(i, j) for i, ws in enumerate(cores) for j, w in enumerate(ws)
           if j and w.isalpha() and len(w) > 2]
  return sorted(spots, key=lambda s: -len(cores[s[0]][s[1]]))


def _highlight(parts: list[str], n: int) -> list[str]:
  words = [p.split(" ") for p in parts]
  for i, j in _spots(parts)[:n]:
    core = words[i][j].rstrip(".!?")
    words[i][j] = f"*{core}*{words[i][j][len(core):]}"
  return [" ".join(ws) for ws in words]


def _keywords(parts: list[str]) -> list[str]:
  """Content words a keywords:existence may ask for, none part of the fixed phrases."""
  words = [w.rstrip(".!?") for p in parts for w in p.split(" ")]
  return list(dict.fromkeys(w for w in words if w.isalpha() and len(w) > 3
                            and w.lower() not in STOP and w.lower() not in FIXED))


def _answer(c: dict, cons: dict[str, dict], broken: str | None = None, fill: int = 0) -> str:
  """The answer following every constraint in `cons` but `broken`, with `fill` filler sentences."""
  kinds = set(cons)
  on = kinds - {broken}
  parts, title = _parts(c, kinds, broken), c["title"]
  if broken == KEYWORD:
    word = re.compile(re.escape(cons[KEYWORD]["keywords"][0]), re.I)
    parts, title = [word.sub(STAND_IN, p) for p in parts], word.sub(STAND_IN, title)
  if HIGHLIGHTS in kinds:
    parts = _highlight(parts, cons[HIGHLIGHTS]["num_highlights"] - (broken == HIGHLIGHTS))
  if broken == FORBIDDEN:  # "Honestly the sea is ...", "* Honestly apples"
    head, _, rest = parts[0].partition(" ")
    head = head.lower() if head in ("The", "A", "An", "It", "Its", "My") else head
    parts[0] = f"{cons[FORBIDDEN]['forbidden_words'][0].capitalize()} {head} {rest}".strip()
  if broken == NO_COMMA and "," not in "".join(parts):
    parts[0] = re.sub(r"[.!?]?$", lambda m: ", of course" + m.group(), parts[0], count=1)
  more = [FILLERS[i % len(FILLERS)] for i in range(fill)]
  if BULLETS in kinds:
    text = "\n".join(f"* {p[0].upper()}{p[1:]}" for p in parts)
    text += "\n" + " ".join(more) if more else ""
  else:
    text = " ".join(parts + more)
  if JSON in on:
    text = json.dumps({"answer": text})
  if TITLE in kinds:
    text = (f"<<{title}>>" if TITLE in on else title) + "\n" + text
  if POSTSCRIPT in on:
    text += f"\n{cons[POSTSCRIPT]['postscript_marker'].rstrip('.')}. {c['note']}"
  if END in on:
    text += "\n" + cons[END]["end_phrase"]
  if QUOTE in on:
    text = f'"{text}"'
  return text.lower() if LOWER in on else text.upper() if CAPITAL in on else text


def _say(text: str, args: dict) -> str:
  """A phrasing or a must with the constraint's arguments in it."""
  n = next((v for v in args.values() if isinstance(v, int)), 0)
  words = args.get("keywords") or args.get("forbidden_words") or []
  return text.format(n=n, s="" if (n or len(words)) == 1 else "s",
                     w=" or ".join(f"'{w}'" for w in words), p=args.get("end_phrase"),
                     m=args.get("postscript_marker"))


def _record(rng: random.Random, task: str, combination: str) -> dict | None:
  """A record of the task under the combination; None when a draw cannot make one."""
  c = _content(task, rng)
  kinds = combination.split("+")
  rng.shuffle(kinds)
  parts = _parts(c, set(kinds))
  keywords, spots = _keywords(parts), _spots(parts)
  if (KEYWORD in kinds and not keywords) or (HIGHLIGHTS in kinds and not spots):
    return None
  draw = {KEYWORD: lambda: {"keywords": [rng.choice(keywords)]},
          FORBIDDEN: lambda: {"forbidden_words": rng.sample(FORBIDDEN_WORDS, rng.randint(1, 2))},
          END: lambda: {"end_phrase": rng.choice(END_PHRASES)},
          BULLETS: lambda: {"num_bullets": len(c["items"])},
          POSTSCRIPT: lambda: {"postscript_marker": rng.choice(("P.S.", "P.P.S"))},
          PLACEHOLDERS: lambda: {"num_placeholders": rng.randint(1, min(3, len(c["slots"])))},
          HIGHLIGHTS: lambda: {"num_highlights": rng.randint(1, min(3, len(spots)))}}
  cons = {k: draw[k]() if k in draw else {} for k in kinds}
  c["note"] = rng.choice(NOTES)  # a postscript's
  text = _answer(c, cons)
  if WORDS in cons:  # a generous bound: no other constraint's break reaches it
    cons[WORDS] = {"num_words": 5 * -(-(_count(text) + rng.randint(8, 16)) // 5),
                   "relation": "less than"}
  sentences = len(parts) + (END in cons)  # each part is one sentence; the end phrase another
  if SENTENCES in cons:
    cons[SENTENCES] = {"num_sentences": sentences + rng.randint(1, 3), "relation": "less than"}
  broken = rng.choice(kinds)
  fill = cons[SENTENCES]["num_sentences"] - sentences if broken == SENTENCES else 0
  wrong = _answer(c, cons, broken, fill)
  while broken == WORDS and _count(wrong) < cons[WORDS]["num_words"]:
    fill += 1
    wrong = _answer(c, cons, broken, fill)
  question = " ".join([c["ask"]] + [_say(rng.choice(PHRASES[k]), cons[k]) for k in kinds])
  if _count(question) >= MAX_PROMPT_WORDS:
    return None
  why = f"<reasoning>{c['aim']}: {'; '.join(_say(MUSTS[k], cons[k]) for k in kinds)}.</reasoning>"
  response = f"{why}\n<answer>{text}</answer>"
  return {"question": question, "constraints": [{"kind": k, "args": cons[k]} for k in kinds],
          "category": "instructions", "template": f"{task}|{combination}", "task": task,
          "combination": combination, "answer": None, "response": response, "chosen": response,
          "rejected": f"{why}\n<answer>{wrong}</answer>"}


def _distinct(rng: random.Random, n: int, tasks: list[str], combinations: list[str],
              seen: set[str]) -> list[dict]:
  """`n` records with prompts not in `seen` (which they join): a task, then a combination that
  fits it (half a list's or message's with its family's kind), of a size drawn from `SIZES`."""
  fits = {t: [c for c in combinations if _fits(t, c)] for t in tasks}
  own = {t: [c for c in fits[t] if any(FAMILY_KINDS.get(k) == TASKS[t] for k in c.split("+"))]
         for t in tasks}
  tasks = [t for t in tasks if fits[t]]
  out: list[dict] = []
  for _ in range(50 * max(n, 1) if tasks else 0):
    if len(out) == n:
      break
    task, size = rng.choice(tasks), rng.choice(SIZES)
    pool = own[task] if own[task] and rng.random() < 0.5 else fits[task]
    combination = rng.choice([c for c in pool if c.count("+") == size - 1] or pool)
    r = _record(rng, task, combination)
    if r and r["question"] not in seen:
      seen.add(r["question"])
      out.append(r)
  if len(out) < n:
    raise ValueError(f"cannot generate {n} distinct instruction prompts from {len(tasks)} tasks "
                     f"and {len(combinations)} constraint combinations; lower data.num_train "
                     "or data.num_eval")
  return out


def split(seed: int) -> tuple[list[str], list[str], list[str], list[str]]:
  """(training tasks, held-out tasks, training combinations, held-out combinations), chosen by
  `seed`: one task of each family, and one in `HELD_OUT_SHARE` of the combinations of two or
  more kinds (every single kind trains, and every family keeps a training task)."""
  rng = random.Random(f"instructions-split-{seed}")
  held_tasks = [rng.choice([t for t in TASKS if TASKS[t] == f]) for f in FAMILIES]
  multi = [c for c in COMBINATIONS if "+" in c]
  held = set(rng.sample(multi, len(multi) // HELD_OUT_SHARE))
  return ([t for t in TASKS if t not in held_tasks], held_tasks,
          [c for c in COMBINATIONS if c not in held], [c for c in COMBINATIONS if c in held])


def held_out(num_train: int, num: int, seed: int, held_out_by: str = "template",
             kind: str | None = None) -> tuple[list[dict], list[dict]]:
  """(train, `num` held-out records); the training records never depend on `num`. `kind`
  (default: `combination` with held_out_by='template', else `record`): `record`, new prompts
  from training's tasks and combinations; `task`, the held-out tasks under combinations the
  training records use; `combination`, held-out combinations of kinds they use, on their tasks."""
  kind = kind or ("combination" if held_out_by == "template" else "record")
  if (held_out_by, kind) not in (("record", "record"), ("template", "record"), ("template", "task"),
                                 ("template", "combination")):
    raise ValueError(f"held_out_by {held_out_by!r} with kind {kind!r}: expected 'template' (kind "
                     "'record', 'task' or 'combination') or 'record' (kind 'record')")
  rng = random.Random(f"instructions-{seed}")
  if held_out_by == "record":  # one stream
    out = _distinct(rng, num_train + num, list(TASKS), COMBINATIONS, set())
    return out[:num_train], out[num_train:]
  train_tasks, held_tasks, train_combinations, held_combinations = split(seed)
  seen: set[str] = set()
  train = _distinct(rng, num_train, train_tasks, train_combinations, seen)
  if kind == "record":
    return train, _distinct(rng, num, train_tasks, train_combinations, seen)
  other = random.Random(f"instructions-held-out-{seed}-{kind}")
  if kind == "task":
    used = {r["combination"] for r in train}
    return train, _distinct(other, num, held_tasks, [c for c in COMBINATIONS if c in used], seen)
  trained = {k for r in train for k in r["combination"].split("+")}
  return train, _distinct(other, num, train_tasks,
                          [c for c in held_combinations if set(c.split("+")) <= trained], seen)


def generate(num_train: int, num_eval: int, seed: int, held_out_by: str = "record"
             ) -> tuple[list[dict], list[dict]]:
  """(train, held_out): `held_out` with its default kind (none of training's combinations for
  held_out_by='template')."""
  return held_out(num_train, num_eval, seed, held_out_by)
