"""The training stages' sections: GRPO's rollouts and objective, SFT, preference optimisation,
distillation, the rewards and the judge. A new stage's section goes here."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Literal

from reasoner.config.model import ModelConfig
from reasoner.config.typed import fail as _fail


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
  """One reward function: a built-in name or 'module:function', its weight, and the records'
  categories it scores (null: every record; a row's reward is the weighted mean of those that
  score it)."""

  fn: str
  weight: float = 1.0
  categories: tuple[str, ...] | None = None
  # the longest a call may take (a batch of completions; the judge's too). Past it: `stop`, the
  # step in flight is not trained on and the run stops with one line, its state saved; `zero`,
  # the rows it did not score get 0 and the count is logged (reward/<fn>/timeouts)
  timeout_s: float = 600.0
  on_timeout: Literal["stop", "zero"] = "stop"

  def __post_init__(self):
    if self.weight < 0:
      _fail("rewards[].weight", self.weight, "a non-negative number")
    if not self.timeout_s > 0:
      _fail("rewards[].timeout_s", self.timeout_s, "a positive number of seconds")
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
  # Chips of the rollout's own, N (null: it shares the training chips and runs in turn): step
  # t + 1's groups are sampled there with the LoRA before step t's update while the other chips
  # train on step t's (one update stale, corrected by grpo.sampler_is: token); only the LoRA
  # crosses between them each step. On one host; GRPO and distillation.
  devices: int | None = None

  def __post_init__(self):
    if self.devices is not None and self.devices < 1:
      _fail("rollout.devices", self.devices, "a positive number of devices, or null")
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
  # Tunix's names and meanings (reasoner/objectives/grpo.py); token-mean is DAPO's.
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
  # Guidance by the record's written response (LUFFY's off-policy guidance, arXiv 2504.14945):
  # a group none of whose samples scores as high as its record's `response` trains on that
  # response in place of its lowest-scoring sample, so that a structure the policy never
  # samples (JSON, a title) still gets a positive advantage. Only records of
  # guidance_categories (null: any record with a response) that fit rollout.max_new_tokens.
  guidance: bool = False
  guidance_categories: tuple[str, ...] | None = None

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
    if self.guidance and self.sampler_is != "off":
      _fail("grpo.guidance", self.guidance, "false with grpo.sampler_is: token (a written "
            "response has no sampler log-probs to weigh it by)")
    if self.guidance_categories is not None and (not self.guidance_categories
                                                 or not all(self.guidance_categories)):
      _fail("grpo.guidance_categories", list(self.guidance_categories),
            "a non-empty list of category names, or null for every record")



@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """`python -m reasoner sft`: the loss on response tokens; train, optim and eval as GRPO's."""

  max_response_tokens: int = 256  # longer responses are dropped or refused, as data.overlong says
  # Examples are sorted by length within windows of this many batches, and each batch is padded
  # to its longest prompt and response rounded up to `bucket` tokens (few shapes to compile).
  window: int = 32
  bucket: int = 16
  # The prompt head that a category's prompts share (a few-shot header) runs once a batch, not
  # once a row (`data.examples.Heads`): the same loss, float32 sums in another order.
  shared_heads: bool = False

  def __post_init__(self):
    for f in ("max_response_tokens", "window", "bucket"):
      if getattr(self, f) < 1:
        _fail(f"sft.{f}", getattr(self, f), "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferConfig:
  """`python -m reasoner prefer`: preference optimisation on pairs of responses, the same LoRA
  (reasoner/objectives/preference.py). Symbols as in the papers: beta, gamma, lambda."""

  # dpo (Rafailov et al. 2023; the reference is the base with the LoRA off), ipo (Azar et al.
  # 2023, on mean log-probs as TRL's), simpo (Meng et al. 2024: length-normalised, a margin
  # gamma, no reference), orpo (Hong et al. 2024: the chosen NLL plus an odds-ratio term)
  loss: Literal["dpo", "ipo", "simpo", "orpo"] = "dpo"
  beta: float = 0.1  # DPO / IPO: the KL weight; SimPO: the reward scale
  gamma: float = 0.5  # SimPO: the target reward margin
  orpo_lambda: float = 0.1  # ORPO: the odds-ratio term's weight (Tunix's lambda_orpo)
  # ORPO's odds of a response from its mean token log-prob (the paper's, TRL's) or from its sum
  # (Tunix 0.1.7's dpo_trainer)
  orpo_odds: Literal["mean", "sum"] = "mean"
  label_smoothing: float = 0.0  # the chance a pair's label is flipped (cDPO; DPO, SimPO, ORPO)
  # file: the records' chosen and rejected responses (data.chosen_field, rejected_field);
  # policy: pairs the policy samples (online DPO): rollout.num_generations completions a prompt,
  # scored by the run's rewards, the best paired with the worst
  pairs: Literal["file", "policy"] = "file"
  min_margin: float = 0.1  # policy: the least reward gap of a pair; closer groups give none
  regenerate_every: int = 1  # policy: new pairs every N steps (N batches of pairs at once)
  max_sample_batches: int = 4  # policy: prompt batches drawn a batch of pairs, at most
  max_response_tokens: int = 256  # file: longer pairs are dropped or refused (data.overlong)

  def __post_init__(self):
    for f in ("beta", "orpo_lambda"):
      if getattr(self, f) <= 0:
        _fail(f"prefer.{f}", getattr(self, f), "a positive number")
    if self.gamma < 0 or self.min_margin < 0:
      key = "gamma" if self.gamma < 0 else "min_margin"
      _fail(f"prefer.{key}", getattr(self, key), "a non-negative number")
    if not 0 <= self.label_smoothing < 0.5:
      _fail("prefer.label_smoothing", self.label_smoothing, "a number in [0, 0.5)")
    for f in ("regenerate_every", "max_sample_batches", "max_response_tokens"):
      if getattr(self, f) < 1:
        _fail(f"prefer.{f}", getattr(self, f), "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  """`python -m reasoner distill`: on-policy distillation (reasoner/objectives/distill.py). The
  student (the policy) samples; a teacher scores every sampled token; the per-token reverse KL
  becomes a dense advantage."""

  # the teacher: a model of its own (a model section, e.g. {source: kaggle, name: gemma3-4b,
  # kaggle_handle: ...}, on `devices` or the policy's), or the policy's base with another run's
  # newest LoRA (a run directory: no second model in memory). One of the two.
  teacher: ModelConfig | None = None
  teacher_lora: str | None = None
  devices: int | None = None  # a teacher model of its own on the last N devices (before a judge's)
  # each sampled token's advantage: kl_coef * (log pi_teacher - log pi_student) ...
  kl_coef: float = 1.0
  # ... plus reward_weight x the GRPO advantage of the run's rewards (0: distillation alone)
  reward_weight: float = 0.0
  # k > 0: the teacher's k likeliest tokens at every sampled position (renormalised over them)
  # are also a soft target: topk_coef x their cross-entropy with the student's distribution
  # (GKD's forward KL on the student's own prefixes), so a token need not be sampled to be
  # taught. 0: the sampled tokens' reverse KL alone.
  topk: int = 0
  topk_coef: float = 1.0

  def __post_init__(self):
    if self.teacher is not None and self.teacher_lora is not None:
      _fail("distill.teacher_lora", self.teacher_lora, "null when distill.teacher is set (one "
            "teacher: a model of its own, or the policy's base with a run's LoRA)")
    if self.devices is not None and (self.devices < 1 or self.teacher is None):
      _fail("distill.devices", self.devices, "null (the policy's devices), or a positive number "
            "of devices for a distill.teacher of its own")
    if self.kl_coef < 0 or (self.kl_coef == 0 and self.topk == 0):
      _fail("distill.kl_coef", self.kl_coef, "a positive number (or 0 with distill.topk > 0)")
    if not 0 <= self.topk <= 256:
      _fail("distill.topk", self.topk, "0 (off) or a number of tokens from 1 to 256")
    if self.topk_coef <= 0:
      _fail("distill.topk_coef", self.topk_coef, "a positive number")
    if self.reward_weight < 0:
      _fail("distill.reward_weight", self.reward_weight, "a non-negative number")


DEFAULT_RUBRIC = (
    "Grade a response to a question for the quality of its reasoning and of its answer, 1 "
    "(poor), 2, 3, 4 or 5 (excellent). A reference answer, where given, is correct.\n\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n\n"
    "Grade (1, 2, 3, 4 or 5): ")
DEFAULT_CRITERION = (
    "Does the response below meet the criterion? A reference answer, where given, is correct."
    "\n\nQuestion: {question}\nReference answer: {reference}\nResponse: {response}\n\n"
    "Criterion: {criterion}\n\nAnswer Yes or No: ")
DEFAULT_PAIRWISE = (
    "Which of two responses to a question is better, for the quality of its reasoning and of "
    "its answer? A reference answer, where given, is correct.\n\nQuestion: {question}\n"
    "Reference answer: {reference}\n\nResponse A: {first}\n\nResponse B: {second}\n\n"
    "The better response (A or B): ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """The `judge` reward (reasoner/rewards/judge.py): a model grades completions against
  `rubric`."""

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
  # per-record rubrics (data.rubric_field): each criterion a prompt ({criterion} as well), read
  # as the probability of the second of `criterion_grades` (no, yes; one token each). The text
  # before {criterion} is read once a completion, each criterion's rest against it
  criterion_prompt: str = DEFAULT_CRITERION
  criterion_grades: tuple[str, ...] = ("No", "Yes")
  # the most judged criteria a record's rubric may have: the suffixes of a completion's pass
  # (`reasoner plan` plans that many); 0: the records carry no rubrics
  max_criteria: int = 0
  # the evaluation's win rate against the model before training: two responses in a prompt,
  # read as the probabilities of `pairwise_grades` (first better, second better), both orders,
  # the text before the first response read once
  pairwise_prompt: str = DEFAULT_PAIRWISE
  pairwise_grades: tuple[str, ...] = ("A", "B")
  # before a run uses the judge: does it rank the records' own responses above another
  # question's and junk (`rewards.judge.agreement`)? Below min_agreement the run stops
  check: bool = False
  min_agreement: float = 0.75

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
    if not 0 < self.min_agreement <= 1:
      _fail("judge.min_agreement", self.min_agreement, "a share in (0, 1]")
    if self.max_criteria < 0:
      _fail("judge.max_criteria", self.max_criteria, "0 (no rubrics) or a positive integer")
    if len(self.criterion_grades) != 2 or len(set(self.criterion_grades)) != 2:
      _fail("judge.criterion_grades", list(self.criterion_grades),
            "two distinct one-token answers, no then yes")
    if len(self.pairwise_grades) != 2 or len(set(self.pairwise_grades)) != 2:
      _fail("judge.pairwise_grades", list(self.pairwise_grades),
            "two distinct one-token answers, the first response then the second")
    if "{first}" not in self.pairwise_prompt or "{second}" not in self.pairwise_prompt:
      short = self.pairwise_prompt[:60] + "..." * (len(self.pairwise_prompt) > 60)
      _fail("judge.pairwise_prompt", short, "a text with {first} and {second}")
    if "{response}" not in self.criterion_prompt or "{criterion}" not in self.criterion_prompt:
      short = self.criterion_prompt[:60] + "..." * (len(self.criterion_prompt) > 60)
      _fail("judge.criterion_prompt", short, "a text with {response} and {criterion}")
    if self.devices is not None and (self.devices < 1 or self.model is None):
      _fail("judge.devices", self.devices, "null (the policy's devices), or a positive number "
            "of devices for a judge.model of its own (self is the policy's own weights)")

