"""Records from the configured source, and the grain training pipeline.

A record is {'question': str, 'answer': str | None, 'category': str | None, 'response':
str | None, 'chosen': str | None, 'rejected': str | None, 'rubric': tuple | None} (and, in a
mixture, 'source': its source's name): the reference answer, the category,
the response (SFT's target) and a preference pair (chosen, rejected) are optional in a file
(rewards that need an answer, and routing by category, are checked against the records in
`rewards.scoring.Rewards.check`, responses and pairs by their stage's check, before any model
loads). A record may give its question and response as chat `messages` instead: [{role: user,
content}, {role: assistant (or model), content}]; a pair's chosen and rejected may each be such
a list (TRL's conversational format), the question taken from its user turn.

Every source of rows maps them to records alike, by the configured field names: jsonl, parquet
and csv files (read by `files`), a file of a Kaggle dataset and a Hugging Face dataset's
splits (both fetched by `hub`), and gsm8k, a Hugging Face dataset under a preset mapping
(PRESETS). A response (and a pair's texts) may instead be written from a record's fields by a
template (data.response_template), a field as it is or by a transform ({answer:final},
{answer:steps}: config.data.TRANSFORMS). Each such source is checked as it loads and summed
up in one line: the records read, those dropped (no question, or a field a template names
missing; a question already in training, the first kept) and the training records whose
question is held out, dropped from training (contamination): held out by the source itself,
by another source of a mixture, or by a named evaluation set.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import string
from typing import Any, NamedTuple

import grain

from reasoner.config import DataConfig, EvalSet
from reasoner.config.data import (FILE_KINDS, TRANSFORMS, Fields, Hub, final_answer,
                                  template_fields)
from reasoner.errors import DataError
from reasoner.data import arithmetic, hub, instructions
from reasoner.data.files import file_rows

_log = logging.getLogger("reasoner")
_TEXTS = ("question", "response", "chosen", "rejected")  # the texts a template may write
# source: gsm8k is hf with GSM8K's mapping: openai/gsm8k, main, its test split held out (an
# evaluation set's records) or a local copy at `path` (no subsets); its `answer` (worked steps,
# then '#### 72') the reference (72, as every answer_field is read) and, by the template's
# transforms, SFT's target; its records' category. A key the source sets itself is its own.
GSM8K = dict(path="openai/gsm8k", subset="main", split="train", eval_split="test",
             question_field="question", answer_field="answer",
             response_template="<reasoning>{answer:steps}</reasoning>\n<answer>{answer:final}"
                               "</answer>", category="math")
# source: ifeval is hf with IFEval's mapping (Zhou et al. 2023; google/IFEval, Apache 2.0): its
# one split of 541 prompts, each with its instructions (`instruction_id_list`, with their
# `kwargs`) as the record's constraints, scored by the `instructions` reward's checks
IFEVAL = dict(path="google/IFEval", subset=None, split="train", eval_split=None,
              question_field="prompt", constraints_field="instruction_id_list",
              constraint_args_field="kwargs", category="instructions")
PRESETS = {"gsm8k": GSM8K, "ifeval": IFEVAL}  # config.data.PRESET_SOURCES


class _Template(string.Formatter):
  """str.format_map with the transforms as format specs: {answer:final}."""

  def format_field(self, value, spec: str) -> str:
    return TRANSFORMS[spec](value) if spec else format(value)


_TEMPLATE = _Template()


def _records(rows: list[dict], cfg, where: str, section: str, overlong: str,
             category: str | None = None) -> tuple[list[dict], collections.Counter]:
  """The records of `rows` by cfg's fields and templates (`category`: theirs where they name
  none), and the rows dropped, by reason: no question (missing, null or blank: str() would
  train on the text 'None'), or a field a template names missing (or null), as `overlong` says
  (drop; error: one line)."""
  rows = [_expanded(row, cfg, f"{where}: record {i}") for i, row in enumerate(rows)]
  templates = _templates(rows, cfg, where, section)
  out, dropped = [], collections.Counter()
  asked = getattr(cfg, "question_template", None) is None  # else a template writes it
  for i, row in enumerate(rows):
    if asked and (row.get(cfg.question_field) is None or not str(row[cfg.question_field]).strip()):
      dropped[f"missing field '{cfg.question_field}'"] += 1
      continue
    texts, gap = {}, None
    for k, (template, names) in templates.items():
      gap = next((n for n in names if row.get(n) is None), None)
      if gap is not None:
        break
      texts[k] = _TEMPLATE.vformat(template, (), row)
    if gap is None:
      out.append(_record(row, cfg, f"{where}: record {i}", section, texts, category))
    elif overlong == "error":
      raise DataError(f"{where}: record {i} has no field '{gap}', which {section}.{k}_template "
                      "names (data.overlong: error; 'drop' skips such records)")
    else:
      dropped[f"missing field '{gap}'"] += 1
  if not out:
    raise DataError(f"{where}: no records" + (f" (every one dropped: {_reasons(dropped)})"
                                              if dropped else ""))
  return out, dropped


def _expanded(row: dict, cfg, where: str) -> dict:
  """A row with its chat `messages` (and conversation pairs) as the configured fields."""
  if "messages" in row and cfg.question_field not in row:
    row = {**row, **_from_messages(row["messages"], where, cfg)}
  for f in (getattr(cfg, "chosen_field", None), getattr(cfg, "rejected_field", None)):
    if f and isinstance(row.get(f), list):  # a conversation: its user turn and its reply
      turns = _from_messages(row[f], f"{where}, field '{f}'", cfg)
      row = {cfg.question_field: turns[cfg.question_field], **row,
             f: turns.get(getattr(cfg, "response_field", "response"))}
  return row


def _templates(rows: list[dict], cfg, where: str, section: str) -> dict[str, tuple]:
  """{text: (its template, the fields it names)}; a configured field or a template's field
  that no row has is one line naming those they have."""
  have = sorted(set().union(*rows)) if rows else []
  for f in dataclasses.fields(Fields):
    name = getattr(cfg, f.name)
    needed = f.name == "question_field" and getattr(cfg, "question_template", None) is None
    if f.name.endswith("_field") and (needed or name != f.default) and (
        rows and name not in have):
      raise DataError(f"{where} has no field '{name}' ({section}.{f.name}) in any record; they "
                      f"have {', '.join(have)}")
  out = {}
  for k in _TEXTS:
    if (template := getattr(cfg, f"{k}_template", None)) is not None:
      names = template_fields(template, f"{section}.{k}_template")
      for n in names:
        if n not in have:
          raise DataError(f"config key '{section}.{k}_template' names field '{n}', which no "
                          f"record of {where} has; they have {', '.join(have)}")
      out[k] = (template, names)
  return out


def _record(row: dict, cfg, where: str, section: str, texts: dict[str, str],
            default: str | None) -> dict:
  """One record of a row that has a question (`texts`: those its templates wrote; `default`:
  its category where it names none)."""
  curriculum = getattr(cfg, "curriculum", None)
  level = curriculum.field if curriculum is not None else None  # a curriculum's field, kept
  answer, category = row.get(cfg.answer_field), row.get(cfg.category_field)
  category = default if category is None else category
  written = {k: texts[k] if k in texts else _text(row, getattr(cfg, f"{k}_field", None))
             for k in _TEXTS}
  return {"question": written.pop("question"),
          "answer": None if answer is None else final_answer(str(answer)),
          "category": None if category is None else str(category),
          "rubric": rubric(row.get(cfg.rubric_field), where, f"{section}.rubric_field"),
          **written,
          **{k: v for k, v in (("constraints", _constraints(row, cfg, where)),
                               ("tests", row.get(getattr(cfg, "tests_field", None) or "")))
             if v is not None},
          **({level: str(row[level])} if level and row.get(level) is not None else {})}


def _constraints(row: dict, cfg, where: str) -> list | None:
  """A record's constraints, as its constraints_field holds them ([{kind, args}]) or, in
  IFEval's layout, its list of kinds paired with its list of their arguments
  (`constraint_args_field`); None where it has none."""
  kinds = row.get(getattr(cfg, "constraints_field", None) or "")
  field = getattr(cfg, "constraint_args_field", None)
  if kinds is None or field is None:
    return kinds
  args = row.get(field)
  if not (isinstance(kinds, list) and isinstance(args, list) and len(args) == len(kinds)):
    raise DataError(f"{where}: '{cfg.constraints_field}' and '{field}' must be lists of the "
                    f"same length, a kind and its arguments each (got {kinds!r} and {args!r})")
  return [{"kind": k, "args": a or {}} for k, a in zip(kinds, args)]


def rubric(value, where: str, key: str) -> tuple[tuple[str | dict, float], ...] | None:
  """A record's rubric as ((criterion, weight), ...): a list of strings (weight 1) or of
  mappings with a `criterion` (or Rubrics as Rewards' `description` / `title`) and a `weight`,
  negative for a pitfall. A criterion code can decide is a check instead, {check: kind, args:
  {...}, weight} with an instruction's kind (rewards/instructions.py; validated where the judge
  is), kept as {"kind", "args"}: it costs the judge nothing. One positive weight at least, else
  nothing could be earned."""
  if value is None:
    return None
  bad = lambda why: DataError(f"{where}: its rubric ({key}) {why}")
  if not isinstance(value, (list, tuple)) or not value:
    raise bad("is not a list of criteria")
  out = []
  for j, item in enumerate(value):
    if isinstance(item, str):
      item = {"criterion": item}
    text = isinstance(item, dict) and next(
        (item[k] for k in ("criterion", "description", "title") if item.get(k)), None)
    if isinstance(item, dict) and isinstance(item.get("check"), str) and not text:
      text = {"kind": item["check"], "args": item.get("args") or {}}
    weight = item.get("weight", 1.0) if isinstance(item, dict) else None
    if not isinstance(text, (str, dict)) or isinstance(weight, bool) or not isinstance(
        weight, (int, float)):
      raise bad(f"criterion {j} = {item!r}: expected a text, {{criterion: text, weight: "
                "number}} or {check: kind, args: {...}, weight: number}")
    out.append((text, float(weight)))
  if not any(w > 0 for _, w in out):
    raise bad(f"has no positive weight ({[w for _, w in out]}): a response could earn nothing")
  return tuple(out)


def _text(row: dict, field: str | None) -> str | None:
  return None if field is None or row.get(field) is None else str(row[field])


def _from_messages(messages, where: str, cfg: DataConfig | EvalSet) -> dict:
  """{question_field, response_field} of a single-turn chat: a user turn, then the model's."""
  roles = [m.get("role") for m in messages] if isinstance(messages, list) and all(
      isinstance(m, dict) for m in messages) else None
  if roles not in (["user", "assistant"], ["user", "model"], ["user"]):
    raise DataError(f"{where}: 'messages' must be a user turn and the model's reply "
                    f"([{{role: user, content}}, {{role: assistant, content}}]); it has roles "
                    f"{roles}")
  out = {cfg.question_field: messages[0].get("content", "")}
  if len(messages) == 2:
    out[getattr(cfg, "response_field", "response")] = messages[1].get("content", "")
  return out


