"""Preference optimisation: the LoRA learns to prefer a chosen response to a rejected one, as the
losses of DPO, IPO, SimPO and ORPO as pure functions of each response's sequence log-prob;
then the stage: its batch, its train step (`PreferenceTrainer`) and one step of the loop.

A pair is a prompt and two responses, the chosen in a batch's row 2i and the rejected in row
2i + 1, so that the prompt runs once for both (`models.prompt.completion_hidden`, G = 2). Each
row's S = sum of its tokens' log-probs comes from the fused head (`heads.fused_sequence_loss`):
no [B, T, V] logits, and the loss's gradient in the same pass. With c, r the chosen's and the
rejected's S, |y| their token counts, and c_ref, r_ref the reference's (the base under the LoRA
the run started from, lora.init_from's, as TRL takes the SFT model; under none without it;
its forward once a batch, never a second model):

- dpo: -log sigmoid(beta [(c - c_ref) - (r - r_ref)]) (Rafailov et al. 2023, Tunix's, TRL's);
- ipo: ([(c - c_ref) / |y_c| - (r - r_ref) / |y_r|] - 1 / (2 beta))^2 (Azar et al. 2023, on
  mean log-probs as TRL's);
- simpo: -log sigmoid(beta c / |y_c| - beta r / |y_r| - gamma) (Meng et al. 2024), no
  reference;
- orpo: -c / |y_c| - lambda log sigmoid(log odds(y_c) - log odds(y_r)), odds(y) = P / (1 - P)
  with P the mean token probability exp(S / |y|) (Hong et al. 2024, TRL's) or exp(S)
  (`prefer.orpo_odds: sum`, Tunix 0.1.7's), no reference.

Label smoothing (cDPO) replaces -log sigmoid(z) by -(1 - e) log sigmoid(z) - e log sigmoid(-z)
in dpo, simpo and orpo's odds term. The batch's loss is the mean over its pairs, so that
micro-batches of whole pairs add up to the one-pass update. Logged, as Tunix names them:
rewards/chosen and /rejected (beta times the log-ratio to the reference; SimPO beta, ORPO
lambda times the mean log-prob), their margin and accuracy (the chosen's reward above the
rejected's), and log_probs/chosen and /rejected (sums).

Pairs come from the records (`prefer.pairs: file`, `data.chosen_field` and `rejected_field`)
or from the policy (`policy`, `objectives.pairs`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reasoner import mesh as mesh_lib
from reasoner.config import Config
from reasoner.data import examples as examples_lib
from reasoner.engine.trainer import Stage, Trainer, TrainState, check_finite
from reasoner.errors import DataError
from reasoner.models import lora as lora_lib
from reasoner.objectives import pairs as pairs_lib


@dataclasses.dataclass(frozen=True)
class PairObjective:
  """The pair loss's static settings (hashable: part of the jitted step)."""

  loss: str = "dpo"  # dpo | ipo | simpo | orpo
  beta: float = 0.1
  gamma: float = 0.5
  orpo_lambda: float = 0.1
  orpo_odds: str = "mean"
  label_smoothing: float = 0.0

  @classmethod
  def from_config(cls, p) -> "PairObjective":
    """From a `config.PreferConfig`."""
    return cls(p.loss, p.beta, p.gamma, p.orpo_lambda, p.orpo_odds, p.label_smoothing)

  @property
  def reference(self) -> bool:
    """Whether the loss compares with the reference policy (the base with the LoRA off)."""
    return self.loss in ("dpo", "ipo")


def _smoothed(z: jax.Array, e: float) -> jax.Array:
  """-log sigmoid(z), the label flipped with probability e."""
  return -(jax.nn.log_sigmoid(z) * (1 - e) + jax.nn.log_sigmoid(-z) * e)


