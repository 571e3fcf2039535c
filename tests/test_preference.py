"""Preference optimisation: the pair losses against Tunix 0.1.7's `dpo_loss_fn` and the papers'
formulas, the fused sequence head against a dense forward, the stage's step, pairs from files
and from the policy, exact resume, bad input."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, tiny_config
from reasoner import mesh as mesh_lib
from reasoner.build import build
from reasoner.config import ConfigError, MeshConfig
from reasoner.data import examples as examples_lib
from reasoner.engine import heads
from reasoner.errors import DataError
from reasoner.objectives import pairs as pairs_lib, preference
from test_train import dense_completion_logprobs, dense_logprobs

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow


def _token_logps(rng, pairs=3, n=6):
  """[2P, N] token log-probs (chosen, rejected interleaved), a mask with a varied length a row,
  and reference sums [2P]."""
  logp = jnp.asarray(-0.3 - rng.gamma(2.0, 0.4, size=(2 * pairs, n)), jnp.float32)
  lengths = rng.integers(1, n + 1, size=2 * pairs)
  mask = jnp.asarray(np.arange(n)[None] < lengths[:, None])
  ref = jnp.asarray(np.asarray(jnp.sum(logp * mask, 1)) + rng.normal(0, 0.5, 2 * pairs),
                    jnp.float32)
  return logp, mask, ref


def _tunix_loss(monkeypatch, logp, mask, ref, algorithm, **kw):
  """Tunix's `dpo_loss_fn` with its log-prob forward replaced by the given token log-probs:
  its layout is [chosen..., rejected...], ours interleaved."""
  from tunix.sft.dpo import dpo_trainer

  order = np.r_[0:logp.shape[0]:2, 1:logp.shape[0]:2]
  sums = jnp.sum(logp * mask, 1)[order]
  half = logp.shape[0] // 2
  monkeypatch.setattr(dpo_trainer, "compute_logps", lambda *a, **k: (sums[:half], sums[half:]))
  example = dpo_trainer.TrainExample(
      input_ids=None, positions=None, attention_mask=None, completion_mask=mask[order],
      ref_chosen_logps=ref[order][:half] if algorithm == "dpo" else None,
      ref_rejected_logps=ref[order][half:] if algorithm == "dpo" else None, logits_to_keep=0)
  return dpo_trainer.dpo_loss_fn(None, example, algorithm=algorithm, **kw)


@pytest.mark.parametrize("loss,smoothing", [("dpo", 0.0), ("dpo", 0.2), ("orpo", 0.0),
                                            ("orpo", 0.1)])
def test_dpo_and_orpo_equal_tunix(monkeypatch, loss, smoothing):
  """Loss, gradient (w.r.t. every token's log-prob) and logged rewards equal Tunix 0.1.7's, ORPO
  with Tunix's odds of summed log-probs (`prefer.orpo_odds: sum`)."""
  pytest.importorskip("tunix.sft.dpo.dpo_trainer")
  logp, mask, ref = _token_logps(np.random.default_rng(1))
  obj = preference.PairObjective(loss, beta=0.3, orpo_lambda=0.2, orpo_odds="sum",
                                 label_smoothing=smoothing)
  ours = lambda lp: preference.dense_loss(lp, mask, ref, obj)
  kw = dict(beta=0.3, lambda_orpo=0.2, label_smoothing=smoothing)
  theirs = lambda lp: _tunix_loss(monkeypatch, lp, mask, ref, loss, **kw)[0]
  (value, grad), (value_t, grad_t) = (jax.value_and_grad(f)(logp) for f in (ours, theirs))
  assert float(value) == pytest.approx(float(value_t), rel=1e-6)
  np.testing.assert_allclose(grad, grad_t, rtol=1e-5, atol=1e-8)
  assert float(jnp.abs(grad).max()) > 0
  s, n = jnp.sum(logp * mask, 1), jnp.sum(mask, 1).astype(jnp.float32)
  m = preference.pair_metrics(s, n, ref, jnp.full(s.shape, 1 / 3), obj)
  aux = _tunix_loss(monkeypatch, logp, mask, ref, loss, **kw)[1]
  for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
              "log_probs/chosen", "log_probs/rejected"):
    assert float(m[key]) == pytest.approx(float(aux[key]), rel=1e-5, abs=1e-7), key


