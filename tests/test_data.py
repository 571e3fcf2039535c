import json
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from reasoner.config import DataConfig, EvalSet
from reasoner.data import arithmetic, hub, prompts, sources


def test_arithmetic_is_deterministic_with_disjoint_held_out():
  a = arithmetic.generate(200, 50, seed=1)
  assert a == arithmetic.generate(200, 50, seed=1)
  assert a != arithmetic.generate(200, 50, seed=2)
  train, held = a
  assert len(train) == 200 and len(held) == 50
  assert not {r["question"] for r in train} & {r["question"] for r in held}
  for r in train[:20]:
    nums = [int(w) for w in r["question"].replace("?", " ").replace(".", " ").split() if w.isdigit()]
    assert int(r["answer"]) in (nums[0] + nums[1], nums[0] - nums[1], nums[0] * nums[1])


def test_local_files_with_configured_fields(tmp_path):
  rows = [{"q": f"what is {i}+{i}?", "a": f"so #### {2 * i}"} for i in range(10)]
  jl = tmp_path / "d.jsonl"
  jl.write_text("\n".join(json.dumps(r) for r in rows))
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
  for src, path in (("jsonl", jl), ("parquet", tmp_path / "d.parquet")):
    cfg = DataConfig(source=src, path=str(path), question_field="q", answer_field="a", num_eval=3)
    train, held = sources.load_splits(cfg)
    assert len(train) == 7 and held[-1] == {"question": "what is 9+9?", "answer": "18",
                                            "category": None, "response": None,
                                            "chosen": None, "rejected": None, "rubric": None}
  with pytest.raises(sources.DataError, match="has no field 'question'"):
    sources.load_splits(DataConfig(source="jsonl", path=str(jl)))


def test_missing_path_and_offline_gsm8k_fail_fast(tmp_path, monkeypatch):
  with pytest.raises(sources.DataError, match=r"'data.path' = '.*nope.jsonl': the file does not"):
    sources.load_splits(DataConfig(source="jsonl", path=str(tmp_path / "nope.jsonl")))
  monkeypatch.setattr(hub, "_online", lambda *a, **k: False)
  t = time.time()
  with pytest.raises(sources.DataError, match="huggingface.co, which cannot be reached"):
    sources.load_splits(DataConfig(source="gsm8k"))
  assert time.time() - t < 5


def test_iterator_state_resumes_exactly():
  recs = [{"question": str(i), "answer": str(i)} for i in range(30)]
  it = sources.train_iterator(recs, 4, seed=3)
  first = [next(it) for _ in range(3)]
  state = it.get_state()
  rest = [next(it) for _ in range(3)]
  it2 = sources.train_iterator(recs, 4, seed=3)
  it2.set_state(json.loads(json.dumps(state)))
  assert [next(it2) for _ in range(3)] == rest
  assert first[0] != rest[0]
  # two processes see disjoint halves of each global batch
  p0 = next(sources.train_iterator(recs, 4, 3, 0, 2))
  p1 = next(sources.train_iterator(recs, 4, 3, 1, 2))
  assert len(p0) == len(p1) == 2 and not {r["question"] for r in p0} & {r["question"] for r in p1}


def test_templates_ask_for_the_format():
  for name in prompts.TEMPLATES:
    p = prompts.render(name, "What is 2 + 2?")
    assert "<reasoning>" in p and "<answer>" in p and p.rstrip().endswith(
        ("What is 2 + 2?", "model"))


def test_a_prompt_asks_what_its_records_category_needs():
  """Math (or no category): the final number after arithmetic shots. Any other category (an
  instruction, a poem): an answer, after shots that each follow an instruction; the record's
  prompt is the same wherever it is built (rollout, evaluation, SFT, the data report)."""
  from reasoner.data import instructions
  from reasoner.rewards.instructions import follows

  rec = instructions.generate(4, 0, 0)[0][0]  # a generated instruction record
  math = {"question": "What is 2 + 2?", "answer": "4", "category": "math"}
  for name in prompts.TEMPLATES:
    assert prompts.render_record(name, math) == prompts.render(name, "What is 2 + 2?")
    assert "final number" in prompts.render_record(name, math)
    p = prompts.render_record(name, rec)
    assert prompts.GENERAL_INSTRUCTION in p and "final number" not in p
    assert p.rstrip().endswith((rec["question"], "model"))
  few = prompts.render_record("fewshot", rec)
  assert "Sam has 3 bags" not in few and all(q in few for q, _, _ in prompts.GENERAL_EXAMPLES)
  # each shot follows the instruction it states, by the reward's own checker
  kinds = [(instructions.BULLETS, {"num_bullets": 2}, {"n": 2}), (instructions.CAPITAL, {}, {})]
  for (q, _, a), (kind, args, words) in zip(prompts.GENERAL_EXAMPLES, kinds):
    assert follows(kind, args, a) and instructions.PHRASES[kind][0].format(**words) in q


