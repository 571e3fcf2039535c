"""The rollout on the tiny model: dynamic sampling, truncated completions, length metrics."""

import dataclasses
import zlib

import jax
import numpy as np
import pytest

from conftest import tiny_config
from reasoner.rewards import builtin as rewards_lib
from reasoner.rewards.scoring import Rewards
from reasoner.build import build
from reasoner.config import GRPOConfig
from reasoner.objectives.grpo import rollout
from reasoner.engine.sampler import Sampler
from reasoner.objectives.grpo import GRPOTrainer as Trainer

# jitted models and heads against their references: seconds each, `make test` (not `make check`)
pytestmark = pytest.mark.slow

B, G = 4, 4


class ParityRewards(Rewards):
  """A prompt chosen by its checksum gets each completion's checksum parity as its reward (a
  group whose completions all share it has zero variance); the others get 0."""

  def __init__(self):
    pass  # no reward functions: __call__ is the rewards (Rewards.score calls it)

  def __call__(self, prompts, completions, **_):
    parity = lambda s: float(zlib.crc32(s.encode()) % 2)
    total = np.asarray([parity(c) if parity(p) else 0.0 for p, c in zip(prompts, completions)],
                       np.float32)
    return total, {"parity": total}


@pytest.fixture(scope="module")
def setup():
  s = build(tiny_config(f"rollout.num_generations={G}", f"train.batch_size={B}",
                        "rollout.max_new_tokens=6"))
  return dataclasses.replace(s, rewards=ParityRewards())


def _run(setup, **grpo):
  cfg = dataclasses.replace(setup.cfg, grpo=dataclasses.replace(setup.cfg.grpo, **grpo))
  s = dataclasses.replace(setup, cfg=cfg)
  trainer = Trainer.for_run(s.graphdef, s.base, cfg)
  batches = iter([s.train_records[i:i + B] for i in range(0, 64, B)])
  drawn = []
  draw = lambda: drawn.append(next(batches)) or drawn[-1]
  batch, metrics = rollout(s, Sampler.for_run(s), trainer, s.lora, draw(),
                           jax.random.PRNGKey(7), draw=draw)
  return batch, metrics, drawn


def test_dynamic_sampling_trains_only_groups_that_carry_a_gradient(setup):
  off_batch, off, _ = _run(setup)
  assert off["groups_drawn"] == B and off["refill_rounds"] == 0 and off["groups_trained"] == B
  assert 0 < off["frac_reward_zero_std"] < 1  # some groups teach nothing
  assert np.asarray(off_batch.completion_mask).any(1).all()  # off: every row trains

  batch, m, drawn = _run(setup, dynamic_sampling=True, max_sample_batches=6)
  assert len(drawn) == m["refill_rounds"] + 1 and m["groups_drawn"] == B * len(drawn)
  informative = round(m["groups_drawn"] * (1 - m["frac_reward_zero_std"]))
  assert m["groups_trained"] == min(B, informative)
  if informative >= B:  # it stopped drawing as soon as the batch was full
    assert m["refill_rounds"] < 5
  trains = np.asarray(batch.completion_mask).any(1).reshape(B, G)
  assert (trains.all(1) | ~trains.any(1)).all()  # whole groups
  assert trains.all(1).sum() == m["groups_trained"]
  adv = np.asarray(batch.advantages).reshape(B, G)
  assert (np.abs(adv[trains.all(1)]).max(1) > 0).all()  # each trained group has a signal
  assert np.asarray(batch.completion).shape == (B * G, 6)  # static shapes


def test_dynamic_sampling_bound_trains_on_what_there_is(setup):
  _, m, drawn = _run(setup, dynamic_sampling=True, max_sample_batches=1)
  assert len(drawn) == 1 and m["refill_rounds"] == 0
  assert m["groups_trained"] == round(B * (1 - m["frac_reward_zero_std"]))


def test_truncated_completions_can_be_masked(setup):
  batch, m, _ = _run(setup, mask_truncated_completions=True)
  rows = np.asarray(batch.completion_mask).any(1)
  assert m["truncated_rate"] > 0  # the tiny model rarely stops within 6 tokens
  assert rows.sum() == round(B * G * (1 - m["truncated_rate"]))
  assert m["completion_length/min"] <= m["completion_length"] <= m["completion_length/max"] <= 6