def test_simpo_ipo_and_orpo_are_the_papers_formulas():
  """From full logits, densely: SimPO -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log
  pi(y_l) - gamma), IPO's square on mean log-ratios, ORPO's odds of the mean probability."""
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.normal(size=(4, 5, 11)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 11, size=(4, 5)))
  mask = jnp.asarray(np.arange(5)[None] < np.array([5, 2, 3, 4])[:, None])
  ref = jnp.asarray([-4.0, -3.0, -2.5, -5.0])
  tok = jnp.take_along_axis(jax.nn.log_softmax(z, -1), y[..., None], -1)[..., 0]
  lp = [float(jnp.sum(tok[i] * mask[i])) for i in range(4)]
  n = [float(mask[i].sum()) for i in range(4)]
  sig = lambda x: 1 / (1 + np.exp(-x))
  b, g = 2.0, 0.8
  simpo = np.mean([-np.log(sig(b / n[w] * lp[w] - b / n[l] * lp[l] - g)) for w, l in ((0, 1),
                                                                                     (2, 3))])
  ipo = np.mean([((lp[w] - ref[w]) / n[w] - (lp[l] - ref[l]) / n[l] - 1 / (2 * b)) ** 2
                 for w, l in ((0, 1), (2, 3))])
  odds = lambda i: np.exp(lp[i] / n[i]) / (1 - np.exp(lp[i] / n[i]))
  orpo = np.mean([-lp[w] / n[w] - 0.5 * np.log(sig(np.log(odds(w) / odds(l))))
                  for w, l in ((0, 1), (2, 3))])
  for loss, want in (("simpo", simpo), ("ipo", ipo), ("orpo", orpo)):
    obj = preference.PairObjective(loss, beta=b, gamma=g, orpo_lambda=0.5, orpo_odds="mean")
    assert float(preference.dense_loss(tok, mask, ref, obj)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_fused_sequence_loss_equals_dense(softcap):
  """Value and gradient (hidden states) of a pair loss through the fused chunked head equal a
  dense float32 computation over full [B, T, V] logits, on 8 devices with chunks that cut rows."""
  rng = np.random.default_rng(3)
  b, t, d, v = 8, 12, 16, 96
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  e = jnp.asarray(rng.normal(size=(v, d)) * 0.3, jnp.float32)
  y = jnp.asarray(rng.integers(0, v, size=(b, t)))
  w = jnp.asarray(np.arange(t)[None] < rng.integers(1, t + 1, size=b)[:, None], jnp.float32)
  ref, share = jnp.asarray(rng.normal(-20, 2, size=b), jnp.float32), jnp.full((b,), 0.25)
  obj = preference.PairObjective("dpo", beta=0.5)
  fn = lambda s, n, r, wt: preference.batch_loss(s, n, r, wt, obj=obj)
  n = jnp.sum(w, 1)
  mesh = mesh_lib.make_mesh(MeshConfig())

  def fused(h):
    return heads.fused_sequence_loss(h, e, y, w, fn, (n, ref, share), chunk=5, mesh=mesh,
                                     softcap=softcap)[0]

  def dense(h):
    tok = jnp.take_along_axis(jax.nn.log_softmax(heads.logits(h, e, softcap), -1),
                              y[..., None], -1)[..., 0]
    return fn(jnp.sum(tok * w, 1), n, ref, share)

  (lf, gf), (ld, gd) = jax.value_and_grad(fused)(h), jax.value_and_grad(dense)(h)
  assert float(lf) == pytest.approx(float(ld), rel=1e-5)
  np.testing.assert_allclose(gf, gd, rtol=1e-4, atol=1e-6)
  with pytest.raises(NotImplementedError, match="embedding must be frozen"):
    jax.grad(lambda e: heads.fused_sequence_loss(h, e, y, w, fn, (n, ref, share))[0])(e)


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("train.batch_size=4"), check_records=preference.check)


