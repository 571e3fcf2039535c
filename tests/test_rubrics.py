"""Per-record rubrics (Rubrics as Rewards): each criterion's yes-probability against a dense
forward, the weighted score with its pitfalls, the rows a step costs, and bad rubrics in one
line before any model loads."""

import json

import numpy as np
import pytest

from conftest import ROOT, dense_grade_probs, tiny_config
from reasoner import mesh as mesh_lib
from reasoner import build as build_lib
from reasoner.build import build
from reasoner.config import ConfigError, EvalSet
from reasoner.data import sources
from reasoner.models import lora as lora_lib
from reasoner.engine.rollout import by_category
from reasoner.errors import DataError
from reasoner.planner import plan
from reasoner.rewards.judge import Judge, rubric_score

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

GENERAL = ROOT / "data/general.jsonl"
# the tiny model attends 16 tokens back in each of its two layers: what differs between prompts
# comes last, so that its probabilities differ (a real judge's prompts end in the question asked)
CRITERION = "Q: {question}\nRef: {reference}\nA: {response}\nMet (N or Y)? {criterion}"
PAIRWISE = "Q: {question}\nRef: {reference}\nBetter, A or B? A: {first}\nB: {second}"
JUDGED = ("data.source=jsonl", f"data.path={GENERAL}", "data.num_eval=2",
          "rewards=[{fn: judge, categories: [creative, science, summarisation, code]}, "
          "{fn: correct, categories: [math]}]",
          "judge.rubric='Grade 1, 2, 3, 4 or 5: {response}\nGrade: '",
          f"judge.criterion_prompt={json.dumps(CRITERION)}",
          f"judge.pairwise_prompt={json.dumps(PAIRWISE)}", "judge.criterion_grades=[N, Y]",
          "judge.max_criteria=5", "judge.batch_size=8", "data.template=plain",
          "data.max_prompt_tokens=640")  # its longest prompts (the tiny default is 256)


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config(*JUDGED))


def test_records_keep_their_rubrics_in_every_form():
  records = sources.load_eval_set(EvalSet(name="general", source="jsonl", path=str(GENERAL),
                                           num=100), tiny_config(*JUDGED).data)
  poem, bees, tips = records[0], records[3], records[10]
  assert poem["rubric"][0] == ("The response is a poem of exactly four lines.", 3.0)
  assert poem["rubric"][3][1] == -2.0  # a pitfall
  assert bees["rubric"][0] == ("The summary is one sentence.", 1.0)  # a plain string: weight 1
  assert tips["rubric"] is None  # judge.rubric grades it
  assert sources.rubric([{"description": "Cites a source.", "title": "Essential", "weight": 5}],
                        "r", "k") == (("Cites a source.", 5.0),)  # Rubrics as Rewards' fields


def test_the_score_is_the_weighted_share_met_and_pitfalls_lower_it():
  w = np.asarray([3.0, 1.0, -2.0])
  assert rubric_score(np.asarray([1.0, 1.0, 0.0]), w) == 1.0
  assert rubric_score(np.asarray([0.0, 0.0, 1.0]), w) == 0.0
  assert rubric_score(np.asarray([1.0, 0.0, 0.0]), w) == pytest.approx(5 / 6)  # (3 + 2) / 6
  met = np.asarray([0.9, 0.4, 0.1])
  assert rubric_score(met, w) > rubric_score(met + [0, 0, 0.8], w)  # falling into a pitfall
  assert rubric_score(met[:2], w[:2]) == pytest.approx((0.9 * 3 + 0.4) / 4)  # no pitfall


