"""The train step every stage shares: one pure jitted function over (base, state, batch), state
donated; a stage (`reasoner.objectives`) gives its loss in `_train_step`.

    trainer = GRPOTrainer.for_run(graphdef, base, cfg)  # a stage's Trainer
    state = trainer.init_state(lora, key)
    state, metrics = trainer.train_step(state, batch)  # trainer.step(base, state, batch)

Only the LoRA parameters are in `state` and receive gradients; the base weights are a separate
argument that is never donated or updated. With `train.micro_batch` the step accumulates the
gradient over micro-batches of whole prompt groups in a `lax.scan` inside the same jitted
function: the same update as one pass over the batch, with one micro-batch's memory. A stage's
loss is a weighted per-token function of the log-probs through the fused head
(`token_loss_grads`); `logprobs` is the forward alone (a reference, an old policy, a teacher).
The loop runs a stage through its `Stage`: the trainer, its batches and one step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from reasoner import mesh as mesh_lib
from reasoner.config import Config, OptimConfig
from reasoner.engine import heads
from reasoner.models.prompt import completion_hidden


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # optimizer steps taken
  lora: Any  # nnx.State of nnx.LoRAParam
  opt_state: Any
  key: jax.Array  # uint32[2], the run's PRNG key


def completion_logprobs(model, prompt, prompt_valid, completion, completion_mask, *,
                        chunk: int | None = None, mesh=None,
                        temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """log p and entropy of each completion token under softmax(logits / temperature),
  [B * G, N] (the chunked head, `heads`)."""
  hidden = completion_hidden(model, prompt, prompt_valid, completion, completion_mask, mesh)
  return heads.token_logprobs(hidden, model.embedding(), completion, chunk=chunk, mesh=mesh,
                              softcap=model.logit_softcap, temperature=temperature)


def make_optimizer(o: OptimConfig, steps: int) -> tuple[optax.GradientTransformation,
                                                     optax.Schedule]:
  """AdamW under global-norm clipping; linear warm-up, then cosine decay over `steps`."""
  decay = optax.cosine_decay_schedule(o.learning_rate, max(1, steps - o.warmup_steps),
                                      alpha=o.min_lr_ratio)
  if o.warmup_steps:
    warm = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
    schedule = optax.join_schedules([warm, decay], [o.warmup_steps])
  else:
    schedule = decay
  return optax.chain(
      optax.clip_by_global_norm(o.max_grad_norm),
      optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)), schedule


class Trainer:
  """Holds the fixed parts (graph, base weights, optimizer, head settings); `step` is the pure
  jitted train step over (base, state, batch), the one function training runs and the planner
  compiles (from a stage's `abstract_inputs`). A stage subclasses it with its `_train_step`."""

  def __init__(self, graphdef, base, optim: OptimConfig, *, schedule_steps: int,
               head_chunk: int | None = None, micro_batch: int | None = None,
               temperature: float = 1.0):
    self.graphdef, self.base = graphdef, base
    # Log-probs of softmax(logits / temperature): GRPO's, the rollouts' sampling distribution.
    self.temperature = temperature
    self.head_chunk, self.micro_batch = head_chunk, micro_batch
    # The head chunks tokens per chip of this mesh (base may be abstract, as in `plan`).
    self.mesh = getattr(jax.tree.leaves(base)[0].sharding, "mesh", None)
    self.tx, self.schedule = make_optimizer(optim, schedule_steps)
    # State is donated on accelerators. XLA:CPU ran the 270M step 1.9x slower with donation
    # (51 s vs 27 s, 2 cores), so on CPU the old state is simply dropped. The platform is the
    # mesh's: the planner's compile-only TPU devices donate as a TPU run does.
    platform = self.mesh.devices.flat[0].platform if self.mesh else jax.default_backend()
    self.step = jax.jit(self._train_step, donate_argnums=(1,) if platform != "cpu" else ())
    self._logprobs = jax.jit(self._completion_logprobs)

  @classmethod
  def for_run(cls, graphdef, base, cfg: Config, **overrides) -> "Trainer":
    """The run's trainer; `overrides` replace keyword settings (the planner's `micro_batch`)."""
    kw = dict(schedule_steps=cfg.train.steps, head_chunk=cfg.train.head_chunk,
              micro_batch=cfg.train.micro_batch, temperature=1.0)
    return cls(graphdef, base, cfg.optim, **{**kw, **overrides})

  def init_state(self, lora, key: jax.Array) -> TrainState:
    """Step, key and optimizer counters are replicated on the LoRA weights' mesh, so that a
    checkpoint restores them there too."""
    state = TrainState(step=jnp.zeros((), jnp.int32), lora=lora, opt_state=self.tx.init(lora),
                       key=key)
    return mesh_lib.replicate_unplaced(state, jax.tree.leaves(lora)[0].sharding.mesh)

  def train_step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    return self.step(self.base, state, batch)

  def abstract_state(self, lora) -> TrainState:
    """The state of `step` as ShapeDtypeStructs placed as a run places it: `lora` (abstract,
    sharded) fixes the LoRA's and the moments' layout, the rest is replicated."""
    rep = mesh_lib.replicated(self.mesh)
    lora_def = jax.tree.structure(lora)

    def place(sub):
      like = lambda a, l: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=l.sharding)
      if jax.tree.structure(sub) == lora_def:
        return jax.tree.map(like, sub, lora)
      return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), sub)

    opt = jax.tree.map(place, jax.eval_shape(self.tx.init, lora),
                       is_leaf=lambda x: jax.tree.structure(x) == lora_def)
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), lora=lora,
                      opt_state=opt, key=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))

  def logprobs(self, lora, prompt, prompt_valid, completion, completion_mask) -> jax.Array:
    """Forward only: [R, N] log-probs (old policy when mu > 1; zeroed LoRA: the reference)."""
    return self._logprobs(self.base, lora, prompt, prompt_valid, completion, completion_mask)

  def micro_steps(self, prompts: int) -> int:
    """Passes the train step (and the log-prob forward) makes over a batch of `prompts`."""
    m = self.micro_batch or prompts
    if prompts % m:
      raise ValueError(f"a batch of {prompts} prompts does not split into micro-batches of "
                       f"train.micro_batch = {m} prompts")
    return prompts // m

  def _completion_logprobs(self, base, lora, *batch):
    def fwd(params, micro):
      return (), completion_logprobs(nnx.merge(self.graphdef, *params), *micro,
                                     chunk=self.head_chunk, mesh=self.mesh,
                                     temperature=self.temperature)[0]

    return self._in_micro_batches(fwd, (lora, base), tuple(batch), ())[1]

  def loss_grads(self, base, lora, prompt, prompt_valid, tokens, mask, head,
                 prompt_heads=None):
    """((loss, LoRA gradients), aux) of `head(hidden, model) -> (loss, aux)`, a head's loss of
    the hidden states of `tokens` after their prompts (`models.prompt.completion_hidden`;
    `prompt_heads`: the prompts' shared heads)."""
    def loss_fn(model):
      return head(completion_hidden(model, prompt, prompt_valid, tokens, mask, self.mesh,
                                     prompt_heads), model)

    # nnx.value_and_grad, not jax's: the layers run under nnx.remat (`models.layer`), which
    # cannot update a module merged inside a plain jax transform (TraceContextError).
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam),
                                 has_aux=True)
    (loss, aux), grads = grad_fn(nnx.merge(self.graphdef, lora, base))
    return (loss, grads), aux

  def token_loss_grads(self, base, lora, prompt, prompt_valid, tokens, mask, weights,
                       token_fn, token_args, soft=None, prompt_heads=None):
    """((loss, LoRA gradients), (log-probs, entropy)) of the weighted per-token loss
    `token_fn` of `tokens` after their prompts, through the fused head: GRPO's objective and
    SFT's likelihood (and `soft` targets' cross-entropy: distillation's teacher top-k)."""
    def head(hidden, model):
      loss, logp, entropy = heads.fused_token_loss(
          hidden, model.embedding(), tokens, weights, token_fn, token_args,
          chunk=self.head_chunk, mesh=self.mesh, softcap=model.logit_softcap,
          temperature=self.temperature, soft=soft)
      return loss, (logp, entropy)

    return self.loss_grads(base, lora, prompt, prompt_valid, tokens, mask, head, prompt_heads)

  def sequence_loss_grads(self, base, lora, prompt, prompt_valid, tokens, mask, weights,
                          seq_fn, seq_args):
    """((loss, LoRA gradients), (S, log-probs)) of `seq_fn(S, *seq_args)`, S each row's
    weighted sum of its tokens' log-probs, through the fused head (`fused_sequence_loss`):
    the preference losses."""
    def head(hidden, model):
      loss, s, logp, _ = heads.fused_sequence_loss(
          hidden, model.embedding(), tokens, weights, seq_fn, seq_args, chunk=self.head_chunk,
          mesh=self.mesh, softcap=model.logit_softcap, temperature=self.temperature)
      return loss, (s, logp)

    return self.loss_grads(base, lora, prompt, prompt_valid, tokens, mask, head)

  def _in_micro_batches(self, fn, params, tree, totals_like):
    """`fn(params, micro) -> (totals, rows)` over the batch `tree`: in one pass, or over the
    micro-batches of `micro_batch` whole prompt groups, one `lax.scan` step each, with totals
    summed in float32 (then cast to `totals_like`'s dtypes) and rows joined back in order;
    memory is one micro-batch's."""
    b = jax.tree.leaves(tree)[0].shape[0]  # prompts: the first array is the prompt
    k = self.micro_steps(b)
    if k == 1:
      return fn(params, tree)

    def body(carry, micro):
      # The weights ride in the carry, unchanged: the layers' nnx.remat and nnx.value_and_grad
      # refuse variables closed over from outside the scan ("different trace level").
      acc, params = carry
      totals, rows = fn(params, micro)
      acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, totals)
      return (acc, params), rows

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), totals_like)
    (totals, _), rows = jax.lax.scan(body, (zeros, params), split_micro(tree, b, k, self.mesh))
    totals = jax.tree.map(lambda x, like: x.astype(like.dtype), totals, totals_like)
    return totals, jax.tree.map(lambda x: join_micro(x, b), rows)

  def _train_step(self, base, state: TrainState, batch) -> tuple[TrainState, dict]:
    raise NotImplementedError("a stage's Trainer gives its loss (reasoner.objectives)")

  def apply(self, state: TrainState, loss, grads) -> tuple[TrainState, dict]:
    """The optimizer's update of `state` by the LoRA gradients `grads`: the new state, and the
    metrics every stage logs (loss, gradient norm, learning rate)."""
    updates, opt_state = self.tx.update(grads, state.opt_state, state.lora)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": self.schedule(state.step)}
    return state.replace(step=state.step + 1, lora=optax.apply_updates(state.lora, updates),
                         opt_state=opt_state), metrics


