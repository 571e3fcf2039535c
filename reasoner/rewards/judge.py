"""The `judge` reward: a Gemma model grades each completion against a rubric, read from its
next-token distribution over the grade tokens in one batched forward pass (no sampling, no
parsing of free text).

The rubric (`judge.rubric`, with {question}, {response} and {reference} filled in) ends where
the grade is due; the judge's probabilities of the grade tokens (`judge.grades`, e.g. 1-5,
renormalised among themselves) give the expected grade, scaled to 0-1. Only the grade tokens'
rows of the embedding are multiplied: no [B, V] logits.

A record with a rubric of its own (`data.rubric_field`; Rubrics as Rewards, Gunjal et al.
2025) is graded criterion by criterion instead, each read as p_j, the probability of "yes"
against "no" (`judge.criterion_grades`) after its prompt (`judge.criterion_prompt`). The judge
reads each completion once: the prompt up to `{criterion}` (question, reference, response) is a
prefix that goes through the model once, and each criterion's rest of the prompt (the criterion
and the prompt's closing words, "Answer Yes or No: ") is a suffix of a few tokens run against
the prefix's KV cache (`models.prompt.suffix_hidden`): `judge.batch_size` completions with
`judge.max_criteria` suffixes each a pass, of bucketed shapes (`pack`), one program reused. A
prompt with `{criterion}` before `{response}` shares no such prefix: there each (completion,
criterion) is a prompt of its own, all in the same batched forwards. The reward is

    (sum_j w_j p_j - sum_{w_j<0} w_j) / (sum_{w_j>0} w_j - sum_{w_j<0} w_j)   in [0, 1]

(`rubric_score`): the weighted share of the criteria met, a pitfall (w_j < 0, "yes" = the
response falls into it) taking its weight off. A criterion that code can decide ({check: kind,
args, weight}: an instruction of `instructions`, e.g. "exactly four lines") is p_j = 1 or 0 from
its check on the completion's answer, and costs the judge nothing: `judge.max_criteria` bounds
the judged criteria, the suffixes a completion's pass holds.

`pairwise` compares two responses to a question in both orders (the evaluation's win rate of
the trained model against the model before training).

Where it runs: by default (`judge.model: null`) the judge is the policy's own base weights with
the LoRA off, on the policy's devices, at no extra memory. A model of its own (`judge.model`,
any this toolkit loads) runs on the policy's devices too, or, with `judge.devices: N`, on the
last N devices alone, loaded straight into their shards there ('tp' over them,
`mesh.forward_mesh`: every pass reads its weights where they lie), while the policy trains on the
others (`build.split_devices`): a Gemma 3 12B judge on half of a v5e-8 beside the policy.
"""

from __future__ import annotations

import math
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoner import mesh as mesh_lib
from reasoner.config import JudgeConfig, ModelConfig
from reasoner.errors import ConfigError
from reasoner.models import lora as lora_lib
from reasoner.models import gemma, load
from reasoner.models.cache import causal_mask, positions_from_mask
from reasoner.models.prompt import suffix_hidden
from reasoner.rewards import instructions

SUFFIX_PLANNED = 64  # tokens `plan` gives a criterion's suffix: the default prompt's tail + ~50


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
  return grade_head(model, h[:, -1], ids)


def grade_head(model, h: jax.Array, ids: jax.Array) -> jax.Array:
  """[..., D] final hidden states -> [..., K] probabilities of the K grade tokens among
  themselves: only their rows of the embedding are multiplied, the logit softcap applied."""
  rows = jnp.take(model.embedding(), ids, axis=0)  # [K, D]
  z = jnp.einsum("...d,kd->...k", h, rows, preferred_element_type=jnp.float32)
  if model.logit_softcap is not None:
    z = jnp.tanh(z / model.logit_softcap) * model.logit_softcap
  return jax.nn.softmax(z, axis=-1)


def criteria_probs(model, prefix, prefix_valid, suffix, lengths, ids, mesh=None) -> jax.Array:
  """[B, K, 2] the (no, yes) probabilities after each of B prefixes' K criterion suffixes, each
  prefix read once (`models.prompt.suffix_hidden`)."""
  return grade_head(model, suffix_hidden(model, prefix, prefix_valid, suffix, lengths, mesh), ids)


def prefix_template(template: str, at: tuple[str, ...] = ("criterion",),
                    after: str | None = "response") -> str | None:
  """The text of `template` before its first field named in `at`, a template still (the
  criterion prompt's before {criterion}; the pairwise prompt's before {first} or {second}).
  None where no field of `at` comes after `after`, or nothing before it (no prefix shared)."""
  out, seen = [], set()
  for text, field, spec, conv in string.Formatter().parse(template):
    out.append(text.replace("{", "{{").replace("}", "}}"))  # parse unescaped them
    if field in at:
      head = "".join(out)
      return head if head and (after is None or after in seen) else None
    if field is not None:
      seen.add(field)
      out.append("{" + field + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}")
  return None