def test_overlong_prompts_are_found_at_load_dropped_or_named():
  from reasoner.models.tokenizer import ByteTokenizer

  tok = ByteTokenizer()
  records = [{"question": "x" * n, "answer": "1"} for n in (5, 400, 10, 300)]
  lengths = [len(tok.encode(prompts.render("chat", r["question"]), add_bos=True))
             for r in records]  # the reference: each rendered prompt encoded whole
  limit = sorted(lengths)[1]  # the two short ones fit, exactly at the limit for one of them
  said = []
  kept = prompts.within_limit(records, "training", "chat", tok, limit, "drop", said.append)
  assert kept == [r for r, n in zip(records, lengths) if n <= limit] == [records[0], records[2]]
  assert said == [f"data: dropped 2 of 4 training records whose prompt is longer than "
                  f"data.max_prompt_tokens = {limit} tokens (data.overlong: drop)"]
  assert prompts.within_limit(records[:1], "held-out", "chat", tok, limit, "drop",
                              said.append) == records[:1] and len(said) == 1  # nothing to say
  with pytest.raises(sources.DataError, match=rf"^record 1 of the training split: its prompt "
                     rf"has {lengths[1]} tokens, more than data.max_prompt_tokens = {limit} "
                     rf"\(data.overlong: error; 'drop' skips such records\): 'xxx"):
    prompts.within_limit(records, "training", "chat", tok, limit, "error")
  with pytest.raises(sources.DataError, match="every held-out prompt is longer than"):
    prompts.within_limit(records[1:2], "held-out", "chat", tok, limit, "drop")
  from reasoner.config import ConfigError, load_config

  with pytest.raises(ConfigError, match="config key 'data.overlong' = 'skip': expected one of "
                     "'drop', 'error'"):
    load_config(ROOT / "configs/tiny.yaml", ["data.overlong=skip"])


def test_the_mixed_example_and_optional_fields():
  """data/mixed.jsonl (the schema's example): five categories, references where a parser or a
  lexical score can use them; a record without an answer or a category loads with None."""
  train, held = sources.load_splits(DataConfig(source="jsonl", path=str(ROOT / "data" /
                                                                         "mixed.jsonl"),
                                               num_eval=2))
  records = train + held
  assert {r["category"] for r in records} == {"math", "science", "summarisation", "creative",
                                              "code"}
  assert all((r["answer"] is None) == (r["category"] == "creative") for r in records)
  assert all(r["category"] == "math" for r in sources.load_splits(DataConfig())[1])


def _file(path, **fields) -> list[dict]:
  """Every record of a jsonl file, read as a source reads it (an evaluation set of it all)."""
  return sources.load_eval_set(EvalSet(name="file", source="jsonl", path=str(path), num=100,
                                       **fields), DataConfig(), log=lambda _: None)


def test_records_carry_responses_from_a_field_or_chat_messages(tmp_path):
  rows = [{"messages": [{"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": "Blue."}], "category": "ideas"},
          {"prompt": "Say hi.", "reply": "Hi!"}]
  path = tmp_path / "chat.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows[:1]))
  got = _file(path)
  assert got == [{"question": "Name a colour.", "answer": None, "category": "ideas",
                  "response": "Blue.", "chosen": None, "rejected": None,
                  "rubric": None}]
  path.write_text(json.dumps(rows[1]))
  assert _file(path, question_field="prompt", response_field="reply")[0]["response"] == "Hi!"
  path.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}))
  with pytest.raises(sources.DataError, match=r"record 0: 'messages' must be a user turn .* roles "
                                      r"\['system'\]"):
    _file(path)


