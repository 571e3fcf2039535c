"""Rollouts one step ahead, on chips of their own (`rollout.devices`).

While the training chips take step t's update, the rollout's chips sample step t + 1's groups
with the LoRA from before that update: one update stale, which the truncated importance
weights of `grpo.sampler_is: token` correct (the sampler's own log-probs are kept). Only the
LoRA crosses between them: moved to the rollout's chips when its rollout starts.

The rollout runs on a thread of its own (JAX releases the GIL while a program runs), so the
host's work of one side (tokenising, scoring, a judge's calls) overlaps the other's programs
too. Resume is exact: a checkpoint keeps the data's state before the rollout in flight and the
LoRA it samples with (`drawn`, `behind`), and a resumed run draws that rollout again, with the
same key.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Ahead:
  """The rollout of the step after the one that trains. `draw(lora, step)` samples and scores
  step `step`'s groups (reading the next records of `data`); `move(lora)` places a LoRA on the
  rollout's chips."""

  def __init__(self, draw: Callable[[Any, int], Any], move: Callable[[Any], Any], data,
               behind: Any):
    self.draw, self.move, self.data = draw, move, data
    self.behind = move(behind)  # the LoRA the next rollout samples with
    self.drawn = copy.deepcopy(data.get_state())  # the data's state before its draws
    self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
    self._flight: tuple[int, Future] | None = None

  def take(self, step: int) -> Any:
    """Step `step`'s rollout: the one in flight, or drawn now (a session's first step)."""
    if self._flight is not None and self._flight[0] == step:
      future, self._flight = self._flight[1], None
      return future.result()
    return self.draw(self.behind, step)

  def start(self, step: int, lora: Any, run: bool = True) -> None:
    """Starts step `step`'s rollout with `lora` (moved now: the update that follows may reuse
    its buffers); with `run` False (past the last step) only notes where it would start, for a
    checkpoint that a longer run may resume. Call it with no rollout in flight."""
    assert self._flight is None, "a rollout is already in flight"
    self.drawn, self.behind = copy.deepcopy(self.data.get_state()), self.move(lora)
    if run:
      self._flight = (step, self._pool.submit(self.draw, self.behind, step))

  def settle(self) -> None:
    """Waits for the rollout in flight to finish, its result kept (before an evaluation, which
    uses the same sampler and rewards)."""
    if self._flight is not None:
      self._flight[1].exception()

  def close(self) -> None:
    """Drops the rollout in flight once it finishes (the run stops: its error, if any, belongs
    to a step that is not trained; a checkpoint draws it again from `drawn` and `behind`)."""
    if self._flight is not None:
      future, self._flight = self._flight[1], None
      future.exception()
    self._pool.shutdown()