def _host(setup, count=4):
  cfg = setup.cfg
  ex = examples_lib.encode(setup.train_records[:count], cfg.data.template, setup.tokenizer,
                           cfg.data.max_prompt_tokens, 128, "drop", fields=("chosen", "rejected"))
  return preference.Weighted(ex, count, 0, 1, 8, setup.tokenizer.pad_id).pad(ex)


@pytest.mark.parametrize("loss", ["dpo", "simpo", "orpo"])
def test_the_step_equals_a_dense_forward_and_ignores_what_the_masks_leave_out(setup, loss):
  """The stage's loss and LoRA gradients (prompt once for both responses, the fused sequence
  head) equal a dense float32 forward of whole sequences; tokens outside the masks change
  nothing."""
  cfg = dataclasses.replace(setup.cfg, prefer=dataclasses.replace(setup.cfg.prefer, loss=loss,
                                                                  beta=0.5))
  trainer = preference.PreferenceTrainer.for_run(setup.graphdef, setup.base, cfg)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)
  host = _host(setup)
  host["ref_logp"] = trainer.reference(None, lora, host)
  batch = preference.PairBatch(**{k: mesh_lib.put_batch(setup.mesh, host[k])
                                  for k in preference.PairBatch._fields})
  (loss_v, grads), s = jax.jit(trainer._pair_grads)(setup.base, lora, batch)

  def dense(model):
    tok = dense_completion_logprobs(model, batch.prompt, batch.prompt_valid, batch.response,
                                    batch.response_mask)
    return preference.dense_loss(tok, batch.response_mask, batch.ref_logp, trainer.obj)

  # jitted: one program, not hundreds of eager ones each with its own 8-device rendezvous
  want, want_g = nnx.jit(nnx.value_and_grad(dense, argnums=nnx.DiffState(0, nnx.LoRAParam)))(
      setup.model(lora))
  assert float(loss_v) == pytest.approx(float(want), rel=1e-4)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_g))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4 * scale)
  # pads and masked-out tokens: other ids there change nothing
  noisy = {k: v.copy() for k, v in host.items()}
  noisy["prompt"][~host["prompt_valid"]] = 77
  noisy["response"][~host["response_mask"]] = 91
  other = preference.PairBatch(**{k: mesh_lib.put_batch(setup.mesh, noisy[k])
                                  for k in preference.PairBatch._fields})
  (loss2, grads2), _ = jax.jit(trainer._pair_grads)(setup.base, lora, other)
  assert float(loss2) == float(loss_v)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
    np.testing.assert_array_equal(a, b)