def test_rubric_scores_equal_a_dense_forward_of_each_criterion(setup):
  """A batch mixing rubric records (4 and 5 criteria, pitfalls), a record judged by
  `judge.rubric`, and a math record `correct` scores: the judge's scores equal each criterion's
  yes-probability from full-vocabulary logits, one prompt at a time, weighted by hand."""
  judge = setup.rewards.fns[0]
  assert isinstance(judge, Judge)
  find = lambda start: next(r for r in setup.train_records + setup.eval_records
                            if r["question"].startswith(start))
  records = [find(q) for q in ("Write a four-line", "Summarise in one sentence: The city",
                               "Why does ice", "What is 15%", "Give two tips")]
  texts = ["The tide breathes slow.", "A key was lost.", "Ice floats; it is less dense.",
           "<answer>7</answer>", "Research the company."]
  total, per_fn = setup.rewards.score(["p"] * 5, texts, records)
  model = setup.model(lora_lib.zeros_like(setup.lora))
  for i, (r, text) in enumerate(zip(records, texts)):
    if r["category"] == "math":
      assert np.isnan(per_fn["judge"][i]) and per_fn["correct"][i] in (0.0, 1.0)
      continue
    if r["rubric"] is None:
      want = dense_grade_probs(model, setup.tokenizer, [judge.texts([text], [r["question"]], [None])[0]],
                    "12345") @ np.arange(5) / 4
    else:
      prompts = [CRITERION.format(question=r["question"], response=text, criterion=c,
                                  reference=r["answer"] or "(none given)")
                 for c, _ in r["rubric"]]
      yes = dense_grade_probs(model, setup.tokenizer, prompts, "NY")[:, 1]
      w = np.asarray([w for _, w in r["rubric"]])
      neg = -w[w < 0].sum()
      want = (yes @ w + neg) / (w[w > 0].sum() + neg)
    np.testing.assert_allclose(per_fn["judge"][i], np.ravel(want)[0], rtol=1e-5, atol=1e-6)
  assert len({round(float(x), 6) for x in per_fn["judge"][:3]}) == 3


def test_a_rubric_mixing_checks_and_judged_criteria_equals_its_dense_computation(setup):
  """Checks ({check: kind, args, weight}) are 1 or 0 from the instruction's check on the answer
  and cost the judge nothing; the judged criteria keep their dense yes-probabilities; the score
  weighs them all. A rubric's judged criteria, not its checks, count against max_criteria."""
  from reasoner.rewards import judge as judge_lib

  judge = setup.rewards.fns[0]
  rubric = sources.rubric([{"check": "punctuation:no_comma", "weight": 2},
                           {"criterion": "The poem is about the sea.", "weight": 3},
                           {"check": "keywords:existence", "args": {"keywords": ["tide"]},
                            "weight": 1},
                           {"criterion": "The poem rhymes badly.", "weight": -1}], "r", "k")
  assert judge_lib.judged(rubric) == ["The poem is about the sea.", "The poem rhymes badly."]
  texts = ["<answer>The tide breathes slow</answer>", "<answer>Sand, sun and wind</answer>"]
  q = "Write a line on the sea."
  got = judge([q, q], texts, question=[q, q], answer=[None, None], rubric=[rubric, rubric])
  model = setup.model(lora_lib.zeros_like(setup.lora))
  w = np.asarray([2.0, 3.0, 1.0, -1.0])
  for text, checks, score in zip(texts, ([1.0, 1.0], [0.0, 0.0]), got):
    prompts = [CRITERION.format(question=q, response=text, criterion=c, reference="(none given)")
               for c in judge_lib.judged(rubric)]
    yes = dense_grade_probs(model, setup.tokenizer, prompts, "NY")[:, 1]
    p = np.asarray([checks[0], yes[0], checks[1], yes[1]])
    np.testing.assert_allclose(score, (p @ w + 1) / (6 + 1), rtol=1e-5, atol=1e-6)
  many = [{"check": "punctuation:no_comma"}] * 6 + ["Judged."]  # 7 criteria, 1 judged
  judge_lib.check_records(judge.cfg, [{"rubric": sources.rubric(many, "r", "k")}], "data")
  with pytest.raises(DataError, match=r"data, record 0, its rubric's checks: constraint 0 has "
                                      r"kind 'no_comma'"):
    judge_lib.check_records(judge.cfg, [{"rubric": sources.rubric(
        [{"check": "no_comma"}, "Judged."], "r", "k")}], "data")


def test_pairwise_preference_is_a_dense_forward_in_both_orders_and_symmetric(setup):
  """P(first better) is the mean of P('A') with it shown first and P('B') with it shown second,
  each from full logits; swapping gives 1 - p; a response against itself gives 0.5."""
  judge = setup.rewards.fns[0]
  a, b = ["Ice is less dense.", "Rain taps."], ["Ice is heavier.", "A poem on rain, slowly."]
  q, ref = ["Why does ice float?", "A haiku on rain."], ["It is less dense.", None]
  got = judge.pairwise(a, b, q, ref)
  fill = lambda x, y, i: judge.cfg.pairwise_prompt.format(
      question=q[i], first=x, second=y, reference=ref[i] or "(none given)")
  model = setup.model(lora_lib.zeros_like(setup.lora))
  for i in range(2):
    shown_first = dense_grade_probs(model, setup.tokenizer, [fill(a[i], b[i], i)], "AB")[0, 0]
    shown_second = dense_grade_probs(model, setup.tokenizer, [fill(b[i], a[i], i)], "AB")[0, 1]
    np.testing.assert_allclose(got[i], (shown_first + shown_second) / 2, rtol=1e-5)
  np.testing.assert_allclose(got + judge.pairwise(b, a, q, ref), 1.0, rtol=1e-6)
  np.testing.assert_allclose(judge.pairwise(a, a, q, ref), 0.5, rtol=1e-6)
  assert not np.allclose(got, 0.5)


