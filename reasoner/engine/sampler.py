"""Batched sampling for rollouts and evaluation: one prefill per prompt, one `lax.while_loop`.

The G completions of a prompt share its prefill: the prompt's KV cache is computed once. Gemma 3
decodes with `models.decode`, which keeps it once for the group; Gemma 2 repeats it to the G
rows and decodes with Tunix's layers.
Decoding stops when every row is done (a stop token or stop sequence), or after
`max_new_tokens` (the cache is sized prompt + max_new_tokens, so it cannot overflow).
No [rows, prompt, V] logits are formed; greedy and top-k sampling take the top-k in two stages
and the log-normaliser from it (`topk.vocab_topk`), optionally over vocabulary blocks.

Returned log-probs are those of the distribution the tokens were drawn from,
softmax(logits / temperature) over the whole vocabulary (top-k and top-p only narrow the
draw), or at `logprob_temperature` where a run sets it (`grpo.logprobs`, the rule
the trainer's log-probs follow too).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from reasoner import mesh as mesh_lib
from reasoner.config import Config, MeshConfig
from reasoner.engine import heads, topk
from reasoner.engine.layout import decode_layout
from reasoner.errors import DataError
from reasoner.models import decode, gemma
from reasoner.models.prompt import prefill, prompt_layout, shared_head
from reasoner.models.tokenizer import stop_pattern

log = logging.getLogger("reasoner")


def logprob_temperature(cfg) -> float:
  """The T of softmax(z / T) whose log-probs the sampler returns and GRPO's trainer takes
  (`grpo.logprobs`, from a `config.Config`): `sampling`, the distribution the rollouts were
  drawn from (`rollout.temperature`); `policy`, the policy itself (1)."""
  return cfg.rollout.temperature if cfg.grpo.logprobs == "sampling" else 1.0


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int
  temperature: float = 1.0  # 0: greedy
  top_k: int | None = None
  top_p: float | None = None
  stop_ids: tuple[int, ...] = ()
  # each a sequence of positions, a position an id or the ids that may stand there
  # (`tokenizer.stop_pattern`: '</answer>' after '.</' as after '</')
  stop_sequences: tuple[tuple[int | tuple[int, ...], ...], ...] = ()
  pad_id: int = 0
  # Vocabulary rows per block of the sampling head (greedy and top-k): [rows, vocab_chunk]
  # logits at a time instead of [rows, V]. None: one block, the faster on the CPU.
  vocab_chunk: int | None = None
  # T of the log-probs returned, softmax(z / T); None: the sampling temperature (1 if greedy).
  logprob_temperature: float | None = None
  # False: no log-probs (zeros), the head's log-sum-exp not computed (greedy or top-k; an
  # evaluation, which reads the texts alone)
  logprobs: bool = True

  @classmethod
  def for_run(cls, cfg: Config, tokenizer, greedy: bool) -> "SamplingConfig":
    """A run's rollouts (`rollout.*`) or, `greedy`, its evaluation (`eval.max_new_tokens`, no
    log-probs): stopping at the tokenizer's end of sequence or of turn, or after '</answer>'."""
    stops = tuple(i for i in (tokenizer.eos_id, tokenizer.end_of_turn_id) if i is not None)
    r = cfg.rollout
    return cls(
        max_new_tokens=cfg.eval.max_new_tokens if greedy else r.max_new_tokens,
        temperature=0.0 if greedy else r.temperature, top_k=None if greedy else r.top_k,
        top_p=None if greedy else r.top_p, vocab_chunk=r.vocab_chunk, stop_ids=stops,
        stop_sequences=(stop_pattern(tokenizer, "</answer>"),), pad_id=tokenizer.pad_id,
        logprob_temperature=1.0 if greedy else logprob_temperature(cfg), logprobs=not greedy)


class Completions(NamedTuple):
  tokens: np.ndarray  # [rows, N] int32, pad after the stop
  mask: np.ndarray  # [rows, N] bool, True on generated tokens (the stop token included)
  logprobs: np.ndarray  # [rows, N] float32, 0 where mask is False
  texts: list[str]
  stopped: np.ndarray  # [rows] bool: ended by a stop token or sequence (else truncated)


