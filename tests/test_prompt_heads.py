"""Shared prompt heads (`models.prompt.Heads`): each head once through the model, the rows' rests
against it, gives the hidden states and the LoRA gradients of every row's whole prompt
left-padded through the model (`completion_hidden` without heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from reasoner.build import build
from reasoner.data import examples as examples_lib
from reasoner.models.prompt import Heads, completion_hidden

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
  return build(tiny_config("train.batch_size=2"))


def _case(seed: int = 0, g: int = 2):
  """Two heads of 5 and 3 tokens and the empty one; 4 prompts (one without a head) of ragged
  rests; G completions each. Returns the heads' layout and the whole prompts left-padded."""
  rng = np.random.default_rng(seed)
  lengths, h, r, n = [5, 3, 0], 6, 4, 5
  tokens = rng.integers(3, 200, (3, h)).astype(np.int32)
  valid = np.arange(h)[None] < np.asarray(lengths)[:, None]
  of = np.asarray([0, 1, 2, 0], np.int32)
  rest_len = [2, 4, 3, 1]
  rest = rng.integers(3, 200, (4, r)).astype(np.int32)
  rest_valid = np.arange(r)[None] >= r - np.asarray(rest_len)[:, None]  # left-padded
  whole = [[*tokens[k][:lengths[k]], *rest[b][r - rest_len[b]:]] for b, k in enumerate(of)]
  width = max(map(len, whole))
  prompt = np.zeros((4, width), np.int32)
  prompt_valid = np.zeros((4, width), bool)
  for b, w in enumerate(whole):
    prompt[b, width - len(w):], prompt_valid[b, width - len(w):] = w, True
  completion = rng.integers(3, 200, (4 * g, n)).astype(np.int32)
  mask = np.arange(n)[None] < rng.integers(1, n + 1, (4 * g, 1))
  heads = Heads(jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(of))
  return heads, (jnp.asarray(rest), jnp.asarray(rest_valid)), (
      jnp.asarray(prompt), jnp.asarray(prompt_valid)), jnp.asarray(completion), jnp.asarray(mask)


@pytest.mark.parametrize("g", [1, 2])
def test_heads_give_the_whole_prompts_values_and_gradients(setup, g):
  heads, rests, wholes, completion, mask = _case(g=g)
  leaves, tree = jax.tree.flatten(setup.lora)  # LoRA away from zero: both factors matter
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  lora = tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                         for x, k in zip(leaves, keys)])

  def loss_and_grads(lora, base, prompt, prompt_valid, heads):
    def loss_fn(model):
      h = completion_hidden(model, prompt, prompt_valid, completion, mask, None, heads)
      kept = jnp.where(mask[..., None], h, 0.0)
      return jnp.sum(kept * jax.random.normal(jax.random.PRNGKey(1), h.shape)), kept
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
    (loss, kept), grads = grad_fn(nnx.merge(setup.graphdef, lora, base))
    return loss, kept, nnx.state(grads)

  shared = jax.jit(lambda lo, ba, h: loss_and_grads(lo, ba, *rests, h))(lora, setup.base, heads)
  whole = jax.jit(lambda lo, ba: loss_and_grads(lo, ba, *wholes, None))(lora, setup.base)
  np.testing.assert_allclose(np.asarray(shared[1]), np.asarray(whole[1]), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(float(shared[0]), float(whole[0]), rtol=1e-4)
  leaves = jax.tree.leaves(whole[2])
  assert leaves and any(float(jnp.max(jnp.abs(x))) > 0 for x in leaves)
  for a, b in zip(jax.tree.leaves(shared[2]), leaves):
    scale = float(jnp.max(jnp.abs(b)))  # float32 sums in another order: relative to the leaf
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale)


def test_a_wrong_head_changes_the_values(setup):
  """The check above can fail: rows pointed at another head get other hidden states (prompt
  3, rows 6 and 7 of G = 2, keeps its head and its values)."""
  heads, rests, wholes, completion, mask = _case()
  f = jax.jit(lambda lo, ba, p, v, h: completion_hidden(
      nnx.merge(setup.graphdef, lo, ba), p, v, completion, mask, None, h))
  right = f(setup.lora, setup.base, *rests, heads)
  wrong = f(setup.lora, setup.base, *rests,
            heads._replace(of=jnp.asarray([1, 0, 2, 0], jnp.int32)))
  assert not np.allclose(np.asarray(right[0]), np.asarray(wrong[0]), atol=1e-4)
  np.testing.assert_allclose(np.asarray(right[6:]), np.asarray(wrong[6:]), rtol=1e-5, atol=1e-5)