def test_micro_batches_give_the_one_pass_update(setup):
  host = _host(setup)
  out = {}
  for micro in (None, 2):
    trainer = preference.PreferenceTrainer.for_run(setup.graphdef, setup.base, setup.cfg,
                                                   micro_batch=micro)
    host["ref_logp"] = trainer.reference(None, setup.lora, host)
    batch = preference.PairBatch(**{k: mesh_lib.put_batch(setup.mesh, host[k])
                                    for k in preference.PairBatch._fields})
    # away from the reference, so that the logged rewards are not rounding noise
    state = trainer.init_state(jax.tree.map(lambda x: x + 0.05, setup.lora),
                               jax.random.PRNGKey(0))
    # the accumulated gradient itself: Adam's first step (about lr * g / |g| an element) would
    # hide a micro-batch sum that should have been a mean
    (loss, grads), _ = jax.jit(lambda base, lora, b: trainer._in_micro_batches(
        lambda params, m: trainer._pair_grads(*params, m), (base, lora), b,
        (jnp.zeros((), jnp.float32), lora)))(setup.base, state.lora, batch)
    state, metrics = trainer.train_step(state, batch)
    out[micro] = (jax.tree.map(np.asarray, state.lora), {k: float(v) for k, v in
                                                        metrics.items()},
                  float(loss), jax.tree.map(np.asarray, grads))
  for k, v in out[None][1].items():
    assert out[2][1][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
  assert out[2][2] == pytest.approx(out[None][2], rel=1e-5)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(out[None][3]))
  for a, b in zip(jax.tree.leaves(out[2][3]), jax.tree.leaves(out[None][3])):
    # float32 sums in another order (measured: 1.3e-4 relative); a sum for a mean is 2x
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)
  # an element whose gradient is near 0 moves by lr * g / (|g| + eps): its rounding is a share
  # of lr (1e-3), so the weights agree to a tenth of one step (measured: 5.2e-5 with the suite's
  # compile flags); a wrong accumulation flips whole steps
  for a, b in zip(jax.tree.leaves(out[2][0]), jax.tree.leaves(out[None][0])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_policy_pairs_pair_the_best_with_the_worst():
  comps = type("C", (), {})()
  comps.tokens = np.arange(24).reshape(6, 4)
  comps.mask = np.ones((6, 4), bool)
  comps.mask[:, 3] = False
  groups = type("G", (), {})()
  groups.records, groups.comps = [{}, {}], comps
  groups.prompt = np.array([[0, 2, 5], [2, 6, 7]])
  groups.prompt_valid = np.array([[False, True, True], [True, True, True]])
  groups.total = np.array([0.2, 0.9, 0.1, 0.5, 0.5, 0.55], np.float32)
  got = pairs_lib.pairs_of(groups, 3, min_margin=0.1)
  assert got == [([2, 5], [4, 5, 6], [8, 9, 10], pytest.approx(0.8))]  # group 2: margin 0.05
  host = examples_lib.pad([x[:3] for x in got] * 2, 0, 4)
  assert host["response"].shape == (4, 4) and host["prompt"].shape == (2, 4)
  np.testing.assert_array_equal(host["prompt"][0], [0, 0, 2, 5])
  np.testing.assert_array_equal(host["response"][1], [8, 9, 10, 0])


def _train(tmp_path, name, *overrides, steps=4):
  from reasoner import loop

  cfg = tiny_config(f"train.run_dir={tmp_path}", f"train.run_name={name}",
                    f"train.steps={steps}", "train.checkpoint_every=2", "train.batch_size=4",
                    "rollout.max_new_tokens=6", *overrides)
  return loop.train(cfg, stage="prefer")


def _lora(run, step):
  import orbax.checkpoint as ocp

  with ocp.CheckpointManager(run / "checkpoints") as m:
    return m.restore(step)["state"]["lora"]


# the policy's own pairs carry the most state through a resume (make test); pairs from a file
# repeat the same resume (make soak, pytest -m extended)
@pytest.mark.parametrize("pairs", [pytest.param("file", marks=pytest.mark.extended), "policy"])
def test_resume_is_exact(tmp_path, pairs):
  """A run whose step-4 checkpoint was removed resumes from step 2 to the same bits, the
  policy's pool of pairs (regenerated every 3 steps: step 4 reuses step 3's) included."""
  extra = (f"prefer.pairs={pairs}", "prefer.regenerate_every=3", "prefer.min_margin=0.01")
  result = _train(tmp_path, "p", *extra)
  run = tmp_path / "p"
  full = _lora(run, 4)
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  trained = [r for r in rows if "rewards/accuracy" in r]
  assert [r["step"] for r in trained] == [1, 2, 3, 4] and "after" in result
  if pairs == "policy":
    assert [("pairs/found" in r) for r in trained] == [True, False, False, True]
  shutil.rmtree(run / "checkpoints" / "4")
  _train(tmp_path, "p", *extra)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(_lora(run, 4))):
    np.testing.assert_array_equal(a, b)
  again = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "rewards/accuracy" in r]
  strip = lambda r: {k: v for k, v in r.items() if not k.endswith(("_s", "per_s"))}
  assert [strip(r) for r in again] == [strip(r) for r in trained]


