"""The sampler against the full forward pass, on the tiny model (1 and 8 devices)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import hidden_states, tiny_config
from reasoner import mesh as mesh_lib
from reasoner.engine import heads
from reasoner.build import build
from reasoner.models import decode, gemma
from reasoner.config import MeshConfig
from reasoner.models.cache import causal_mask, init_cache, positions_from_mask
from reasoner.engine import sampler as sampler_lib
from reasoner.engine.sampler import Sampler, SamplingConfig, next_token, sample_token
from reasoner.objectives.grpo import GRPOTrainer as Trainer

# models built or whole runs started: `make test`, not `make check`
pytestmark = pytest.mark.slow


def _nonzero_lora(*overrides):
  """The tiny model with LoRA B != 0, so that every comparison exercises the LoRA path."""
  s = build(tiny_config("lora.rank=4", *overrides))
  s.lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                        s.lora)
  return s


@pytest.fixture(scope="module")
def setup():
  return _nonzero_lora()


def full_forward_greedy(setup, ids, n):
  model = setup.model()
  ids = list(ids)
  for _ in range(n):
    ids.append(int(_greedy_next(model, jnp.asarray([ids]))))
  return ids[-n:]


@nnx.jit  # jitted: eager ops over 8 fake devices aborted XLA:CPU on a loaded machine
def _greedy_next(model, x):
  v = jnp.ones_like(x, bool)
  h, _ = model.hidden_states(x, positions_from_mask(v), None, causal_mask(v))
  return jnp.argmax(heads.logits(h[0, -1], model.embedding()))


def test_greedy_equals_stepwise_argmax_of_full_forward(setup):
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 64)
  cfg = SamplingConfig(max_new_tokens=6, temperature=0.0, vocab_chunk=100)  # 4 blocks
  prompts = ["Question: 1 + 2?", "Q: 7?"]  # different lengths: left padding is exercised
  comps, _, _ = sampler.sample((setup.lora, setup.base), prompts, jax.random.PRNGKey(0), cfg)
  for row, p in enumerate(prompts):
    ids = setup.tokenizer.encode(p, add_bos=True)
    assert comps.tokens[row].tolist() == full_forward_greedy(setup, ids, 6)
  assert comps.mask.all()


def test_gemma2_greedy_decode_on_the_repeated_cache(setup):
  """Gemma 2 keeps Tunix's decode on the prompt's cache repeated to its G rows: a tiny random
  Gemma 2, greedy, each of the G rows equals the full forward's stepwise argmax. Its window
  (128) spans the padded prompt, as gemma2-2b's 4,096 does: Tunix's Gemma 2 prefill differs
  from the unpadded forward once the left padding is longer than the window."""
  import dataclasses

  from reasoner.models import gemma

  _, gemma_lib, _, gemma2_cls = gemma.classes()
  tcfg = dataclasses.replace(
      gemma_lib.ModelConfig.gemma2_2b(), num_layers=2,
      num_embed=setup.model().embedding().shape[0], embed_dim=64, hidden_dim=128, num_heads=2,
      head_dim=32, num_kv_heads=1, sliding_window_size=128,
      attention_types=gemma_lib.ModelConfig.gemma2_2b().attention_types[:2])
  spec = gemma.ModelSpec(family="gemma2", tunix_config=tcfg, cls=gemma2_cls, dtype=jnp.float32)
  model = gemma.init_random(spec, setup.mesh, 0)
  assert not decode.shares_prompt(model)
  graphdef, state = nnx.split(model)
  sampler = Sampler(graphdef, (state,), setup.tokenizer, setup.mesh, 64)
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
  prompts = ["Question: 1 + 2?", "Q: 7?"]
  comps, _, _ = sampler.sample((state,), prompts, jax.random.PRNGKey(0), cfg, num_generations=2)
  for row in range(4):
    ids = list(setup.tokenizer.encode(prompts[row // 2], add_bos=True))
    for _ in range(5):
      x = jnp.asarray([ids])
      v = jnp.ones_like(x, bool)
      h, _ = hidden_states(model, x, positions_from_mask(v), None, causal_mask(v))
      ids.append(int(jnp.argmax(heads.logits(h[0, -1], model.embedding(),
                                             model.logit_softcap))))
    assert comps.tokens[row].tolist() == ids[-5:]


def test_shared_prompt_decode_equals_tunix_on_the_repeated_cache(setup):
  """`models.decode` (through `hidden_states(..., step=)`, where qwix applies LoRA) against
  Tunix's decode on the prompt's cache repeated to the G rows: 20 steps after a left-padded
  prefill longer than the tiny model's 16-slot sliding window, so the window and the padding
  both mask keys; the tiny model's layers are sliding-window ones, so their new tokens go to a
  ring of 16 slots, which wraps after step 15 (the reads cross its spans first)."""
  model = setup.model()
  assert decode.shares_prompt(model) and model.layers[0].attn.sliding_window_size == 16
  b, g, p, n, steps = 8, 2, 24, 24, 20
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, 200, (b, p)), jnp.int32)
  valid = jnp.asarray(np.arange(p)[None] >= rng.integers(0, 6, (b, 1)))
  rep = lambda x: jnp.repeat(x, g, axis=0)
  _, cache = hidden_states(model, prompt, positions_from_mask(valid),
                                 init_cache(model.config, b, p + n, jnp.float32),
                                 causal_mask(valid, p + n))
  cache = jax.tree.map(rep, cache)
  _, prefill = hidden_states(model, prompt, positions_from_mask(valid),
                                   init_cache(model.config, b, p, jnp.float32), causal_mask(valid))
  slots = mesh_lib.slot_major_sharding(model.config.num_kv_heads, setup.mesh)
  prompts = mesh_lib.prompt_cache_sharding(model.config.num_kv_heads, setup.mesh)
  ours = decode.Cache(decode.from_prefill(prefill, prompts),
                      decode.empty(model.config, b * g, n, jnp.float32, slots))
  assert {k[0].shape[0] for k in ours.new.values()} == {16}  # rings of the window, not 24
  assert decode.spans(16) == (4, 8, 12, 16)
  kv_mask = rep(jnp.pad(valid, ((0, 0), (0, n))))
  for step in range(steps):
    tok = jnp.asarray(rng.integers(3, 200, (b * g, 1)), jnp.int32)
    pos = rep(jnp.sum(valid, -1, keepdims=True)).astype(jnp.int32) + step
    kv_mask = kv_mask.at[:, p + step].set(True)
    h_ref, cache = hidden_states(model, tok, pos, cache, kv_mask[:, None])
    h, ours = hidden_states(model, tok, pos, ours, valid, step=jnp.int32(step))
    # float32 attention summed span by span, not in one pass: ~1e-5 apart on values ~1 (the
    # pinned XLA:CPU measures 1.1e-5); a key masked wrongly moves h by ~1e-1
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=5e-5, err_msg=f"step {step}")
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5)
  newest = [steps - 1 - (steps - 1 - j) % 16 for j in range(16)]  # the token in ring slot j
  for name, c in cache.items():
    for prompt_part, new_part, full, order in zip(ours.prompt[name], ours.new[name],
                                                  (c["k"], c["v"]), ((0, 3, 1, 2), (0, 2, 1, 3))):
      real = np.asarray(valid)  # (a padding slot's keys depend on the cache's length)
      close(np.transpose(prompt_part, order)[real], full[::g, :p][real])  # once, not G times
      close(np.swapaxes(new_part, 0, 1), full[:, [p + t for t in newest]])


def test_a_sliding_window_layer_refuses_a_cache_longer_than_its_window(setup):
  """The ring's reads assume every slot is in the window: a whole-sequence cache on a local
  layer would see keys out of it, so it is refused, naming the slots and the window."""
  model = setup.model()
  b, p, n = 8, 8, 24  # b: a row for each of the 8 devices
  valid = jnp.ones((b, p), bool)
  _, prefill = hidden_states(model, jnp.ones((b, p), jnp.int32), positions_from_mask(valid),
                             init_cache(model.config, b, p, jnp.float32), causal_mask(valid))
  prompts = mesh_lib.prompt_cache_sharding(model.config.num_kv_heads, setup.mesh)
  whole = {k: (jnp.zeros((n, b, 1, model.config.head_dim)),) * 2 for k in prefill}
  with pytest.raises(ValueError, match="24 slots, more than its window 16"):
    hidden_states(model, jnp.ones((b, 1), jnp.int32), jnp.full((b, 1), p, jnp.int32),
                  decode.Cache(decode.from_prefill(prefill, prompts), whole), valid,
                  step=jnp.int32(0))


@pytest.fixture(scope="module")
def six_layers():
  """The tiny model with six layers: five sliding-window ones (16 slots) and a global one."""
  return _nonzero_lora("model.tiny_layers=6")


@nnx.jit
def _full_logprobs(model, tokens, valid):
  """log softmax of the full forward's logits (no cache: Tunix's band mask in the local
  layers) at every position of left-padded [B, T] sequences."""
  h, _ = model.hidden_states(tokens, positions_from_mask(valid), None, causal_mask(valid))
  return jax.nn.log_softmax(heads.logits(h, model.embedding()), axis=-1)


# the layouts beyond one device's and 8 devices' training and tp8 layouts repeat them: make soak
@pytest.mark.parametrize("devices,layout", [
    (1, "train"), (8, "train"), (8, "tp8"),
    *(pytest.param(8, x, marks=pytest.mark.extended) for x in ("replicated", "tp2", "tp4"))])
def test_the_ring_cache_decodes_what_the_full_forward_gives(six_layers, devices, layout):
  """40 new tokens, two and a half windows: greedy tokens are the full forward's argmax at each
  position, and greedy and sampled (top-k 32) log-probs are the full forward's, in the layout
  and on `devices`; the five local layers decode on rings of 16 slots, the global one on 40."""
  from reasoner.models.cache import new_slots

  s = six_layers
  assert new_slots(s.spec.tunix_config, 40) == (16,) * 5 + (40,)
  mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:devices])
  states = (s.lora, s.base) if devices == 8 else jax.device_put(
      (s.lora, s.base), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  sampler = Sampler(s.graphdef, states, s.tokenizer, mesh, 64, layout=layout)
  prompts, g = ["Q: 1 + 2?", "Question: 22?"], 4
  model = s.model()
  for cfg in (SamplingConfig(max_new_tokens=40, temperature=0.0),
              SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=32)):
    comps, tok, mask = sampler.sample(states, prompts, jax.random.PRNGKey(3), cfg, g)
    assert comps.mask.all()  # no stop ids: every row decodes all 40
    seq = np.concatenate([np.repeat(tok, g, 0), comps.tokens], axis=1)
    valid = np.concatenate([np.repeat(mask, g, 0), comps.mask], axis=1)
    lp = np.asarray(_full_logprobs(model, jnp.asarray(seq), jnp.asarray(valid)))
    at = lp[:, tok.shape[1] - 1:-1]  # the logits that chose each new token
    chosen = np.take_along_axis(at, comps.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(comps.logprobs, chosen, atol=2e-4, err_msg=f"{cfg}")
    if cfg.temperature == 0:
      np.testing.assert_array_equal(comps.tokens, at.argmax(-1))
    else:
      assert len({tuple(r) for r in comps.tokens[:g]}) > 1  # the draws differ


def test_batch_of_one_is_not_truncated(setup):
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 64)
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
  comps, _, _ = sampler.sample((setup.lora, setup.base), ["Q: 7?"], jax.random.PRNGKey(0), cfg)
  assert comps.tokens.shape == (1, 5) and comps.mask.sum() == 5


@pytest.mark.parametrize("temperature,logprobs,top_k", [
    (1.0, "sampling", 20), (0.7, "sampling", 20), (0.7, "sampling", None), (0.7, "policy", 20)])
def test_sampled_logprobs_equal_trainer_logprobs(setup, temperature, logprobs, top_k):
  """The first pass's ratio pi_trainer / pi_sampler is 1 within float rounding: both take the
  log-probs of softmax(z / T) (`grpo.logprobs: sampling`) or both of the policy at T = 1
  (`policy`). The other choice's log-probs are far from the sampler's."""
  other = {"sampling": "policy", "policy": "sampling"}[logprobs]
  run = lambda lp: dataclasses.replace(
      setup.cfg, rollout=dataclasses.replace(setup.cfg.rollout, temperature=temperature,
                                             top_k=top_k),
      grpo=dataclasses.replace(setup.cfg.grpo, logprobs=lp))
  cfg = dataclasses.replace(SamplingConfig.for_run(run(logprobs), setup.tokenizer, greedy=False),
                            max_new_tokens=7, vocab_chunk=100, stop_ids=(), stop_sequences=())
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 64)
  comps, tok, mask = sampler.sample((setup.lora, setup.base), ["Q: 3 + 4?", "Q: 9?"],
                                    jax.random.PRNGKey(3), cfg, num_generations=4)
  assert comps.tokens.shape == (8, 7) and comps.stopped.sum() == 0  # cut at 7 tokens
  lp = lambda lp: np.asarray(Trainer.for_run(setup.graphdef, setup.base, run(lp)).logprobs(
      setup.lora, tok, mask, comps.tokens, comps.mask))[comps.mask]
  np.testing.assert_allclose(lp(logprobs), comps.logprobs[comps.mask], atol=2e-4)
  if temperature != 1.0:  # the tiny model's logits are near uniform: T moves them little
    assert np.abs(lp(other) - comps.logprobs[comps.mask]).mean() > 50 * 2e-4
  # rows of one group differ (sampling), and the group shares the prompt
  assert len({tuple(r) for r in comps.tokens[:4]}) > 1


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("cfg", [
    SamplingConfig(max_new_tokens=1, temperature=0.0),
    SamplingConfig(max_new_tokens=1, temperature=0.7, top_k=5),
    SamplingConfig(max_new_tokens=1, temperature=1.3, top_k=40, top_p=0.8),
    SamplingConfig(max_new_tokens=1, temperature=1.0, top_p=0.9),  # forms the logits
], ids=["greedy", "top_k", "top_k_top_p", "top_p_only"])
@pytest.mark.parametrize("vocab, vocab_chunk", [(12288, None), (1000, 128)])
def test_next_token_equals_dense(cfg, softcap, vocab, vocab_chunk):
  """One block (two-stage top-k over 192 groups) and vocabulary blocks (8, the last padded)."""
  h = jax.random.normal(jax.random.key(0), (6, 16))
  emb = jax.random.normal(jax.random.key(1), (vocab, 16))
  z = heads.logits(h, emb, softcap)
  t = cfg.temperature or 1.0  # log-probs of softmax(z / T); greedy: of the policy
  for seed in range(4):
    key = jax.random.PRNGKey(seed)
    want = sample_token(z, key, cfg)
    for policy, temperature in ((False, t), (True, 1.0)):
      cfg_v = dataclasses.replace(cfg, vocab_chunk=vocab_chunk,
                                  logprob_temperature=1.0 if policy else None)
      tok, logp = next_token(h, emb, key, cfg_v, softcap)
      np.testing.assert_array_equal(tok, want)
      np.testing.assert_allclose(
          logp, jax.nn.log_softmax(z / temperature)[jnp.arange(6), want], atol=1e-5)
    if cfg.temperature == 0 or cfg.top_k is not None:  # the heads that can skip the normaliser
      tok, logp = next_token(h, emb, key, dataclasses.replace(
          cfg, vocab_chunk=vocab_chunk, logprobs=False), softcap)
      np.testing.assert_array_equal(tok, want)
      np.testing.assert_array_equal(logp, np.zeros(6, np.float32))


def test_stop_token_and_stop_sequence_end_rows_early(setup):
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 64)
  free = SamplingConfig(max_new_tokens=6, temperature=0.0)
  comps, _, _ = sampler.sample((setup.lora, setup.base), ["Q: 5?"], jax.random.PRNGKey(0), free)
  toks = comps.tokens[0].tolist()
  by_id = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_ids=(toks[1],))
  c1, _, _ = sampler.sample((setup.lora, setup.base), ["Q: 5?"], jax.random.PRNGKey(0), by_id)
  first = toks.index(toks[1])
  assert c1.mask[0].tolist() == [True] * (first + 1) + [False] * (5 - first)
  by_seq = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_sequences=(tuple(toks[2:4]),))
  c2, _, _ = sampler.sample((setup.lora, setup.base), ["Q: 5?"], jax.random.PRNGKey(0), by_seq)
  assert c2.mask[0].sum() <= 4 and c2.tokens[0, :4].tolist()[:c2.mask[0].sum()] == \
      toks[:c2.mask[0].sum()]
  # a position may allow several ids ('.</' as well as '</'): one of them there is enough
  other = next(i for i in range(3, 200) if i not in toks)
  for first, stops in (((other, toks[2]), True), ((other,), False)):
    by_way = SamplingConfig(max_new_tokens=6, temperature=0.0,
                            stop_sequences=((first, toks[3]),))
    c3, _, _ = sampler.sample((setup.lora, setup.base), ["Q: 5?"], jax.random.PRNGKey(0), by_way)
    assert (c3.mask[0].sum() < 6) == stops and (c3.mask[0].sum() == c2.mask[0].sum()) == stops


def test_a_stop_hit_equals_its_dense_reading():
  """`_stop_hit` on random tails against reading each row's tail in Python."""
  seqs = (((5, 6), 7, (8, 9, 10)), (11,), (3, 4))
  cfg = SamplingConfig(max_new_tokens=4, stop_ids=(2,), stop_sequences=seqs)
  stops = sampler_lib._stops(cfg)
  tails = np.random.default_rng(0).integers(-1, 13, (4000, stops[1].shape[1])).astype(np.int32)
  tails[:50, -3:] = [6, 7, 9]  # a few sure hits
  got = np.asarray(sampler_lib._stop_hit(jnp.asarray(tails[:, -1]), jnp.asarray(tails), *stops))

  def ends(tail, seq):
    return all(t in ((p,) if isinstance(p, int) else p)
               for t, p in zip(tail[len(tail) - len(seq):], seq))

  want = [t[-1] == 2 or any(ends(list(t), q) for q in seqs) for t in tails]
  assert got.tolist() == want and 50 < sum(want) < 4000