def test_the_log_prob_forwards_dispatched_before_scoring_equal_those_after(setup):
  """grpo_step dispatches the reference's (beta > 0) and pi_old's (mu > 1) log-probs as soon as
  the rollout's tokens reach the host, before they are detokenised and scored: on every token
  the batch trains they equal those of the batch assembled after scoring, with rows that the
  batch masks out (a truncated row, a filler group) or without, and the batch carries them.
  Dynamic sampling, which may reorder the batch, dispatches none early."""
  from reasoner.engine import rollout as rollout_lib
  from reasoner.objectives.grpo import batch_from_rollout, early_forwards

  cfg = dataclasses.replace(setup.cfg, grpo=dataclasses.replace(setup.cfg.grpo,
                                                                num_iterations=2))
  s = dataclasses.replace(setup, cfg=cfg)
  trainer = Trainer.for_run(s.graphdef, s.base, cfg)
  then, early = early_forwards(s, trainer, s.lora)
  r = rollout_lib.draw(s, Sampler.for_run(s), s.lora, s.train_records[:B],
                       jax.random.PRNGKey(7), then=then)
  assert sorted(early) == ["old_logp", "ref_logp"]
  masked = r.host["completion_mask"].copy()
  masked[:G] = False  # the first group masked out, as assemble masks a filler group
  for host in (r.host, {**r.host, "completion_mask": masked}):
    rr = r._replace(host=host)
    after = batch_from_rollout(s, trainer, s.lora, rr)
    batch = batch_from_rollout(s, trainer, s.lora, rr, early=early)
    mask = np.asarray(after.completion_mask)
    assert mask.any()
    for k in ("old_logp", "ref_logp"):
      assert getattr(batch, k) is early[k]
      np.testing.assert_array_equal(np.asarray(getattr(batch, k))[mask],
                                    np.asarray(getattr(after, k))[mask])
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, dynamic_sampling=True))
  assert early_forwards(dataclasses.replace(s, cfg=cfg), trainer, s.lora)[0] is None


def test_overlong_penalty_by_hand():
  lengths = np.array([2, 6, 7, 8, 10])
  p = rewards_lib.overlong(lengths, max_new_tokens=10, buffer=4, penalty=0.5)
  np.testing.assert_allclose(p, [0, 0, -0.125, -0.25, -0.5])
  assert not rewards_lib.overlong(lengths, 10, 0, 1.0).any()


def test_overlong_penalty_enters_the_reward(setup):
  _, m, _ = _run(setup, overlong_buffer=4, overlong_penalty=0.5)
  assert m["reward/overlong"] < 0  # rows cut at 6 tokens pay the whole penalty
  _, off, _ = _run(setup)
  assert m["reward/mean"] == pytest.approx(off["reward/mean"] + m["reward/overlong"], abs=1e-6)


def test_grpo_options_are_checked():
  from reasoner.config import ConfigError

  with pytest.raises(ConfigError, match="'grpo.overlong_buffer' = 9: expected at most "
                                        "rollout.max_new_tokens = 6"):
    tiny_config("rollout.max_new_tokens=6", "grpo.overlong_buffer=9")
  with pytest.raises(ConfigError, match="'grpo.importance_sampling' = 'seq'"):
    tiny_config("grpo.importance_sampling=seq")
  with pytest.warns(UserWarning, match="now means Tunix's"):
    GRPOConfig(loss_agg="sequence-mean-token-sum-norm")


def test_pass_at_k_by_hand():
  from reasoner.evaluation import majority_correct, pass_at_k

  assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
  assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) / C(4,2) miss it
  assert pass_at_k(5, 2, 4) == 1.0  # only 3 wrong ones: any 4 include a right one
  with pytest.raises(ValueError, match="pass@5 needs 1 <= k <= n = 4"):
    pass_at_k(4, 1, 5)
  votes = ["<answer>7</answer>", "<answer>8</answer>", "<answer> 7 </answer>", "no answer"]
  assert majority_correct(votes, "7") == 1.0 and majority_correct(votes, "8") == 0.0
  assert majority_correct(["none"], "7") == 0.0


def test_sampled_evaluation_reports_pass_at_k(setup, monkeypatch):
  """Correctness by the checksum parity of each completion (the tiny model answers nothing):
  pass@k from the counts each question got, as the estimator gives them."""
  from reasoner import evaluation
  from reasoner.rewards.scoring import Rewards

  counts = []

  def parity_correct(prompts, completions, **_):
    hits = [float(zlib.crc32(c.encode()) % 2) for c in completions]
    if len(completions) == 4:  # a question's samples (the greedy pass scores 3 at once)
      counts.append(int(sum(hits)))
    return hits

  monkeypatch.setattr(evaluation.rewards_lib, "correct", parity_correct)
  cfg = dataclasses.replace(setup.cfg, eval=dataclasses.replace(
      setup.cfg.eval, samples=4, pass_k=(1, 2, 4), batch_size=8))
  s = dataclasses.replace(setup, cfg=cfg, rewards=Rewards(cfg.rewards))
  result, rows = evaluation.evaluate(s, Sampler.for_run(s), s.lora, s.eval_records[:3])
  assert result["n"] == 3 and len(rows) == 3 and len(counts) == 3
  for k in (1, 2, 4):
    want = np.mean([evaluation.pass_at_k(4, c, k) for c in counts])
    assert result[f"pass@{k}"] == pytest.approx(want)
  assert result["pass@1"] == pytest.approx(np.mean(counts) / 4)
  assert 0 <= result["majority"] <= 1