def test_bad_pairs_are_one_line_before_the_model_loads(tmp_path, capsys):
  from reasoner import cli
  from reasoner.build import check

  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps({"question": "2+2?", "chosen": "4"}) + "\n"
                  + json.dumps({"question": "3+3?", "chosen": "6", "rejected": "5"}) + "\n")
  data = ("data.source=jsonl", f"data.path={path}", "rewards=[{fn: format_exact}]")
  with pytest.raises(DataError, match=r"prefer: record 0 of the training data has no rejected "
                                      r"response \(data.rejected_field = 'rejected'\)"):
    check(tiny_config(*data), check_records=preference.check)
  path.write_text(json.dumps({"question": "2+2?", "chosen": "4 ", "rejected": "4"}) + "\n" * 2
                  + json.dumps({"question": "3+3?", "chosen": "6", "rejected": "5"}) + "\n")
  with pytest.raises(DataError, match="record 0 of the training data has the same chosen and "
                                      "rejected response"):
    check(tiny_config(*data), check_records=preference.check)
  with pytest.raises(ConfigError, match=r"'prefer.label_smoothing' = 0.5: expected a number in"):
    tiny_config("prefer.label_smoothing=0.5")
  path.write_text(json.dumps({"question": "2+2?", "chosen": "4"}) + "\n"
                  + json.dumps({"question": "3+3?", "chosen": "6", "rejected": "5"}) + "\n")
  tiny = str(ROOT / "configs" / "tiny.yaml")
  assert cli.main(["prefer", "--config", tiny, *data, f"train.run_dir={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: prefer: record 0 of the training data")
  assert not (tmp_path / "tiny" / "checkpoints").exists()


def test_after_sft_the_reference_is_the_sft_lora_kept_with_the_run(tmp_path):
  """DPO from an SFT run (lora.init_from): the reference policy is the base under the SFT
  LoRA (as TRL takes the SFT model), kept in <run>/reference, so that a later session has it
  when the SFT run is gone; its log-probs are those of that LoRA."""
  from reasoner import loop

  sft = tiny_config(f"train.run_dir={tmp_path}", "train.run_name=sft", "train.steps=2")
  loop.train(sft, stage="sft")
  want = _lora(tmp_path / "sft", 2)
  cfg = lambda steps: tiny_config(f"train.run_dir={tmp_path}", "train.run_name=dpo",
                                  f"train.steps={steps}", "train.batch_size=4",
                                  f"lora.init_from={tmp_path / 'sft'}", "prefer.loss=dpo")
  for steps in (1, 2):  # a fresh start, then a later session without the SFT run
    run = loop.Run(cfg(steps), stage="prefer")
    try:
      for a, b in zip(jax.tree.leaves(run.setup.reference), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)
      host = _host(run.setup)
      ref = run.trainer.reference(run.setup.reference, run.state.lora, host)
      put = lambda k: mesh_lib.put_batch(run.setup.mesh, host[k])
      # jitted: eager ops over 8 fake devices, each its own rendezvous, aborted XLA:CPU once in
      # a fresh clone's suite
      dense = dense_logprobs(run.setup.model(run.setup.reference), put("prompt"),
                             put("prompt_valid"), put("response"), put("response_mask"))
      np.testing.assert_allclose(ref, np.asarray(jnp.sum(dense * host["response_mask"], 1)),
                                 rtol=1e-4)
      run.train()
    finally:
      run.close()
    assert (tmp_path / "dpo" / "reference").is_dir()
    shutil.rmtree(tmp_path / "sft", ignore_errors=True)