def _pick(z: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """[B, K] candidate logits already divided by the temperature (sorted descending when top-p
  applies) -> [B] chosen positions, under top-p."""
  if cfg.top_p is not None:
    probs = jax.nn.softmax(z, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    z = jnp.where(before < cfg.top_p, z, -jnp.inf)
  return jax.random.categorical(key, z, axis=-1)


def sample_token(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """[B, V] float32 -> [B] int32 under temperature / top-k / top-p (0 temperature: argmax)."""
  if cfg.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if cfg.top_k is not None:
    z, idx = jax.lax.top_k(logits, cfg.top_k)  # sorted, descending
  elif cfg.top_p is not None:  # a full sort of the vocabulary: prefer setting top_k too
    idx = jnp.argsort(-logits, axis=-1)
    z = jnp.take_along_axis(logits, idx, axis=-1)
  else:
    z, idx = logits, None
  choice = _pick(z / cfg.temperature, key, cfg)
  if idx is None:
    return choice.astype(jnp.int32)
  return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def next_token(hidden: jax.Array, emb: jax.Array, key: jax.Array, cfg: SamplingConfig,
               softcap: float | None = None, split: Mesh | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """[B, D] final hidden states -> [B] sampled ids and their log-probs under softmax(logits /
  T): T `cfg.logprob_temperature`, by default the sampling temperature (1 when greedy); zeros
  where `cfg.logprobs` is False (greedy and top-k only: the dense path computes them).

  Greedy and top-k sampling go through `topk.vocab_topk` (a two-stage top-k, the
  log-normaliser from its maximum, and with `cfg.vocab_chunk` vocabulary blocks so that no
  [B, V] array is formed); the candidates are the dense path's, and so is the draw for the
  same key. `split`: a decode mesh whose 'tp' chips each hold a slice of the vocabulary
  (`topk.split_vocab_topk`: only the candidates cross chips). Plain temperature sampling and
  top-p alone (a sort of the whole vocabulary) use the dense path.
  """
  t = cfg.logprob_temperature or cfg.temperature or 1.0
  if cfg.temperature == 0 or cfg.top_k is not None:
    k = 1 if cfg.temperature == 0 else cfg.top_k
    vals, ids, lse = (topk.split_vocab_topk(hidden, emb, k, cfg.vocab_chunk, softcap, t, split,
                                            normaliser=cfg.logprobs)
                      if split is not None else
                      topk.vocab_topk(hidden, emb, k, cfg.vocab_chunk, softcap, t,
                                      normaliser=cfg.logprobs))  # z / t
    pos = (jnp.zeros(hidden.shape[:1], jnp.int32) if cfg.temperature == 0
           else _pick(vals if t == cfg.temperature else vals * (t / cfg.temperature), key, cfg))
    take = lambda x: jnp.take_along_axis(x, pos[:, None], axis=-1)[:, 0]
    return take(ids), (take(vals) - lse) if cfg.logprobs else lse  # lse: zeros
  z = heads.logits(hidden, emb, softcap)
  tok = sample_token(z, key, cfg)
  z = z / t
  logp = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(z, axis=-1)
  return tok, logp


def _stops(cfg: SamplingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The stop criteria as arrays: the stop ids, and the stop sequences right-aligned in an
  [S, L, M] table of the ids each position allows (-2 pads: no token, nor the tail's start -1)
  with an [S, L] mask of the positions that count."""
  seqs = [[(p,) if isinstance(p, int) else tuple(p) for p in s] for s in cfg.stop_sequences]
  seqs = seqs or [[]]
  width = max(1, max(len(s) for s in seqs))
  ways = max([1, *(len(p) for s in seqs for p in s)])
  table = np.full((len(seqs), width, ways), -2, np.int32)
  valid = np.zeros((len(seqs), width), bool)
  for i, s in enumerate(seqs):
    for j, p in enumerate(s, start=width - len(s)):
      table[i, j, :len(p)] = p
      valid[i, j] = True
  return jnp.asarray(cfg.stop_ids or (-1,), jnp.int32), jnp.asarray(table), jnp.asarray(valid)


def _stop_hit(tok, tail, stop_ids, table, table_valid) -> jax.Array:
  """[rows] bool: the token is a stop id, or the last tokens (`tail`) end a stop sequence."""
  at = jnp.any(tail[:, None, :, None] == table[None], axis=-1)  # [rows, S, L]
  seq_hit = jnp.all(at | ~table_valid[None], axis=-1)
  seq_hit = jnp.any(seq_hit & jnp.any(table_valid, axis=-1)[None], axis=-1)
  return jnp.any(tok[:, None] == stop_ids[None], axis=-1) | seq_hit


class _Loop(NamedTuple):
  step: jax.Array
  tokens: jax.Array
  logps: jax.Array
  valid: jax.Array
  done: jax.Array
  tail: jax.Array
  hidden: jax.Array
  cache: dict
  key: jax.Array


def _prefilled(model, mesh: Mesh, prompt: jax.Array, prompt_mask: jax.Array, g: int, n: int,
               over_rows: bool, head: tuple[int, int] = (0, 0)):
  """The prompt through the model once (`head`: its shared head once, `prompt.prefill`): its
  last hidden state repeated to its G rows [rows, D], the decode cache, and
  `forward(model, tok, step, cache) -> (hidden, cache)`, one decode step of [rows] tokens, the
  step-th new one of each row."""
  rows, shared = prompt.shape[0] * g, decode.shares_prompt(model)  # Gemma 3
  rep = lambda x: jnp.repeat(x, g, axis=0)
  prompt_len = rep(jnp.sum(prompt_mask, axis=-1).astype(jnp.int32))
  axes = mesh_lib.decode_rows(mesh, rows, g, over_rows and shared)
  hidden, prompt_kv, cache = prefill(model, mesh, prompt, prompt_mask, g, n, shared, axes, *head)
  attention_mesh = mesh if "tp" in axes else None
  row_prompt_mask = rep(prompt_mask)  # Gemma 2's mask: once, not each step

  def forward(m, tok: jax.Array, step: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    pos = (prompt_len + step)[:, None]
    if shared:
      h, c = m.hidden_states(tok[:, None], pos, decode.Cache(prompt_kv, cache), prompt_mask,
                             attention_mesh, step=step)
      return h[:, 0], c.new
    fresh = jnp.broadcast_to(jnp.arange(n) <= step, (rows, n))
    seen = jnp.concatenate([row_prompt_mask, fresh], axis=1)
    h, c = m.hidden_states(tok[:, None], pos, cache, seen[:, None, :])
    return h[:, 0], c

  hidden = rep(hidden)
  if attention_mesh is not None:  # rows over 'fsdp', as each step leaves it; elsewhere XLA's
    # choice (pinned so on the training layout, it gathered the 576 MiB embedding each token)
    hidden = jax.lax.with_sharding_constraint(hidden, mesh_lib.batch_placement(mesh,
                                                                               hidden.shape))
  return hidden, cache, forward


def generate(graphdef, mesh: Mesh, states: tuple, prompt: jax.Array, prompt_mask: jax.Array,
             key: jax.Array, *, cfg: SamplingConfig, num_generations: int,
             split_vocab: bool = False, over_rows: bool = False, head: tuple[int, int] = (0, 0)):
  """prompt [B, P] left-padded -> tokens, mask, log-probs [B*G, N] (rows grouped by prompt)
  and [B*G] whether each row stopped (not cut at max_new_tokens).

  B must be a multiple of the mesh's 'fsdp' size (`Sampler` pads it): rows and their caches
  are split over 'fsdp', KV heads over 'tp'; `split_vocab`: the head's vocabulary over 'tp'
  (it divides: `Sampler` decides); `over_rows`: attention over each chip's own rows where
  they divide (`mesh.decode_rows`); `head`: (tokens every prompt starts with, slots after
  them the longest needs), run once (`prompt.shared_head`).
  """
  model = nnx.merge(graphdef, *states)
  n, rows, emb = cfg.max_new_tokens, prompt.shape[0] * num_generations, model.embedding()
  split = mesh if split_vocab else None
  hidden, cache, forward = _prefilled(model, mesh, prompt, prompt_mask, num_generations, n,
                                      over_rows, head)
  stops = _stops(cfg)

  def body(s: _Loop) -> _Loop:
    step_model = nnx.merge(graphdef, *states)  # modules of this trace level (qwix sets attrs)
    key, sub = jax.random.split(s.key)
    tok, logp = next_token(s.hidden, emb, sub, cfg, model.logit_softcap, split)
    tok = jnp.where(s.done, cfg.pad_id, tok)
    live = ~s.done
    tail = jnp.concatenate([s.tail[:, 1:], tok[:, None]], axis=1)
    hit = _stop_hit(tok, tail, *stops)
    h, cache = forward(step_model, tok, s.step, s.cache)
    return _Loop(
        step=s.step + 1,
        tokens=s.tokens.at[:, s.step].set(tok),
        logps=s.logps.at[:, s.step].set(jnp.where(live, logp, 0.0)),
        valid=s.valid.at[:, s.step].set(live),
        done=s.done | (live & hit),
        tail=tail, hidden=h, cache=cache, key=key)

  def cond(s: _Loop) -> jax.Array:
    return (s.step < n) & ~jnp.all(s.done)

  init = _Loop(
      step=jnp.int32(0), tokens=jnp.full((rows, n), cfg.pad_id, jnp.int32),
      logps=jnp.zeros((rows, n), jnp.float32), valid=jnp.zeros((rows, n), bool),
      done=jnp.zeros((rows,), bool), tail=jnp.full((rows, stops[1].shape[1]), -1, jnp.int32),
      hidden=hidden, cache=cache, key=key)
  out = jax.lax.while_loop(cond, body, init)
  return out.tokens, out.valid, out.logps, out.done


def on_own_chips(setup):
  """`setup` with the rollout's own chips (`rollout.devices`) as its mesh, rows over them (as
  the sampler and the planner's decode layout see them); `setup` where it has none."""
  if setup.devices is None or setup.devices.rollout is None:
    return setup
  return dataclasses.replace(setup, mesh=mesh_lib.make_mesh(MeshConfig(), setup.devices.rollout))


def default_buckets(max_prompt_tokens: int, smallest: int = 64) -> tuple[int, ...]:
  """Powers of two from `smallest`, ending at `max_prompt_tokens` itself: at most
  log2(max / smallest) + 1 prompt widths, so at most that many compiles per sampling config."""
  out, w = [], smallest
  while w < max_prompt_tokens:
    out.append(w)
    w *= 2
  return tuple(out) + (max_prompt_tokens,)


def bucket(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds `length` tokens."""
  for width in sorted(buckets):
    if width >= length:
      return width
  raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket "
                   f"{max(buckets)}")


def left_pad(seqs: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
  toks = np.full((len(seqs), width), pad_id, np.int32)
  mask = np.zeros((len(seqs), width), bool)
  for i, s in enumerate(seqs):
    if len(s) > width:
      raise ValueError(f"prompt of {len(s)} tokens exceeds the padded width {width}")
    toks[i, width - len(s):] = s
    mask[i, width - len(s):] = True
  return toks, mask


class Sampler:
  """Tokenises prompts, pads them into buckets and the batch to the data-parallel size.

  Each distinct (batch, width, sampling config, G) compiles once; the count is logged, so a
  run that keeps recompiling shows it. The graph decodes with remat off whatever the training
  graph uses (`gemma.without_remat`); `states` (arrays or ShapeDtypeStructs) only give its
  structure: parameters (LoRA included) come with each call, never copied.

  `layout` (`rollout.layout`) is where decoding runs: 'train' on the training mesh and
  placement; 'replicated' or 'tp<k>' on the same devices as rows x k (`mesh.decode_mesh`), the
  parameters split Megatron-style over k chips (`mesh.decode_shardings`; Gemma 3's attention
  over each chip's own rows where 'tp' cannot split its KV heads, `over_rows`). There a state that
  never changes (the base weights) is copied into the layout once (`keep`, on device), and the
  others (the LoRA weights, new each step) are moved at each call. `own`: `mesh` holds chips of
  the rollout's own (`rollout.devices`), which keep their copy of the base in any layout ('train':
  the parameters' rules on those chips).
  """

  def __init__(self, graphdef, states: tuple, tokenizer, mesh: Mesh, max_prompt_tokens: int,
               buckets: Sequence[int] | None = None, layout: str = "train", own: bool = False):
    graphdef = gemma.without_remat(graphdef, *states)
    self.layout, self.own = layout, own
    self.mesh = mesh_lib.decode_mesh(mesh, layout)
    # `generate(states, prompt, prompt_mask, key, cfg=, num_generations=)`: the rollout step
    # the planner compiles from `abstract_inputs`.
    split = layout != "train" and self.mesh.shape["tp"] > 1
    model = nnx.merge(graphdef, *states)
    # attention over each chip's own rows where 'tp' cannot split the KV heads (Gemma 3 only)
    self.over_rows = split and decode.shares_prompt(model) and mesh_lib.attention_over_rows(
        model.config.num_kv_heads, self.mesh)
    # the head's vocabulary over 'tp' where it divides, as the embedding's decode rule splits it
    self.split_vocab = split and mesh_lib.vocab_axis(self.mesh, model.config.num_embed) == "tp"
    self.generate = jax.jit(functools.partial(generate, graphdef, self.mesh,
                                              split_vocab=self.split_vocab,
                                              over_rows=self.over_rows),
                            static_argnames=("cfg", "num_generations", "head"))
    # prompts that share a head (a few-shot header) run it once (`prompt.shared_head`) below
    # this sliding window (None: none); 0: never (Gemma 2 decodes on Tunix's repeated cache)
    self.window = (getattr(model.config, "sliding_window_size", None)
                   if decode.shares_prompt(model) else 0)
    self.tokenizer = tokenizer
    self.max_prompt_tokens = max_prompt_tokens
    self.buckets = tuple(sorted(buckets or default_buckets(max_prompt_tokens)))
    if self.buckets[-1] < max_prompt_tokens:
      raise ValueError(f"the largest prompt bucket {self.buckets[-1]} is smaller than "
                       f"max_prompt_tokens {max_prompt_tokens}")
    self.compiled_shapes: set[tuple[int, int, SamplingConfig, int, tuple[int, int]]] = set()
    self._kept: list[tuple[object, object]] = []  # (state, its copy in the decode layout)
    self._ahead: list[tuple[object, object]] = []  # the LoRA moved ahead (`move_ahead`)
    self._rules: dict = {}  # a state's tree structure -> its decode shardings (the LoRA's)

  @classmethod
  def for_run(cls, setup, layout: str | None = None) -> "Sampler":
    """The run's sampler (`setup`: a `build.Setup`), decoding in `layout` (default
    `rollout.layout`, auto resolved by `engine.layout.decode_layout`), its base weights kept
    in that layout."""
    cfg, own_setup = setup.cfg, on_own_chips(setup)
    own = own_setup is not setup
    if own:
      setup = own_setup
      log.info("sampler: on %d devices of its own, a step ahead of training",
               setup.mesh.size)
    layout = layout or decode_layout(setup)
    if layout != "train":
      log.info("sampler: decoding in the %s layout", layout)
    sampler = cls(setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh,
                  cfg.data.max_prompt_tokens, cfg.rollout.prompt_buckets, layout, own)
    sampler.keep(setup.base)
    return sampler

  def _shardings(self, state, mesh: Mesh | None = None):
    if self.layout == "train":  # chips of its own: the parameters' rules there
      return mesh_lib.shardings(state, mesh or self.mesh)
    return mesh_lib.decode_shardings(state, mesh or self.mesh, self.over_rows)

  def keep(self, state) -> None:
    """Copies `state`, which never changes (the base weights), into the decode layout once,
    resharded on device; `sample` then decodes with that copy whenever it is passed `state`.
    Nothing to do on the training layout or for abstract states (the planner)."""
    if ((self.layout != "train" or self.own)
        and all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))):
      self._kept.append((state, mesh_lib.moved(state, self._shardings(state))))

  def move_ahead(self, lora) -> None:
    """Dispatches `lora`'s move into the decode layout now, and keeps the copy for the next
    `in_layout` of that LoRA: called as soon as the train step that makes it is dispatched, the
    move's dispatch on the host overlaps that step on the chips."""
    if self.layout != "train" or self.own:
      self._ahead = [(lora, self.in_layout((lora,))[0])]

  def in_layout(self, states: tuple) -> tuple:
    """`states` as decoding reads them: a kept state's copy, the others moved (the LoRA)."""
    if self.layout == "train" and not self.own:
      return tuple(states)
    out = []
    for s in states:
      kept = [copy for source, copy in (*self._kept, *self._ahead) if source is s]
      if not kept:
        tree = jax.tree.structure(s)
        rules = self._rules.get(tree) or self._rules.setdefault(tree, self._shardings(s))
      out.append(kept[0] if kept else mesh_lib.moved(s, rules))
    return tuple(out)

  def abstract_inputs(self, states: tuple, prompts: int, g: int,
                      cfg: SamplingConfig) -> tuple[tuple, dict]:
    """(args, kwargs) of `generate` as `sample` calls it for `prompts` x `g` rows of the widest
    prompts, as placed ShapeDtypeStructs: `states` abstract, placed in the decode layout."""
    if self.layout != "train" or self.own:
      states = tuple(mesh_lib.placed(s, self.mesh, self._shardings) for s in states)
    c, extra = prompt_layout(self.mesh, prompts, g)
    shape = (prompts * c + extra, bucket(self.max_prompt_tokens, self.buckets))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=mesh_lib.replicated(self.mesh))
    return ((tuple(states), mesh_lib.batch_struct(self.mesh, shape, jnp.int32),
             mesh_lib.batch_struct(self.mesh, shape, jnp.bool_), key),
            {"cfg": cfg, "num_generations": g // c})

  def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
    out = []
    for text in prompts:
      ids = self.tokenizer.encode(text, add_bos=True)
      if len(ids) > self.max_prompt_tokens:
        raise DataError(f"a prompt has {len(ids)} tokens, more than data.max_prompt_tokens = "
                         f"{self.max_prompt_tokens}: {text[:80]!r}...")
      out.append(ids)
    return out

  def sample(self, states: tuple, prompts: Sequence[str], key: jax.Array, cfg: SamplingConfig,
             num_generations: int = 1, then: Callable | None = None
             ) -> tuple[Completions, np.ndarray, np.ndarray]:
    """Completions ([len(prompts) * G] rows) and the padded prompt tokens and mask.

    `states` are the model's states as split with the sampler's graphdef, e.g. (lora, base):
    the live training parameters, never a copy. Every process passes the same prompts.
    `then(prompt, prompt_mask, tokens, mask)` is called once the tokens reach the host, before
    they are detokenised: a program it dispatches runs on the chips while this host detokenises
    (and its caller scores).
    """
    ids = self.encode_prompts(prompts)
    width = bucket(max(len(s) for s in ids), self.buckets)
    toks, mask = left_pad(ids, width, self.tokenizer.pad_id)
    b = len(prompts)
    prompt_toks, prompt_mask = toks, mask
    c, extra = prompt_layout(self.mesh, b, num_generations)
    toks, mask, g = np.repeat(toks, c, 0), np.repeat(mask, c, 0), num_generations // c
    if extra:
      toks = np.concatenate([toks, np.repeat(toks[:1], extra, 0)])
      mask = np.concatenate([mask, np.repeat(mask[:1], extra, 0)])
    head = shared_head(ids, width, self.window) if self.window != 0 else (0, 0)
    shape = (toks.shape[0], width, cfg, g, head)
    if shape not in self.compiled_shapes:
      self.compiled_shapes.add(shape)
      log.info("sampler: compiling for %d prompts x %d tokens%s, G = %d, %d new tokens "
               "(%d sampler shapes so far)", shape[0], width,
               f" (a shared head of {head[0]}, then {head[1]})" if head[0] else "", g,
               cfg.max_new_tokens, len(self.compiled_shapes))
    if self.own:  # the run's key lives on the training chips (one host: `rollout.devices`)
      key = jax.device_put(key, mesh_lib.replicated(self.mesh))
    out = self.generate(self.in_layout(states), mesh_lib.put_batch(self.mesh, toks),
                         mesh_lib.put_batch(self.mesh, mask), key, cfg=cfg, num_generations=g,
                         head=head)
    rows = b * num_generations
    tokens, valid, logps, stopped = (mesh_lib.to_host(x)[:rows] for x in out)
    if then is not None:
      then(prompt_toks, prompt_mask, tokens, valid)
    texts = [self.tokenizer.decode(t[m]) for t, m in zip(tokens, valid)]
    return Completions(tokens, valid, logps, texts, stopped), prompt_toks, prompt_mask

