"""Supervised fine-tuning: the LoRA learns written responses (worked solutions, chat replies)
before GRPO reinforces what it samples. `python -m reasoner sft` runs it in the same loop as
GRPO (`reasoner.loop`, through `STAGE`: mesh, checkpoints, exact resume, deadline, metrics,
held-out evaluation).

An example is a record's prompt and its response (`data.examples`: length-bucketed batches by
`sft.window` and `sft.bucket`; `padding` in the metrics is the padded share). The loss is the
mean negative log-likelihood of the batch's response tokens: prompt tokens are context, never
targets, and the fused chunked head (`heads.fused_token_loss`) takes it without [B, T, V]
logits.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from reasoner import mesh as mesh_lib
from reasoner.data import examples as examples_lib
from reasoner.errors import DataError
from reasoner.engine.trainer import Stage, Trainer, check_finite
from reasoner.models.prompt import Heads


class SFTBatch(NamedTuple):
  prompt: jax.Array  # [B, P] left-padded (with shared heads: each prompt's rest after its head)
  prompt_valid: jax.Array  # [B, P]
  response: jax.Array  # [B, N] right-padded, ended by the stop token
  response_mask: jax.Array  # [B, N] the tokens the loss sees
  # sft.shared_heads (`data.examples.Heads`): each prompt's head [B] and the heads [K, H]
  head_of: jax.Array | None = None
  head_tokens: jax.Array | None = None
  head_valid: jax.Array | None = None


def check(cfg, records: list[dict], where: str) -> None:
  """Every record has a response (before any model loads)."""
  missing = [i for i, r in enumerate(records) if not r.get("response")]
  if missing:
    raise DataError(f"sft: {len(missing)} of {len(records)} records of {where} have no response "
                    f"(data.response_field = '{cfg.data.response_field}'; record {missing[0]} "
                    "is the first)")


def batches(setup, log=None) -> examples_lib.Batches:
  """The run's training batches (`setup.train_records` encoded; the padding share logged)."""
  return examples_lib.for_run(setup, setup.cfg.sft.max_response_tokens, log,
                              shared_heads=setup.cfg.sft.shared_heads)


def nll(logp: jax.Array) -> jax.Array:
  return -logp


class SFTTrainer(Trainer):
  """`Trainer` with the SFT loss (temperature-1 likelihood): the same state, optimizer,
  micro-batches and placement."""

  def _sft_grads(self, base, lora, batch: SFTBatch, weights: jax.Array, table=None):
    """((loss, LoRA gradients), log-probs) of one (micro-)batch; `table`: the shared heads'
    (tokens, valid), or None."""
    heads = None if table is None else Heads(*table, batch.head_of)
    (loss, grads), (logp, _) = self.token_loss_grads(base, lora, *batch[:4], weights, nll, (),
                                                     prompt_heads=heads)
    return (loss, grads), logp

  def _train_step(self, base, state, batch: SFTBatch):
    m = batch.response_mask.astype(jnp.float32)
    weights = m / jnp.maximum(jnp.sum(m), 1.0)  # the mean over the whole batch's tokens
    # the heads are every micro-batch's: only their rows' `head_of` is split
    table = None if batch.head_tokens is None else (batch.head_tokens, batch.head_valid)
    rows = batch._replace(head_tokens=None, head_valid=None)
    (loss, grads), logp = self._in_micro_batches(
        lambda params, micro: self._sft_grads(*params, *micro, table), (base, state.lora),
        (rows, weights), (jnp.zeros((), jnp.float32), state.lora))
    state, metrics = self.apply(state, loss, grads)
    return state, {**metrics, "perplexity": jnp.exp(-jnp.sum(logp * weights))}


def sft_step(setup, trainer: SFTTrainer, state, data: examples_lib.Batches, step: int):
  """The next batch of `data`, one optimizer step: (state, metrics)."""
  t0 = time.perf_counter()
  host = next(data)
  table = {k: host.pop(k) for k in ("head_tokens", "head_valid") if k in host}
  batch = SFTBatch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()},
                   **mesh_lib.replicate_unplaced(table, setup.mesh))
  state, metrics = trainer.train_step(state, batch)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  check_finite(metrics["loss"], step)
  dt = time.perf_counter() - t0
  real = int(host["prompt_valid"].sum() + host["response_mask"].sum())  # heads: once each
  cells = host["prompt"].size + host["response"].size
  if table:
    real, cells = real + int(table["head_valid"].sum()), cells + table["head_valid"].size
  return state, {**metrics, "response_tokens": int(host["response_mask"].sum()),
                 "padding": 1.0 - real / cells, "step_time_s": dt, "tokens_per_s": real / dt}


def _step(setup, sampler, trainer: SFTTrainer, state, data: examples_lib.Batches, step: int):
  return sft_step(setup, trainer, state, data, step)


STAGE = Stage("sft", SFTTrainer, batches, _step, check)
