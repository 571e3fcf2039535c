"""`python -m reasoner data`: each source's records, categories and shares of the draws, token
lengths against the budgets and two rendered examples, in seconds and with no model loaded."""

from __future__ import annotations

import json
import math
import time

import pytest

from conftest import ROOT
from reasoner import cli
from reasoner.data import prompts
from reasoner.models import gemma, load
from reasoner.models.tokenizer import SentencePieceTokenizer, sentencepiece_from_vocab

TINY = str(ROOT / "configs" / "tiny.yaml")
# tiny.yaml's plain prompt around an ASCII question, in bytes, and its BOS: a prompt's tokens
# (a math record's; any other category's is GENERAL more)
PLAIN = len(prompts.INSTRUCTION) + len("\n\nQuestion: \n") + 1
GENERAL = len(prompts.GENERAL_INSTRUCTION) - len(prompts.INSTRUCTION)


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
  """Loading a model, or reading the embedded GGUF, fails the test."""
  def refuse(*args, **kwargs):
    raise AssertionError("the data command loaded a model")

  for module, name in ((load, "load_model"), (load, "embedded"), (gemma, "init_random"),
                       (gemma, "from_host")):
    monkeypatch.setattr(module, name, refuse)


def write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def data(capsys, *args):
  """(exit status, stdout, stderr) of `python -m reasoner data ARGS`, run in this process."""
  code = cli.main(["data", *args])
  out = capsys.readouterr()
  return code, out.out, out.err


def line(out: str, start: str) -> str:
  found = [l.strip() for l in out.splitlines() if l.strip().startswith(start)]
  assert len(found) == 1, (start, out)
  return found[0]


def row(out: str, category: str) -> list[str]:
  """A category table's row, split: name, counts, share of the draws."""
  return line(out, category + " ").split()


RECORDS = [
    {"question": "a" * 10, "answer": "1", "category": "math", "response": "r" * 5},
    {"question": "b" * 20, "answer": "2", "category": "math", "response": "r" * 30},
    {"question": "c" * 40, "answer": "3", "category": "code", "response": "r" * 10},
    {"question": "a" * 10, "answer": "1", "category": "math"},  # a repeat: dropped
    {"question": "d" * 200, "answer": "4", "category": "code"},  # the prompt over 256 tokens
    {"question": "e" * 50, "answer": "5", "category": "math"},  # held out (data.num_eval=2)
    {"question": "f" * 5, "answer": "6", "category": "science"},  # held out
]


def test_a_jsonl_file_counted_against_the_budgets(tmp_path, capsys):
  path = write(tmp_path / "mine.jsonl", RECORDS)
  code, out, err = data(capsys, "--config", TINY, "data.source=jsonl", f"data.path={path}",
                        "data.num_eval=2", "--stage", "sft", "sft.max_response_tokens=20")
  assert code == 0, err
  # the source's own summary line, as a run logs it
  assert line(out, "data: jsonl") == (f"data: jsonl {path}: 7 read, 1 dropped (1 duplicate "
                                      "question); 4 training, 2 held out")
  assert line(out, "tokens:").startswith("tokens: the byte tokenizer")
  assert line(out, "== data") == f"== data (jsonl {path}): 4 training, 2 held out; 100.0% of the draws"
  assert row(out, "math") == ["math", "2", "1", "50.0%"]
  assert row(out, "code") == ["code", "2", "0", "50.0%"]
  assert row(out, "science") == ["science", "0", "1", "0.0%"]
  # prompts (training and held out): PLAIN + 10, 20, 40, 200, 50, 5 bytes, and GENERAL more
  # for the code and science records (their prompt asks for an answer, not a number)
  p = sorted([PLAIN + n for n in (10, 20, 50)] + [PLAIN + GENERAL + n for n in (40, 200, 5)])
  assert p[-1] > 256 >= p[-2]
  assert line(out, "prompt tokens") == (
      f"prompt tokens (training and held out): median {(p[2] + p[3]) / 2:g}, p95 {p[-1]}, "
      f"max {p[-1]}; 1 of 6 over data.max_prompt_tokens = 256, dropped at load "
      "(data.overlong: drop)")
  # responses (training): 5, 30 and 10 bytes and the stop token; one record has none
  assert line(out, "response tokens") == (
      "response tokens (3 of 4 records have one): median 11, p95 31, max 31; 1 of 3 over "
      "sft.max_response_tokens = 20, dropped at load (data.overlong: drop)")
  # two examples exactly as rendered: the first record, and the longest prompt that fits
  first = prompts.render("plain", "a" * 10)
  assert (f"record 0): prompt, {PLAIN + 10} tokens ---\n{first}\n--- response, 6 tokens ---\n"
          f"{'r' * 5}\n--- end ---\n") in out
  longest = prompts.render("plain", "c" * 40, "code")
  assert (f"(the longest prompt that fits: record 2): prompt, {PLAIN + GENERAL + 40} tokens ---\n"
          f"{longest}\n--- response, 11 tokens ---\n") in out
  assert out.count("--- example") == 2 and "d" * 200 not in out