def test_records_with_constraints_report_ifeval_and_are_correct_when_all_are_followed(setup):
  """Where held-out records carry constraints, the evaluation reports IFEval's four numbers of
  the greedy completions (against `instructions.judge` on them), and such a row is correct
  when it follows all of its constraints strictly."""
  from reasoner import evaluation
  from reasoner.rewards import instructions
  from reasoner.rewards.scoring import Rewards

  s = dataclasses.replace(setup, rewards=Rewards(setup.cfg.rewards))  # the config's own
  no_zebra = {"kind": "keywords:forbidden_words", "args": {"forbidden_words": ["zebra"]}}
  records = [{"question": "Say hi.", "answer": None, "constraints": [no_zebra]},
             {"question": "Shout hi.", "answer": None,
              "constraints": [no_zebra, {"kind": "change_case:english_capital", "args": {}}]},
             {"question": "What is 2 + 2?", "answer": "4"}]
  result, rows = evaluation.evaluate(s, Sampler.for_run(s), s.lora, records)
  strict, loose = instructions.judge([r["completion"] for r in rows[:2]],
                                     [r["constraints"] for r in records[:2]])
  want = instructions.ifeval_scores(strict, loose)
  assert {k: result[f"ifeval/{k}"] for k in want} == want
  assert [rows[i]["correct"] for i in (0, 1)] == [float(all(s)) for s in strict]
  assert rows[2]["correct"] in (0.0, 1.0)  # the math row keeps its answer's check
  assert result["accuracy"] == pytest.approx(np.mean([r["correct"] for r in rows]))


def test_named_eval_sets_are_evaluated_and_logged_under_their_names(tmp_path):
  """`eval.sets` from a config override: a jsonl file with its own field names and an
  arithmetic set at another difficulty, evaluated beside the held-out split and logged as
  eval/<name>/<metric>; each set's figures are `evaluate` on its records."""
  import json

  from reasoner import evaluation
  from reasoner.engine.metrics import MetricsWriter

  f = tmp_path / "mine.jsonl"
  f.write_text("\n".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)})
                         for i in range(5)))
  s = build(tiny_config("data.num_eval=2", "eval.max_new_tokens=4",
                        f"eval.sets=[{{name: mine, source: jsonl, path: {f}, question_field: q, "
                        "answer_field: a, num: 3}, {name: hard, source: arithmetic, "
                        "difficulty: hard, num: 2}]"))
  assert [len(s.eval_records), len(s.eval_sets["mine"]), len(s.eval_sets["hard"])] == [2, 3, 2]
  assert s.eval_sets["mine"][1] == {"question": "What is 1 + 1?", "answer": "2", "category": None,
                                    "response": None, "chosen": None, "rejected": None,
                                    "rubric": None}
  assert not {r["question"] for r in s.eval_sets["hard"]} & {r["question"] for r in
                                                               s.eval_records}
  writer = MetricsWriter(tmp_path / "run", enabled=True)
  writer.start(0)
  sampler = Sampler.for_run(s)
  result = evaluation.evaluate_all(s, sampler, s.lora, "before", writer, 0)
  assert set(result["sets"]) == {"mine", "hard"}
  for name in ("mine", "hard"):
    assert result["sets"][name] == evaluation.evaluate(s, sampler, s.lora, s.eval_sets[name])[0]
  assert result["n"] == 2
  logged = {k: v for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            for k, v in json.loads(line).items()}
  assert logged["eval/n"] == 2 and logged["eval/mine/n"] == 3 and logged["eval/hard/n"] == 2
  assert logged["eval/mine/accuracy"] == result["sets"]["mine"]["accuracy"]


@pytest.mark.parametrize("sets, message", [
    ("[{name: a, source: arithmetic}, {name: a, source: gsm8k}]",
     "config key 'eval.sets' = ['a', 'a']: expected distinct names"),
    ("[{name: mine, source: jsonl}]",
     "config key 'eval.sets[mine].path' = None: expected a file path when its source is 'jsonl'"),
    ("[{name: held-out, source: gsm8k}]", "config key 'eval.sets[].name' = 'held-out'"),
    ("[{name: mine, source: jsonl, path: /nonexistent.jsonl}]",
     "config key 'eval.sets[mine].path' = '/nonexistent.jsonl': the file does not exist"),
])
def test_a_bad_eval_set_is_one_line_naming_its_key(sets, message):
  from reasoner.errors import DataError
  from reasoner.config import ConfigError

  with pytest.raises((ConfigError, DataError)) as e:
    build(tiny_config(f"eval.sets={sets}"))
  assert message in str(e.value) and "\n" not in str(e.value)


