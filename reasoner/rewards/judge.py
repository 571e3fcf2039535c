"""The `judge` reward: a Gemma model grades each completion against a rubric, read from its
next-token distribution over the grade tokens in one batched forward pass (no sampling, no
parsing of free text).

The rubric (`judge.rubric`, with {question}, {response} and {reference} filled in) ends where
the grade is due; the judge's probabilities of the grade tokens (`judge.grades`, e.g. 1-5,
renormalised among themselves) give the expected grade, scaled to 0-1. Only the grade tokens'
rows of the embedding are multiplied: no [B, V] logits.

A record with a rubric of its own (`data.rubric_field`; Rubrics as Rewards, Gunjal et al.
2025) is graded criterion by criterion instead: each (completion, criterion) is a prompt
(`judge.criterion_prompt`), all of a batch's in the same batched forwards, read as p_j, the
probability of "yes" against "no" (`judge.criterion_grades`). The reward is

    (sum_j w_j p_j - sum_{w_j<0} w_j) / (sum_{w_j>0} w_j - sum_{w_j<0} w_j)   in [0, 1]

(`rubric_score`): the weighted share of the criteria met, a pitfall (w_j < 0, "yes" = the
response falls into it) taking its weight off. A criterion that code can decide ({check: kind,
args, weight}: an instruction of `instructions`, e.g. "exactly four lines") is p_j = 1 or 0 from
its check on the completion's answer, and costs no judge row: `judge.max_criteria` bounds the
judged criteria, the rows a completion costs.

`pairwise` compares two responses to a question in both orders (the evaluation's win rate of
the trained model against the model before training).

Where it runs: by default (`judge.model: null`) the judge is the policy's own base weights with
the LoRA off, on the policy's devices, at no extra memory. A model of its own (`judge.model`,
any this toolkit loads) runs on the policy's devices too, or, with `judge.devices: N`, on the
last N devices alone, loaded straight into their shards there, while the policy trains on the
others (`build.split_devices`): a Gemma 3 12B judge on half of a v5e-8 beside the policy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoner import mesh as mesh_lib
from reasoner.config import JudgeConfig, MeshConfig
from reasoner.errors import ConfigError
from reasoner.models import lora as lora_lib
from reasoner.models import gemma, load
from reasoner.models.cache import causal_mask, positions_from_mask
from reasoner.rewards import instructions


def grade_ids(cfg: JudgeConfig, tokenizer, key: str = "grades") -> list[int]:
  """Each grade's token id (`judge.<key>`); a grade that is not one token is refused (before any
  weight loads)."""
  ids = []
  for g in getattr(cfg, key):
    enc = tokenizer.encode(g)
    if len(enc) != 1:
      raise ConfigError(f"config key 'judge.{key}': {g!r} is {len(enc)} tokens for this "
                        "tokenizer; each must be one token")
    ids.append(enc[0])
  return ids


def grade_probs(model, tokens: jax.Array, valid: jax.Array, ids: jax.Array, mesh=None
                ) -> jax.Array:
  """[B, K] probabilities of the K grade tokens (among themselves) after each left-padded
  prompt."""
  h, _ = model.hidden_states(tokens, positions_from_mask(valid), None, causal_mask(valid), mesh)
  rows = jnp.take(model.embedding(), ids, axis=0)  # [K, D]
  z = jnp.einsum("bd,kd->bk", h[:, -1], rows, preferred_element_type=jnp.float32)
  if model.logit_softcap is not None:
    z = jnp.tanh(z / model.logit_softcap) * model.logit_softcap
  return jax.nn.softmax(z, axis=-1)


def rubric_score(p_yes: np.ndarray, weights: np.ndarray) -> float:
  """One completion's reward from its criteria's yes-probabilities and weights (module doc)."""
  low, high = weights[weights < 0].sum(), weights[weights > 0].sum()
  return float((p_yes @ weights - low) / (high - low))


def judged(rubric) -> list:
  """A rubric's criteria for the judge (its texts), checks left out."""
  return [c for c, _ in rubric or () if isinstance(c, str)]


def check_records(cfg: JudgeConfig, records, where: str) -> None:
  """One line, before any model loads, for a rubric with more judged criteria than
  `judge.max_criteria` allows (a completion's judge rows are bounded and planned), or a check
  that cannot be checked."""
  for i, r in enumerate(records):
    n = len(judged(r.get("rubric")))
    if n > cfg.max_criteria:
      raise ConfigError(f"config key 'judge.max_criteria' = {cfg.max_criteria}: {where}, record "
                        f"{i} has a rubric of {n} judged criteria; set it to the most a record "
                        "has (each is a judge row for every completion)")
    checks = [c for c, _ in r.get("rubric") or () if isinstance(c, dict)]
    instructions.validate(checks, f"{where}, record {i}, its rubric's checks")


JUNK = "the the the the the the the the"
CHECK_RECORDS = 32  # the most records `agreement` asks about