def check_finite(loss: float, step: int) -> None:
  """A step whose loss is not finite stops the run before its state is saved."""
  if not np.isfinite(loss):
    raise FloatingPointError(f"step {step + 1}: the loss is {loss}; stopping without saving "
                             "(the last checkpoint is intact)")


def split_micro(tree, prompts: int, k: int, mesh=None):
  """Splits every batch array of `tree` into k micro-batches of whole prompt groups, stacked
  on a new leading axis: [prompts * c, ...] -> [k, prompts / k * c, ...] (c = 1 for prompt
  arrays, G for completion rows). Micro-batch i holds prompts i, i + k, i + 2k, ...: strided,
  so that where the batch is split over 'fsdp' every chip keeps its own rows in each one."""
  def split(x):
    c = x.shape[0] // prompts
    y = x.reshape(prompts // k, k, c, *x.shape[1:]).swapaxes(0, 1)
    y = y.reshape(k, prompts // k * c, *x.shape[1:])
    if mesh is not None:
      y = jax.lax.with_sharding_constraint(y, mesh_lib.micro_placement(mesh, y.shape))
    return y

  return jax.tree.map(split, tree)


def join_micro(x: jax.Array, prompts: int) -> jax.Array:
  """The inverse of `split_micro` for one array: [k, prompts / k * c, ...] -> [prompts * c, ...]."""
  k = x.shape[0]
  c = x.shape[1] * k // prompts
  y = x.reshape(k, prompts // k, c, *x.shape[2:]).swapaxes(0, 1)
  return y.reshape(prompts * c, *x.shape[2:])


def checkpoint_tree(state: TrainState) -> dict:
  """What a checkpoint holds of the state (`engine.checkpoint`)."""
  return {"step": state.step, "lora": state.lora, "opt_state": state.opt_state, "key": state.key}


@dataclasses.dataclass(frozen=True)
class Stage:
  """A training stage as the loop (`reasoner.loop`) runs it."""

  name: str  # the CLI command and run.json's stage: grpo, sft, ...
  trainer: type  # its Trainer, built by `trainer.for_run(graphdef, base, cfg)`
  # (setup, log or None) -> the batches: an iterator with get_state / set_state (checkpointed)
  batches: Callable[..., Any]
  # (setup, sampler, trainer, state, batches, step) -> (state, metrics); metrics may carry
  # "samples" (rows for samples.jsonl) and "rollout_s" (an evaluation's time is estimated by it)
  step: Callable[..., tuple]
  # (cfg, records, where) -> None: the stage's rule for its records, before any model loads
  check_records: Callable[..., None] | None = None
  needs_teacher: bool = False  # distillation: `build(teacher=True)` loads the teacher
  # `step` in two halves, for rollouts a step ahead on chips of their own (`engine.ahead`):
  # draw(setup, sampler, lora, batches, step, key) -> drawn (host arrays and metrics, with
  # "tokens"), learn(setup, trainer, state, drawn, step) -> (state, metrics); None where the
  # stage samples nothing
  draw: Callable[..., Any] | None = None
  learn: Callable[..., tuple] | None = None