def _examples(rng, n=8, head=40, question=(3, 21), response=(2, 10), groups="abacbabc"):
  """Examples of two categories, each with its own `head`-token header, and one of a third
  whose prompts share nothing; questions and responses of lengths in those ranges."""
  header = {c: list(rng.integers(3, 200, head)) for c in ("a", "b")}
  groups = list(groups[:n])
  examples = []
  for g in groups:
    ids = (*header.get(g, []), *rng.integers(3, 200, rng.integers(*question)))
    examples.append(([int(t) for t in ids],
                     [int(t) for t in rng.integers(3, 200, rng.integers(*response))]))
  return examples, groups


def test_heads_found_by_category():
  """A category's head is its prompts' common prefix less each prompt's last token; one too
  short (under `least`) or alone is no head, and its prompts take the empty head."""
  rng = np.random.default_rng(0)
  examples, groups = _examples(rng)
  heads = examples_lib.Heads.of_examples(examples, groups, 0, 16)
  lengths = sorted(len(h) for h in heads.heads)
  assert lengths[0] == 0 and all(n >= 40 for n in lengths[1:]) and len(lengths) == 3
  for ex, g, k in zip(examples, groups, heads.of):
    head = heads.heads[k]
    assert ex[0][:len(head)] == head and len(head) < len(ex[0])
    assert (len(head) == 0) == (g == "c")
  assert examples_lib.Heads.of_examples(examples, groups, 0, 16, least=64).heads == [[]]
  batch = heads.pad(examples[:4], [0, 1, 2, 3])
  assert batch["head_tokens"].shape == (3, 48) and batch["head_of"].tolist() == list(
      heads.of[:4])
  for b, (ex, k) in enumerate(zip(examples[:4], heads.of[:4])):
    rest = batch["prompt"][b][batch["prompt_valid"][b]].tolist()
    head = batch["head_tokens"][k][batch["head_valid"][k]].tolist()
    assert head + rest == ex[0]
  assert "2 shared prompt heads" in heads.describe(examples)


@pytest.mark.parametrize("micro", [None, 2])
@pytest.mark.parametrize("short", [True, False])
def test_sft_step_with_shared_heads_is_the_whole_prompts_step(setup, micro, short):
  """sft.shared_heads: the SFT loss and LoRA gradients of batches split into heads and rests
  (`data.examples.Heads`), in one pass and over micro-batches, equal the whole prompts'; short
  rows run their heads once (heads, rests and responses within the tiny model's window of
  16; both categories with a head), long ones (a prompt without a head among them) are joined
  back into whole prompts."""
  import dataclasses

  from reasoner import mesh as mesh_lib
  from reasoner.objectives import sft

  rng = np.random.default_rng(3)
  examples, groups = (_examples(rng, 4, 5, (1, 4), (2, 5), "abab") if short
                      else _examples(rng, 4))
  bucket = 4 if short else 16
  heads = examples_lib.Heads.of_examples(examples, groups, 0, bucket, least=4 if short else 32)
  assert heads.heads[0]
  # LoRA a little away from zero: at +0.05 on every weight, 60-token rows' gradients already
  # differed by 1% between Tunix's attention and ours, and between one row and a batch
  lora = jax.tree.map(lambda x: x + 0.01, setup.lora)
  cfg = dataclasses.replace(setup.cfg, train=dataclasses.replace(setup.cfg.train,
                                                                 micro_batch=micro))
  trainer = sft.SFTTrainer.for_run(setup.graphdef, setup.base, cfg)
  out = []
  for host in (examples_lib.pad(examples, 0, bucket), heads.pad(examples, range(4))):
    table = {k: host.pop(k) for k in ("head_tokens", "head_valid") if k in host}
    batch = sft.SFTBatch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()},
                         **mesh_lib.replicate_unplaced(table, setup.mesh))
    if table and short:  # the path that runs each head once
      assert batch.head_tokens.shape[1] + batch.prompt.shape[1] + batch.response.shape[1] <= 16
    state = trainer.init_state(jax.tree.map(jnp.copy, lora), jax.random.PRNGKey(0))
    _, metrics = trainer.train_step(state, batch)
    t = (batch.head_tokens, batch.head_valid) if table else None
    m = batch.response_mask.astype(jnp.float32)
    rows = batch._replace(head_tokens=None, head_valid=None)
    _, grads = jax.jit(lambda b, l, x, w: trainer._in_micro_batches(
        lambda p, mb: trainer._sft_grads(*p, *mb, t), (b, l), (x, w), (jnp.zeros(()), l))[0])(
            setup.base, lora, rows, m / m.sum())
    out.append(({k: float(v) for k, v in metrics.items()}, jax.tree.map(np.asarray, grads)))
  for k in ("loss", "grad_norm", "perplexity"):
    assert out[1][0][k] == pytest.approx(out[0][0][k], rel=1e-4), k
  scale = max(np.abs(g).max() for g in jax.tree.leaves(out[0][1]))
  assert scale > 0
  for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[0][1])):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)
