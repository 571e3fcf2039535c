"""The loop's sections: steps, batch, checkpoints, the session's deadline; the optimizer."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import pathlib
import re
import time

from reasoner.config.typed import fail as _fail

LOGGERS = ("tensorboard", "wandb")
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def process_start() -> float:
  """This process's start as a Unix time (from /proc on Linux; else when this module loaded).
  In a notebook that is the kernel's start, which a Kaggle session begins with."""
  try:
    ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return _IMPORTED


_IMPORTED = time.time()


def parse_deadline(text: str, start: float | None = None) -> float:
  """'8h45m', '90m', '3600s', '1.5h' (from `start`, default this process's start) or an ISO
  time ('2026-11-25T08:30', local time unless it names a zone) -> a Unix time."""
  text = str(text).strip()
  m = _DURATION.fullmatch(text)
  if text and m and any(m.groups()):
    h, mi, s = (float(g or 0) for g in m.groups())
    return (process_start() if start is None else start) + h * 3600 + mi * 60 + s
  try:
    return dt.datetime.fromisoformat(text).timestamp()
  except ValueError:
    raise ValueError("a duration from the process start such as 8h45m, 90m or 600s, or an ISO "
                     "time such as 2026-11-25T08:30") from None


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
  # Tokens per chip in each step of the vocabulary head's scan (reasoner/engine/heads.py); null: as
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
  # Where the metrics go besides metrics.jsonl: `tensorboard` (tb/) and `wandb` (Weights & Biases,
  # the `wandb` extra: online with WANDB_API_KEY or `wandb login`, else offline under wandb/ to
  # upload with `wandb sync`). A wandb that is missing or fails to start falls back to TensorBoard.
  loggers: tuple[str, ...] = ("tensorboard",)
  # Where compiled programs are kept between processes (JAX's persistent compilation cache,
  # `engine.session.compile_cache`, set by `build` for every command but `plan`): a resumed
  # session, the next stage or the same command again reads them instead of compiling (make
  # general's second run: the compiles of its first steps and evaluation). null: compile
  # afresh each process (to read --xla_dump_to, which a program read from the cache does not
  # write).
  compile_cache: str | None = "~/.cache/reasoner/jax"

  def __post_init__(self):
    if self.deadline is not None:
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
    if not self.loggers or not set(self.loggers) <= set(LOGGERS):
      _fail("train.loggers", list(self.loggers), "a list of " + " and/or ".join(LOGGERS))
    if self.compile_cache is not None and not self.compile_cache.strip():
      _fail("train.compile_cache", self.compile_cache, "a folder, or null (no cache)")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name):
      _fail("train.run_name", self.run_name, "letters, digits, '.', '_' or '-'")