def in_passes(cfg: JudgeConfig) -> bool:
  """Whether records' rubrics are judged a pass a completion, its criteria as suffixes on its
  prefix (`criteria_probs`): they are allowed (`judge.max_criteria`) and the criterion prompt
  shares a prefix (`prefix_template`)."""
  return bool(cfg.max_criteria) and prefix_template(cfg.criterion_prompt) is not None


def left_padded(prompts: list[list[int]], n: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
  """`prompts` (token ids) as [n, P] tokens left-padded to a multiple of 64, and their valid
  mask; filler rows past `prompts` are one pad token, so a batch keeps its shape."""
  width = 64 * math.ceil(max(map(len, prompts)) / 64)
  tokens = np.full((n, width), pad, np.int32)
  valid = np.zeros((n, width), bool)
  for i, x in enumerate(prompts):
    tokens[i, width - len(x):], valid[i, width - len(x):] = x, True
  valid[len(prompts):, -1] = True
  return tokens, valid


def planned_prefix(cfg: JudgeConfig) -> int:
  """The prefix tokens `plan` gives a criteria pass: the rest of `judge.max_tokens` beside a
  suffix of `SUFFIX_PLANNED`, in the passes' multiple of 64."""
  return 64 * math.ceil(max(cfg.max_tokens - SUFFIX_PLANNED, 1) / 64)


def pack(rows: list, n: int, k: int, pad: int) -> tuple[np.ndarray, ...]:
  """`rows` of (prefix ids, [suffix ids]) as one pass's arrays for `n` completions of `k`
  suffixes: prefixes [n, P] left-padded to a multiple of 64 tokens, suffixes [n, k, S] right-
  padded to a power of two of 16 or more, and their lengths [n, k] (0: no criterion), so that
  a jitted pass is reused across calls. Filler completions (past `rows`) are one pad token."""
  prefix, valid = left_padded([p for p, _ in rows], n, pad)
  s = max(16, 1 << (max(len(x) for _, xs in rows for x in xs) - 1).bit_length())
  suffix = np.full((n, k, s), pad, np.int32)
  lengths = np.zeros((n, k), np.int32)
  for i, (_, xs) in enumerate(rows):
    for j, x in enumerate(xs):
      suffix[i, j, :len(x)], lengths[i, j] = x, len(x)
  return prefix, valid, suffix, lengths


def rubric_score(p_yes: np.ndarray, weights: np.ndarray) -> float:
  """One completion's reward from its criteria's yes-probabilities and weights (module doc)."""
  low, high = weights[weights < 0].sum(), weights[weights > 0].sum()
  return float((p_yes @ weights - low) / (high - low))


def judged(rubric) -> list:
  """A rubric's criteria for the judge (its texts), checks left out."""
  return [c for c, _ in rubric or () if isinstance(c, str)]


def check_records(cfg: JudgeConfig, records, where: str) -> None:
  """One line, before any model loads, for a rubric with more judged criteria than
  `judge.max_criteria` allows (the suffixes of a completion's pass are bounded and planned), or a
  check that cannot be checked."""
  for i, r in enumerate(records):
    n = len(judged(r.get("rubric")))
    if n > cfg.max_criteria:
      raise ConfigError(f"config key 'judge.max_criteria' = {cfg.max_criteria}: {where}, record "
                        f"{i} has a rubric of {n} judged criteria; set it to the most a record "
                        "has (each is a suffix in every completion's judge pass)")
    checks = [c for c, _ in r.get("rubric") or () if isinstance(c, dict)]
    instructions.validate(checks, f"{where}, record {i}, its rubric's checks")


def estimate(cfg: JudgeConfig, model: ModelConfig, chips: int) -> dict:
  """One judge batch a chip from its model's shapes, where nothing is compiled (`plan
  --analytic`), as `Judge.planned` lays it out: its weights over its chips, the KV cache of a
  pass and one layer's activations, FLOPs 2 x weights x tokens, and its weights read once a
  forward (the prefix's, then each criterion's)."""
  t = load.spec_without_checkpoint(model)[1].tunix_config
  d, f, kh = t.embed_dim, t.hidden_dim, t.num_kv_heads * t.head_dim
  weights = t.num_layers * (d * (2 * t.num_heads * t.head_dim + 2 * kh) + 3 * d * f)
  weights += t.num_embed * d
  k = cfg.max_criteria if prefix_template(cfg.criterion_prompt) is not None else 0
  s = SUFFIX_PLANNED if k else 0
  b, p = cfg.batch_size, planned_prefix(cfg) if k else 64 * math.ceil(cfg.max_tokens / 64)
  cache = t.num_layers * b * (p + s) * 2 * kh if k else 0
  item = jnp.dtype(model.dtype).itemsize
  return {"arguments": int(weights * item / chips),
          "temporaries": int((cache + b * p * (2 * d + f)) * item / chips),
          "flops": 2 * weights * b * (p + k * s) / chips, "bytes": weights * item * (1 + k) / chips,
          "note": "analytic estimate (nothing compiled)"}


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
    self._criteria = jax.jit(lambda params, *batch: criteria_probs(
        nnx.merge(graphdef, *params), *batch, mesh=mesh))
    self.prefix = prefix_template(cfg.criterion_prompt)  # None: a prompt a criterion
    self.pair_prefix = prefix_template(cfg.pairwise_prompt, ("first", "second"), after=None)

  @classmethod
  def own(cls, cfg: JudgeConfig, devices: list, seed: int) -> "Judge":
    """A judge of its own (`judge.model`) on `devices`, its weights loaded into their shards
    there (a mesh of its own, `mesh.forward_mesh`: 'tp' over them)."""
    mesh = mesh_lib.forward_mesh(devices, gemma.model_spec(cfg.model).tunix_config)
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
    tokenizer, spec = load.spec_without_checkpoint(cfg.model)
    mesh = mesh_lib.forward_mesh(own, spec.tunix_config) if own else setup.mesh
    graphdef, state, _ = gemma.abstract_model(spec, mesh)
    return cls(cfg, graphdef, (mesh_lib.placed(state, mesh),), tokenizer, mesh)

  def abstract_inputs(self) -> tuple:
    """(params, tokens, valid, grade ids) of one full batch of `judge.max_tokens` tokens."""
    s = lambda dtype: mesh_lib.batch_struct(
        self.mesh, (self.cfg.batch_size, self.cfg.max_tokens), dtype)
    return self.params, s(jnp.int32), s(jnp.bool_), self.ids

  def criteria_inputs(self) -> tuple:
    """(params, prefixes, their valid mask, suffixes, their lengths, (no, yes) ids) of one full
    pass of `criteria_probs`: `judge.batch_size` completions, each with `judge.max_criteria`
    suffixes of `SUFFIX_PLANNED` tokens behind a prefix of the rest of `judge.max_tokens`."""
    b, k, s = self.cfg.batch_size, self.cfg.max_criteria, SUFFIX_PLANNED
    p = planned_prefix(self.cfg)
    put = lambda shape, dtype: mesh_lib.batch_struct(self.mesh, shape, dtype)
    return (self.params, put((b, p), jnp.int32), put((b, p), jnp.bool_),
            put((b, k, s), jnp.int32), put((b, k), jnp.int32), self.yes_no)

  def planned(self) -> tuple:
    """(the jitted program, its abstract inputs) a batch of a step runs: one pass of completions
    with their criteria where records carry rubrics, else a batch of rubric prompts."""
    if in_passes(self.cfg):
      return self._criteria, self.criteria_inputs()
    return self._probs, self.abstract_inputs()

  def texts(self, completions, question, answer) -> list[str]:
    return [self.cfg.rubric.format(question=q, response=c,
                                   reference=a if a is not None else "(none given)")
            for q, c, a in zip(question, completions, answer)]

  def criterion_texts(self, completion: str, question: str, answer, rubric) -> list[str]:
    """A completion's prompts, one a criterion of its record's rubric."""
    ref = answer if answer is not None else "(none given)"
    return [self.cfg.criterion_prompt.format(question=question, response=completion,
                                             reference=ref, criterion=c) for c in judged(rubric)]

  def criterion_rows(self, completion: str, question: str, answer, rubric) -> tuple:
    """A completion's judged criteria as (prefix ids, [suffix ids]): the criterion prompt up to
    its first {criterion}, and each criterion's rest of it (`rows`)."""
    fill = dict(question=question, response=completion,
                reference=answer if answer is not None else "(none given)")
    return self.rows(self.prefix.format(**fill), [
        self.cfg.criterion_prompt.format(**fill, criterion=c) for c in judged(rubric)])

  def rows(self, head: str, texts: list[str]) -> tuple:
    """(prefix ids, [suffix ids]) of prompts `texts` that all begin with `head`: `head` with
    BOS, and each text's rest. Within `judge.max_tokens`, as the per-row path cuts its prompts:
    a suffix keeps its last max_tokens - 1 tokens (two long responses of a pair), and the
    prefix its last tokens beside the longest suffix (a prompt's end is kept)."""
    # a space before the suffix goes with it, as SentencePiece joins it to the next word
    head = head.rstrip(" ")
    suffixes = [self.tokenizer.encode(t[len(head):])[1 - self.cfg.max_tokens:] for t in texts]
    keep = max(1, self.cfg.max_tokens - max(map(len, suffixes)))
    return self.tokenizer.encode(head, add_bos=True)[-keep:], suffixes

  def criteria(self, rows: list) -> list[np.ndarray]:
    """Each completion's judged criteria's yes-probabilities from its `criterion_rows`, each
    completion read once (`passes`)."""
    k = max([self.cfg.max_criteria, *(len(xs) for _, xs in rows)])
    return [p[:, 1] for p in self.passes(rows, self.yes_no, k)]

  def passes(self, rows: list, grades: jax.Array, k: int) -> list[np.ndarray]:
    """Each row's ([its suffixes], K) probabilities of the K tokens `grades` after each of its
    suffixes, read behind its prefix once: `judge.batch_size` rows a pass of `k` suffixes
    (filler rows and suffixes keep its shape)."""
    n, pad = self.cfg.batch_size, self.tokenizer.pad_id
    out = []
    for start in range(0, len(rows), n):
      part = rows[start:start + n]
      batch = [mesh_lib.put_batch(self.mesh, a) for a in pack(part, n, k, pad)]
      p = mesh_lib.to_host(self._criteria(self.params, *batch, grades))
      out += [p[i, :len(xs)] for i, (_, xs) in enumerate(part)]
    return out

  def probs(self, texts: list[str], grades: jax.Array | None = None) -> np.ndarray:
    """[n, K] probabilities of the K tokens `grades` (default: `judge.grades`) among
    themselves after each prompt (`token_probs`)."""
    return self.token_probs([self.tokenizer.encode(t, add_bos=True) for t in texts], grades)

  def token_probs(self, prompts: list[list[int]], grades: jax.Array | None = None
                  ) -> np.ndarray:
    """`probs` of prompts as token ids, `judge.batch_size` a forward pass; each prompt's last
    `judge.max_tokens` tokens (the rubric's end, where the grade is due, is kept)."""
    grades = self.ids if grades is None else grades
    out = []
    for k in range(0, len(prompts), self.cfg.batch_size):
      ids = [x[-self.cfg.max_tokens:] for x in prompts[k:k + self.cfg.batch_size]]
      tokens, valid = left_padded(ids, self.cfg.batch_size, self.tokenizer.pad_id)
      put = lambda a: mesh_lib.put_batch(self.mesh, a)
      out.append(mesh_lib.to_host(self._probs(self.params, put(tokens), put(valid), grades))[
          :len(ids)])
    return np.concatenate(out) if out else np.zeros((0, len(grades)), np.float32)

  def yes(self, completions, question, answer, rubric) -> np.ndarray:
    """The yes-probabilities of every judged criterion of every completion, in order: a pass
    a `judge.batch_size` completions, or, with no prefix shared, a prompt a criterion."""
    args = list(zip(completions, question, answer, rubric))
    if self.prefix is None:
      texts = [t for a in args for t in self.criterion_texts(*a)]
      return self.probs(texts, self.yes_no)[:, 1] if texts else np.zeros(0, np.float32)
    rows = [self.criterion_rows(*a) for a in args if judged(a[3])]
    return np.concatenate(self.criteria(rows)) if rows else np.zeros(0, np.float32)

  def __call__(self, prompts, completions, question=None, answer=None, rubric=None, **_
               ) -> list[float]:
    """Each completion's reward: its expected grade under `judge.rubric`, or, where its record
    has a rubric, `rubric_score` of its criteria (`yes`: each completion read once)."""
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
      pick = lambda xs: [xs[i] for i in graded]
      yes = iter(self.yes(*map(pick, (completions, question, answer, rubric))))
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
    two gives 1 - p, and a response against itself gives exactly 0.5. The two orders share the
    prompt before the first response (question, reference), read once (`passes`); a prompt
    that opens with a response is read whole in each order."""
    n = len(first)
    ref = [a if a is not None else "(none given)" for a in answer]
    fill = lambda q, x, y, a: self.cfg.pairwise_prompt.format(
        question=q, first=x, second=y, reference=a)
    if self.pair_prefix is not None:
      rows = [self.rows(self.pair_prefix.format(question=q, reference=a),
                        [fill(q, x, y, a), fill(q, y, x, a)])
              for q, x, y, a in zip(question, first, second, ref)]
      return np.asarray([0.5 * (p[0, 0] + p[1, 1]) for p in self.passes(rows, self.ab, 2)],
                        np.float32).reshape(n)
    texts = [fill(*t) for t in zip(question, first, second, ref)]
    texts += [fill(*t) for t in zip(question, second, first, ref)]
    p = self.probs(texts, self.ab)
    return 0.5 * (p[:n, 0] + p[n:, 1])