def load_splits(cfg: DataConfig, key: str = "data", log=None,
                evaluated: dict[str, list[dict]] | None = None) -> tuple[list[dict], list[dict]]:
  """(train, held_out) records (`key`: the config section, for messages; `log`: where each
  source's summary line goes, default the reasoner logger; `evaluated`: the named evaluation
  sets' records, whose questions leave training). Fails fast, before any model is loaded."""
  log = log or _log.info
  elsewhere = {_norm(r): f"eval.sets[{name}]" for name, rs in (evaluated or {}).items()
               for r in rs}
  if cfg.mixture is not None:
    return _mixture(cfg, log, elsewhere)
  return _checked(_part(cfg, key, cfg.num_eval, None), elsewhere, log)


class _Part(NamedTuple):
  """A source's records before the checks across sources: its line's label and count (`read`:
  "13 read", "72 generated"), its training and held-out records, and those dropped, by reason
  (None: generated, its questions distinct and its held-out split apart by construction)."""

  label: str
  read: str
  train: list[dict]
  held: list[dict]
  dropped: collections.Counter | None


def _part(cfg: DataConfig, section: str, n_eval: int, name: str | None) -> _Part:
  """A source's records (`n_eval` held out; `name`: its mixture name): generated, or rows read
  and mapped, their held-out split's or else their last records held out."""
  label = lambda what: what if name is None else f"'{name}' ({what})"
  if cfg.source in ("arithmetic", "instructions"):
    train, held = (arithmetic.generate(cfg.num_train, cfg.num_eval, cfg.seed, cfg.difficulty,
                                       cfg.held_out_by) if cfg.source == "arithmetic" else
                   instructions.generate(cfg.num_train, cfg.num_eval, cfg.seed,
                                         cfg.held_out_by))
    return _Part(label(cfg.source), f"{len(train) + len(held)} generated", train,
                 held[:n_eval], None)
  got = _fetch(cfg, section, cfg.num_train, n_eval)
  train, dropped = _records(got.rows, got.c, got.where, section, cfg.overlong, got.category)
  if got.held is None:
    if n_eval and len(train) < 2:
      raise DataError(f"{got.where}: {len(train)} record(s); need at least 2 to hold one out")
    n = min(n_eval, len(train) // 2)
    train, held = (train[:-n], train[-n:]) if n else (train, [])
  else:
    (rows, where), c = got.held, got.c
    held, more = _records(rows, c, where, section, cfg.overlong, got.category)
    held, dropped = held[:n_eval], dropped + more
  read = len(got.rows) + (0 if got.held is None else len(got.held[0]))
  return _Part(label(got.label), f"{read} read", train, held, dropped)


def _checked(p: _Part, elsewhere: dict[str, str], log) -> tuple[list[dict], list[dict]]:
  """p's (train, held out), its training records less repeats of a question and any question
  held out (by p, or `elsewhere`: {question: the key of what holds it out}); its line logged
  (a generated source's only where some left training)."""
  train, contaminated = _hygiene(p.train, p.held, elsewhere, p.dropped)
  if p.dropped is None and not contaminated:
    return train, p.held
  line = _summary(p.label, p.read, p.dropped or collections.Counter(), contaminated)
  if not train:
    raise DataError(f"{line}: no training records are left")
  log(f"{line}; {len(train)} training, {len(p.held)} held out")
  return train, p.held


class _Fetched(NamedTuple):
  """A source of rows as read: `c` as its rows are mapped, its label, its rows and where they
  are, its held-out rows and where (None: its last records are held out), and its records'
  category where they name none (a preset's)."""

  c: Any
  label: str
  rows: list[dict]
  where: str
  held: tuple[list[dict], str] | None
  category: str | None = None


def _fetch(c, section: str, n_train: int, n_held: int) -> _Fetched:
  """A file's rows, a Kaggle file's, or a Hugging Face dataset's splits (a stream's first
  n_train + n_held, or n_train and n_held of a held-out split), a preset's (gsm8k) as hf's
  under its mapping."""
  named, category = c.source, None
  if named in PRESETS:
    c, category = _preset(c)
  if c.source == "kaggle":
    path = hub.kaggle_file(c, section)
    rows = file_rows(str(path), FILE_KINDS[path.suffix], f"{section}.file")
    return _Fetched(c, f"kaggle {c.path} {c.file}", rows, str(path), None)
  if c.source != "hf":
    eval_path = getattr(c, "eval_path", None)
    held = (file_rows(eval_path, c.source, f"{section}.eval_path"), eval_path) if (
        eval_path and n_held) else None
    return _Fetched(c, f"{named} {c.path}", file_rows(c.path, c.source, f"{section}.path"),
                    c.path, held)
  held_split = c.eval_split if n_held else None
  limits = {c.split: (n_train + (0 if held_split else n_held)) if c.streaming else None}
  if held_split:
    limits[held_split] = n_held if c.streaming else None
  splits = hub.hf_rows(c, section, limits, named)
  held = (splits[held_split], f"{c.path} ({held_split})") if held_split else None
  return _Fetched(c, f"{named} {c.path}", splits[c.split], f"{c.path} ({c.split})", held,
                  category)


def _preset(c) -> tuple[Any, str | None]:
  """(c as an hf source under its preset's mapping, its records' category): the preset's
  dataset, or a local copy at c.path (no subsets); its training and held-out splits, or an
  evaluation set's held-out split; its fields and templates where c leaves them unset."""
  preset = dict(PRESETS[c.source])
  category = preset.pop("category", None)
  unset = {f.name: f.default for f in dataclasses.fields(Fields)}
  mapping = {k: v for k, v in preset.items() if k in unset and getattr(c, k) == unset[k]}
  splits = ({"split": preset["eval_split"] or preset["split"], "eval_split": None}
            if isinstance(c, EvalSet) else
            {"split": preset["split"], "eval_split": preset["eval_split"]})
  return dataclasses.replace(c, source="hf", path=c.path or preset["path"],
                             subset=None if c.path else preset["subset"], **splits,
                             **mapping), category


def _norm(r: dict) -> str:
  """A record's question, compared with its whitespace collapsed."""
  return " ".join(r["question"].split())


def _hygiene(train: list[dict], held: list[dict], elsewhere: dict[str, str],
             dropped: collections.Counter | None) -> tuple[list[dict], collections.Counter]:
  """The training records less repeats of a question (the first kept; counted in `dropped`;
  None: not looked for) and those whose question is held out, by `held` or `elsewhere`
  ({question: who}); the latter counted by who holds them out (None: `held`)."""
  held_out = {**elsewhere, **{_norm(r): None for r in held}}
  seen, out, contaminated = set(), [], collections.Counter()
  for r in train:
    q = _norm(r)
    if dropped is not None and q in seen:
      dropped["duplicate question"] += 1
    elif q in held_out:
      contaminated[held_out[q]] += 1
    else:
      out.append(r)
    seen.add(q)
  return out, contaminated


def _reasons(dropped: collections.Counter) -> str:
  return ", ".join(f"{n} {why}" for why, n in dropped.items())


def _summary(label: str, read: str, dropped: collections.Counter,
             contaminated: collections.Counter | None = None) -> str:
  """A source's line: read, dropped and why, and held-out questions dropped from training, by
  what holds them out where it is not the source itself."""
  parts = [read]
  if dropped:
    parts.append(f"{sum(dropped.values())} dropped ({_reasons(dropped)})")
  if contaminated:
    theirs = [f"{n} by {who}" for who, n in contaminated.items() if who is not None]
    parts.append(f"{sum(contaminated.values())} held-out questions also in training dropped "
                 "from training (contamination" + (
                     f"; held out {', '.join(theirs)}" if theirs else "") + ")")
  return f"data: {label}: " + ", ".join(parts)


def _mixture(cfg: DataConfig, log, elsewhere: dict[str, str]) -> tuple[list[dict], list[dict]]:
  """Each source's (train, held-out) split, its records tagged with its name (`source`) and,
  where they name none, its category; the held-out records of all sources together. A question
  one source holds out leaves every source's training."""
  parts = []
  for m in cfg.mixture:
    options = {f.name: getattr(m, f.name) for f in (*dataclasses.fields(Fields),
                                                    *dataclasses.fields(Hub))}
    one = dataclasses.replace(cfg, mixture=None, source=m.source, path=m.path,
                              eval_path=m.eval_path, num_eval=max(m.num_eval, 1),
                              difficulty=m.difficulty, **options)
    parts.append(_part(one, f"data.mixture[{m.name}]", m.num_eval, m.name))
  train, held_out = [], []
  for m, p in zip(cfg.mixture, parts):
    theirs = {_norm(r): f"data.mixture[{o.name}]" for o, q in zip(cfg.mixture, parts)
              if o is not m for r in q.held}
    t, h = _checked(p, {**elsewhere, **theirs}, log)
    tag = lambda rs: [{**r, "source": m.name, "category": r.get("category") or m.category}
                      for r in rs]
    if not t:
      raise DataError(f"config key 'data.mixture[{m.name}]': no training records")
    train, held_out = train + tag(t), held_out + tag(h)
  return train, held_out


def draw_weights(records: list[dict], mixture) -> list[float] | None:
  """Each record's chance of a draw, so that source k gives a share w_k / sum w of the draws
  (records of a source alike); None without a mixture."""
  if mixture is None:
    return None
  counts = {m.name: sum(r["source"] == m.name for r in records) for m in mixture}
  weight = {m.name: m.weight / counts[m.name] for m in mixture if counts[m.name]}
  return [weight[r["source"]] for r in records]


def load_eval_set(s: EvalSet, data: DataConfig, log=None) -> list[dict]:
  """The records of a named evaluation set: its first `num`. Arithmetic ones are held-out
  problems of the training generator at the set's difficulty (none is a training problem when
  the difficulty is the training one's): new questions in the training wordings
  (`held_out_by: record`) or in the wordings held out of training (`template`). A set of rows
  is summed up in one line (`log`) as a training source is."""
  kind = {"template": None}.get(s.held_out_by, s.held_out_by)  # None: the generator's own
  if s.source == "instructions":
    return instructions.held_out(data.num_train, s.num, data.seed, data.held_out_by, kind)[1]
  if s.held_out_by == "task":
    raise DataError(f"config key 'eval.sets[{s.name}].held_out_by' = 'task': only the "
                    "instructions source holds out whole tasks")
  if s.source == "arithmetic":
    return arithmetic.held_out(data.num_train, s.num, data.seed, s.difficulty, data.held_out_by,
                               s.held_out_by or data.held_out_by)[1]
  section = f"eval.sets[{s.name}]"
  got = _fetch(s, section, s.num, 0)
  records, dropped = _records(got.rows, got.c, got.where, section, data.overlong, got.category)
  line = _summary(f"evaluation set {s.name!r} ({got.label})", f"{len(got.rows)} read", dropped)
  (log or _log.info)(f"{line}; {min(len(records), s.num)} evaluated")
  return records[:s.num]


def train_iterator(records: list[dict], batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1, mixture=None) -> Any:
  """An endless shuffled iterator of per-process batches; `get_state()` goes into checkpoints.
  With a `mixture` (data.mixture), each source's records are shuffled and repeated on their
  own and grain mixes them by the sources' weights: over n draws, source k gives n w_k / sum w.

  The GRPO loop draws the global batch on every process (the default 0 of 1): each process
  scores whole groups, and `mesh.put_batch` hands each process's devices only their rows.
  """
  if batch_size % process_count:
    raise DataError(f"train.batch_size {batch_size} does not split over {process_count} "
                    "processes")
  shuffled = lambda rs, k: grain.MapDataset.source(rs).shuffle(seed=seed + k).repeat()
  if mixture is None:
    ds = shuffled(records, 0)
  else:
    ds = grain.MapDataset.mix([shuffled([r for r in records if r["source"] == m.name], k)
                               for k, m in enumerate(mixture)], [m.weight for m in mixture])
  ds = ds[process_index::process_count].batch(batch_size // process_count, batch_fn=list)
  return iter(ds)