def test_preference_pairs_from_fields_or_conversations(tmp_path):
  """A pair as two fields (named by data.chosen_field / rejected_field), or as two chat
  conversations (TRL's format), the question from their user turn."""
  turn = lambda reply: [{"role": "user", "content": "2 + 2?"},
                        {"role": "assistant", "content": reply}]
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps({"chosen": turn("4"), "rejected": turn("5")}) + "\n")
  got = _file(path)[0]
  assert (got["question"], got["chosen"], got["rejected"]) == ("2 + 2?", "4", "5")
  path.write_text(json.dumps({"q": "3 + 3?", "good": "6", "bad": "7"}) + "\n")
  got = _file(path, question_field="q", chosen_field="good", rejected_field="bad")[0]
  assert (got["question"], got["chosen"], got["rejected"]) == ("3 + 3?", "6", "7")
  train, _ = sources.load_splits(DataConfig(difficulty="medium", num_train=8, num_eval=2))
  for r in train:  # the generated pairs: the worked solution against the wrong operation
    assert r["chosen"] == r["response"] and r["rejected"] != r["chosen"]
    assert f"<answer>{r['answer']}</answer>" not in r["rejected"]


def test_arithmetic_worked_solutions_state_the_answer():
  from reasoner.rewards import builtin as rewards

  train, _ = arithmetic.generate(50, 5, seed=0, difficulty="medium")
  for r in train:
    assert rewards.correct([""], [r["response"]], answer=[r["answer"]])[0] == 1.0
    assert rewards.format_exact([""], [r["response"]])[0] == 1.0


def test_gsm8k_solutions_become_responses(tmp_path, monkeypatch):
  """source: gsm8k is hf under GSM8K's mapping: a local copy's test split (an evaluation set's
  records), the final number the answer, the worked steps the response."""
  import datasets

  from reasoner.rewards import builtin as rewards

  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
  row = {"question": "Tom has 3 bags of 4 apples and eats 2. How many are left?",
         "answer": "He has 3*4=<<3*4=12>>12 apples.\nHe eats 2, so 12-2=<<12-2=10>>10 are left.\n"
                   "#### 10"}
  (tmp_path / "gsm8k").mkdir()
  (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(row) + "\n")
  s = EvalSet(name="gsm8k", source="gsm8k", path=str(tmp_path / "gsm8k"), num=1)
  r, = sources.load_eval_set(s, DataConfig(), log=lambda _: None)
  assert r["question"] == row["question"] and r["answer"] == "10" and r["category"] == "math"
  assert r["response"] == ("<reasoning>He has 3*4=12 apples.\nHe eats 2, so 12-2=10 are left."
                           "</reasoning>\n<answer>10</answer>")
  assert rewards.format_exact([""], [r["response"]]) == [1.0]


def test_a_template_writes_a_field_by_a_transform(tmp_path):
  """{answer:steps} and {answer:final} split a GSM8K-style answer in any source (GSM8K's own
  mapping is this template); a transform that does not exist is one line at load."""
  from reasoner.config import ConfigError

  rows = [{"q": "3 bags of 4?", "a": "3*4=<<3*4=12>>12 in all.\n#### 1,212"}, {"q": "x?", "a": "7"}]
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  template = "<reasoning>{a:steps}</reasoning>\n<answer>{a:final}</answer> ({a})"
  train, _ = sources.load_splits(DataConfig(source="jsonl", path=str(path), num_eval=1,
                                            question_field="q", answer_field="a",
                                            response_template=template), log=lambda _: None)
  assert train == [{"question": "3 bags of 4?", "answer": "1212", "category": None,
                    "response": f"<reasoning>3*4=12 in all.</reasoning>\n<answer>1212</answer> "
                                f"({rows[0]['a']})", "chosen": None, "rejected": None,
                    "rubric": None}]
  assert sources.GSM8K["response_template"] == (
      "<reasoning>{answer:steps}</reasoning>\n<answer>{answer:final}</answer>")
  for bad, shown in (("{a:step}", "{a:step}"), ("{a!r}", "{a!r}"), ("{a:>9}", "{a:>9}")):
    with pytest.raises(ConfigError, match="^" + re.escape(
        f"config key 'data.response_template' = '{bad}': expected a template of record fields "
        "in braces, e.g. '<answer>{solution}</answer>' ({{ and }} for a brace): "
        f"{shown} is neither a field nor a transform of one ({{a:final}}, {{a:steps}}, "
        "{a:lines})") + "$"):
      DataConfig(source="jsonl", path="d.jsonl", response_template=bad)


