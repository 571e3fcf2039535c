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
splits (both fetched by `hub`), and gsm8k, a Hugging Face dataset with a mapping of its own. A
response (and a pair's texts) may instead be written from a record's fields by a template
(data.response_template). Each such source is checked as it loads and summed up in one line:
the records read, those dropped (no question, or a field a template names missing; a question
already in training, the first kept) and the training records whose question is also held
out, dropped from training (contamination).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from typing import Any

import grain

from reasoner.config import DataConfig, EvalSet
from reasoner.config.data import FILE_KINDS, READ, Fields, Hub, template_fields
from reasoner.errors import DataError
from reasoner.data import arithmetic, hub, instructions
from reasoner.data.files import file_rows

_log = logging.getLogger("reasoner")
_TEXTS = ("response", "chosen", "rejected")  # a record's texts a template may write
# gsm8k: GSM8K's splits and fields, its worked solutions the responses (gsm8k_record)
GSM8K = dict(path="openai/gsm8k", subset="main", split="train", eval_split="test",
             question_field="question", answer_field="answer", category_field="category",
             response_field="response")


def _records(rows: list[dict], cfg, where: str, section: str,
             overlong: str) -> tuple[list[dict], collections.Counter]:
  """The records of `rows` by cfg's fields and templates, and the rows dropped, by reason: no
  question (missing, null or blank: str() would train on the text 'None'), or a field a
  template names missing (or null), as `overlong` says (drop; error: one line)."""
  rows = [_expanded(row, cfg, f"{where}: record {i}") for i, row in enumerate(rows)]
  templates = _templates(rows, cfg, where, section)
  out, dropped = [], collections.Counter()
  for i, row in enumerate(rows):
    if row.get(cfg.question_field) is None or not str(row[cfg.question_field]).strip():
      dropped[f"missing field '{cfg.question_field}'"] += 1
      continue
    texts, gap = {}, None
    for k, (template, names) in templates.items():
      gap = next((n for n in names if row.get(n) is None), None)
      if gap is not None:
        break
      texts[k] = template.format_map(row)
    if gap is None:
      out.append(_record(row, cfg, f"{where}: record {i}", section, texts))
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
    if f.name.endswith("_field") and (f.name == "question_field" or name != f.default) and (
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


def _record(row: dict, cfg, where: str, section: str, texts: dict[str, str]) -> dict:
  """One record of a row that has a question (`texts`: those its templates wrote)."""
  curriculum = getattr(cfg, "curriculum", None)
  level = curriculum.field if curriculum is not None else None  # a curriculum's field, kept
  answer, category = row.get(cfg.answer_field), row.get(cfg.category_field)
  return {"question": str(row[cfg.question_field]),
          "answer": None if answer is None else _final_answer(str(answer)),
          "category": None if category is None else str(category),
          "rubric": rubric(row.get(cfg.rubric_field), where, f"{section}.rubric_field"),
          **{k: texts[k] if k in texts else _text(row, getattr(cfg, f"{k}_field", None))
             for k in _TEXTS},
          **{k: row[f] for k in ("constraints", "tests")
             if (f := getattr(cfg, f"{k}_field", None)) and row.get(f) is not None},
          **({level: str(row[level])} if level and row.get(level) is not None else {})}


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


def _final_answer(answer: str) -> str:
  """GSM8K-style answers end with '#### 72': keep the final answer only."""
  m = re.search(r"####\s*(.+)\s*$", answer)
  return m.group(1).replace(",", "").strip() if m else answer.strip()


def gsm8k_record(row: dict) -> dict:
  """A GSM8K row as a record; its worked solution (calculator notes <<...>> dropped) becomes
  the response in the prompts' format, for SFT."""
  steps = re.sub(r"<<[^>]*>>", "", row["answer"].split("####")[0]).strip()
  final = _final_answer(row["answer"])
  return {"question": row["question"], "answer": final, "category": "math",
          "response": f"<reasoning>{steps}</reasoning>\n<answer>{final}</answer>"}


def load_splits(cfg: DataConfig, key: str = "data", log=None) -> tuple[list[dict], list[dict]]:
  """(train, held_out) records (`key`: the config section, for messages; `log`: where each
  source's summary line goes, default the reasoner logger). Fails fast, before any model is
  loaded."""
  log = log or _log.info
  if cfg.mixture is not None:
    return _mixture(cfg, log)
  if cfg.source == "arithmetic":
    return arithmetic.generate(cfg.num_train, cfg.num_eval, cfg.seed, cfg.difficulty,
                               cfg.held_out_by)
  if cfg.source == "instructions":
    return instructions.generate(cfg.num_train, cfg.num_eval, cfg.seed, cfg.held_out_by)
  return _row_splits(cfg, key, cfg.num_eval, None, log)


def _row_splits(cfg: DataConfig, section: str, n_eval: int, name: str | None,
                log) -> tuple[list[dict], list[dict]]:
  """(train, held_out) of a source of rows (`n_eval` held out; `name`: its mixture name): the
  held-out split, or else the last records, then the training records checked."""
  c, label, (rows, where), held_rows = _fetch(cfg, section, cfg.num_train, n_eval)
  train, dropped = _records(rows, c, where, section, cfg.overlong)
  if held_rows is None:
    if n_eval and len(train) < 2:
      raise DataError(f"{where}: {len(train)} record(s); need at least 2 to hold one out")
    n = min(n_eval, len(train) // 2)
    train, held = (train[:-n], train[-n:]) if n else (train, [])
  else:
    held, more = _records(held_rows[0], c, held_rows[1], section, cfg.overlong)
    held, dropped = held[:n_eval], dropped + more
  train, contaminated = _hygiene(train, held, dropped)
  label = label if name is None else f"'{name}' ({label})"
  read = len(rows) + (0 if held_rows is None else len(held_rows[0]))
  line = _summary(label, read, dropped, contaminated)
  if not train:
    raise DataError(f"{line}: no training records are left")
  log(f"{line}; {len(train)} training, {len(held)} held out")
  return train, held


def _fetch(c, section: str, n_train: int, n_held: int):
  """(c as its rows are mapped, its label, (its rows, where they are), (its held-out rows,
  where) or None (then the last rows are held out)): a file's rows, a Kaggle file's, or a
  Hugging Face dataset's splits (a stream's first n_train + n_held, or n_train and n_held of a
  held-out split)."""
  named = c.source
  if named == "gsm8k":
    c = dataclasses.replace(c, **{**GSM8K, "source": "hf", "path": c.path or GSM8K["path"],
                                  "subset": None if c.path else GSM8K["subset"],
                                  **({"split": "test", "eval_split": None}
                                     if isinstance(c, EvalSet) else {})})
  if c.source == "kaggle":
    path = hub.kaggle_file(c, section)
    rows = file_rows(str(path), FILE_KINDS[path.suffix], f"{section}.file")
    return c, f"kaggle {c.path} {c.file}", (rows, str(path)), None
  if c.source != "hf":
    eval_path = getattr(c, "eval_path", None)
    held = (file_rows(eval_path, c.source, f"{section}.eval_path"), eval_path) if (
        eval_path and n_held) else None
    return c, f"{named} {c.path}", (file_rows(c.path, c.source, f"{section}.path"), c.path), held
  held_split = c.eval_split if n_held else None
  limits = {c.split: (n_train + (0 if held_split else n_held)) if c.streaming else None}
  if held_split:
    limits[held_split] = n_held if c.streaming else None
  splits = hub.hf_rows(c, section, limits, named)
  if named == "gsm8k":  # its worked solutions: the responses
    splits = {k: [{**r, **gsm8k_record(r)} if isinstance(r.get("answer"), str) else r
                   for r in v] for k, v in splits.items()}
  held = (splits[held_split], f"{c.path} ({held_split})") if held_split else None
  return c, f"{named} {c.path}", (splits[c.split], f"{c.path} ({c.split})"), held


def _hygiene(train: list[dict], held: list[dict],
             dropped: collections.Counter) -> tuple[list[dict], int]:
  """The training records less repeats of a question (the first kept; counted in `dropped`)
  and those whose question is held out (their count returned). Questions compare with their
  whitespace collapsed."""
  norm = lambda r: " ".join(r["question"].split())
  held_out, seen, out, contaminated = {norm(r) for r in held}, set(), [], 0
  for r in train:
    q = norm(r)
    if q in seen:
      dropped["duplicate question"] += 1
    elif q in held_out:
      contaminated += 1
    else:
      out.append(r)
    seen.add(q)
  return out, contaminated


def _reasons(dropped: collections.Counter) -> str:
  return ", ".join(f"{n} {why}" for why, n in dropped.items())


def _summary(label: str, read: int, dropped: collections.Counter, contaminated: int = 0) -> str:
  """A source's line: read, dropped and why, and held-out questions dropped from training."""
  parts = [f"{read} read"]
  if dropped:
    parts.append(f"{sum(dropped.values())} dropped ({_reasons(dropped)})")
  if contaminated:
    parts.append(f"{contaminated} held-out questions also in training dropped from training "
                 "(contamination)")
  return f"data: {label}: " + ", ".join(parts)


def _mixture(cfg: DataConfig, log) -> tuple[list[dict], list[dict]]:
  """Each source's (train, held-out) split, its records tagged with its name (`source`) and,
  where they name none, its category; the held-out records of all sources together."""
  train, held_out = [], []
  for m in cfg.mixture:
    options = {f.name: getattr(m, f.name) for f in (*dataclasses.fields(Fields),
                                                    *dataclasses.fields(Hub))}
    one = dataclasses.replace(cfg, mixture=None, source=m.source, path=m.path,
                              eval_path=m.eval_path, num_eval=max(m.num_eval, 1),
                              difficulty=m.difficulty, **options)
    key = f"data.mixture[{m.name}]"
    if m.source in READ:  # num_eval 0: nothing held out, every record trains
      t, h = _row_splits(one, key, m.num_eval, m.name, log)
    else:
      t, h = load_splits(one, key)
    tag = lambda rs: [{**r, "source": m.name, "category": r.get("category") or m.category}
                      for r in rs]
    if not t:
      raise DataError(f"config key 'data.mixture[{m.name}]': no training records")
    train, held_out = train + tag(t), held_out + tag(h[:m.num_eval])
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
  c, label, (rows, where), _ = _fetch(s, section, s.num, 0)
  records, dropped = _records(rows, c, where, section, data.overlong)
  (log or _log.info)(f"{_summary(f'evaluation set {s.name!r} ({label})', len(rows), dropped)}; "
                     f"{min(len(records), s.num)} evaluated")
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