def _log1m_exp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x < 0 (x at most -1e-7: a certain response has no finite odds)."""
  return jnp.log(-jnp.expm1(jnp.minimum(x, -1e-7)))


def pair_losses(logps: jax.Array, lengths: jax.Array, ref: jax.Array, obj: PairObjective
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """[2P] rows' summed log-probs (chosen, rejected, chosen, ...), token counts and reference
  sums -> [P] losses, chosen rewards, rejected rewards (the module's formulas)."""
  c, r = logps[0::2], logps[1::2]
  lc, lr = jnp.maximum(lengths[0::2], 1.0), jnp.maximum(lengths[1::2], 1.0)
  rc, rr = ref[0::2], ref[1::2]
  e = obj.label_smoothing
  if obj.loss == "dpo":
    wc, wr = obj.beta * (c - rc), obj.beta * (r - rr)
    return _smoothed(wc - wr, e), wc, wr
  if obj.loss == "ipo":
    d = (c - rc) / lc - (r - rr) / lr
    wc, wr = obj.beta * (c - rc) / lc, obj.beta * (r - rr) / lr
    return jnp.square(d - 1.0 / (2 * obj.beta)), wc, wr
  mc, mr = c / lc, r / lr
  if obj.loss == "simpo":
    wc, wr = obj.beta * mc, obj.beta * mr
    return _smoothed(wc - wr - obj.gamma, e), wc, wr
  a, b = (mc, mr) if obj.orpo_odds == "mean" else (c, r)  # orpo
  log_odds = (a - b) - (_log1m_exp(a) - _log1m_exp(b))
  return -mc + obj.orpo_lambda * _smoothed(log_odds, e), obj.orpo_lambda * a, obj.orpo_lambda * b


def batch_loss(logps: jax.Array, lengths: jax.Array, ref: jax.Array, weight: jax.Array, *,
               obj: PairObjective) -> jax.Array:
  """The batch's loss: sum over pairs of weight x loss, `weight` [2P] the pair's (its chosen
  row's) share of the whole batch (1 / pairs; 0 for a filler): micro-batches add up."""
  return jnp.sum(weight[0::2] * pair_losses(logps, lengths, ref, obj)[0])


def pair_metrics(logps, lengths, ref, weight, obj: PairObjective) -> dict[str, jax.Array]:
  """Means over the batch's real pairs (weight > 0) of the rewards, their margin and accuracy,
  and the summed log-probs."""
  _, wc, wr = pair_losses(logps, lengths, ref, obj)
  real = (weight[0::2] > 0).astype(jnp.float32)
  mean = lambda x: jnp.sum(x * real) / jnp.maximum(jnp.sum(real), 1.0)
  return {"rewards/chosen": mean(wc), "rewards/rejected": mean(wr),
          "rewards/margin": mean(wc - wr), "rewards/accuracy": mean((wc > wr).astype(jnp.float32)),
          "log_probs/chosen": mean(logps[0::2]), "log_probs/rejected": mean(logps[1::2]),
          "pairs": jnp.sum(real)}


def dense_loss(token_logps: jax.Array, mask: jax.Array, ref: jax.Array, obj: PairObjective
               ) -> jax.Array:
  """The mean pair loss from [2P, N] token log-probs: what the fused step computes, written
  densely (the tests' reference)."""
  m = mask.astype(jnp.float32)
  s, n = jnp.sum(token_logps * m, axis=1), jnp.sum(m, axis=1)
  return jnp.mean(pair_losses(s, n, ref, obj)[0])


# ------------------------------------------------------------------------------- the stage

class PairBatch(NamedTuple):
  prompt: jax.Array  # [P, T] left-padded, each shared by its pair's two rows
  prompt_valid: jax.Array  # [P, T]
  response: jax.Array  # [2P, N] right-padded, ended by the stop token: chosen, rejected, ...
  response_mask: jax.Array  # [2P, N] the tokens the loss sees
  ref_logp: jax.Array  # [2P] the reference's summed log-probs (zeros without a reference)
  weight: jax.Array  # [2P] each pair's share of the batch's loss (0: a filler)


class PreferenceTrainer(Trainer):
  """`Trainer` with a pair loss (temperature-1 log-probs)."""

  def __init__(self, graphdef, base, prefer, optim, **kw):
    self.obj = PairObjective.from_config(prefer)
    super().__init__(graphdef, base, optim, **kw)

  @classmethod
  def for_run(cls, graphdef, base, cfg: Config, **overrides) -> "PreferenceTrainer":
    kw = dict(schedule_steps=cfg.train.steps, head_chunk=cfg.train.head_chunk,
              micro_batch=cfg.train.micro_batch, temperature=1.0)
    return cls(graphdef, base, cfg.prefer, cfg.optim, **{**kw, **overrides})

  def reference(self, ref, lora, host: dict) -> np.ndarray:
    """[2P] the reference's summed log-probs of a host batch: the base under `ref` (the LoRA
    the run started from) or under none (None: `lora` zeroed); zeros where the loss has no
    reference."""
    if not self.obj.reference:
      return np.zeros(host["response"].shape[0], np.float32)
    put = lambda a: mesh_lib.put_batch(self.mesh, a)
    ref = lora_lib.zeros_like(lora) if ref is None else ref
    logp = self.logprobs(ref, *(put(host[k]) for k in (
        "prompt", "prompt_valid", "response", "response_mask")))
    return (np.asarray(jax.device_get(logp)) * host["response_mask"]).sum(1).astype(np.float32)

  def abstract_inputs(self, lora, pairs: int, prompt_len: int, response_len: int) -> tuple:
    """(base, state, batch) of `step` as placed ShapeDtypeStructs, for `pairs` pairs."""
    s = lambda shape, dtype: mesh_lib.batch_struct(self.mesh, shape, dtype)
    batch = PairBatch(s((pairs, prompt_len), jnp.int32), s((pairs, prompt_len), jnp.bool_),
                      s((2 * pairs, response_len), jnp.int32),
                      s((2 * pairs, response_len), jnp.bool_), s((2 * pairs,), jnp.float32),
                      s((2 * pairs,), jnp.float32))
    return self.base, self.abstract_state(lora), batch

  def _pair_grads(self, base, lora, batch: PairBatch):
    """((loss, LoRA gradients), summed log-probs [2P]) of one (micro-)batch."""
    m = batch.response_mask.astype(jnp.float32)
    (loss, grads), (s, _) = self.sequence_loss_grads(
        base, lora, *batch[:4], m, functools.partial(batch_loss, obj=self.obj),
        (jnp.sum(m, axis=1), batch.ref_logp, batch.weight))
    return (loss, grads), s

  def _train_step(self, base, state: TrainState, batch: PairBatch):
    (loss, grads), s = self._in_micro_batches(
        lambda params, micro: self._pair_grads(*params, micro), (base, state.lora), batch,
        (jnp.zeros((), jnp.float32), state.lora))
    state, metrics = self.apply(state, loss, grads)
    lengths = jnp.sum(batch.response_mask.astype(jnp.float32), axis=1)
    return state, {**metrics, **pair_metrics(s, lengths, batch.ref_logp, batch.weight,
                                             self.obj)}


def prefer_step(setup, sampler, trainer: PreferenceTrainer, state, data, step: int):
  """The next batch of pairs (drawn again from the policy when due), its reference log-probs,
  one optimizer step: (state, metrics)."""
  t0 = time.perf_counter()
  extra = {}
  if isinstance(data, pairs_lib.PolicyPairs) and data.due():
    extra = data.regenerate(setup, sampler, state.lora, jax.random.fold_in(state.key, step))
  host = next(data)
  host["ref_logp"] = trainer.reference(setup.reference, state.lora, host)
  batch = PairBatch(**{k: mesh_lib.put_batch(setup.mesh, host[k]) for k in PairBatch._fields})
  state, metrics = trainer.train_step(state, batch)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  check_finite(metrics["loss"], step)
  dt = time.perf_counter() - t0
  tokens = int(host["prompt_valid"].sum() * 2 + host["response_mask"].sum())
  return state, {**metrics, **extra, "response_tokens": int(host["response_mask"].sum()),
                 "step_time_s": dt, "tokens_per_s": tokens / dt}


def batches(setup, log=None):
  """The run's pairs: the records' (`prefer.pairs: file`, length-bucketed as SFT's, each pair
  weighing 1 / batch), or the policy's (`pairs_lib.PolicyPairs`)."""
  cfg = setup.cfg
  if cfg.prefer.pairs == "policy":
    return pairs_lib.PolicyPairs(setup)
  return examples_lib.for_run(setup, cfg.prefer.max_response_tokens, log,
                              ("chosen", "rejected"), "prefer", "prefer.max_response_tokens",
                              Weighted, "pairs")


class Weighted(examples_lib.Batches):
  """Batches of the records' pairs, each pair weighing 1 / batch in the loss."""

  def pad(self, examples: list) -> dict:
    out = super().pad(examples)
    out["weight"] = np.full(2 * len(examples), 1.0 / len(examples), np.float32)
    return out


def check(cfg, records: list[dict], where: str) -> None:
  """The records' pairs (`prefer.pairs: file`), before any model loads: each record has both
  responses, and they differ."""
  if cfg.prefer.pairs != "file":
    return
  for i, r in enumerate(records):
    for k in ("chosen", "rejected"):
      if not r.get(k):
        raise DataError(f"prefer: record {i} of {where} has no {k} response (data.{k}_field = "
                        f"'{getattr(cfg.data, f'{k}_field')}'); a pair file needs both, or "
                        "prefer.pairs=policy samples pairs")
    if r["chosen"].strip() == r["rejected"].strip():
      raise DataError(f"prefer: record {i} of {where} has the same chosen and rejected "
                      f"response ({r['chosen'][:60]!r}): a pair teaches nothing")


STAGE = Stage("prefer", PreferenceTrainer, batches, prefer_step, check)
