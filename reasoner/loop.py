"""The training run: resume, evaluate before, a stage's steps (GRPO, SFT, preference,
distillation: `STAGES`) until done or the session's deadline, evaluate after. `python -m
reasoner train`, `sft`, `prefer` and `distill` call `train`; the notebook calls the same phases
of `Run` in cells of their own.

A run resumes from its own latest checkpoint, else from `train.resume_from` (another session's
output, read-only: its logs are carried over, so this run's directory reads as one run's). Each
step's rows are logged once: rows past the restored step are dropped. With `train.deadline`,
the loop stops before a step that would leave too little time for the final save, evaluation
and export (`session.Clock`), saves, and says how to continue.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib
import signal
import sys
import threading
import time

import jax
from tqdm import tqdm

from reasoner.build import build
from reasoner.config import Config, ConfigError
from reasoner.config.loop import parse_deadline
from reasoner.engine import manifest, metrics as metrics_lib, session
from reasoner.engine.ahead import Ahead
from reasoner.engine.checkpoint import (Checkpointer, find_checkpoints, load_reference,
                                        read_newest, save_reference)
from reasoner.engine.metrics import MetricsWriter
from reasoner.engine.sampler import Sampler
from reasoner.engine.trainer import Stage, checkpoint_tree
from reasoner.errors import RewardInterrupted, RewardTimeout, write_error
from reasoner.evaluation import describe_change, evaluate_all, paired_change
from reasoner.mesh import agreed, largest
from reasoner.objectives import distill, grpo, preference, sft

STAGES: dict[str, Stage] = {s.name: s for s in (grpo.STAGE, sft.STAGE, preference.STAGE,
                                               distill.STAGE)}


class Interrupted(Exception):
  """SIGTERM or SIGINT stopped the run after saving; `code` is the exit status (143, 130)."""

  def __init__(self, line: str, code: int):
    super().__init__(line)
    self.code = code


def train(cfg: Config, command: str | None = None, stage: str = "grpo") -> dict:
  """Runs (or resumes) a stage (`STAGES`: grpo, sft, prefer, distill); returns {'before': ...,
  'after': ...} held-out results, and 'stopped' (the line that says how to continue) when the
  deadline stopped it early. `command` is what the user ran, repeated in that line."""
  run = Run(cfg, command, stage)
  if cfg.train.eval_before:
    run.evaluate_before()
  try:
    run.train()
  except Interrupted:
    run.close()
    raise
  run.evaluate_after()
  run.close()
  return run.results


class Run:
  """One session of a run: built, resumed and its logs opened on construction."""

  def __init__(self, cfg: Config, command: str | None = None, stage: str = "grpo"):
    self.cfg, self.command, self.stage = cfg, command, stage
    kind = STAGES[stage]
    if cfg.rollout.devices and kind.draw is None:
      raise ConfigError(f"config key 'rollout.devices' = {cfg.rollout.devices}: the {stage} "
                        "stage samples no rollouts (GRPO and distillation do)")
    deadline = parse_deadline(cfg.train.deadline) if cfg.train.deadline else None
    self.clock = session.Clock(deadline, cfg.train.checkpoint_minutes)
    if self.clock.left() <= 0:
      raise ConfigError(f"config key 'train.deadline' = {cfg.train.deadline!r}: already past "
                        f"({session.duration(-self.clock.left())} ago)")
    self.path = cfg.run_path
    _check_writable(self.path)
    if jax.process_index() == 0:
      session.claim(self.path)
    # before anything loads: a refused start costs nothing
    manifest.check(cfg, self.path, stage=stage)
    self._checked: set = set()  # another run's directories whose manifest was checked
    if cfg.train.resume_from and not _has_checkpoints(self.path):
      self._check_source(find_checkpoints(cfg.train.resume_from))
    # lora.init_from starts a fresh run only: a later session (whose SFT run may be gone from
    # the machine) continues from its own checkpoints or train.resume_from's
    if cfg.lora.init_from and not cfg.train.resume_from and not _has_checkpoints(self.path):
      manifest.check(cfg, find_checkpoints(cfg.lora.init_from, "lora.init_from").parent,
                     via="lora.init_from")
    with self.clock.timed("load"):
      self.setup = build(cfg, check_records=kind.check_records, teacher=kind.needs_teacher)
    config = cfg.to_dict()
    self.writer = MetricsWriter(self.path, loggers=cfg.train.loggers, config=config)
    self.writer.write_json("config.json", config, overwrite=False)
    self.trainer = kind.trainer.for_run(self.setup.graphdef, self.setup.base, cfg)
    self.sampler = Sampler.for_run(self.setup)
    self.ckpt = Checkpointer(self.path / "checkpoints", cfg.train.keep_checkpoints)
    state = self.trainer.init_state(self.setup.lora, jax.random.PRNGKey(cfg.train.seed))
    # Every process draws the same global batch of questions (a few KB of text); placement
    # (mesh.put_batch) gives each process's devices only their rows.
    self.data = kind.batches(self.setup, tqdm.write if jax.process_index() == 0 else None)
    # with rollout.devices: the rollouts drawn a step ahead, and the LoRA the next one samples
    # with as checkpointed
    self.ahead: Ahead | None = None
    self.behind = None
    self.state, self.start, origin = self._resume(state)
    self.setup.reference = self._reference(origin)
    self.step = self.start
    self.writer.start(self.start, carry_over=origin)
    if jax.process_index() == 0:
      manifest.record(cfg, self.path, self.start, self.setup.train_records, origin, tqdm.write,
                      stage)
    self.results = read_eval(self.path) if jax.process_index() == 0 else {}
    if "seconds" in self.results.get("before", {}):  # timed in an earlier session
      self.clock.measured("eval", self.results["before"]["seconds"])

  @property
  def stopped(self) -> bool:
    return self.step < self.cfg.train.steps

  def evaluate_before(self) -> dict:
    """The held-out evaluation of the model before training (once per run, kept in eval.json)."""
    if agreed("before" in self.results):
      return self.results.get("before", {})  # (process 0 holds the results)
    with self.clock.timed("eval"):
      result = evaluate_all(self.setup, self.sampler, self.state.lora, "before", self.writer)
    self.results["before"] = {**result, "seconds": self.clock.times["eval"]}
    self.writer.write_json("eval.json", self.results)
    return self.results["before"]

  def train(self) -> str | None:
    """GRPO steps until train.steps or the deadline; the line that says how to continue when
    the deadline stopped it. SIGTERM (a session's end, `docker stop`, preemption) or SIGINT
    finishes the step in flight, saves, and raises `Interrupted`; a second signal exits at once."""
    with self._signals() as received:
      self.step, self.state = self._loop(self.state, received)
    if received:
      name = signal.Signals(received[0]).name
      # the line travels in the exception, which the CLI prints (not `close` as well)
      raise Interrupted(f"{name}: saved step {self.step} of {self.cfg.train.steps} in "
                        f"{self.path / 'checkpoints' / str(self.step)}; continue with: "
                        f"{self.command or 'the same command'}", 128 + received[0])
    if not self.stopped:
      return None
    if self.step == self.start:
      raise ConfigError(
          f"config key 'train.deadline' = {self.cfg.train.deadline!r}: too short for one step "
          f"({session.duration(self.clock.left())} left; the final save, evaluation and export "
          f"alone take {session.duration(self.clock.reserve(True))})")
    self.results["stopped"] = self._stop_line()
    return self.results["stopped"]

  def evaluate_after(self) -> dict:
    tag = f"step-{self.step}" if self.stopped else "after"
    self.results["after"] = evaluate_all(self.setup, self.sampler, self.state.lora, tag,
                                         self.writer, self.step, self.writer.rows("eval-before"))
    if self.results.get("before") and jax.process_index() == 0:
      self._changes(tag)
    self.writer.write_json("eval.json", {k: v for k, v in self.results.items()
                                         if k not in ("stopped", "fell")})
    return self.results["after"]

  def _changes(self, tag: str) -> None:
    """Each evaluation set's paired change from before training (eval.json's "changes"),
    printed; a retention set that fell beyond noise leaves the run's warning line."""
    named = {s.name: s for s in self.cfg.eval.sets}
    changes = {}
    pairs = {name: ("eval-before", f"eval-{tag}") if name == "held-out" else
             (f"eval-{name}-before", f"eval-{name}-{tag}") for name in ("held-out", *named)}
    rows = self.writer.rows_by_tag([t for pair in pairs.values() for t in pair])
    for name, (before, after) in pairs.items():
      c = paired_change(rows[before], rows[after])
      if c is None:
        continue
      changes[name] = c
      label = f"held-out by {self.cfg.data.held_out_by}" if name == "held-out" else (
          f"{name} (retention)" if named[name].retention else name)
      tqdm.write(describe_change(label, c))
      if name in named and named[name].retention and c["change"] < (
          -self.cfg.eval.retention_se * c["se"]):
        self.results["fell"] = (
            f"warning: the retention set '{name}' fell beyond noise, "
            f"{describe_change(name, c).split(': ', 1)[1]}, more than eval.retention_se = "
            f"{self.cfg.eval.retention_se:g} standard errors: the run lost some of what the "
            f"model could do before it")
        c["fell"] = True
    self.results["changes"] = changes
    tqdm.write(f"run in {self.path}")

  def close(self) -> pathlib.Path | None:
    """Writes reward.png (returned) and closes the logs and the checkpoint manager."""
    plot = self.writer.plot()
    self.writer.close()
    self.ckpt.close()
    session.release(self.path)
    if jax.process_index() == 0:
      for line in ("fell", "stopped"):  # last, where the user looks
        if line in self.results:
          tqdm.write(self.results[line])
    return plot

  @contextlib.contextmanager
  def _signals(self):
    """Collects SIGTERM / SIGINT while the loop runs (main thread only); a second one exits."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
      yield received
      return
    cancel = self.setup.rewards.cancel  # a reward that hangs is not waited for
    cancel.clear()

    def on_signal(signum, frame):
      if received:
        print(f"second {signal.Signals(signum).name}: exiting without saving (the latest "
              "checkpoint is intact)", file=sys.stderr, flush=True)
        os._exit(128 + signum)
      received.append(signum)
      cancel.set()
      print(f"{signal.Signals(signum).name}: finishing the step in flight, then saving "
            "(again to exit at once)", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield received
    finally:
      for s, handler in old.items():
        signal.signal(s, handler)

  def _loop(self, state, received: list[int]):
    cfg, clock = self.cfg, self.clock
    bar = tqdm(range(self.start, cfg.train.steps), initial=self.start, total=cfg.train.steps,
               desc=self.stage.upper(), unit="step", disable=jax.process_index() != 0)
    step, saved = self.start, self.start
    self.ahead = ahead = self._ahead(state)
    try:
      for step in bar:
        # the data drawn before this step's rollout: a step dropped in flight saves it, not its
        # own draws (with a rollout ahead, as of before that rollout started)
        drawn = copy.deepcopy(self.data.get_state()) if ahead is None else ahead.drawn
        sig = largest(received[0] if received else 0)  # every process stops at the same step
        if sig and not received:
          received.append(sig)
        if sig or agreed(clock.stop_before_next_step(eval_after=True)):
          break
        try:
          with clock.timed("step"):
            state, metrics = self._step(state, step, ahead)
        except RewardInterrupted:  # a signal while a reward scored: the step in flight is dropped
          break
        except RewardTimeout as e:
          raise self._timed_out(e, step, saved, state, drawn) from None
        self.writer.log(step + 1, metrics)
        bar.set_postfix(_postfix(metrics))
        done = step + 1 == cfg.train.steps
        if (step + 1) % cfg.train.checkpoint_every == 0 or done or agreed(clock.save_due()):
          self._save(step + 1, state, None if ahead is None else ahead.drawn)
          saved = step + 1
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and not done:
          if ahead is not None:
            ahead.settle()  # the same sampler and rewards
          evaluate_all(self.setup, self.sampler, state.lora, f"step-{step + 1}", self.writer,
                       step + 1)
      else:
        step = cfg.train.steps
    finally:
      if ahead is not None:
        ahead.close()
    bar.close()
    if step != saved:  # stopped for the deadline or a signal after unsaved steps
      self._save(step, state, drawn)
    return step, state

  def _timed_out(self, e: RewardTimeout, step: int, saved: int, state,
                 drawn: dict) -> RewardTimeout:
    """The line for a reward past its time limit during step `step` + 1 (not trained on),
    after saving the steps before it (with `drawn`, the data state before that step)."""
    if step != saved:
      self._save(step, state, drawn)
    kept = (f"step {step} is saved in {self.path / 'checkpoints'}" if step else
            "no step had been trained")
    return RewardTimeout(f"{e} at step {step + 1}: that step was not trained on; {kept}; "
                         f"continue with: {self.command or 'the same command'}")

  def _init_from(self, state, say):
    """`state` with the LoRA of lora.init_from's newest readable checkpoint (an SFT run's)."""
    folder = find_checkpoints(self.cfg.lora.init_from, "lora.init_from")
    step, tree, _ = read_newest(folder, "lora.init_from", self.cfg.lora.init_from,
                            checkpoint_tree(state), say)
    say(f"LoRA from {folder / str(step)} (lora.init_from); step 0, a fresh optimizer")
    return state.replace(lora=tree["lora"])

  def _step(self, state, step: int, ahead: Ahead | None = None):
    kind = STAGES[self.stage]
    if ahead is None:
      state, metrics = kind.step(self.setup, self.sampler, self.trainer, state, self.data, step)
    else:  # step + 1's rollout starts before this step's update
      t0 = time.perf_counter()
      drawn = ahead.take(step)
      waited = time.perf_counter() - t0
      ahead.start(step + 1, state.lora, run=step + 1 < self.cfg.train.steps)
      state, metrics = kind.learn(self.setup, self.trainer, state, drawn, step)
      metrics = metrics_lib.timed({**metrics, "rollout_wait_s": waited}, time.perf_counter() - t0)
    metrics.update(self.setup.rewards.take_timeouts())
    if "rollout_s" in metrics:
      self.clock.estimated("eval", metrics["rollout_s"] * _eval_share(self.cfg))
    if "samples" in metrics:
      self.writer.samples(step + 1, "rollout", metrics.pop("samples"))
    return state, metrics

  def _ahead(self, state) -> Ahead | None:
    """With `rollout.devices`: the rollouts drawn a step ahead, the first with the checkpoint's
    LoRA (`behind`), else the state's."""
    if not self.cfg.rollout.devices:
      return None
    kind, key = STAGES[self.stage], state.key
    draw = lambda lora, step: kind.draw(self.setup, self.sampler, lora, self.data, step,
                                        jax.random.fold_in(key, step))
    return Ahead(draw, lambda lora: self.sampler.in_layout((lora,))[0], self.data,
                 state.lora if self.behind is None else self.behind)

  def _check_source(self, folder: pathlib.Path) -> None:
    """train.resume_from's run (`folder`: its checkpoints) fits this one: checked once."""
    if folder not in self._checked:
      manifest.check(self.cfg, folder.parent, stage=self.stage, via="train.resume_from")
      self._checked.add(folder)

  def _reference(self, origin: pathlib.Path | None):
    """The LoRA the run started from (lora.init_from's, kept in <run>/reference, or in the
    run train.resume_from continues), or None: the reference policy is the base under it."""
    for run in (self.path, origin):
      ref = load_reference(run, self.setup.lora) if run is not None else None
      if ref is not None:
        if run != self.path:
          save_reference(self.path, ref)
        return ref
    return None

  def _save(self, step: int, state, drawn: dict | None = None) -> None:
    """Checkpoint `step`: the state and the data drawn so far (`drawn`: as of before a step
    dropped in flight)."""
    tree = checkpoint_tree(state)
    if self.ahead is not None:
      tree["behind"] = self.ahead.behind
    with self.clock.timed("save"):
      self.ckpt.save(step, tree, self.data.get_state() if drawn is None else drawn)

  def _stop_line(self) -> str:
    again = self.command or "the same command"
    return (f"stopped for the deadline at step {self.step} of {self.cfg.train.steps} (saved in "
            f"{self.path / 'checkpoints' / str(self.step)}); continue with: {again} (in a new "
            f"session: its own train.deadline and train.resume_from=<this run's output, here "
            f"{self.path.absolute()}>)")

  def _resume(self, state):
    """(state, step, origin): from this run's latest checkpoint, else from train.resume_from's
    (origin: that run's directory, whose logs this run carries on), else step 0."""
    cfg = self.cfg
    say = tqdm.write if jax.process_index() == 0 else (lambda _: None)
    target = checkpoint_tree(state)
    if cfg.rollout.devices:
      target["behind"] = state.lora
    found, origin, folder = self.ckpt.restore_latest(target, say), None, self.ckpt.directory
    if found is not None and cfg.train.resume_from:
      say(f"train.resume_from ({cfg.train.resume_from}) is not used: this run has checkpoints "
          f"of its own, and continues from its newest")
    if found is None and cfg.train.resume_from:
      folder = find_checkpoints(cfg.train.resume_from)
      self._check_source(folder)
      found = read_newest(folder, "train.resume_from", cfg.train.resume_from, target, say)
      origin = folder.parent
    if found is None and cfg.lora.init_from:
      state = self._init_from(state, say)
      save_reference(self.path, state.lora)
      return state, 0, None
    if found is None:
      return state, 0, None
    start, tree, data_state = found
    self.behind = tree.pop("behind", None)
    self.data.set_state(data_state)
    say(f"resumed from {folder / str(start)} "
        f"(step {start} of {cfg.train.steps})")
    return state.replace(**tree), start, origin


