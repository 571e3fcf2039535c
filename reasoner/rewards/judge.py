"""The `judge` reward: a Gemma model grades each completion against a rubric, read from its
next-token distribution over the grade tokens in one batched forward pass (no sampling, no
parsing of free text).

The rubric (`judge.rubric`, with {question}, {response} and {reference} filled in) ends where
the grade is due; the judge's probabilities of the grade tokens (`judge.grades`, e.g. 1-5,
renormalised among themselves) give the expected grade, scaled to 0-1. Only the grade tokens'
rows of the embedding are multiplied: no [B, V] logits.

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
from reasoner.engine import lora as lora_lib
from reasoner.errors import ConfigError
from reasoner.models import load
from reasoner.models.cache import causal_mask, positions_from_mask


def grade_ids(cfg: JudgeConfig, tokenizer) -> list[int]:
  """Each grade's token id; a grade that is not one token is refused (before any weight loads)."""
  ids = []
  for g in cfg.grades:
    enc = tokenizer.encode(g)
    if len(enc) != 1:
      raise ConfigError(f"config key 'judge.grades': {g!r} is {len(enc)} tokens for this "
                        "tokenizer; each grade must be one token")
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


class Judge:
  """The reward function `judge` (`__call__(prompts, completions, question=, answer=)`), bound to
  a model by `for_run`."""

  needs_answer = False

  def __init__(self, cfg: JudgeConfig, graphdef, params, tokenizer, mesh):
    self.cfg, self.graphdef, self.params, self.tokenizer, self.mesh = (
        cfg, graphdef, params, tokenizer, mesh)
    self.ids = jnp.asarray(grade_ids(cfg, tokenizer), jnp.int32)
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
    with jax.set_mesh(mesh):
      graphdef, state = nnx.split(nnx.eval_shape(
          lambda: spec.cls(spec.tunix_config, rngs=nnx.Rngs(0))))
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

  def probs(self, texts: list[str]) -> np.ndarray:
    """[n, K] grade probabilities, `judge.batch_size` prompts a forward pass; each prompt's
    last `judge.max_tokens` tokens (the rubric's end, where the grade is due, is kept)."""
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
      out.append(np.asarray(self._probs(self.params, put(tokens), put(valid), self.ids))[
          :len(ids)])
    return np.concatenate(out)

  def __call__(self, prompts, completions, question=None, answer=None, **_) -> list[float]:
    question = question or prompts
    answer = answer or [None] * len(completions)
    p = self.probs(self.texts(completions, question, answer))
    scale = np.arange(len(self.cfg.grades), dtype=np.float32) / (len(self.cfg.grades) - 1)
    return list(map(float, p @ scale))
