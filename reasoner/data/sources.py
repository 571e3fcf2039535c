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
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import socket
from typing import Any

import grain

from reasoner.config import DataConfig, EvalSet
from reasoner.config.data import Fields
from reasoner.errors import DataError
from reasoner.data import arithmetic, instructions


def _read_file(path: str, kind: str, cfg: DataConfig | EvalSet, key: str) -> list[dict]:
  """Records of a jsonl / parquet file; `key` names the file's config key, and the field
  keys are named beside it (data.question_field, eval.sets[NAME].question_field)."""
  section = key.rsplit(".", 1)[0]
  p = pathlib.Path(path)
  if not p.is_file():
    raise DataError(f"config key '{key}' = '{path}': the file does not exist")
  if kind == "jsonl":
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
  else:
    import pyarrow.parquet as pq

    try:
      rows = pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow raises several types for unreadable files
      raise DataError(f"{path}: not a readable Parquet file ({e})") from None
  curriculum = getattr(cfg, "curriculum", None)
  level = curriculum.field if curriculum is not None else None  # a curriculum's field, kept
  out = []
  for i, row in enumerate(rows):
    if "messages" in row and cfg.question_field not in row:
      row = {**row, **_from_messages(row["messages"], f"{path}: record {i}", cfg)}
    for f in (getattr(cfg, "chosen_field", None), getattr(cfg, "rejected_field", None)):
      if f and isinstance(row.get(f), list):  # a conversation: its user turn and its reply
        turns = _from_messages(row[f], f"{path}: record {i}, field '{f}'", cfg)
        row = {cfg.question_field: turns[cfg.question_field], **row,
               f: turns.get(getattr(cfg, "response_field", "response"))}
    if cfg.question_field not in row:
      raise DataError(f"{path}: record {i} has no field '{cfg.question_field}' "
                      f"({section}.question_field); it has {', '.join(sorted(row))}")
    answer, category = row.get(cfg.answer_field), row.get(cfg.category_field)
    out.append({"question": str(row[cfg.question_field]),
                "answer": None if answer is None else _final_answer(str(answer)),
                "category": None if category is None else str(category),
                "rubric": rubric(row.get(cfg.rubric_field), f"{path}: record {i}",
                                 f"{section}.rubric_field"),
                **{k: _text(row, getattr(cfg, f"{k}_field", None))
                   for k in ("response", "chosen", "rejected")},
                **{k: row[f] for k in ("constraints", "tests")
                   if (f := getattr(cfg, f"{k}_field", None)) and row.get(f) is not None},
                **({level: str(row[level])} if level and row.get(level) is not None else {})})
  if not out:
    raise DataError(f"{path}: no records")
  return out


def rubric(value, where: str, key: str) -> tuple[tuple[str | dict, float], ...] | None:
  """A record's rubric as ((criterion, weight), ...): a list of strings (weight 1) or of
  mappings with a `criterion` (or Rubrics as Rewards' `description` / `title`) and a `weight`,
  negative for a pitfall. A criterion code can decide is a check instead, {check: kind, args:
  {...}, weight} with an instruction's kind (rewards/instructions.py; validated where the judge
  is), kept as {"kind", "args"}: it costs no judge row. One positive weight at least, else
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


def _online(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
  try:
    socket.create_connection((host, 443), timeout=timeout).close()
    return True
  except OSError:
    return False


def _gsm8k() -> tuple[list[dict], list[dict]]:
  if not _online():
    raise DataError("data.source 'gsm8k' downloads from huggingface.co, which cannot be reached; "
                    "save GSM8K as JSONL and use data.source=jsonl data.path=<file>")
  import datasets

  d = datasets.load_dataset("openai/gsm8k", "main")
  return [gsm8k_record(r) for r in d["train"]], [gsm8k_record(r) for r in d["test"]]


def gsm8k_record(row: dict) -> dict:
  """A GSM8K row as a record; its worked solution (calculator notes <<...>> dropped) becomes
  the response in the prompts' format, for SFT."""
  steps = re.sub(r"<<[^>]*>>", "", row["answer"].split("####")[0]).strip()
  final = _final_answer(row["answer"])
  return {"question": row["question"], "answer": final, "category": "math",
          "response": f"<reasoning>{steps}</reasoning>\n<answer>{final}</answer>"}


def load_splits(cfg: DataConfig, key: str = "data") -> tuple[list[dict], list[dict]]:
  """(train, held_out) records (`key`: the config section, for messages). Fails fast, before
  any model is loaded."""
  if cfg.mixture is not None:
    return _mixture(cfg)
  if cfg.source == "arithmetic":
    return arithmetic.generate(cfg.num_train, cfg.num_eval, cfg.seed, cfg.difficulty,
                               cfg.held_out_by)
  if cfg.source == "instructions":
    return instructions.generate(cfg.num_train, cfg.num_eval, cfg.seed, cfg.held_out_by)
  if cfg.source == "gsm8k":
    train, test = _gsm8k()
    return train, test[:cfg.num_eval]
  train = _read_file(cfg.path, cfg.source, cfg, f"{key}.path")
  if cfg.eval_path:
    return train, _read_file(cfg.eval_path, cfg.source, cfg, f"{key}.eval_path")[:cfg.num_eval]
  if len(train) < 2:
    raise DataError(f"{cfg.path}: {len(train)} record(s); need at least 2 to hold one out")
  n_eval = min(cfg.num_eval, len(train) // 2)
  return train[:-n_eval], train[-n_eval:]


def _mixture(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
  """Each source's (train, held-out) split, its records tagged with its name (`source`) and,
  where they name none, its category; the held-out records of all sources together."""
  train, held_out = [], []
  for m in cfg.mixture:
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(Fields)}
    one = dataclasses.replace(cfg, mixture=None, source=m.source, path=m.path,
                              eval_path=m.eval_path, num_eval=max(m.num_eval, 1),
                              difficulty=m.difficulty, **fields)
    t, h = load_splits(one, f"data.mixture[{m.name}]")
    tag = lambda rs: [{**r, "source": m.name, "category": r.get("category") or m.category}
                      for r in rs]
    if m.num_eval == 0:  # nothing held out: a file's every record trains
      t, h = t + h if m.source in ("jsonl", "parquet") and m.eval_path is None else t, []
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


def load_eval_set(s: EvalSet, data: DataConfig) -> list[dict]:
  """The records of a named evaluation set: its first `num`. Arithmetic ones are held-out
  problems of the training generator at the set's difficulty (none is a training problem when
  the difficulty is the training one's): new questions in the training wordings
  (`held_out_by: record`) or in the wordings held out of training (`template`)."""
  kind = {"template": None}.get(s.held_out_by, s.held_out_by)  # None: the generator's own
  if s.source == "instructions":
    return instructions.held_out(data.num_train, s.num, data.seed, data.held_out_by, kind)[1]
  if s.held_out_by == "task":
    raise DataError(f"config key 'eval.sets[{s.name}].held_out_by' = 'task': only the "
                    "instructions source holds out whole tasks")
  if s.source == "arithmetic":
    return arithmetic.held_out(data.num_train, s.num, data.seed, s.difficulty, data.held_out_by,
                               s.held_out_by or data.held_out_by)[1]
  if s.source == "gsm8k":
    return _gsm8k()[1][:s.num]
  return _read_file(s.path, s.source, s, f"eval.sets[{s.name}].path")[:s.num]


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