def test_a_question_written_from_fields_and_tests_that_run(tmp_path):
  """MBPP's layout (task_id, text, code, test_list): the question written from the task and its
  tests (which name the function), the tests a list of asserts that `tests_pass` runs one by
  one; the record's own solution passes them all. A row without a field the question template
  names is dropped and counted."""
  from reasoner.rewards import sandbox

  rows = [{"task_id": 2, "text": "Write a function to find the shared elements of two lists.",
           "code": "def similar_elements(a, b):\n  return tuple(sorted(set(a) & set(b)))",
           "test_list": ["assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
                         "assert similar_elements((1, 2), (3, 4)) == ()"]},
          {"task_id": 3, "text": "Write a function with no tests.", "code": "pass"},
          {"task_id": 4, "text": "Add two numbers.", "code": "def add(a, b):\n  return a + b",
           "test_list": ["assert add(1, 2) == 3"]}]
  path = tmp_path / "mbpp.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  seen = []
  train, held = sources.load_splits(DataConfig(
      source="jsonl", path=str(path), num_eval=1, tests_field="test_list",
      question_template="{text}\nYour code should pass these tests:\n{test_list:lines}",
      response_template="```python\n{code}\n```"), log=seen.append)
  assert len(train) + len(held) == 2
  r = next(r for r in train + held if r["question"].startswith("Write a function to find"))
  assert r["question"] == ("Write a function to find the shared elements of two lists.\n"
                           "Your code should pass these tests:\n" + "\n".join(rows[0]["test_list"]))
  assert r["tests"] == rows[0]["test_list"]
  both = train + held
  assert sandbox.tests_pass([""] * 2, [r["response"] for r in both], [r["tests"] for r in both],
                            timeout_s=10.0) == [1.0, 1.0]
  assert any("missing field 'test_list'" in line for line in seen), seen


def test_ifeval_reads_its_instructions_as_constraints(tmp_path, monkeypatch):
  """`source: ifeval` (google/IFEval's mapping) on a local copy in the card's layout, kwargs as
  the Hub's parquet has them (every argument of every kind, None where unused): each record's
  instructions are its constraints, scored by IFEval's four numbers; lists that do not pair
  are one line."""
  import datasets

  from reasoner.errors import DataError
  from reasoner.rewards import instructions

  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
  rows = [{"key": 1000, "prompt": "Write a 300+ word summary of the wikipedia page about Raymond "
                                  "III. Do not use any commas and highlight at least 3 sections.",
           "instruction_id_list": ["punctuation:no_comma",
                                   "detectable_format:number_highlighted_sections",
                                   "length_constraints:number_words"],
           "kwargs": [{}, {"num_highlights": 3}, {"relation": "at least", "num_words": 300}]},
          {"key": 1001, "prompt": "Plan a trip to Japan. Write the itinerary in lowercase.",
           "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]}]
  (tmp_path / "ifeval").mkdir()
  datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "ifeval" / "train.parquet"))
  s = EvalSet(name="ifeval", source="ifeval", path=str(tmp_path / "ifeval"), num=2)
  first, second = sources.load_eval_set(s, DataConfig(), log=lambda _: None)
  assert first["question"] == rows[0]["prompt"] and first["category"] == "instructions"
  assert [c["kind"] for c in first["constraints"]] == rows[0]["instruction_id_list"]
  assert first["constraints"][2]["args"]["num_words"] == 300  # others None: absent
  assert instructions.validate(first["constraints"], "r") == [
      ("punctuation:no_comma", {}), ("detectable_format:number_highlighted_sections",
                                     {"num_highlights": 3}),
      ("length_constraints:number_words", {"relation": "at least", "num_words": 300})]
  strict, loose = instructions.judge(["day one: tokyo. day two: kyoto.", "Day one: Tokyo."],
                                     [second["constraints"]] * 2)
  assert strict == [[True], [False]]
  assert instructions.ifeval_scores(strict, loose)["prompt_level_strict"] == 0.5
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({**rows[1], "kwargs": [{}, {}]}) + "\n")
  with pytest.raises(DataError, match=r"record 0: 'instruction_id_list' and 'kwargs' must be "
                                      r"lists of the same length"):
    sources.load_eval_set(EvalSet(name="x", source="jsonl", path=str(bad), num=1,
                                  question_field="prompt", constraints_field="instruction_id_list",
                                  constraint_args_field="kwargs"), DataConfig(), log=lambda _: None)