def test_pairwise_reads_the_shared_question_once_and_equals_each_order_read_whole(setup):
  """The two orders share the prompt before the first response: it is read once, each order's
  rest against its cache (`Judge.passes`), equal to each order's per-row forward of the same
  token ids. A prompt that opens with a response shares nothing: it is read whole."""
  import dataclasses

  judge = setup.rewards.fns[0]
  assert judge.pair_prefix == "Q: {question}\nRef: {reference}\nBetter, A or B? A: "
  a = [f"Answer {i}: " + "tide, " * (2 * i) + f"end {i}." for i in range(10)]  # 2 passes of 8
  b = [f"Other {i}: " + "rain " * (i % 3) + "stop." for i in range(10)]
  q, ref = [f"Question {i}? " + "Why " * i for i in range(10)], [None, "ref"] * 5
  got = judge.pairwise(a, b, q, ref)
  fill = lambda x, y, i: judge.cfg.pairwise_prompt.format(
      question=q[i], first=x, second=y, reference=ref[i] or "(none given)")
  rows = [judge.rows(judge.pair_prefix.format(question=q[i], reference=ref[i] or "(none given)"),
                     [fill(a[i], b[i], i), fill(b[i], a[i], i)]) for i in range(10)]
  assert min(len(p) for p, _ in rows) > 16  # past the tiny model's window
  dense = judge.token_probs([p + x for p, xs in rows for x in xs], judge.ab)
  np.testing.assert_allclose(got, (dense[0::2, 0] + dense[1::2, 1]) / 2, rtol=1e-5, atol=1e-6)
  assert len(set(np.round(got, 6))) == 10
  # responses longer than judge.max_tokens: a pass stays within it, as the per-row path does,
  # keeping each order's end (where the grade is due)
  long = ["tide, " * judge.cfg.max_tokens, "rain " * judge.cfg.max_tokens]
  head = judge.pair_prefix.format(question=q[0], reference="ref")
  texts = [fill(long[0], long[1], 0), fill(long[1], long[0], 0)]
  prefix, suffixes = judge.rows(head, texts)
  assert len(prefix) + max(map(len, suffixes)) == judge.cfg.max_tokens
  for x, t in zip(suffixes, texts):
    assert x == setup.tokenizer.encode(t[len(head.rstrip(" ")):])[-len(x):]
  whole = Judge(dataclasses.replace(judge.cfg, pairwise_prompt="{first} | {second} | Q: "
                                    "{question} Better, A or B? "), judge.graphdef,
                judge.params, judge.tokenizer, judge.mesh)
  assert whole.pair_prefix is None
  shown = lambda x, y, i: whole.cfg.pairwise_prompt.format(question=q[i], first=x, second=y)
  texts = [shown(a[i], b[i], i) for i in range(2)] + [shown(b[i], a[i], i) for i in range(2)]
  dense = whole.probs(texts, whole.ab)
  np.testing.assert_allclose(whole.pairwise(a[:2], b[:2], q[:2], ref[:2]),
                             (dense[:2, 0] + dense[2:, 1]) / 2, rtol=1e-5)


def test_a_run_reports_categories_and_its_win_rate(setup, tmp_path):
  """GRPO on data/general.jsonl with rubric judging: per-category rewards each step, per-
  category held-out means before and after, and the judge's win rate against the model before
  training (matched question by question) in eval.json."""
  from reasoner import loop
  from reasoner.evaluation import win_rate

  cfg = tiny_config(*JUDGED, f"train.run_dir={tmp_path}", "train.steps=2", "data.num_eval=4",
                    "train.eval_before=true", "train.batch_size=2")
  loop.train(cfg)
  run = tmp_path / cfg.train.run_name
  results = json.loads((run / "eval.json").read_text())
  before, after = results["before"], results["after"]
  assert {k for k in before if k.startswith("mean_reward/")} == {
      k for k in after if k.startswith("mean_reward/")} and len(after) > 6
  assert 0 < after["win_rate"] < 1 and after["win_rate_n"] == 4
  rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  assert any(k.startswith("reward/judge/") for r in rows for k in r)
  same = [{"question": "q", "answer": None, "completion": "x", "category": "a"}]
  assert win_rate(setup, same, same) == {"win_rate": 0.5, "win_rate_n": 1}
  assert win_rate(setup, same, [{**same[0], "question": "other"}]) == {}