class MatchRewards(Rewards):
  """1 for a completion equal to its record's answer (every completion where it has none), else
  0: a group's samples from the tiny model never match, its written response does."""

  def __init__(self):
    pass

  def __call__(self, prompts, completions, answer=(), **_):
    total = np.asarray([1.0 if a is None or c == a else 0.0 for c, a in zip(completions, answer)],
                       np.float32)
    return total, {"match": total}


def test_guidance_puts_the_written_response_in_place_of_the_worst_sample(setup):
  """grpo.guidance: a group whose samples all score below its record's response trains on the
  response (its tokens and the stop token) in place of its lowest-scoring sample, with the
  response's reward and a positive advantage; the other rows are the samples of a run without
  guidance, row for row. Not guided: a record outside guidance_categories, one whose response
  does not fit max_new_tokens, and one whose samples already score as high. The rollout's
  metrics stay the samples'; no log-prob forward is dispatched before scoring."""
  from reasoner.data.examples import stop_id
  from reasoner.engine import rollout as rollout_lib
  from reasoner.objectives.grpo import batch_from_rollout, early_forwards

  records = [dict(r, answer="ok", response="ok") for r in setup.train_records[:B]]
  records[1].update(category="creative", question="Say ok.")  # outside guidance_categories
  records[2]["response"] = "far too long a response"  # over max_new_tokens = 6
  records[3]["answer"] = None  # every sample scores 1, as the response does
  runs = {}
  for guidance in (False, True):
    grpo = dataclasses.replace(setup.cfg.grpo, guidance=guidance,
                               guidance_categories=("math",))
    s = dataclasses.replace(setup, cfg=dataclasses.replace(setup.cfg, grpo=grpo),
                            rewards=MatchRewards())
    trainer = Trainer.for_run(s.graphdef, s.base, s.cfg)
    r = rollout_lib.draw(s, Sampler.for_run(s), s.lora, records, jax.random.PRNGKey(3))
    runs[guidance] = r, batch_from_rollout(s, trainer, s.lora, r), rollout_lib.metrics(r)
  assert early_forwards(s, trainer, s.lora)[0] is None
  (off, _, m_off), (on, batch, m_on) = runs[False], runs[True]
  np.testing.assert_array_equal(on.guided, [True, False, False, False])
  assert m_on["guided_groups"] == 1 and "guided_groups" not in m_off
  assert m_on["reward/mean"] == m_off["reward/mean"]  # the samples' figures
  ids = [*setup.tokenizer.encode("ok"), stop_id(setup.cfg.data.template, setup.tokenizer)]
  n = len(ids)
  np.testing.assert_array_equal(on.host["completion"][0, :n], ids)
  np.testing.assert_array_equal(on.host["completion_mask"][0], np.arange(6) < n)
  assert not on.host["sampler_logp"][0].any()
  np.testing.assert_array_equal(on.rewards, [1, 0, 0, 0] + [0] * 8 + [1] * 4)
  for k in ("completion", "completion_mask", "sampler_logp"):
    np.testing.assert_array_equal(on.host[k][1:], off.host[k][1:])
  adv = np.asarray(batch.advantages)
  assert adv[0] > 0 and (adv[1:G] < 0).all() and not adv[G:].any()
  np.testing.assert_array_equal(np.asarray(batch.completion)[0, :n], ids)


def test_sample_asks_a_question_as_its_category_asks(tmp_path, monkeypatch):
  """`reasoner sample --category`: the question in its category's prompt (an answer asked for,
  not a number), sampled greedily; without one, math's. The tiny model answers alike whatever
  comes before the question, so the sampler's own calls are watched."""
  from reasoner import evaluation
  from reasoner.data import prompts

  asked, real = [], Sampler.sample

  def watched(self, params, texts, *args, **kw):
    out = real(self, params, texts, *args, **kw)
    asked.append((list(texts), out[0].texts))
    return out

  monkeypatch.setattr(Sampler, "sample", watched)
  cfg = tiny_config(f"train.run_dir={tmp_path}")
  q = "Name two colours."
  got = evaluation.sample(cfg, q, 1, "instructions")
  assert asked == [([prompts.render(cfg.data.template, q, "instructions")], got)]
  assert prompts.GENERAL_INSTRUCTION in asked[0][0][0]
  evaluation.sample(cfg, q, 1)
  assert asked[1][0] == [prompts.render(cfg.data.template, q)]
  assert prompts.INSTRUCTION in asked[1][0][0]
