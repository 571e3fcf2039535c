"""On-policy distillation: the teacher's log-probs and the per-token advantage against dense
forwards, a teacher on its own devices, exact resume, bad input."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from reasoner.build import build, check
from reasoner.config import ConfigError
from reasoner.engine.sampler import Sampler, SamplingConfig
from reasoner.engine.teacher import Teacher
from reasoner.objectives import distill, grpo
from test_train import dense_logprobs

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow

OWN = "distill.teacher={source: random, name: tiny, tokenizer: bytes, tiny_layers: 1}"


def test_token_advantages_by_hand():
  student = np.array([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
  teacher = np.array([[-0.5, -2.5, -0.5], [-1.2, -1.0, -9.0]])
  mask = np.array([[True, True, False], [True, True, True]])
  got = distill.token_advantages(student, teacher, mask, np.array([1.0, 0.0]), 2, 2.0, 0.0)
  np.testing.assert_allclose(got, [[1.0, -1.0, 0.0], [-2.0, 4.0, -16.0]])
  mixed = distill.token_advantages(student, teacher, mask, np.array([1.0, 0.0]), 2, 2.0, 0.5)
  group = np.asarray(grpo.group_advantages(jnp.array([1.0, 0.0]), 2))  # ~ [1, -1]
  np.testing.assert_allclose(mixed, np.where(mask, got + 0.5 * group[:, None], 0), rtol=1e-6)


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("train.batch_size=2"))


def test_the_advantage_is_teacher_minus_student_computed_densely(setup):
  """The student samples; the teacher (the policy's base under another LoRA) scores every
  sampled token in one batched forward; kl_coef x (teacher - student) equals the same
  difference from dense float32 forwards of both models over full logits."""
  teacher_lora = jax.tree.map(lambda x: x + 0.1, setup.lora)
  teacher = Teacher(setup.graphdef, (teacher_lora, setup.base), setup.mesh, setup.tokenizer,
                    None, 1.0)
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 640)
  cfg = SamplingConfig.for_run(setup.cfg, setup.tokenizer, greedy=False)
  comps, tok, mask = sampler.sample((setup.lora, setup.base), ["Q: 3 + 4?", "Q: 9 - 2?"],
                                    jax.random.PRNGKey(5), cfg, num_generations=4)
  t = teacher.logprobs(tok, mask, comps.tokens, comps.mask)
  adv = distill.token_advantages(comps.logprobs, t, comps.mask, np.zeros(8), 4, 1.5, 0.0)
  dense = lambda lora: np.asarray(dense_logprobs(
      setup.model(lora), tok, mask, comps.tokens, comps.mask))
  want = 1.5 * (dense(teacher_lora) - dense(setup.lora))
  np.testing.assert_allclose(adv[comps.mask], want[comps.mask], atol=5e-4)
  assert np.abs(want[comps.mask]).mean() > 50 * 5e-4 and (adv[~comps.mask] == 0).all()
  full = dense_logprobs(setup.model(teacher_lora), tok, mask, comps.tokens, comps.mask,
                        full=True)
  assert_topk(teacher, (tok, mask, comps.tokens, comps.mask), t, full)


def assert_topk(teacher, batch, logp, full, k=5):
  """`Teacher.topk` gives `logprobs` and, from the same forward, the top-k of the dense
  [R, N, V] log-softmax `full` at every masked position."""
  same, logq, ids = teacher.topk(*batch, k)
  on = batch[3]
  np.testing.assert_allclose(same[on], logp[on], atol=1e-5)
  want_q, want_ids = jax.lax.top_k(full, k)
  np.testing.assert_allclose(logq[on], np.asarray(want_q)[on], atol=1e-4)
  np.testing.assert_array_equal(ids[on], np.asarray(want_ids)[on])
  assert np.ptp(ids[on][:, 0]) > 0  # not one token everywhere


def test_a_teacher_of_its_own_lives_on_the_last_four_devices():
  setup = build(tiny_config(OWN, "distill.devices=4", "train.batch_size=2"), teacher=True)
  where = lambda tree: {s.device for x in jax.tree.leaves(tree) for s in x.addressable_shards}
  assert where(setup.base) | where(setup.lora) == set(jax.devices()[:4])
  assert where(setup.teacher.params) == set(jax.devices()[4:])
  t = setup.teacher
  tok = np.array([[0, 2, 70, 71], [2, 72, 73, 74]], np.int32)
  valid = tok > 0
  comp = np.array([[80, 81, 1], [82, 1, 0]] * 2, np.int32)
  cmask = comp > 0
  got = t.logprobs(tok, valid, comp, cmask)
  model = nnx.merge(t.graphdef, *t.params)
  assert len(model.layers) == 1  # the teacher's own model, not the policy's two layers
  want = np.asarray(dense_logprobs(model, tok, valid, comp, cmask))
  np.testing.assert_allclose(got[cmask], want[cmask], atol=1e-4)
  full = dense_logprobs(model, tok, valid, comp, cmask, full=True)  # its vocabulary over 4 chips
  assert_topk(t, (tok, valid, comp, cmask), got, full)


def _run(tmp_path, name, stage, *overrides, steps=4):
  from reasoner import loop

  cfg = tiny_config(f"train.run_dir={tmp_path}", f"train.run_name={name}",
                    f"train.steps={steps}", "train.checkpoint_every=2", "train.batch_size=2",
                    *overrides)
  return loop.train(cfg, stage=stage)


def _lora(run, step):
  import orbax.checkpoint as ocp

  with ocp.CheckpointManager(run / "checkpoints") as m:
    return m.restore(step)["state"]["lora"]


def test_resume_is_exact_with_the_teacher_a_runs_lora(tmp_path):
  """An SFT run's LoRA teaches (distill.teacher_lora); a distillation whose step-4 checkpoint
  was removed resumes to the same bits and logs the same rows."""
  _run(tmp_path, "teacher", "sft", steps=2)
  d = (f"distill.teacher_lora={tmp_path / 'teacher'}", "distill.reward_weight=0.5",
       "grpo.num_iterations=2",  # mu passes a rollout, pi_old from the trainer's forward
       "distill.topk=4")  # and the teacher's top-4 as soft targets
  _run(tmp_path, "student", "distill", *d)
  run = tmp_path / "student"
  full = _lora(run, 4)
  read = lambda: [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                  if "distill/reverse_kl" in r]
  rows = read()
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(np.isfinite(r["distill/reverse_kl"]) for r in rows)
  assert all(0 < r["distill/topk_mass"] <= 1 + 1e-6 for r in rows)
  shutil.rmtree(run / "checkpoints" / "4")
  _run(tmp_path, "student", "distill", *d)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(_lora(run, 4))):
    np.testing.assert_array_equal(a, b)
  strip = lambda r: {k: v for k, v in r.items() if not k.endswith(("_s", "per_s"))}
  assert [strip(r) for r in read()] == [strip(r) for r in rows]


def test_bad_teachers_are_one_line_before_any_model_loads(tmp_path):
  stage = distill.STAGE.check_records
  with pytest.raises(ConfigError, match=r"distillation needs a teacher"):
    check(tiny_config(), check_records=stage)
  other = OWN.replace("tiny_layers: 1", "tiny_layers: 1, tiny_vocab: 512")
  with pytest.raises(ConfigError, match=r"'distill.teacher.name' = 'tiny': its tokenizer "
                                        r"\(bytes, 512 ids\) is not the policy's \(bytes, 384"):
    check(tiny_config(other), check_records=stage)
  with pytest.raises(ConfigError, match=r"'distill.devices' = 8: this run has 8 devices, and "
                                        r"the policy needs at least one \(at most 7\)"):
    check(tiny_config(OWN, "distill.devices=8"), check_records=stage, teacher=True)
  run = tmp_path / "other"  # a run of another base model (three layers)
  (run / "checkpoints" / "2").mkdir(parents=True)
  cfg = tiny_config("model.tiny_layers=3").to_dict()
  (run / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError, match=r"'model.tiny_layers' = 2: the run in "
                                        r"distill.teacher_lora \(.*other\) was trained with 3"):
    check(tiny_config(f"distill.teacher_lora={run}"), check_records=stage)
  with pytest.raises(ConfigError, match=r"'distill.teacher_lora' = .*: expected null when "
                                        r"distill.teacher is set"):
    tiny_config(OWN, f"distill.teacher_lora={run}")
  with pytest.raises(ConfigError, match=r"'distill.topk' = 300: expected 0 \(off\) or a "
                                        r"number of tokens from 1 to 256"):
    tiny_config(OWN, "distill.topk=300")
  with pytest.raises(ConfigError, match=r"'distill.kl_coef' = 0.0: expected a positive number "
                                        r"\(or 0 with distill.topk > 0\)"):
    tiny_config(OWN, "distill.kl_coef=0")


def test_the_planner_plans_the_teacher_on_its_own_chips():
  """`plan` compiles the teacher's forward over a rollout's rows on its four chips, the
  policy's steps on the other four, and counts it in the GRPO step's estimate."""
  from reasoner.planner import plan, report as report_lib

  report = plan.plan(tiny_config(OWN, "distill.devices=4", "train.batch_size=2",
                                 "data.max_prompt_tokens=64", "distill.topk=8"), "cpu",
                     search=False)
  assert report["mesh"]["fsdp"] == 4 and report["teacher_on"] == "4 chips of its own"
  t = report["teacher"]
  assert t.fits and t.what == "teacher" and t.rows == 8 and t.flops > 0
  weights = build(tiny_config(OWN.replace("distill.teacher=", "model="))).base
  full = sum(x.nbytes for x in jax.tree.leaves(weights))
  assert full / 8 < t.arguments < full / 2  # its weights split over its own four chips
  text = report_lib.format_report(report)
  assert "(on 4 chips of its own; once a step)" in text and "teacher + train" in text
  step = plan.step_seconds(report)
  assert step == pytest.approx(sum(report[k].seconds(report["chip"])
                                   for k in ("rollout", "train", "logprobs", "teacher")))