def test_a_judge_past_its_time_limit_gives_no_win_rate_and_one_line(setup, monkeypatch, capsys):
  """`win_rate` waits for the judge at most its reward's `timeout_s`, then says so in one line
  and reports none; a signal while it waits stops the wait within a second."""
  import dataclasses
  import time

  from reasoner.errors import RewardInterrupted
  from reasoner.evaluation import win_rate

  rewards = setup.rewards
  k = next(k for k, f in enumerate(rewards.fns) if isinstance(f, Judge))
  monkeypatch.setattr(rewards.fns[k], "pairwise", lambda *a: time.sleep(4) or np.ones(1))
  limit = lambda s: [dataclasses.replace(x, timeout_s=s) if i == k else x
                     for i, x in enumerate(rewards.specs)]
  monkeypatch.setattr(rewards, "specs", limit(0.5))
  same = [{"question": "q", "answer": None, "completion": "x", "category": "a"}]
  t = time.monotonic()
  assert win_rate(setup, same, same) == {} and time.monotonic() - t < 1.5
  out = capsys.readouterr()
  assert (out.out + out.err).count(
      f"win rate: the judge did not return within 0.5 s (rewards[{k}].timeout_s)") == 1
  monkeypatch.setattr(rewards, "specs", limit(60))
  rewards.cancel.set()
  try:
    t = time.monotonic()
    with pytest.raises(RewardInterrupted, match="while the judge compared completions"):
      win_rate(setup, same, same)
    assert time.monotonic() - t < 1.0
  finally:
    rewards.cancel.clear()