def check_agreement_records(cfg: JudgeConfig, records, where: str) -> None:
  """`judge.check` needs records with a response to compare (before any model loads)."""
  n = sum(bool(r.get("response")) for r in records)
  if cfg.check and n < 4:
    raise ConfigError(f"config key 'judge.check' = true: {where} has {n} records with a "
                      "response (data.response_field); the check compares 4 or more")


def agreement(judge: "Judge", records) -> dict:
  """Does the judge tell answers apart? For each record with a response (at most
  `CHECK_RECORDS`): its score (the record's rubric where it has one) of the record's own
  response against another question's and against junk, and its pairwise preference of the own
  response over the other's. `agreement`: the share of these 3 calls a record it gets right
  (a tie is wrong; a judge with no signal scores about 0.5 or less)."""
  rows = [r for r in records if r.get("response")][:CHECK_RECORDS]
  n = len(rows)
  q, a = [r["question"] for r in rows], [r.get("answer") for r in rows]
  rubric = [r.get("rubric") for r in rows]
  own = [r["response"] for r in rows]
  other = [rows[(i + n // 2) % n]["response"] for i in range(n)]
  score = lambda texts: np.asarray(judge(q, texts, question=q, answer=a, rubric=rubric))
  s_own, s_other, s_junk = score(own), score(other), score([JUNK] * n)
  pair = judge.pairwise(own, other, q, a)
  calls = np.concatenate([s_own > s_other, s_own > s_junk, pair > 0.5])
  return {"agreement": float(calls.mean()), "own": float(s_own.mean()),
          "other": float(s_other.mean()), "junk": float(s_junk.mean()),
          "pairwise": float(pair.mean()), "n": n}


def check(judge: "Judge", records) -> dict:
  """`agreement` at the start of a run (`judge.check`): one line, and the run stops, below
  `judge.min_agreement`."""
  a = agreement(judge, records)
  if a["agreement"] < judge.cfg.min_agreement:
    raise ConfigError(
        f"config key 'judge.min_agreement' = {judge.cfg.min_agreement}: the judge got "
        f"{a['agreement']:.2f} of its calls right on {a['n']} records (own response "
        f"{a['own']:.3f}, another question's {a['other']:.3f}, junk {a['junk']:.3f}; own "
        f"preferred {a['pairwise']:.3f}): it gives no signal; use a stronger judge.model")
  return a


class Judge:
  """The reward function `judge` (`__call__(prompts, completions, question=, answer=)`), bound to
  a model by `for_run`."""

  needs_answer = False

  def __init__(self, cfg: JudgeConfig, graphdef, params, tokenizer, mesh):
    self.cfg, self.graphdef, self.params, self.tokenizer, self.mesh = (
        cfg, graphdef, params, tokenizer, mesh)
    self.ids = jnp.asarray(grade_ids(cfg, tokenizer), jnp.int32)
    self.ab = jnp.asarray(grade_ids(cfg, tokenizer, "pairwise_grades"), jnp.int32)
    self.yes_no = None  # the criteria's (no, yes) token ids, where records may carry rubrics
    if cfg.max_criteria:
      self.yes_no = jnp.asarray(grade_ids(cfg, tokenizer, "criterion_grades"), jnp.int32)
    self._probs = jax.jit(lambda params, tokens, valid, ids: grade_probs(
        nnx.merge(graphdef, *params), tokens, valid, ids, mesh))

  @classmethod
  def own(cls, cfg: JudgeConfig, devices: list, seed: int) -> "Judge":
    """A judge of its own (`judge.model`) on `devices`, its weights loaded into their shards
    there (a mesh of its own: 'fsdp' over them)."""
    mesh = mesh_lib.make_mesh(MeshConfig(), devices)
    tokenizer, _, model = load.load_model(cfg.model, mesh, seed)
    graphdef, state = nnx.split(model)
    return cls(cfg, graphdef, (state,), tokenizer, mesh)

  @classmethod
  def for_run(cls, setup) -> "Judge":
    """`self`: the policy's base weights with a zero LoRA (the same arrays, nothing copied)."""
    return cls(setup.cfg.judge, setup.graphdef, (lora_lib.zeros_like(setup.lora), setup.base),
               setup.tokenizer, setup.mesh)

  @classmethod
  def abstract(cls, setup) -> "Judge":
    """The run's judge with placed ShapeDtypeStructs for weights (nothing read), on its devices
    of an abstract `setup` (`build(abstract=True)`): what `plan` compiles."""
    cfg, own = setup.cfg.judge, setup.devices.judge
    if cfg.model is None:
      return cls(cfg, setup.graphdef, (setup.lora, setup.base), setup.tokenizer, setup.mesh)
    mesh = mesh_lib.make_mesh(MeshConfig(), own) if own else setup.mesh
    tokenizer, spec = load.spec_without_checkpoint(cfg.model)
    graphdef, state, _ = gemma.abstract_model(spec, mesh)
    return cls(cfg, graphdef, (mesh_lib.placed(state, mesh),), tokenizer, mesh)

  def abstract_inputs(self) -> tuple:
    """(params, tokens, valid, grade ids) of one full batch of `judge.max_tokens` tokens."""
    s = lambda dtype: mesh_lib.batch_struct(
        self.mesh, (self.cfg.batch_size, self.cfg.max_tokens), dtype)
    return self.params, s(jnp.int32), s(jnp.bool_), self.ids

  def texts(self, completions, question, answer) -> list[str]:
    return [self.cfg.rubric.format(question=q, response=c,
                                   reference=a if a is not None else "(none given)")
            for q, c, a in zip(question, completions, answer)]

  def criterion_texts(self, completion: str, question: str, answer, rubric) -> list[str]:
    """A completion's prompts, one a criterion of its record's rubric."""
    ref = answer if answer is not None else "(none given)"
    return [self.cfg.criterion_prompt.format(question=question, response=completion,
                                             reference=ref, criterion=c) for c in judged(rubric)]

  def probs(self, texts: list[str], grades: jax.Array | None = None) -> np.ndarray:
    """[n, K] probabilities of the K tokens `grades` (default: `judge.grades`) among
    themselves, `judge.batch_size` prompts a forward pass; each prompt's last `judge.max_tokens`
    tokens (the rubric's end, where the grade is due, is kept)."""
    grades = self.ids if grades is None else grades
    out = []
    for k in range(0, len(texts), self.cfg.batch_size):
      ids = [self.tokenizer.encode(t, add_bos=True)[-self.cfg.max_tokens:]
             for t in texts[k:k + self.cfg.batch_size]]
      rows = self.cfg.batch_size
      width = 64 * math.ceil(max(map(len, ids)) / 64)
      tokens = np.full((rows, width), self.tokenizer.pad_id, np.int32)
      valid = np.zeros((rows, width), bool)
      for i, x in enumerate(ids):
        tokens[i, width - len(x):], valid[i, width - len(x):] = x, True
      valid[len(ids):, -1] = True  # filler rows (one token each) keep the batch's shape
      put = lambda a: mesh_lib.put_batch(self.mesh, a)
      out.append(mesh_lib.to_host(self._probs(self.params, put(tokens), put(valid), grades))[
          :len(ids)])
    return np.concatenate(out) if out else np.zeros((0, len(grades)), np.float32)

  def __call__(self, prompts, completions, question=None, answer=None, rubric=None, **_
               ) -> list[float]:
    """Each completion's reward: its expected grade under `judge.rubric`, or, where its record
    has a rubric, `rubric_score` of its criteria (every criterion of every such completion in
    the same batched forwards)."""
    n = len(completions)
    question, answer = question or prompts, answer or [None] * n
    rubric = rubric or [None] * n
    out = np.zeros(n, np.float32)
    plain = [i for i in range(n) if not rubric[i]]
    if plain:
      p = self.probs(self.texts([completions[i] for i in plain], [question[i] for i in plain],
                                [answer[i] for i in plain]))
      out[plain] = p @ (np.arange(len(self.cfg.grades), dtype=np.float32)
                        / (len(self.cfg.grades) - 1))
    graded = [i for i in range(n) if rubric[i]]
    if graded:
      if self.yes_no is None:
        raise ConfigError("config key 'judge.max_criteria' = 0: a record has a rubric; set it "
                          "to the most criteria a record has")
      texts = [t for i in graded
               for t in self.criterion_texts(completions[i], question[i], answer[i], rubric[i])]
      yes = iter(self.probs(texts, self.yes_no)[:, 1] if texts else ())
      for i in graded:  # a check's p is its result on the answer, a judged one the judge's
        text = instructions.answer_text(completions[i])
        p = [float(instructions.follows(c["kind"], c["args"], text)) if isinstance(c, dict)
             else next(yes) for c, _ in rubric[i]]
        out[i] = rubric_score(np.asarray(p, np.float32),
                              np.asarray([w for _, w in rubric[i]], np.float32))
    return list(map(float, out))

  def pairwise(self, first, second, question, answer) -> np.ndarray:
    """[n] the probability that each `first` response is the better of the pair, the mean of
    both orders (`judge.pairwise_prompt`, A = first shown): position bias cancels, swapping the
    two gives 1 - p, and a response against itself gives exactly 0.5."""
    n = len(first)
    fill = lambda q, x, y, a: self.cfg.pairwise_prompt.format(
        question=q, first=x, second=y, reference=a if a is not None else "(none given)")
    texts = [fill(*t) for t in zip(question, first, second, answer)]
    texts += [fill(*t) for t in zip(question, second, first, answer)]
    p = self.probs(texts, self.ab)
    return 0.5 * (p[:n, 0] + p[n:, 1])
