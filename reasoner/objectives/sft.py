"""Supervised fine-tuning: the LoRA learns written responses (worked solutions, chat replies)
before GRPO reinforces what it samples. `python -m reasoner sft` runs it in the same loop as
GRPO (`reasoner.loop`, through `STAGE`: mesh, checkpoints, exact resume, deadline, metrics,
held-out evaluation).

An example is a record's prompt, rendered by `data.template` exactly as rollouts and evaluation
render it, and its response followed by the end-of-turn (chat) or end-of-sequence token. The
loss is the mean negative log-likelihood of the batch's response tokens: prompt tokens are
context, never targets, and the fused chunked head (`heads.fused_token_loss`) takes it without
[B, T, V] logits. Examples are sorted by length (prompt bucket, then response) within windows
of `sft.window` batches, and each batch is padded to its own longest prompt and response
(rounded up to `sft.bucket`), so that padding stays small and few shapes compile; `padding` in
the metrics is the padded share.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reasoner import mesh as mesh_lib
from reasoner.data import prompts as prompts_lib
from reasoner.errors import DataError
from reasoner.engine.trainer import Stage, Trainer, check_finite


class SFTBatch(NamedTuple):
  prompt: jax.Array  # [B, P] left-padded
  prompt_valid: jax.Array  # [B, P]
  response: jax.Array  # [B, N] right-padded, ended by the stop token
  response_mask: jax.Array  # [B, N] the tokens the loss sees


def check(cfg, records: list[dict], where: str) -> None:
  """Every record has a response (before any model loads)."""
  missing = [i for i, r in enumerate(records) if not r.get("response")]
  if missing:
    raise DataError(f"sft: {len(missing)} of {len(records)} records of {where} have no response "
                    f"(data.response_field = '{cfg.data.response_field}'; record {missing[0]} "
                    "is the first)")


def encode(records: list[dict], template: str, tokenizer, max_prompt: int, max_response: int,
           overlong: str, log=print) -> list[tuple[list[int], list[int]]]:
  """(prompt ids with BOS, response ids with the stop token) of each record that fits; the rest
  dropped with one line of counts, or refused ('error'), as data.overlong says."""
  stop = tokenizer.end_of_turn_id if template == "chat" and tokenizer.end_of_turn_id else (
      tokenizer.eos_id)
  out = []
  for i, r in enumerate(records):
    p = tokenizer.encode(prompts_lib.render(template, r["question"]), add_bos=True)
    y = [*tokenizer.encode(r["response"]), stop]
    if len(p) <= max_prompt and len(y) <= max_response:
      out.append((p, y))
    elif overlong == "error":
      raise DataError(f"sft: record {i} has {len(p)} prompt and {len(y)} response tokens, over "
                      f"data.max_prompt_tokens = {max_prompt} or sft.max_response_tokens = "
                      f"{max_response} (data.overlong: error): {r['question'][:60]!r}")
  if len(out) < len(records):
    log(f"sft: dropped {len(records) - len(out)} of {len(records)} examples over "
        f"data.max_prompt_tokens = {max_prompt} or sft.max_response_tokens = {max_response}")
  return out


class Batches:
  """An endless, deterministic iterator of length-bucketed host batches. Epoch e shuffles the
  examples (seed, e), sorts each window of `window` batches by length, cuts it into batches and
  shuffles the epoch's batches; the state is the number of batches drawn (`get_state`), so a
  resumed run draws exactly the batches it would have drawn."""

  def __init__(self, examples: list, batch_size: int, seed: int, window: int, bucket: int,
               pad_id: int):
    if len(examples) < batch_size:
      raise DataError(f"sft: {len(examples)} examples, fewer than train.batch_size = "
                      f"{batch_size}")
    self.examples, self.batch_size, self.seed = examples, batch_size, seed
    self.window, self.bucket, self.pad_id = window, bucket, pad_id
    self.per_epoch = len(examples) // batch_size
    self.position, self._cached = 0, (None, None)

  def epoch(self, e: int) -> list[np.ndarray]:
    """The batches of epoch e, as arrays of example indices."""
    if self._cached[0] != e:
      rng = np.random.default_rng([self.seed, e])
      order = rng.permutation(len(self.examples))[:self.per_epoch * self.batch_size]
      # by prompt bucket, then response length: a batch's two widths are padded apart
      size = lambda i: (math.ceil(len(self.examples[i][0]) / self.bucket),
                        len(self.examples[i][1]))
      span = self.window * self.batch_size
      order = np.concatenate([sorted(order[k:k + span], key=size)
                              for k in range(0, len(order), span)])
      batches = order.reshape(self.per_epoch, self.batch_size)
      self._cached = (e, batches[rng.permutation(self.per_epoch)])
    return self._cached[1]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    e, i = divmod(self.position, self.per_epoch)
    self.position += 1
    return self.pad([self.examples[j] for j in self.epoch(e)[i]])

  def get_state(self) -> dict:
    return {"position": self.position}

  def set_state(self, state: dict) -> None:
    if set(state) != {"position"}:
      raise DataError(f"sft: the checkpoint's data state {sorted(state)} is not an SFT run's")
    self.position = int(state["position"])

  def padding(self) -> float:
    """The padded share of the tokens of the first epoch's batches."""
    real = sum(len(p) + len(y) for p, y in self.examples[:self.per_epoch * self.batch_size])
    total = sum(len(b) * sum(self._widths([self.examples[j] for j in b]))
                for b in self.epoch(0))
    return 1.0 - real / total

  def _widths(self, examples: list) -> tuple[int, int]:
    up = lambda n: math.ceil(n / self.bucket) * self.bucket
    return up(max(len(p) for p, _ in examples)), up(max(len(y) for _, y in examples))

  def pad(self, examples: list) -> dict[str, np.ndarray]:
    width, n = self._widths(examples)
    out = {"prompt": np.full((len(examples), width), self.pad_id, np.int32),
           "prompt_valid": np.zeros((len(examples), width), bool),
           "response": np.full((len(examples), n), self.pad_id, np.int32),
           "response_mask": np.zeros((len(examples), n), bool)}
    for k, (p, y) in enumerate(examples):
      out["prompt"][k, width - len(p):], out["prompt_valid"][k, width - len(p):] = p, True
      out["response"][k, :len(y)], out["response_mask"][k, :len(y)] = y, True
    return out


