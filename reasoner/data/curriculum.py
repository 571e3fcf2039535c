"""A curriculum for the RL stages (`data.curriculum`): which records a step draws.

Two forms, alone or together:
- By a record field on a schedule: from step `from_step` of each phase on, the records whose
  field (e.g. `difficulty`) is one of the phase's `values`. Records without the field are drawn
  in every phase (a mixture's general prompts beside graded math).
- Adaptive: after each step, a prompt whose G completions all reached `solved_at` (solved in
  every sample) or all stayed at or below `failed_at` (never solved) is set aside for
  `set_aside_steps` steps, then comes back. Neither teaches GRPO anything (every advantage in
  its group is zero); a prompt set aside frees its place for one that does.

A batch is `batch_size` records drawn without replacement from those eligible at the step
(with a mixture, by the sources' weights), from a generator seeded by (seed, batches drawn): the
order is deterministic, and the state (batches drawn, the step, the prompts set aside) is the
checkpoint's data state, so resume is exact. Where fewer records than a batch are eligible, the
ones set aside are drawn too, the phase's records before any other.
"""

from __future__ import annotations

import numpy as np

from reasoner.config import DataConfig
from reasoner.data import sources
from reasoner.errors import ConfigError, DataError


def check(cfg: DataConfig, records: list[dict], where: str) -> None:
  """One line, before any model loads, for a curriculum field that no record has, or a phase
  whose values no record has (a typo would draw only the records without the field)."""
  c = cfg.curriculum
  if c is None or c.field is None:
    return
  if not any(c.field in r for r in records):
    raise ConfigError(f"config key 'data.curriculum.field' = {c.field!r}: no record of {where} "
                      f"has it (their fields: {', '.join(sorted(records[0]))})")
  for k, phase in enumerate(c.schedule):
    if not any(r.get(c.field) in phase.values for r in records):
      raise ConfigError(f"config key 'data.curriculum.schedule[{k}].values' = "
                        f"{list(phase.values)}: no record of {where} has {c.field} in them")


class Curriculum:
  """An endless iterator of record batches (each record with its `index`) under
  `data.curriculum`; `observe(step, groups)` after each step moves it on."""

  def __init__(self, records: list[dict], batch_size: int, seed: int, cfg: DataConfig):
    if len(records) < batch_size:
      raise DataError(f"{len(records)} training records, fewer than train.batch_size = "
                      f"{batch_size}")
    self.records, self.batch_size, self.seed, self.cfg = records, batch_size, seed, cfg
    weights = sources.draw_weights(records, cfg.mixture)
    self.weights = np.ones(len(records)) if weights is None else np.asarray(weights)
    self.drawn, self.step, self.aside = 0, 0, {}  # aside: record index -> step it returns

  def phase(self, step: int) -> np.ndarray:
    """[n] bool: the records the schedule allows at `step`."""
    c = self.cfg.curriculum
    if not c.schedule:
      return np.ones(len(self.records), bool)
    values = [p for p in c.schedule if p.from_step <= step][-1].values
    return np.asarray([r.get(c.field, values[0]) in values for r in self.records])

  def __iter__(self):
    return self

  def __next__(self) -> list[dict]:
    allowed = self.phase(self.step)
    back = np.ones(len(self.records), bool)
    back[[i for i, until in self.aside.items() if until > self.step]] = False
    rng = np.random.default_rng([self.seed, self.drawn])
    self.drawn += 1
    picked: list[int] = []
    for pool in (allowed & back, allowed, np.ones_like(allowed)):  # widest last
      pool[picked] = False
      need = self.batch_size - len(picked)
      idx = np.flatnonzero(pool)
      if need and idx.size:
        p = self.weights[idx] / self.weights[idx].sum()
        picked += rng.choice(idx, min(need, idx.size), replace=False, p=p).tolist()
    return [{**self.records[i], "index": i} for i in picked]

  def observe(self, step: int, groups: list[tuple[list[dict], np.ndarray]]) -> None:
    """After step `step`: its groups' (records, rewards [B, G]) set solved and failed prompts
    aside (adaptive), and the next batch is drawn for step + 1."""
    c = self.cfg.curriculum
    self.step = step + 1
    if not c.set_aside_steps:
      return
    for records, rewards in groups:
      for r, row in zip(records, np.asarray(rewards)):
        if row.min() >= c.solved_at or row.max() <= c.failed_at:
          self.aside[r["index"]] = self.step + c.set_aside_steps
    self.aside = {i: s for i, s in self.aside.items() if s > self.step}

  def metrics(self) -> dict[str, float]:
    """For the step's log: the prompts set aside, and the schedule's phase."""
    c = self.cfg.curriculum
    phase = sum(p.from_step <= self.step for p in c.schedule) - 1 if c.schedule else 0
    return {"curriculum/set_aside": len(self.aside), "curriculum/phase": phase}

  def get_state(self) -> dict:
    return {"drawn": self.drawn, "step": self.step,
            "aside": sorted([i, s] for i, s in self.aside.items())}

  def set_state(self, state: dict) -> None:
    if set(state) != {"drawn", "step", "aside"}:
      raise DataError(f"the checkpoint's data state {sorted(state)} is not a curriculum's "
                      "(data.curriculum was set after the run began, or removed)")
    self.drawn, self.step = int(state["drawn"]), int(state["step"])
    self.aside = {int(i): int(s) for i, s in state["aside"]}