# the progress bar's figures, those a step's metrics have: (metric, label, format)
_POSTFIX = (("reward/mean", "reward", ".2f"), ("accuracy", "acc", ".2f"),
            ("format_rate", "fmt", ".2f"), ("loss", "loss", ".3f"), ("padding", "pad", ".2f"),
            ("rewards/accuracy", "pair_acc", ".2f"), ("rewards/margin", "margin", ".2f"),
            ("distill/reverse_kl", "kl", ".3f"), ("step_time_s", "s", ".0f"))


def _postfix(m: dict) -> dict:
  return {label: format(m[k], f) for k, label, f in _POSTFIX if k in m}


def _eval_share(cfg: Config) -> float:
  """Held-out evaluation tokens over one rollout's tokens (an evaluation's time, estimated
  from the rollouts' while no evaluation has been timed)."""
  return (cfg.data.num_eval * cfg.eval.max_new_tokens * (1 + cfg.eval.samples)) / (
      cfg.train.batch_size * cfg.rollout.num_generations * cfg.rollout.max_new_tokens)


def _check_writable(run: pathlib.Path) -> None:
  """A run directory that cannot be written fails here, in one line, before anything loads."""
  if jax.process_index() == 0:
    try:
      run.mkdir(parents=True, exist_ok=True)
      probe = run / f".probe-{os.getpid()}"
      probe.write_bytes(b"")
      probe.unlink()
    except OSError as e:
      raise ConfigError(f"the run directory {run} cannot be written: {write_error(e, run)}") from e


def _has_checkpoints(run: pathlib.Path) -> bool:
  folder = run / "checkpoints"
  return folder.is_dir() and any(c.name.isdigit() for c in folder.iterdir())


def read_eval(run: pathlib.Path) -> dict:
  p = run / "eval.json"
  return json.loads(p.read_text()) if p.exists() else {}
