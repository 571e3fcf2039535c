"""The judge reward: its grade against a dense computation of the grade tokens' probabilities,
routed by category, and its settings refused in one line."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import ROOT, dense_grade_probs, tiny_config
from reasoner import mesh as mesh_lib
from reasoner.models import lora as lora_lib
from reasoner.build import build
from reasoner.config import ConfigError
from reasoner.rewards.judge import Judge

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

RUBRIC = "Rate 1-5.\nQ: {question}\nA: {response}\nRef: {reference}\nGrade (1, 2, 3, 4, 5): "
MIXED = ("data.source=jsonl", f"data.path={ROOT / 'data/mixed.jsonl'}", "data.num_eval=2",
         "rewards=[{fn: judge, categories: [creative, science, summarisation, code]}, "
         "{fn: correct, categories: [math]}]")


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config(*MIXED, f"judge.rubric={json.dumps(RUBRIC)}", "judge.batch_size=4"))


def test_grade_is_the_expected_grade_of_a_dense_forward(setup):
  judge = setup.rewards.fns[0]
  assert isinstance(judge, Judge)
  qs = ["Why is the sky blue?", "Sum 2 and 3.", "A haiku on rain.", "x", "Name a prime."]
  rs = ["Rayleigh scattering.", "<answer>5</answer>", "Rain taps the roof", "", "7"]
  refs = ["Short wavelengths scatter more.", "5", None, None, "2"]
  got = judge(["p"] * 5, rs, question=qs, answer=refs)
  texts = judge.texts(rs, qs, refs)
  assert "Ref: (none given)" in texts[2] and texts[0].startswith("Rate 1-5.\nQ: Why is")
  model = setup.model(lora_lib.zeros_like(setup.lora))  # the base: LoRA off
  np.testing.assert_allclose(got, _dense_grades(model, setup.tokenizer, texts), rtol=1e-5,
                             atol=1e-6)
  assert len(set(np.round(got, 6))) > 1  # the grades differ between completions


def _dense_grades(model, tokenizer, texts):
  """The expected grade, 0-1, from the grade tokens' dense probabilities."""
  return dense_grade_probs(model, tokenizer, texts, "12345") @ np.arange(5) / 4


def test_a_judge_of_its_own_lives_on_the_last_four_devices(tmp_path):
  """judge.devices: 4 on 8 devices: the judge's weights only on the last four, split over 'tp'
  (`mesh.forward_mesh`), the policy's only on the first four; its grades, and a rubric's
  criteria read in one pass, those of a dense forward of the judge's own model on one device.
  The judge is a Kaggle-layout checkpoint, restored straight into its 'tp' shards."""
  from flax import nnx
  from test_kaggle import TINY, write_download

  write_download(tmp_path / "judge", "gemma3", {**TINY, "layers": 1, "heads": 8, "kv": 4},
                 "gemma3-1b-it")
  own = (f"judge.model={{source: kaggle, name: tiny, path: '{tmp_path / 'judge'}', "
         "tokenizer: bytes, tiny_layers: 1, tiny_heads: 8, tiny_kv_heads: 4}")
  criterion = "Q: {question}\nA: {response}|{criterion}"  # its 16-token window sees the response
  setup = build(tiny_config(*MIXED, own, "judge.devices=4", f"judge.rubric={json.dumps(RUBRIC)}",
                            f"judge.criterion_prompt={json.dumps(criterion)}",
                            "judge.criterion_grades=[N, Y]", "judge.max_criteria=3",
                            "train.batch_size=2"))
  judge = setup.rewards.fns[0]
  where = lambda tree: {s.device for x in jax.tree.leaves(tree) for s in x.addressable_shards}
  assert where(setup.base) | where(setup.lora) == set(jax.devices()[:4])
  assert where(judge.params) == set(jax.devices()[4:])
  assert setup.mesh.devices.size == 4 and dict(judge.mesh.shape) == {"fsdp": 1, "tp": 4}
  tcfg = nnx.merge(judge.graphdef, *judge.params).config
  shapes = [tuple(mesh_lib.forward_mesh(jax.devices()[:n], tcfg).shape.values())
            for n in (2, 3, 6, 8)]
  assert shapes == [(1, 2), (3, 1), (3, 2), (2, 4)]  # 'tp': a power of two dividing the heads
  one_kv_head = dataclasses.replace(tcfg, num_kv_heads=1)  # Gemma 3 1B's, the tiny default's
  assert dict(mesh_lib.forward_mesh(jax.devices()[4:], one_kv_head).shape) == {"fsdp": 4, "tp": 1}
  split = [x for x in jax.tree.leaves(judge.params)
           if len({str(s.index) for s in x.addressable_shards}) == 4]
  assert len(split) >= len(jax.tree.leaves(judge.params)) // 2  # weights split, not copied
  texts = judge.texts(["Blue.", "7"], ["Sky colour?", "A prime?"], [None, "2"])
  got = judge(["p", "p"], ["Blue.", "7"], question=["Sky colour?", "A prime?"],
              answer=[None, "2"])
  model = nnx.merge(judge.graphdef, *judge.params)
  assert len(model.layers) == 1  # the judge's own model, not the policy's two layers
  np.testing.assert_allclose(got, _dense_grades(model, judge.tokenizer, texts), rtol=1e-5,
                             atol=1e-6)
  rubric = [("Y?", 1.0), ("Ok?", 1.0), ("x", 1.0)]
  answers = [("Sky colour?", "Blue, on a clear day."), ("A prime?", "7 is prime."),
             ("Name a fruit.", "A pear.")]
  got = judge.criteria([judge.criterion_rows(r, q, None, rubric[:1 + i])
                        for i, (q, r) in enumerate(answers)])
  texts = [t for i, (q, r) in enumerate(answers)
           for t in judge.criterion_texts(r, q, None, rubric[:1 + i])]
  want = dense_grade_probs(model, judge.tokenizer, texts, "NY")[:, 1]
  np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-6)
  assert len(set(np.round(want, 6))) > 3


