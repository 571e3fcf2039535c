"""A teacher's log-probs of the tokens the policy sampled: one batched forward over prompt +
completion on the teacher's own devices, of which only a number a token (its log-prob) crosses
to the policy's (on-policy distillation, `objectives.distill`); with `distill.topk` = k, its k
likeliest tokens at every position and their log-probs instead (2k numbers a token).

The teacher is a model of its own (`distill.teacher`, any model this toolkit loads), loaded
straight into its shards on its devices (`distill.devices: N`, the last N before a judge's) or
on the policy's; or the policy's own base weights with another run's newest LoRA
(`distill.teacher_lora`): the same arrays as the policy's base, nothing copied but the LoRA.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import numpy as np
from flax import nnx

from reasoner import mesh as mesh_lib
from reasoner.config import Config, ConfigError, MeshConfig
from reasoner.engine import heads, manifest, topk as topk_lib
from reasoner.engine.checkpoint import find_checkpoints, read_newest
from reasoner.engine.sampler import logprob_temperature
from reasoner.engine.trainer import Trainer, checkpoint_tree, completion_logprobs
from reasoner.models import gemma, load
from reasoner.models.prompt import completion_hidden

log = logging.getLogger("reasoner")
PROBE = "Teachers and students: 12 + 7 = 19 <answer>"  # two tokenizers must encode it alike


def check(cfg: Config, tokenizer_kind: tuple[str, int] | None = None) -> None:
  """What can fail before any weight is read: a teacher named once, with the policy's
  vocabulary (`load.vocabulary`, or `tokenizer_kind`); a teacher run of this run's base model
  and LoRA settings, with a checkpoint."""
  d = cfg.distill
  if d.teacher is None and d.teacher_lora is None:
    raise ConfigError("config key 'distill.teacher' = None: distillation needs a teacher, a "
                      "model section (distill.teacher) or a run whose LoRA on this base teaches "
                      "(distill.teacher_lora=runs/<run>)")
  if d.teacher is not None:
    load.check(d.teacher)
    theirs, ours = load.vocabulary(d.teacher), tokenizer_kind or load.vocabulary(cfg.model)
    if theirs != ours:
      raise ConfigError(f"config key 'distill.teacher.name' = {d.teacher.name!r}: its tokenizer "
                        f"({theirs[0]}, {theirs[1]:,} ids) is not the policy's ({ours[0]}, "
                        f"{ours[1]:,} ids); a teacher scores the student's tokens, so both "
                        "must share one vocabulary")
    return
  run = find_checkpoints(d.teacher_lora, "distill.teacher_lora").parent
  manifest.check(cfg, run, via="distill.teacher_lora")


class Teacher:
  """`logprobs(prompt, prompt_valid, completion, mask) -> [R, N]` host log-probs of the
  completions' tokens under the teacher, and `topk(..., k) -> ([R, N, k], [R, N, k])` its k
  likeliest tokens' log-probs and ids at each completion position, at the temperature of the
  student's log-probs (`engine.sampler.logprob_temperature`)."""

  def __init__(self, graphdef, params: tuple, mesh, tokenizer, head_chunk: int | None,
               temperature: float):
    self.graphdef, self.params, self.mesh, self.tokenizer = graphdef, params, mesh, tokenizer
    self._fwd = jax.jit(lambda params, *batch: completion_logprobs(
        nnx.merge(graphdef, *params), *batch, chunk=head_chunk, mesh=mesh,
        temperature=temperature)[0])

    def top(params, prompt, prompt_valid, completion, mask, k):
      model = nnx.merge(graphdef, *params)
      hidden = completion_hidden(model, prompt, prompt_valid, completion, mask, mesh)
      kw = dict(chunk=head_chunk, mesh=mesh, softcap=model.logit_softcap,
                temperature=temperature)
      logp = heads.token_logprobs(hidden, model.embedding(), completion, **kw)[0]
      return (logp, *topk_lib.token_topk(hidden, model.embedding(), k, **kw))

    self._top = jax.jit(top, static_argnums=(5,))

  @classmethod
  def for_run(cls, setup, devices: list | None) -> "Teacher":
    """The run's teacher (`distill.*`), on `devices` (its own) or the policy's."""
    cfg = setup.cfg
    t = logprob_temperature(cfg)
    if cfg.distill.teacher is None:
      lora = _teacher_lora(setup)
      return cls(setup.graphdef, (lora, setup.base), setup.mesh, setup.tokenizer,
                 cfg.train.head_chunk, t)
    mesh = mesh_lib.make_mesh(MeshConfig(), devices) if devices else setup.mesh
    tokenizer, _, model = load.load_model(cfg.distill.teacher, mesh, cfg.train.seed)
    ours, theirs = setup.tokenizer, tokenizer
    if ours.vocab_size != theirs.vocab_size or ours.encode(PROBE) != theirs.encode(PROBE):
      raise ConfigError(f"config key 'distill.teacher': its tokenizer ({theirs.vocab_size:,} "
                        f"ids) encodes text unlike the policy's ({ours.vocab_size:,} ids); a "
                        "teacher scores the student's tokens, so both must share one")
    graphdef, state = nnx.split(model)
    return cls(graphdef, (state,), mesh, tokenizer, cfg.train.head_chunk, t)

  @classmethod
  def abstract(cls, setup) -> "Teacher":
    """The run's teacher with placed ShapeDtypeStructs for weights, on its devices of an
    abstract `setup` (`build(abstract=True)`): what `plan` compiles."""
    cfg, own = setup.cfg, setup.devices.teacher
    t = logprob_temperature(cfg)
    if cfg.distill.teacher is None:
      return cls(setup.graphdef, (setup.lora, setup.base), setup.mesh, setup.tokenizer,
                 cfg.train.head_chunk, t)
    mesh = mesh_lib.make_mesh(MeshConfig(), own) if own else setup.mesh
    tokenizer, spec = load.spec_without_checkpoint(cfg.distill.teacher)
    graphdef, state, _ = gemma.abstract_model(spec, mesh)
    return cls(graphdef, (mesh_lib.placed(state, mesh),), mesh, tokenizer,
               cfg.train.head_chunk, t)

  def abstract_inputs(self, prompts: int, rows: int, prompt_len: int, new_tokens: int):
    """(params, prompt, prompt_valid, completion, mask) of one batch, placed on its mesh."""
    s = lambda shape, dtype: mesh_lib.batch_struct(self.mesh, shape, dtype)
    return (self.params, s((prompts, prompt_len), np.int32), s((prompts, prompt_len), np.bool_),
            s((rows, new_tokens), np.int32), s((rows, new_tokens), np.bool_))

  def logprobs(self, prompt: np.ndarray, prompt_valid: np.ndarray, completion: np.ndarray,
               mask: np.ndarray) -> np.ndarray:
    """[R, N] float32 on the host, 0 where `mask` is False."""
    put = lambda a: mesh_lib.put_batch(self.mesh, a)
    out = mesh_lib.to_host(self._fwd(self.params, put(prompt), put(prompt_valid),
                                     put(completion), put(mask)))
    return np.where(mask, out, 0.0).astype(np.float32)

  def topk(self, prompt: np.ndarray, prompt_valid: np.ndarray, completion: np.ndarray,
           mask: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`logprobs` and, from the same forward, [R, N, k] float32 log-probs (descending) and
    int32 ids of the teacher's k likeliest tokens at each position, on the host."""
    put = lambda a: mesh_lib.put_batch(self.mesh, a)
    logp, logq, ids = self._top(self.params, put(prompt), put(prompt_valid), put(completion),
                                put(mask), k)
    return (np.where(mask, mesh_lib.to_host(logp), 0.0).astype(np.float32),
            mesh_lib.to_host(logq).astype(np.float32), mesh_lib.to_host(ids).astype(np.int32))


def _teacher_lora(setup):
  """The newest readable LoRA of `distill.teacher_lora`'s run, read-only, placed as the
  policy's LoRA (the same base weights run under it)."""
  cfg = setup.cfg
  folder = find_checkpoints(cfg.distill.teacher_lora, "distill.teacher_lora")
  target = checkpoint_tree(Trainer.for_run(setup.graphdef, setup.base, cfg).init_state(
      setup.lora, jax.random.PRNGKey(0)))
  say = lambda line: log.warning(line)
  step, tree, _ = read_newest(folder, "distill.teacher_lora", cfg.distill.teacher_lora, target,
                              say)
  log.info("teacher: %s (step %d) on the policy's base", pathlib.Path(folder) / str(step), step)
  return tree["lora"]
