"""SFT: the loss and gradients against a dense float32 reference, the batches, exact resume, and
GRPO from an SFT run's LoRA (lora.init_from)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import ROOT, tiny_config
from reasoner import mesh as mesh_lib
from reasoner.data import examples as examples_lib
from reasoner.objectives import sft
from reasoner.build import build
from reasoner.config import ConfigError
from reasoner.errors import DataError
from test_train import dense_completion_logprobs

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("train.batch_size=4"), check_records=sft.check)


def _batch(setup, seed=0, rows=4, p=7, n=6):
  rng = np.random.default_rng(seed)
  host = {"prompt": rng.integers(3, 200, (rows, p)).astype(np.int32),
          "prompt_valid": np.arange(p)[None] >= rng.integers(0, 3, (rows, 1)),
          "response": rng.integers(3, 200, (rows, n)).astype(np.int32),
          "response_mask": np.arange(n)[None] < rng.integers(1, n + 1, (rows, 1))}
  return host, sft.SFTBatch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()})


def _dense_loss(graphdef, base, prompt, valid, response, mask):
  def loss(model):
    logp = dense_completion_logprobs(model, prompt, valid, response, mask)
    m = mask.astype(jnp.float32)
    return -jnp.sum(logp * m) / jnp.sum(m)
  return loss


def test_loss_and_gradients_match_a_dense_reference(setup):
  """The fused head's response-only NLL and its LoRA gradients equal a dense float32 forward of
  whole sequences with [B, T, V] logits; padding and prompt tokens are never targets."""
  host, batch = _batch(setup)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)  # B != 0: every LoRA weight has a gradient
  trainer = sft.SFTTrainer.for_run(setup.graphdef, setup.base, setup.cfg)
  m = batch.response_mask.astype(jnp.float32)
  (loss, grads), _ = jax.jit(trainer._sft_grads)(setup.base, lora, batch, m / m.sum())
  ref_fn = _dense_loss(setup.graphdef, setup.base, *batch[:4])
  grad_fn = nnx.value_and_grad(ref_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
  ref, ref_grads = grad_fn(nnx.merge(setup.graphdef, lora, setup.base))
  assert float(loss) == pytest.approx(float(ref), rel=1e-5)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
  assert scale > 0
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4 * scale)
  # Tokens outside the masks (prompt padding, response padding) change nothing.
  noisy = dict(host)
  noisy["prompt"] = np.where(host["prompt_valid"], host["prompt"], 150).astype(np.int32)
  noisy["response"] = np.where(host["response_mask"], host["response"], 99).astype(np.int32)
  other = sft.SFTBatch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in noisy.items()})
  (loss2, grads2), _ = jax.jit(trainer._sft_grads)(setup.base, lora, other, m / m.sum())
  assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
  for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7 * scale)


def test_micro_batches_give_the_one_pass_step(setup):
  """Two micro-batches: the one pass's loss, gradients and metrics (the mean is the batch's)."""
  _, batch = _batch(setup, seed=1)
  lora = jax.tree.map(lambda x: x + 0.05, setup.lora)
  m = batch.response_mask.astype(jnp.float32)
  out = {}
  for micro in (None, 2):
    cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(setup.cfg.train,
                                                                   micro_batch=micro))
    trainer = sft.SFTTrainer.for_run(setup.graphdef, setup.base, cfg)
    assert trainer.micro_steps(4) == (2 if micro else 1)
    loss, grads = jax.jit(lambda b, l, x, w: trainer._in_micro_batches(
        lambda p, mb: trainer._sft_grads(*p, *mb), (b, l), (x, w), (jnp.zeros(()), l))[0])(
            setup.base, lora, batch, m / m.sum())
    state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
    _, metrics = trainer.train_step(state, batch)
    out[micro] = (float(loss), jax.tree.map(np.asarray, grads),
                  {k: float(v) for k, v in metrics.items()})
  assert out[2][0] == pytest.approx(out[None][0], rel=1e-5)
  for k, v in out[None][2].items():
    assert out[2][2][k] == pytest.approx(v, rel=1e-4), k
  scale = max(np.abs(g).max() for g in jax.tree.leaves(out[None][1]))
  for a, b in zip(jax.tree.leaves(out[2][1]), jax.tree.leaves(out[None][1])):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)


def _examples(n, rng):
  return [([2] + [5] * int(rng.integers(3, 40)), [7] * int(rng.integers(2, 30)) + [1])
          for _ in range(n)]


def test_batches_bucket_lengths_and_resume_in_place():
  ex = _examples(96, np.random.default_rng(0))
  a = examples_lib.Batches(ex, batch_size=8, seed=3, window=6, bucket=8, pad_id=0)
  drawn = [next(a) for _ in range(15)]  # past one epoch (12 batches)
  # Each epoch holds every example once; every width a multiple of the bucket.
  seen = sorted(j for b in a.epoch(0) for j in b)
  assert seen == list(range(96))
  for b in drawn:
    assert b["prompt"].shape[1] % 8 == 0 and b["response"].shape[1] % 8 == 0
    for k in range(8):  # left-padded prompts, right-padded responses: the example's own tokens
      assert b["prompt"][k][b["prompt_valid"][k]][0] == 2
      assert b["response"][k][b["response_mask"][k]][-1] == 1
  # Sorting within windows pads less than batches of random examples do.
  unsorted = examples_lib.Batches(ex, batch_size=8, seed=3, window=1, bucket=8, pad_id=0)
  assert a.padding() < unsorted.padding() - 0.1
  # A resumed iterator draws exactly what the uninterrupted one draws.
  b = examples_lib.Batches(ex, batch_size=8, seed=3, window=6, bucket=8, pad_id=0)
  b.set_state(json.loads(json.dumps({"position": 10})))
  for want in drawn[10:]:
    got = next(b)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  with pytest.raises(DataError, match="not an SFT run's"):
    b.set_state({"sampler": 1})


def test_encode_drops_long_examples_and_ends_with_the_stop_token(setup):
  records = [{"question": "What is 2 + 2?", "response": "<answer>4</answer>"},
             {"question": "Hi", "response": "x" * 400}]
  lines = []
  out = examples_lib.encode(records, "fewshot", setup.tokenizer, 640, 64, "drop", lines.append)
  assert len(out) == 1 and out[0][1][-1] == setup.tokenizer.eos_id
  assert setup.tokenizer.decode(out[0][1][:-1]) == "<answer>4</answer>"
  assert "dropped 1 of 2" in lines[0]
  with pytest.raises(DataError, match="record 1 has"):
    examples_lib.encode(records, "fewshot", setup.tokenizer, 640, 64, "error")


def _train(tmp_path, name, *overrides, stage="sft"):
  from reasoner import loop

  cfg = tiny_config(f"train.run_dir={tmp_path}", f"train.run_name={name}", "train.steps=4",
                    "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.batch_size=4",
                    "eval.max_new_tokens=2", *overrides)
  return loop.train(cfg, stage=stage)


def _state(run, step):
  return ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "state")


def test_resume_is_exact_and_grpo_starts_from_the_sft_lora(tmp_path):
  _train(tmp_path, "sft")
  run = tmp_path / "sft"
  full = _state(run, 4)
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
  assert all(0 <= r["padding"] < 1 and r["loss"] > 0 for r in rows if "loss" in r)
  assert json.loads((run / "run.json").read_text())["stage"] == "sft"
  assert (run / "reward.png").is_file()  # the loss and the held-out evaluation
  # The process died after saving step 2: the same command continues from it, to the same bits.
  shutil.rmtree(run / "checkpoints" / "4")
  _train(tmp_path, "sft")
  again = _state(run, 4)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(again)):
    np.testing.assert_array_equal(a, b)
  rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]

  # GRPO from it: step 0 holds the SFT run's LoRA, and the optimizer starts afresh.
  with pytest.raises(ConfigError, match="is an SFT run"):
    _train(tmp_path, "sft", stage="grpo")
  with pytest.raises(ConfigError, match="'lora.rank' = 8: the run in lora.init_from"):
    _train(tmp_path, "bad", f"lora.init_from={run}", "lora.rank=8", stage="grpo")
  assert not (tmp_path / "bad" / "checkpoints").exists()
  from reasoner import loop

  cfg = tiny_config(f"train.run_dir={tmp_path}", "train.run_name=grpo", "train.steps=1",
                    f"lora.init_from={run}")
  r = loop.Run(cfg, stage="grpo")
  try:
    assert r.start == 0 and int(r.state.step) == 0
    for a, b in zip(jax.tree.leaves(r.state.lora), jax.tree.leaves(full["lora"])):
      np.testing.assert_array_equal(np.asarray(a), b)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(r.state.opt_state)
               if x.ndim > 0)
  finally:
    r.close()
  # A later session continues from its own checkpoints, whether or not the SFT run is still there
  _train(tmp_path, "grpo2", f"lora.init_from={run}", "train.steps=1", stage="grpo")
  shutil.rmtree(run)
  _train(tmp_path, "grpo2", f"lora.init_from={run}", "train.steps=2", stage="grpo")
  assert (tmp_path / "grpo2" / "checkpoints" / "2").is_dir()


def test_a_file_without_responses_fails_before_the_model_loads(tmp_path):
  import subprocess
  import sys

  path = tmp_path / "qa.jsonl"
  path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                          for i in range(6)))
  out = subprocess.run([sys.executable, "-m", "reasoner", "sft", "--config",
                        str(ROOT / "configs/tiny.yaml"), "data.source=jsonl",
                        f"data.path={path}", f"train.run_dir={tmp_path}"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()  # the data's summary line, then the error's one
  assert lines[0].startswith(f"data: jsonl {path}: 6 read") and len(lines) == 2
  assert lines[1] == ("error: sft: 3 of 3 records of the training data have no response "
                      "(data.response_field = 'response'; record 0 is the first)")