def test_the_default_stage_counts_responses_against_the_rollouts_budget(tmp_path, capsys):
  path = write(tmp_path / "mine.jsonl", RECORDS)
  code, out, _ = data(capsys, "--config", TINY, "data.source=jsonl", f"data.path={path}",
                      "data.num_eval=2")
  assert code == 0
  assert line(out, "response tokens").endswith(
      "2 of 3 over rollout.max_new_tokens = 8 (reference texts longer than a rollout may write)")


def test_a_mixture_shows_each_sources_share_of_the_draws(tmp_path, capsys):
  a = write(tmp_path / "a.jsonl", [{"question": f"sum {i}?", "answer": str(i),
                                    "category": "math" if i < 2 else "code"} for i in range(4)])
  b = write(tmp_path / "b.jsonl", [{"question": f"a poem about {x}"} for x in ("rain", "sun")])
  mixture = (f"data.mixture=[{{name: a, source: jsonl, path: {a}, weight: 3, num_eval: 0}}, "
             f"{{name: b, source: jsonl, path: {b}, weight: 1, num_eval: 1, "
             "category: creative}]")
  code, out, err = data(capsys, "--config", TINY, mixture)
  assert code == 0, err
  assert line(out, "the mixture:") == ("the mixture: 5 training, 1 held out, drawn by weight "
                                       "a 3, b 1")
  assert line(out, "== data.mixture 'a'") == (f"== data.mixture 'a' (jsonl {a}): 4 training, 0 "
                                              "held out; 75.0% of the draws")
  assert line(out, "== data.mixture 'b'") == (f"== data.mixture 'b' (jsonl {b}): 1 training, 1 "
                                              "held out; 25.0% of the draws")
  # by category, over the whole mixture and within each source: shares of all the draws
  tables = [l.split() for l in out.splitlines() if l.startswith("  ") and "%" in l]
  assert tables == [["code", "2", "0", "37.5%"], ["creative", "1", "1", "25.0%"],
                    ["math", "2", "0", "37.5%"],
                    ["code", "2", "0", "37.5%"], ["math", "2", "0", "37.5%"],
                    ["creative", "1", "1", "25.0%"]]
  # the mixture's category reaches the prompt: a poem is asked for an answer, not a number
  assert f"{prompts.render('plain', 'a poem about rain', 'creative')}\n--- end ---" in out
  assert "final number" not in prompts.render('plain', 'a poem about rain', 'creative')


def test_a_kaggle_models_local_tokenizer_counts(tmp_path, capsys):
  """model.path's tokenizer.model, read without the checkpoint beside it."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
  tokens += [f"<0x{b:02X}>" for b in range(256)] + list("\u2581abcdefghijklmnopqrstuvwxyz")
  tokens += ["aa", "aaaa", "on", "ion"]  # merges: fewer tokens than bytes
  types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * 31
  proto = sentencepiece_from_vocab(tokens, [0.0] * 262 + [-float(i) for i in range(31)], types)
  root = tmp_path / "download"
  (root / "gemma3-1b-it").mkdir(parents=True)
  (root / "gemma3-1b-it" / "_METADATA").write_text("{}")
  (root / "tokenizer.model").write_bytes(proto)
  path = write(tmp_path / "mine.jsonl", RECORDS[:3])
  code, out, err = data(capsys, "--config", TINY, "model.source=kaggle", "model.name=gemma3-1b",
                        f"model.path={root}", "model.tokenizer=auto", "data.source=jsonl",
                        f"data.path={path}", "data.num_eval=1")
  assert code == 0, err
  assert line(out, "tokens:").startswith(f"tokens: gemma3-1b's {root / 'tokenizer.model'};")
  n = len(SentencePieceTokenizer(proto).encode(prompts.render("plain", "a" * 10))) + 1
  assert n != PLAIN + 10  # not the byte tokenizer's count
  assert f"record 0): prompt, {n} tokens ---" in out


def test_without_the_tokenizer_model_gemma2_is_an_estimate(tmp_path, capsys, monkeypatch):
  """A Kaggle Gemma 2 with neither model.path nor a cached download: characters / 4, said so;
  nothing is downloaded."""
  monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path / "empty-cache"))
  path = write(tmp_path / "mine.jsonl", RECORDS[:3])
  code, out, err = data(capsys, "--config", TINY, "model.source=kaggle", "model.name=gemma2-2b",
                        "model.kaggle_handle=google/gemma-2/flax/gemma2-2b-it",
                        "model.tokenizer=auto", "data.source=jsonl", f"data.path={path}",
                        "data.num_eval=1")
  assert code == 0, err
  assert line(out, "tokens:").startswith("tokens: an ESTIMATE, characters / 4: gemma2-2b's "
                                         "tokenizer.model is not on this machine")
  estimate = math.ceil((PLAIN - 1 + 10) / 4) + 1
  assert f"record 0): prompt, {estimate} tokens ---" in out


def test_a_missing_file_is_one_line_in_a_second_with_no_model(tmp_path, capsys):
  start = time.perf_counter()
  code, out, err = data(capsys, "--config", TINY, "data.source=jsonl",
                        f"data.path={tmp_path / 'nope.jsonl'}")
  assert time.perf_counter() - start < 3  # in-process: no imports left to pay for
  assert code == 2 and out == ""
  assert err == (f"error: config key 'data.path' = '{tmp_path / 'nope.jsonl'}': the file does "
                 "not exist\n")