def test_the_agreement_check_counts_the_calls_and_stops_a_run_without_signal(setup, tmp_path):
  """`agreement` by hand from the judge's scores and pairwise preferences; a judge below
  judge.min_agreement stops the run in one line (the random tiny judge has no signal), and
  judge.check without records to compare is refused before any model loads."""
  from reasoner.rewards import judge as judge_lib

  judge, records = setup.rewards.fns[0], setup.train_records + setup.eval_records
  a = judge_lib.agreement(judge, records)
  rows = [r for r in records if r.get("response")]
  n, q = len(rows), [r["question"] for r in rows]
  args = dict(question=q, answer=[r["answer"] for r in rows], rubric=[r["rubric"] for r in rows])
  own, other = [r["response"] for r in rows], [rows[(i + n // 2) % n]["response"] for i in range(n)]
  s = lambda t: np.asarray(judge(q, t, **args))
  pair = judge.pairwise(own, other, q, args["answer"])
  calls = [*(s(own) > s(other)), *(s(own) > s([judge_lib.JUNK] * n)), *(pair > 0.5)]
  assert a["n"] == n == 12 and a["agreement"] == pytest.approx(np.mean(calls))
  with pytest.raises(ConfigError, match=r"'judge.min_agreement' = 1.0: the judge got 0.\d\d of "
                     r"its calls right on 12 records .* it gives no signal"):
    build(tiny_config(*JUDGED, "judge.check=true", "judge.min_agreement=1.0"))
  path = tmp_path / "q.jsonl"
  path.write_text("".join(f'{{"question": "q{i}", "category": "creative"}}\n' for i in range(6)))
  with pytest.raises(ConfigError, match=r"'judge.check' = true: the data has 0 records with a "
                     "response"):
    build(tiny_config(*JUDGED, f"data.path={path}", "judge.check=true"))


def test_scores_are_logged_by_category():
  per_fn = {"judge": np.asarray([0.2, 0.4, np.nan, 0.9]),
            "correct": np.asarray([np.nan, np.nan, 1.0, np.nan])}
  got = by_category(per_fn, np.asarray(["creative", "creative", "math", ""]))
  assert got == {"reward/judge/creative": pytest.approx(0.3), "reward/correct/math": 1.0}


def test_evaluations_report_each_category():
  from reasoner.evaluation import by_category as eval_by_category

  got = eval_by_category([0.2, 0.6, 1.0, 0.5], ["creative", "creative", "math", None])
  assert got == {"mean_reward/creative": pytest.approx(0.4), "mean_reward/math": 1.0}
  assert eval_by_category([0.2, 0.6], ["math", "math"]) == {}  # one category: the mean says it


def test_the_planner_counts_a_pass_a_completion_with_its_criteria():
  """Where records carry rubrics, a judge batch is one pass of judge.batch_size completions,
  each read once with its judge.max_criteria suffixes: a step costs B x G / batch_size
  batches whatever the criteria, and `plan` compiles that pass (prefixes of judge.max_tokens
  less the planned suffix, 5 suffixes of `SUFFIX_PLANNED` tokens each), and `plan --analytic`
  estimates it."""
  from reasoner.chips import CHIPS
  from reasoner.planner import report as report_lib
  from reasoner.rewards.judge import SUFFIX_PLANNED

  cfg = tiny_config(*JUDGED, "train.batch_size=2", "rollout.num_generations=4")
  assert plan.judge_batches({"cfg": cfg}) == 1  # 2 x 4 completions, 8 a pass, 5 criteria each
  cfg = tiny_config(*JUDGED, "train.batch_size=2", "rollout.num_generations=4",
                    "judge.batch_size=3")
  assert plan.judge_batches({"cfg": cfg}) == 3  # 8 completions, 3 a pass
  cfg = tiny_config(*JUDGED, "judge.max_criteria=0", "train.batch_size=2",
                    "rollout.num_generations=4")  # no rubrics: a prompt a completion
  assert plan.judge_batches({"cfg": cfg}) == 1
  # a mixture: only the prompts of categories the judge names cost passes; on average, each of
  # a step's prompts drawn by weight (arithmetic 3 : a file of any category 1: a quarter)
  mix = ("data.mixture=[{name: a, source: arithmetic, weight: 3}, "
         f"{{name: g, source: jsonl, path: {GENERAL}, weight: 1, num_eval: 2}}]")
  cfg = tiny_config(*JUDGED, "data.source=arithmetic", "data.path=null", mix,
                    "train.batch_size=2", "rollout.num_generations=4", "judge.batch_size=4")
  assert build_lib.judged_share(cfg) == 0.25
  assert plan.judge_batches({"cfg": cfg}) == 2  # both prompts judged: 8 rows, 4 a pass
  # n of 2 prompts judged ~ Binomial(2, 1/4): 1 pass for one (6/16), 2 for both (1/16)
  assert plan.judge_batches({"cfg": cfg}, average=True) == pytest.approx(6 / 16 + 2 / 16)
  assert build_lib.judged_share(tiny_config(*JUDGED)) == 1.0  # no mixture
  assert build_lib.judged_share(tiny_config("data.source=arithmetic", "data.path=null", mix)) == 0
  setup = build(tiny_config(*JUDGED, "judge.max_tokens=256"), abstract=True)
  judge = Judge.abstract(setup)
  fn, args = judge.planned()
  assert fn is judge._criteria and SUFFIX_PLANNED == 64
  assert [a.shape for a in args[1:5]] == [(8, 192), (8, 192), (8, 5, 64), (8, 5)]
  step, _ = plan.judge_plan(setup, CHIPS["v5e"])
  assert step.what == "judge" and step.prompts == 8 and step.fits and step.flops > 0
  report = plan.plan(tiny_config(*JUDGED, "judge.max_tokens=256"), analytic=True, search=False)
  guess = report["judge"]  # --analytic estimates the same pass: 8 x (192 + 5 x 64) tokens
  assert "analytic" in guess.note and report["judge_on"] == "8 chips, the policy's"
  assert guess.bytes == pytest.approx(6 * guess.arguments)  # weights: the prefix, 5 criteria
  assert "judge + train" in report_lib.format_report(report)


def test_the_shared_prefix_is_the_prompt_before_its_first_criterion():
  from reasoner.config.stages import DEFAULT_CRITERION
  from reasoner.rewards.judge import prefix_template

  assert prefix_template(CRITERION) == ("Q: {question}\nRef: {reference}\nA: {response}\n"
                                        "Met (N or Y)? ")
  assert prefix_template(DEFAULT_CRITERION).endswith("Response: {response}\n\nCriterion: ")
  assert prefix_template("{{x}} {response!r:>4} {criterion} {question}") == "{{x}} {response!r:>4} "
  assert prefix_template("Criterion: {criterion}\nResponse: {response}") is None  # none shared
  pair = lambda t: prefix_template(t, ("first", "second"), after=None)
  assert pair(PAIRWISE) == "Q: {question}\nRef: {reference}\nBetter, A or B? A: "
  assert pair("{question} B: {second} A: {first}") == "{question} B: "
  assert pair("{first} {second} {question}") is None  # nothing before the first response


def _dense_yes(judge, rows):
  """The yes-probability of every (prefix + suffix) row, each its own prompt (`token_probs`,
  the per-row forward): the same token ids, so no tokenisation boundary can differ."""
  return judge.token_probs([p + x for p, xs in rows for x in xs], judge.yes_no)[:, 1]


def test_one_pass_a_completion_equals_a_dense_row_a_criterion(setup):
  """`Judge.criteria`: each completion's prefix once, its criteria's suffixes against its KV
  cache, on the 8 devices: each criterion's yes-probability equals the per-row forward of the
  same tokens. 11 completions of 1 to 5 criteria (two passes of 8, the second with filler),
  prefixes of 40 to 200 tokens (past the tiny model's 16-token window: its sliding layers see
  the cache's last 15 prefix slots), then prefixes of 5 to 8 tokens (shorter than the window:
  all of the cache)."""
  from reasoner.rewards.judge import pack

  judge = setup.rewards.fns[0]
  # short criteria after responses whose ends differ: the tiny model sees 2 x 15 tokens back,
  # so each criterion's grade reads the end of its completion's prefix
  crit = ["Sea.", "Rhymes.", "Four.", "No.", "x"]
  rows = [judge.criterion_rows(f"Answer {i}: " + "tide, " * (3 * i) + f"end {i}{i}{i}.",
                               f"Question {i}?", "ref" if i % 2 else None,
                               [(c, 1.0) for c in crit[:1 + i % 5]])
          for i in range(11)]
  assert 64 < max(len(p) for p, _ in rows) <= 256 and min(len(p) for p, _ in rows) > 16
  got = judge.criteria(rows)
  assert [len(g) for g in got] == [1 + i % 5 for i in range(11)]
  want = _dense_yes(judge, rows)
  np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-6)
  assert len(set(np.round(want, 6))) > 20
  encode = setup.tokenizer.encode
  long = ["The poem is about the sea.", "It rhymes.", "Four lines, no more.", "x"]
  short = [(encode("Q" * i, add_bos=True), [encode(c) for c in long[:1 + i % 4]])
           for i in range(4, 8)]  # 20 tokens or more past a prefix: the window binds
  prefix, valid, suffix, lengths = pack(short, 8, 5, setup.tokenizer.pad_id)
  assert suffix.shape == (8, 5, 32)
  batch = [mesh_lib.put_batch(judge.mesh, a)  # a width of 8, not the bucket's 64
           for a in (prefix[:, -8:], valid[:, -8:], suffix, lengths)]
  p = mesh_lib.to_host(judge._criteria(judge.params, *batch, judge.yes_no))[..., 1]
  np.testing.assert_allclose([x for i, (_, xs) in enumerate(short) for x in p[i, :len(xs)]],
                             _dense_yes(judge, short), rtol=1e-5, atol=1e-6)


def test_a_band_counted_from_positions_reads_the_prefix_behind_each_criterion(setup,
                                                                               monkeypatch):
  """Sliding layers that are not Gemma 3's (Gemma 2's band counts from positions, so a cut
  cache would not do; here Tunix's own layers, `layer.replaces` false): a prefix as long as the
  window goes through the model again behind each suffix (`_behind_prefix`), to the same
  probabilities as the per-row forward."""
  import jax
  from flax import nnx

  from reasoner.models import layer as layer_lib, prompt
  from reasoner.rewards.judge import criteria_probs, pack

  judge = setup.rewards.fns[0]
  rows = [judge.criterion_rows(f"Answer {i}: end {i}{i}.", "Q?", None,
                               [("Sea.", 1.0), ("x", 1.0)]) for i in range(3)]
  want = _dense_yes(judge, rows)
  behind, real = [], prompt._behind_prefix
  monkeypatch.setattr(layer_lib, "replaces", lambda layer, tokens: False)
  monkeypatch.setattr(prompt, "_behind_prefix", lambda *a: behind.append(1) or real(*a))
  fn = jax.jit(lambda params, *batch: criteria_probs(nnx.merge(judge.graphdef, *params), *batch,
                                                     mesh=judge.mesh))
  batch = [mesh_lib.put_batch(judge.mesh, a) for a in pack(rows, 8, 5, setup.tokenizer.pad_id)]
  p = mesh_lib.to_host(fn(judge.params, *batch, judge.yes_no))[..., 1]
  assert behind
  np.testing.assert_allclose(p[:3, :2].ravel(), want, rtol=1e-5, atol=1e-6)


def test_rubric_rewards_are_rubric_scores_of_the_dense_rows(setup):
  """`Judge.__call__` on records with rubrics (judged criteria, checks, pitfalls, a rubric of
  checks only that costs the judge nothing) and without: each reward is `rubric_score` of its
  criteria, the judged ones' yes-probabilities from the per-row forward of the same tokens."""
  from reasoner.rewards import instructions

  judge = setup.rewards.fns[0]
  rubrics = [sources.rubric(r, "r", "k") for r in (
      [{"check": "punctuation:no_comma", "weight": 2},
       {"criterion": "About the sea.", "weight": 3}, {"criterion": "Rhymes badly.", "weight": -1}],
      ["One sentence.", {"criterion": "Names the city.", "weight": 2},
       {"criterion": "Too long.", "weight": -1}, "Clear.", "Kind."],
      [{"check": "punctuation:no_comma"}],
      ["Is a haiku."])] + [None]
  texts = ["<answer>The tide, slow</answer>", "The city of Lyon is old.", "No comma here",
           "Rain taps the roof", "Research the company."]
  q = ["A line on the sea.", "Summarise: Lyon.", "Say it plainly.", "A haiku on rain.", "Tips?"]
  ref = [None, "Lyon is old.", None, None, None]
  got = judge(q, texts, question=q, answer=ref, rubric=rubrics)
  for i in range(4):
    rows = [judge.criterion_rows(texts[i], q[i], ref[i], rubrics[i])] if i != 2 else []
    yes = iter(_dense_yes(judge, rows))
    answer = instructions.answer_text(texts[i])
    p = [float(instructions.follows(c["kind"], c["args"], answer)) if isinstance(c, dict)
         else next(yes) for c, _ in rubrics[i]]
    w = np.asarray([w for _, w in rubrics[i]], np.float32)
    np.testing.assert_allclose(got[i], rubric_score(np.asarray(p, np.float32), w), rtol=1e-5,
                               atol=1e-6)
  assert got[2] == 1.0 and 0 < got[4] < 1  # checks only; `judge.rubric` for the last


def test_bad_rubrics_fail_in_one_line(tmp_path):
  def data(rubric):  # the same rubric in training and held out, on another question
    paths = tmp_path / "r.jsonl", tmp_path / "held.jsonl"
    for path, q in zip(paths, ("q", "another q")):
      path.write_text(json.dumps({"question": q, "category": "creative", "rubric": rubric}) + "\n")
    return [f"data.path={paths[0]}", f"data.eval_path={paths[1]}"]

  for rubric, why in [
      ([{"criterion": "Has a pitfall only.", "weight": -1}],
       r"has no positive weight \(\[-1.0\]\)"),
      ("Be good.", "is not a list of criteria"),
      ([{"weight": 2}], r"criterion 0 = \{'weight': 2\}: expected a text"),
      (["Fine.", {"criterion": "x", "weight": "high"}], "criterion 1 .*expected a text")]:
    with pytest.raises(DataError, match=r"r.jsonl: record 0: its rubric \(data.rubric_field\) "
                       + why):
      build(tiny_config(*JUDGED, *data(rubric)))
  with pytest.raises(ConfigError, match=r"'judge.max_criteria' = 2: the training data, record 0 "
                     r"has a rubric of 3 judged criteria"):
    build(tiny_config(*JUDGED, *data(["a", "b", "c"]), "judge.max_criteria=2"))
  with pytest.raises(ConfigError, match=r"'judge.criterion_prompt' = 'Is it good\?': expected a "
                     r"text with \{response\} and \{criterion\}"):
    tiny_config("judge.criterion_prompt='Is it good?'")
  with pytest.raises(ConfigError, match=r"'judge.criterion_grades' = \['Y'\]: expected two"):
    tiny_config("judge.criterion_grades=[Y]")