def batches(setup, log=None) -> Batches:
  """The run's training batches (`setup.train_records` encoded; the padding share logged)."""
  cfg = setup.cfg
  examples = encode(setup.train_records, cfg.data.template, setup.tokenizer,
                    cfg.data.max_prompt_tokens, cfg.sft.max_response_tokens, cfg.data.overlong,
                    log or (lambda _: None))
  out = Batches(examples, cfg.train.batch_size, cfg.train.seed, cfg.sft.window, cfg.sft.bucket,
                setup.tokenizer.pad_id)
  if log:
    log(f"sft: {len(examples)} examples, {out.per_epoch} batches an epoch, "
        f"{out.padding():.1%} of their tokens padding")
  return out


def nll(logp: jax.Array) -> jax.Array:
  return -logp


class SFTTrainer(Trainer):
  """`Trainer` with the SFT loss (temperature-1 likelihood): the same state, optimizer,
  micro-batches and placement."""

  def _sft_grads(self, base, lora, batch: SFTBatch, weights: jax.Array):
    """((loss, LoRA gradients), log-probs) of one (micro-)batch."""
    (loss, grads), (logp, _) = self.token_loss_grads(base, lora, *batch, weights, nll, ())
    return (loss, grads), logp

  def _train_step(self, base, state, batch: SFTBatch):
    m = batch.response_mask.astype(jnp.float32)
    weights = m / jnp.maximum(jnp.sum(m), 1.0)  # the mean over the whole batch's tokens
    (loss, grads), logp = self._in_micro_batches(
        lambda params, micro: self._sft_grads(*params, *micro), (base, state.lora),
        (batch, weights), (jnp.zeros((), jnp.float32), state.lora))
    state, metrics = self.apply(state, loss, grads)
    return state, {**metrics, "perplexity": jnp.exp(-jnp.sum(logp * weights))}


def sft_step(setup, trainer: SFTTrainer, state, data: Batches, step: int):
  """The next batch of `data`, one optimizer step: (state, metrics)."""
  t0 = time.perf_counter()
  host = next(data)
  batch = SFTBatch(**{k: mesh_lib.put_batch(setup.mesh, v) for k, v in host.items()})
  state, metrics = trainer.train_step(state, batch)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  check_finite(metrics["loss"], step)
  dt = time.perf_counter() - t0
  real = int(host["prompt_valid"].sum() + host["response_mask"].sum())
  cells = host["prompt"].size + host["response"].size
  return state, {**metrics, "response_tokens": int(host["response_mask"].sum()),
                 "padding": 1.0 - real / cells, "step_time_s": dt, "tokens_per_s": real / dt}


def _step(setup, sampler, trainer: SFTTrainer, state, data: Batches, step: int):
  return sft_step(setup, trainer, state, data, step)


STAGE = Stage("sft", SFTTrainer, batches, _step, check)