def test_judge_scores_only_its_categories(setup):
  total, per_fn = setup.rewards(["p"] * 3, ["<answer>4</answer>", "a poem", "a proof"],
                                answer=["4", None, "QED"], category=["math", "creative", "code"],
                                question=["2+2?", "A poem.", "Prove it."])
  judge, correct = per_fn["judge"], per_fn["correct"]
  assert np.isnan(judge[0]) and not np.isnan(judge[1:]).any()
  assert 0 <= judge[1:].min() and judge[1:].max() <= 1
  assert correct[0] == 1.0 and np.isnan(correct[1:]).all()
  np.testing.assert_allclose(total, [1.0, judge[1], judge[2]], rtol=1e-6)


def test_bad_judge_settings_fail_in_one_line():
  with pytest.raises(ConfigError,
                     match=r"'judge.rubric' = 'Grade 1 to 4: {response}': .*missing: 2, 3, 5"):
    tiny_config("judge.rubric='Grade 1 to 4: {response}'")
  with pytest.raises(ConfigError, match=r"'judge.rubric'.*missing: \{response\}"):
    tiny_config("judge.rubric='Grade 1, 2, 3, 4, 5'")
  with pytest.raises(ConfigError, match="'judge.grades'.*two or more distinct"):
    tiny_config("judge.grades=['1', '1']")
  cfg = tiny_config(*MIXED, "judge.grades=['1', '10']", "judge.rubric='1 or 10: {response}'")
  with pytest.raises(ConfigError, match=r"'judge.grades': '10' is 2 tokens"):
    build(cfg)
  with pytest.raises(ConfigError, match=r"'judge.devices' = 4: expected null .* of its own"):
    tiny_config(*MIXED, "judge.devices=4")
  own = "judge.model={source: random, name: tiny, tokenizer: bytes}"
  with pytest.raises(ConfigError, match=r"'judge.devices' = 8: this run has 8 devices, and the "
                                        r"policy needs at least one \(at most 7\)"):
    build(tiny_config(*MIXED, own, "judge.devices=8"))


def test_the_planner_plans_the_judge_on_its_own_chips():
  """`plan` compiles one judge batch on the judge's four chips, the policy's steps on the
  other four, and counts the judge's batches in the GRPO step's estimate."""
  from reasoner.planner import plan, report as report_lib

  own = "judge.model={source: random, name: tiny, tokenizer: bytes, tiny_layers: 1}"
  report = plan.plan(tiny_config(*MIXED, own, "judge.devices=4", "judge.max_tokens=128",
                                 "train.batch_size=2", "data.max_prompt_tokens=64"), "cpu",
                     search=False)
  assert report["mesh"]["fsdp"] == 4 and report["judge_on"] == "4 chips of its own"
  judge = report["judge"]
  assert judge.fits and judge.what == "judge" and judge.prompts == 16
  weights = build(tiny_config(*MIXED, own.replace("judge.model=", "model="))).base
  full = sum(x.nbytes for x in jax.tree.leaves(weights))
  assert full / 8 < judge.arguments < full / 2  # its weights split over its own four chips
  text = report_lib.format_report(report)
  assert ("(on 4 chips of its own; 1 batch a step at most, 1.00 on average at the mixture's "
          "judged share 1.00)") in text and "judge + train" in text