def test_one_device_and_eight_devices_agree(setup):
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
  outs = []
  for devices in (jax.devices()[:1], jax.devices()):
    mesh = mesh_lib.make_mesh(MeshConfig(), devices)
    states = jax.device_put((setup.lora, setup.base),
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, mesh, 64)
    c, _, _ = sampler.sample(states, ["Q: 1?", "Q: 22?", "Q: 3?"], jax.random.PRNGKey(0), cfg)
    outs.append(c.tokens)
  np.testing.assert_array_equal(outs[0], outs[1])


def test_fewer_prompts_than_chips_sample_copies_not_padding(setup):
  """2 prompts x G = 4 on 8 devices: 8 prompt copies of one row each (no padded prompts whose
  rows are thrown away); greedy rows equal the full forward's, grouped by prompt."""
  from reasoner.models.prompt import prompt_layout

  assert setup.mesh.shape["fsdp"] == 8
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 64)
  cfg = SamplingConfig(max_new_tokens=4, temperature=0.0)
  prompts = ["Question: 1 + 2?", "Q: 7?"]
  comps, toks, _ = sampler.sample((setup.lora, setup.base), prompts, jax.random.PRNGKey(0), cfg,
                                  num_generations=4)
  assert [s[0] for s in sampler.compiled_shapes] == [8]  # prompts run: 8 copies, 1 row each
  assert [s[3] for s in sampler.compiled_shapes] == [1]
  assert prompt_layout(setup.mesh, 2, 4) == (4, 0)  # as the planner compiles and sizes it
  assert prompt_layout(setup.mesh, 3, 4) == (1, 5)  # no copies: 3 + 5 padding prompts x 4 rows
  assert comps.tokens.shape == (8, 4) and toks.shape[0] == 2
  for row in range(8):
    ids = setup.tokenizer.encode(prompts[row // 4], add_bos=True)
    assert comps.tokens[row].tolist() == full_forward_greedy(setup, ids, 4)


HEADER = "Answer each question with one number. Example: two plus two is 4. Now the question: "


@pytest.fixture(scope="module")
def wide_window(setup):
  """(graphdef, state) of the tiny model with a 256-token sliding window (the tiny's 16 is
  narrower than these prompts, where the head is not shared: `shared_head`)."""
  spec = dataclasses.replace(setup.spec, tunix_config=dataclasses.replace(
      setup.spec.tunix_config, sliding_window_size=256))
  return nnx.split(gemma.new_model(spec, 3))


@pytest.mark.parametrize("devices", [1, 8])
def test_a_shared_head_runs_once_and_samples_what_the_full_prefill_does(setup, wide_window,
                                                                       devices):
  """Prompts that start with the same 85 tokens (a few-shot header): the head goes through the
  model once and each row only its last 64 slots, and the greedy tokens are the full forward's
  argmax, the log-probs (greedy and top-k) the full prefill's, on 1 and 8 devices."""
  from reasoner.models.prompt import shared_head

  prompts = [HEADER + q for q in ("1 + 2?", "What is 7 times 6, please?", "9?")]
  ids = [setup.tokenizer.encode(p, add_bos=True) for p in prompts]
  assert shared_head(ids, 128, 256) == (64, 64)  # 85 common bytes, rows of 87 to 111
  graphdef, state = wide_window
  mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:devices])
  states = jax.device_put((state,), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  shared = Sampler(graphdef, states, setup.tokenizer, mesh, 128)
  full = Sampler(graphdef, states, setup.tokenizer, mesh, 128)
  full.window = 0  # the plain prefill: every row's every slot
  for cfg, g in ((SamplingConfig(max_new_tokens=5, temperature=0.0), 1),
                 (SamplingConfig(max_new_tokens=5, temperature=1.0, top_k=16), 2)):
    a, toks, _ = shared.sample(states, prompts, jax.random.PRNGKey(2), cfg, g)
    b, toks_b, _ = full.sample(states, prompts, jax.random.PRNGKey(2), cfg, g)
    np.testing.assert_array_equal(toks, toks_b)  # the same prompt layout goes to training
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    if g == 1:  # greedy: each row the full forward's argmax at every step
      model = nnx.merge(graphdef, state)
      for row, i in enumerate(ids):
        seq = list(i)
        for _ in range(5):
          seq.append(int(_greedy_next(model, jnp.asarray([seq]))))
        assert a.tokens[row].tolist() == seq[-5:]
  assert {s[4] for s in shared.compiled_shapes} == {(64, 64)}
  assert {s[4] for s in full.compiled_shapes} == {(0, 0)}


def test_shared_head_is_chosen_only_where_it_saves_and_is_exact():
  from reasoner.models.prompt import shared_head

  head = list(range(1, 80))
  rows = [head + [100, 101], head + [102] * 30]  # 79 common tokens, rows of 81 and 109
  assert shared_head(rows, 128, None) == (64, 64)  # 64 once; 109 - 64 = 45 -> 64 slots
  assert shared_head(rows, 128, 512) == (64, 64)
  assert shared_head(rows, 128, 64) == (0, 0)  # a window narrower than the prompt
  assert shared_head(rows[:1], 128, None) == (0, 0)  # one prompt shares nothing
  assert shared_head([[1, 2] * 40, [2, 1] * 40], 128, None) == (0, 0)  # nothing in common
  assert shared_head([head, head + [5] * 40], 128, None) == (64, 64)  # a row keeps its last
  assert shared_head([head[:40], head[:40] + [7]], 64, None) == (32, 32)
  assert shared_head([head[:20] + [1], head[:20] + [2]], 64, None) == (0, 0)  # under 32 shared


def test_prompt_buckets_bound_the_compiles(setup):
  from reasoner.engine.sampler import bucket, default_buckets

  assert default_buckets(640) == (64, 128, 256, 512, 640)
  assert default_buckets(64) == (64,)
  assert bucket(65, (64, 128)) == 128 and bucket(64, (64, 128)) == 64
  with pytest.raises(ValueError, match="longer than the largest bucket 128"):
    bucket(129, (64, 128))
  sampler = Sampler(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh, 640)
  cfg = SamplingConfig(max_new_tokens=2, temperature=0.0)
  for prompt in ["Q: 1?", "Question: 12 + 30?", "x" * 100]:  # widths 64, 64, 128
    sampler.sample((setup.lora, setup.base), [prompt], jax.random.PRNGKey(0), cfg)
  assert sorted(s[1] for s in sampler.compiled_shapes) == [64, 128]


@pytest.mark.parametrize("kv_heads,mesh_shape", [(1, (4, 2)), (2, (4, 2)), (1, (8, 1))])
def test_kv_cache_estimate_matches_the_compiled_per_chip_bytes(kv_heads, mesh_shape):
  """Both cache layouts of the sampler, compiled for 8 devices: the per-device bytes XLA plans
  equal `kv_cache_bytes`, and each live shard holds exactly its block; in Gemma 3's, the five
  sliding-window layers (an 8-slot window) hold rings of 8 new slots, the global one all 16."""
  import types

  from reasoner.models.cache import init_cache, kv_cache_bytes, kv_cache_split, shard_cache

  spec = types.SimpleNamespace(num_layers=6, num_kv_heads=kv_heads, head_dim=16,
                               sliding_window_size=8)
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=mesh_shape[0], tp=mesh_shape[1]))
  prompts, g, p, n = 8, 2, 24, 16
  rows, size = prompts * g, p + n
  make = jax.jit(lambda: shard_cache(init_cache(spec, rows, size, jnp.bfloat16), spec, mesh))
  compiled = make.lower().compile()
  expected = kv_cache_bytes(spec, prompts, g, p, n, jnp.bfloat16, mesh, shared=False)
  cache = make()
  # XLA's output figure also counts the output tuple's table of 8-byte buffer pointers.
  tuple_table = 8 * len(jax.tree.leaves(cache))
  assert compiled.memory_analysis().output_size_in_bytes == expected + tuple_table
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache))
  assert per_device == expected
  k = cache["layer_0"]["k"].addressable_shards[0].data
  assert k.shape == (rows // mesh_shape[0], size, kv_heads // (2 if kv_heads == 2 else 1), 16)
  # Gemma 3's decode layout (`models.decode.Cache`): each prompt's slots once, rows' new slots;
  # one KV head on tp 2: the new slots' rows over every chip (attention over rows)
  over_rows = mesh_lib.attention_over_rows(kv_heads, mesh)
  axes = mesh_lib.decode_rows(mesh, rows, g, over_rows)
  assert axes == (("fsdp", "tp") if kv_heads == 1 and mesh_shape[1] == 2 else ("fsdp",))
  slots = lambda axes: mesh_lib.slot_major_sharding(spec.num_kv_heads, mesh, axes)
  make = jax.jit(lambda: decode.Cache(
      decode.from_prefill(shard_cache(init_cache(spec, prompts, p, jnp.bfloat16), spec, mesh),
                          mesh_lib.prompt_cache_sharding(spec.num_kv_heads, mesh)),
      decode.empty(spec, rows, n, jnp.bfloat16, slots(axes))))
  compiled, shared = make.lower().compile(), make()
  expected = kv_cache_bytes(spec, prompts, g, p, n, jnp.bfloat16, mesh, True, over_rows)
  assert compiled.memory_analysis().output_size_in_bytes == expected + 8 * 4 * spec.num_layers
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(shared))
  assert per_device == expected < kv_cache_bytes(spec, prompts, g, p, n, jnp.bfloat16, mesh,
                                                 shared=False)
  split = kv_cache_split(spec, prompts, g, p, n, jnp.bfloat16, mesh, True, over_rows)
  in_layers = lambda i: sum(x.addressable_shards[0].data.nbytes
                            for c in (shared.prompt, shared.new) for x in c[f"layer_{i}"])
  assert split == (in_layers(5), sum(in_layers(i) for i in range(5)))  # (global, local)
  heads, rows_here = k.shape[2:], k.shape[0] // (mesh_shape[1] if "tp" in axes else 1)
  assert shared.prompt["layer_0"][0].addressable_shards[0].data.shape == (
      prompts // mesh_shape[0], heads[0], heads[1], p)  # keys [.., H, P]
  assert shared.prompt["layer_0"][1].addressable_shards[0].data.shape == (
      prompts // mesh_shape[0], heads[0], p, heads[1])
  assert shared.new["layer_0"][0].addressable_shards[0].data.shape == (8, rows_here) + heads
  assert shared.new["layer_5"][0].addressable_shards[0].data.shape == (n, rows_here) + heads


def test_sampler_runs_with_block_and_decoder_remat():
  """Both shipped TPU presets train with block remat: the sampler (`Sampler.for_run`) decodes
  them with Tunix's remat off (its `nnx.remat` fails inside the decode loop), token for token
  and log-prob for log-prob as the no-remat model."""
  cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
  out = {}
  for remat in ("none", "block", "decoder"):
    s = _nonzero_lora(f"model.remat={remat}")
    comps, logp, _ = Sampler.for_run(s).sample((s.lora, s.base), ["Question: 1 + 2?", "Q: 7?"],
                                               jax.random.PRNGKey(0), cfg)
    out[remat] = comps.tokens, logp
  for remat in ("block", "decoder"):
    np.testing.assert_array_equal(out[remat][0], out["none"][0])
    np.testing.assert_array_equal(out[remat][1], out["none"][1])


def test_building_the_sampler_leaves_the_train_steps_remat():
  """The sampler's graphdef without remat is a copy: the model the train step is traced from
  still recomputes, so `plan` (which builds the sampler's graphdef first, as a run does) counts
  more train FLOPs for block and decoder remat than for none."""
  from reasoner.planner import plan

  s = _nonzero_lora("model.remat=block")
  before = repr(s.graphdef)
  Sampler.for_run(s)
  assert repr(s.graphdef) == before and "BLOCK" in before
  flops = {}
  for remat in ("none", "block", "decoder"):
    cfg = tiny_config(f"model.remat={remat}", "train.batch_size=8",
                      "rollout.max_new_tokens=32")
    flops[remat] = plan.plan(cfg, "cpu", search=False)["train"].flops
  assert flops["block"] > 1.05 * flops["none"] and flops["decoder"] > 1.05 * flops["none"], flops


def _gemma2_state(setup, heads=4, kv=2):
  from reasoner.models import gemma

  _, gemma_lib, _, gemma2_cls = gemma.classes()
  tcfg = dataclasses.replace(
      gemma_lib.ModelConfig.gemma2_2b(), num_layers=2,
      num_embed=setup.model().embedding().shape[0], embed_dim=64, hidden_dim=128,
      num_heads=heads, head_dim=16, num_kv_heads=kv, sliding_window_size=128,
      attention_types=gemma_lib.ModelConfig.gemma2_2b().attention_types[:2])
  spec = gemma.ModelSpec(family="gemma2", tunix_config=tcfg, cls=gemma2_cls, dtype=jnp.float32)
  return nnx.split(gemma.init_random(spec, setup.mesh, 0))


# Gemma 2's decode is checked on its own (test_gemma2_greedy_decode_on_the_repeated_cache); its
# layouts repeat Gemma 3's with the family changed: make soak
@pytest.mark.parametrize("family", ["gemma3", pytest.param("gemma2", marks=pytest.mark.extended)])
def test_decode_layouts_sample_what_the_training_layout_samples(setup, family):
  """Each decode layout on 8 devices, against the training layout: greedy tokens equal (3
  prompts x 4: 12 rows, attention over 'fsdp' rows), and sampled tokens and their log-probs
  for the same key (top-k 32, 4 prompts x 4: Gemma 3's single KV head puts attention over every
  chip's own rows in tp layouts). The base is copied into the layout once and that copy
  decodes; the LoRA moves at each call."""
  if family == "gemma3":
    graphdef, states = setup.graphdef, (setup.lora, setup.base)
  else:
    graphdef, state = _gemma2_state(setup)
    states = (state,)
  prompts = ["Q: 1 + 2?", "Question: 22?", "Q: 3?", "Q: 4 * 5?"]
  greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
  drawn = SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=32)
  out = {}
  for layout in ("train", "replicated", "tp2", "tp4", "tp8"):
    sampler = Sampler(graphdef, states, setup.tokenizer, setup.mesh, 64, layout=layout)
    sampler.keep(states[-1])
    out[layout] = [sampler.sample(states, prompts[:n], jax.random.PRNGKey(3), c, 4)[0]
                   for c, n in ((greedy, 3), (drawn, 4))]
    placed = sampler.in_layout(states)[-1]
    assert placed is (states[-1] if layout == "train" else sampler._kept[0][1])
    if layout != "train":
      tp = mesh_lib.decode_tp(layout)
      assert dict(sampler.mesh.shape) == {"fsdp": 8 // tp, "tp": tp}
      specs = {tuple(x.sharding.spec) for x in jax.tree.leaves(placed)}
      assert not any("fsdp" in str(s) for s in specs)  # rows only: no weight over 'fsdp'
      assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(placed)) == (tp > 1)
      assert sampler.over_rows == (family == "gemma3" and tp > 1)  # Gemma 3 only
      attn = [x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(placed)[0]
              if "'attn'" in str(p) and x.ndim > 1]
      assert attn and all((tuple(s) == ()) == sampler.over_rows for s in attn)
      if family == "gemma3":  # the LoRA moved ahead (grpo_step, after its train step) decodes
        sampler.move_ahead(states[0])
        ahead = sampler.in_layout(states)[0]
        assert ahead is sampler._ahead[0][1]
        other = sampler.in_layout((jax.tree.map(jnp.copy, states[0]),))[0]  # moved now
        assert other is not ahead
        for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(other)):
          assert a.sharding == b.sharding and (np.asarray(a) == np.asarray(b)).all()
  for layout, (g, d) in out.items():
    np.testing.assert_array_equal(g.tokens, out["train"][0].tokens, err_msg=layout)
    np.testing.assert_array_equal(d.tokens, out["train"][1].tokens, err_msg=layout)
    np.testing.assert_allclose(d.logprobs, out["train"][1].logprobs, atol=2e-5, err_msg=layout)
  assert len({tuple(r) for r in out["train"][1].tokens}) > 1  # the draws are not all alike
