"""Scoring a batch with the configured rewards: each reward a function `(prompts, completions,
**batch) -> list[float]`, a built-in name (`builtin`, and `judge`, a model's grade bound by
`build`) or 'module:function'. `batch` holds per-completion fields: `question` (the record's,
unrendered), `answer` (the reference, or None), `category`, `rubric` (the record's criteria, or
None; `data.sources.rubric`), `constraints` (instructions code checks: `instructions`) and
`tests` (what its code must pass: `tests_pass`, run in a sandbox), each None where a record has
none.

Each reward scores the rows of its `categories` (rewards[].categories; all rows by default): a
row's total is the weighted mean of the rewards that score it, so it stays on a 0-1 scale
whatever the weights, and a math row can be scored by `correct` while an essay is scored by
`relevance`. User functions and the judge run concurrently in threads of their own (slow ones,
e.g. a remote judge, overlap), each waited for at most its `rewards[].timeout_s`: past it the
batch stops with `RewardTimeout` (`on_timeout: stop`) or that reward's rows get 0, counted in
`timeouts` (`zero`). A signal while waiting (`cancel`, set by the loop's handler) raises
`RewardInterrupted` within a quarter of a second, not when the reward returns; the thread is a
daemon, so a call that never returns does not keep the process alive. The other built-ins run
in the calling thread, bounded by their own code (math-verify's timeouts need the main thread's
signals); `tests_pass`, which waits on its programs, runs in a thread as they do.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from reasoner import mesh as mesh_lib
from reasoner.config import RewardSpec
from reasoner.errors import ConfigError, DataError, RewardError, RewardInterrupted, RewardTimeout
from reasoner.rewards import instructions as instructions_lib, sandbox
from reasoner.rewards.builtin import correct, format_exact, format_partial, relevance, repetition

RewardFn = Callable[..., list[float]]
# a record's, given to every reward
FIELDS = ("question", "answer", "category", "rubric", "constraints", "tests")


def unbound_judge(prompts, completions, **_) -> list[float]:
  raise RewardError("the judge reward has no model: build() binds it (Rewards.bind)")


BUILTIN: dict[str, RewardFn] = {"format_exact": format_exact, "format_partial": format_partial,
                                "correct": correct, "relevance": relevance,
                                "repetition": repetition, "judge": unbound_judge,
                                "instructions": instructions_lib.instructions,
                                "tests_pass": sandbox.tests_pass}
THREADED = ("judge", "tests_pass")  # built-ins that wait (on a model, on programs)


def resolve(name: str) -> RewardFn:
  """A built-in name or 'package.module:function'."""
  if name in BUILTIN:
    return BUILTIN[name]
  if ":" not in name:
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: expected a built-in "
                      f"({', '.join(BUILTIN)}) or 'module:function'")
  mod_name, fn_name = name.split(":", 1)
  try:
    mod = importlib.import_module(mod_name)
  except ImportError as e:
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: cannot import module "
                      f"'{mod_name}' ({e})") from None
  fn = getattr(mod, fn_name, None)
  if not callable(fn):
    raise ConfigError(f"config key 'rewards[].fn' = {name!r}: module '{mod_name}' has no "
                      f"function '{fn_name}'")
  return fn


class Rewards:
  """The configured reward functions: their weights, the categories each scores, and the
  scoring of a batch (`__call__`)."""

  def __init__(self, specs: Sequence[RewardSpec]):
    self.specs = list(specs)
    total = sum(s.weight for s in specs)
    # a name per reward: the function's, with its categories where it appears more than once
    count = lambda fn: sum(s.fn == fn for s in specs)
    self.names = [s.fn if count(s.fn) == 1 else f"{s.fn}[{'+'.join(s.categories or ['all'])}]"
                  for s in specs]
    if len(set(self.names)) < len(self.names):
      raise ConfigError(f"config key 'rewards' = {[s.fn for s in specs]}: a function appears "
                        "twice for the same categories")
    self.fns = [resolve(s.fn) for s in specs]
    self.weights = np.asarray([s.weight / total for s in specs], np.float32)
    self.cancel = threading.Event()  # set by a signal: stop waiting for any reward
    self.timeouts: collections.Counter = collections.Counter()  # on_timeout: zero, rows

  def bind(self, name: str, fn: RewardFn) -> None:
    """Replaces built-in `name` (the judge, once its model is loaded) by `fn`."""
    self.fns = [fn if s.fn == name else f for s, f in zip(self.specs, self.fns)]

  def _scores(self, k: int, category: str | None) -> bool:
    cats = self.specs[k].categories
    return cats is None or category in cats

  def check(self, records: Sequence[dict], where: str) -> None:
    """One line, before any model loads, for a record that no reward scores (a category no
    reward names) or that a reward needing a reference answer scores without one."""
    for i, r in enumerate(records):
      cat = r.get("category")
      scoring = [k for k in range(len(self.fns)) if self._scores(k, cat)]
      if not scoring:
        raise ConfigError(f"config key 'rewards': no reward scores category {cat!r} ({where}, "
                          f"record {i}); name it in a reward's categories, or give one "
                          "categories: null")
      for k in scoring:
        fn, name = self.fns[k], self.names[k]
        if getattr(fn, "needs_answer", False) and r.get("answer") is None:
          raise DataError(f"{where}, record {i} (category {cat!r}) has no reference answer "
                          f"(data.answer_field), which reward '{name}' needs")
        for field, validate in (("constraints", instructions_lib.validate),
                                ("tests", sandbox.validate_tests)):
          if getattr(fn, f"needs_{field}", False):
            if not r.get(field):
              raise DataError(f"{where}, record {i} (category {cat!r}) has no {field} "
                              f"(data.{field}_field), which reward '{name}' needs")
            validate(r[field], f"{where}, record {i}")

  def take_timeouts(self) -> dict[str, int]:
    """{`reward/<name>/timeouts`: rows zeroed since the last call} for the rewards that zero
    (0 where none timed out, so that the column is there from the first step)."""
    out = {f"reward/{n}/timeouts": self.timeouts[n]
           for n, s in zip(self.names, self.specs) if s.on_timeout == "zero"}
    self.timeouts.clear()
    return out

  def _score(self, k: int, rows: list[int], prompts, completions, batch) -> np.ndarray:
    """Reward k on `rows` -> [n] values, NaN on the rows it does not score."""
    out = np.full(len(completions), np.nan, np.float32)
    if not rows:
      return out
    pick = lambda xs: [xs[j] for j in rows]
    name = self.names[k]
    try:
      values = self.fns[k](pick(prompts), pick(completions),
                           **{key: pick(v) for key, v in batch.items()})
    except Exception as e:
      raise RewardError(f"reward function '{name}' raised {type(e).__name__}: {e}") from e
    values = np.asarray(values, np.float32)
    if values.shape != (len(rows),) or not np.all(np.isfinite(values)):
      raise RewardError(f"reward function '{name}' returned {values.shape} values "
                        f"(expected {len(rows)} finite numbers)")
    out[rows] = values
    return out

  def score(self, prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict],
            g: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`__call__` on the completions of `records`, G consecutive completions a record."""
    rep = lambda key: [r.get(key) for r in records for _ in range(g)]
    return self(prompts, completions, **{k: rep(k) for k in FIELDS})

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **batch
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total [n], {name: [n], NaN where it does not score}) for n completions; batch fields
    (answer, category, ...) are per completion."""
    n, prompts, completions = len(completions), list(prompts), list(completions)
    cats = list(batch.get("category") or [None] * n)
    rows = [[j for j in range(n) if self._scores(k, cats[j])] for k in range(len(self.fns))]
    score = lambda k: self._score(k, rows[k], prompts, completions, batch)
    # user functions (a judge, a remote call) in threads; the built-ins, quick, in this one:
    # math-verify's timeouts use signals, which only the main thread can set (in a worker
    # thread every answer it parses came out wrong)
    futures = {k: in_thread(lambda k=k: score(k)) for k, s in enumerate(self.specs)
               if s.fn not in BUILTIN or s.fn in THREADED}
    values = self._agreed([None if k in futures else score(k) for k in range(len(self.fns))],
                          futures, rows, n)
    scored = np.stack([~np.isnan(v) for v in values])
    if n and not scored.any(0).all():
      j = int(np.argmin(scored.any(0)))
      raise RewardError(f"no reward scores row {j} (category {cats[j]!r})")
    weights = np.where(scored, self.weights[:, None], 0.0)
    total = (weights * np.nan_to_num(np.stack(values))).sum(0) / np.maximum(weights.sum(0), 1e-9)
    return np.asarray(total, np.float32), dict(zip(self.names, values))

  def _agreed(self, values: list, futures: dict, rows: list[list[int]], n: int) -> list:
    """The threaded rewards' values, each waited for within its `timeout_s` (module doc), the
    same on every process: a signal or a time limit that reached one process acts on all (as
    the loop's `mesh.largest` does for signals), and all take process 0's values, so that no
    process trains on rewards another did not see (a remote judge may answer each alike)."""
    if not futures:  # the built-ins alone: deterministic, scored alike on every process
      return values
    late, interrupted = np.zeros(len(values) + 1, np.int32), None
    for k, future in futures.items():
      try:
        values[k] = wait(future, self.specs[k].timeout_s, self.cancel,
                         f"reward '{self.names[k]}' scored")
      except concurrent.futures.TimeoutError:
        late[k] = 1
      except RewardInterrupted as e:
        late[-1], interrupted = 1, e
        break
    agreed = mesh_lib.largest_each(late)
    if agreed[-1]:
      raise interrupted or RewardInterrupted("a signal reached another process while rewards "
                                             "scored")
    for k in np.flatnonzero(agreed[:-1]):
      spec, elsewhere = self.specs[k], "" if late[k] else " on another process"
      if spec.on_timeout != "zero":
        raise RewardTimeout(f"reward function '{self.names[k]}' did not return within "
                            f"{spec.timeout_s:g} s{elsewhere} (rewards[{k}].timeout_s; "
                            "on_timeout: zero scores such rows 0 instead)")
      self.timeouts[self.names[k]] += len(rows[k])
      values[k] = np.full(n, np.nan, np.float32)
      values[k][rows[k]] = 0.0
    if jax.process_count() > 1:
      values = list(mesh_lib.from_process_0(np.stack(values)))
    return values


def wait(future: concurrent.futures.Future, timeout_s: float, cancel: threading.Event,
         what: str):
  """`future`'s result within `timeout_s` (else `concurrent.futures.TimeoutError`), polled
  every quarter of a second for `cancel`: set, it raises `RewardInterrupted` naming `what`."""
  start = time.monotonic()
  while True:
    left = timeout_s - (time.monotonic() - start)
    try:
      return future.result(timeout=max(0.0, min(0.25, left)))
    except concurrent.futures.TimeoutError:
      if cancel.is_set():
        raise RewardInterrupted(f"a signal arrived while {what}") from None
      if left <= 0:
        raise


def in_thread(fn: Callable[[], np.ndarray]) -> concurrent.futures.Future:
  """`fn()` in a daemon thread of its own: a call that never returns keeps no process alive."""
  future: concurrent.futures.Future = concurrent.futures.Future()

  def run():
    try:
      future.set_result(fn())
    except BaseException as e:  # handed to the waiting thread, which raises it
      future.set_exception(e)

  threading.Thread(target=run, daemon=True, name="reward").start()
  return future
