"""Run outputs: console progress, metrics.jsonl, TensorBoard, samples and reward.png.

Only process 0 writes; other processes get a writer that does nothing. A run resumed at step S
(from its own checkpoint or another session's, `carry_over`) keeps each step's rows once: rows
past S are dropped (and a last row a kill cut short) and TensorBoard purges its events past S.
With `wandb` in `train.loggers`, the same scalars go to Weights & Biases as well (`wandb_log`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np

from reasoner.data.files import jsonl_rows, read_jsonl, read_text
from reasoner.engine import wandb_log


ROW_FILES = ("metrics.jsonl", "samples.jsonl")


def timed(metrics: dict, seconds: float) -> dict:
  """A step's metrics with its wall time and tokens a second (counted on the host: the batch
  spans every process)."""
  tokens = metrics.pop("tokens")
  return {**metrics, "step_time_s": seconds, "tokens_per_s": float(tokens / seconds)}


class MetricsWriter:
  def __init__(self, run_path: pathlib.Path, enabled: bool | None = None,
               loggers: tuple[str, ...] = ("tensorboard",), config: dict | None = None):
    """`loggers`: train.loggers; `config`: the run's, which W&B shows beside its charts."""
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.path = pathlib.Path(run_path)
    self.loggers, self.config = tuple(loggers), config or {}
    self._tb = None
    self._wandb = None
    if self.enabled:
      self.path.mkdir(parents=True, exist_ok=True)

  def start(self, step: int, carry_over: pathlib.Path | None = None) -> None:
    """Opens the run's logs at `step`: rows past it dropped, TensorBoard purged past it. With
    `carry_over` (another run's directory, never written to), its logs up to `step` are copied
    in first, so this run's logs read as one run's."""
    if not self.enabled:
      return
    if carry_over is not None:
      for name in (*ROW_FILES, "eval.json"):
        if (carry_over / name).is_file() and not (self.path / name).exists():
          shutil.copyfile(carry_over / name, self.path / name)
      if (carry_over / "tb").is_dir() and not (self.path / "tb").exists():
        shutil.copytree(carry_over / "tb", self.path / "tb")
    for name in ROW_FILES:
      truncate_rows(self.path / name, step)
    if "wandb" in self.loggers:
      self._wandb = wandb_log.open_run(self.path, self.config)
    if "tensorboard" in self.loggers or self._wandb is None:  # W&B's fallback
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(self.path / "tb"), purge_step=step + 1 if step else None)

  def log(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": step, **{k: _py(v) for k, v in metrics.items()}}
    _append(self.path / "metrics.jsonl", json.dumps(row) + "\n")
    scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
    if self._wandb is not None:
      self._wandb.log(step, scalars)
    if self._tb is None:
      return
    try:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, step)
      self._tb.flush()
    except OSError as e:  # a full disk: the row is kept, the event file left as it is
      _abandon(self._tb)
      self._tb = None
      raise OSError(e.errno, e.strerror, str(self.path / "tb")) from None

  def samples(self, step: int, tag: str, rows: list[dict]) -> None:
    if not self.enabled:
      return
    _append(self.path / "samples.jsonl",
            "".join(json.dumps({"step": step, "tag": tag, **r}) + "\n" for r in rows))

  def rows(self, tag: str) -> list[dict]:
    """The samples logged under `tag` (this session's or an earlier one's); [] where none."""
    return self.rows_by_tag([tag])[tag]

  def rows_by_tag(self, tags) -> dict[str, list[dict]]:
    """{tag: its samples} for each of `tags`, from one read of samples.jsonl."""
    out = {t: [] for t in tags}
    path = self.path / "samples.jsonl"
    if self.enabled and path.exists():
      for r in read_jsonl(path, torn_tail_ok=True):
        if r.get("tag") in out:
          out[r["tag"]].append(r)
    return out

  def write_json(self, name: str, data: dict, overwrite: bool = True) -> None:
    if self.enabled and (overwrite or not (self.path / name).exists()):
      (self.path / name).write_text(json.dumps(data, indent=2) + "\n")

  def plot(self) -> pathlib.Path | None:
    """reward.png: training reward per step (SFT and preference: the loss, on its own axis;
    preference: the pairs' reward accuracy), with held-out evaluations marked."""
    if not self.enabled or not (self.path / "metrics.jsonl").exists():
      return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(self.path / "metrics.jsonl", torn_tail_ok=True)
    train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/mean_reward"]) for r in rows if "eval/mean_reward" in r]
    # an SFT or preference step's row: its loss on its own axis
    pairs = [(r["step"], r["rewards/accuracy"]) for r in rows if "rewards/accuracy" in r]
    sft = [(r["step"], r["loss"]) for r in rows if "padding" in r or "rewards/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    lines = []
    if sft:
      twin = ax.twinx()
      s, v = zip(*sft)
      what = "preference" if pairs else "SFT"
      lines += twin.plot(s, v, "-", color="tab:red", alpha=0.6, label=f"{what} loss (right)")
      twin.set_ylabel("preference loss" if pairs else "SFT loss (NLL a response token)")
    if pairs:
      s, v = zip(*pairs)
      ax.plot(s, v, "-", alpha=0.6, label="pairs whose chosen outscores the rejected")
    if train:
      s, v = zip(*train)
      ax.plot(s, v, ".", alpha=0.4, label="rollout reward")
      if len(v) >= 5:
        k = 5
        ax.plot(s[k - 1:], np.convolve(v, np.ones(k) / k, mode="valid"), label="5-step mean")
    if evals:
      s, v = zip(*evals)
      ax.plot(s, v, "o-", label="held-out mean reward (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (0-1)")
    ax.set_ylim(-0.02, 1.02)
    lines = ax.get_lines() + lines
    if lines:
      ax.legend(lines, [l.get_label() for l in lines], loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = self.path / "reward.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

  def close(self) -> None:
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _abandon(tb) -> None:
  """Stops a TensorBoard writer whose disk failed without another flush: tensorboardX flushes
  again at exit (an atexit hook) and in its worker thread, and each would print a traceback.
  A resumed run purges the event file past its step."""
  for w in (tb.all_writers or {}).values():
    ev = w.event_writer
    if ev._closed:
      continue
    ev._closed = True  # what tensorboardX checks before each flush and at exit
    for stop in (ev._worker.stop, ev._ev_writer.close):
      try:
        stop()
      except OSError:
        pass


def _append(path: pathlib.Path, text: str) -> None:
  """Appends whole rows or none: a failed write (a full disk) is cut back to the file's old
  end, so that a resumed run never reads half a row, and raised naming the file."""
  size = path.stat().st_size if path.exists() else 0
  try:
    with open(path, "a") as f:
      f.write(text)
  except OSError as e:
    try:
      os.truncate(path, size)
    except OSError:
      pass
    raise OSError(e.errno, e.strerror, str(path)) from None


def truncate_rows(path: pathlib.Path, step: int) -> None:
  """Drops the JSONL rows of steps after `step` (written before a crash, to be written again),
  and a last row a kill cut short; the file is rewritten only where one is dropped, or where
  its last row lacks its newline (the next row would join it)."""
  if not path.is_file():
    return
  text = read_text(path)
  rows = jsonl_rows(text, str(path), torn_tail_ok=True)
  kept = [r for r in rows if r.get("step", 0) <= step]
  lines = sum(1 for line in text.split("\n") if line.strip())
  if len(kept) != lines or (text.strip() and not text.endswith("\n")):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def _py(v: Any) -> Any:
  if isinstance(v, (np.ndarray, jax.Array)):
    v = np.asarray(v)
    return v.item() if v.size == 1 else v.tolist()
  if isinstance(v, (np.floating, np.integer)):
    return v.item()
  return v
