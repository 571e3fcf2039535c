"""Weights & Biases beside TensorBoard (`train.loggers: [tensorboard, wandb]`), used by
`MetricsWriter` on process 0.

Online only with credentials (WANDB_API_KEY, or `wandb login`'s netrc entry); otherwise offline,
under RUN/wandb/, to upload later with `wandb sync` (a user's WANDB_MODE is respected). A missing
package or a failed start is one line, and the run logs to TensorBoard only. No line here prints
a key or any environment value.

The W&B run's id is derived from the run folder, so each session of a resumed run appends to the
same W&B run (`resume="allow"`; offline, each session leaves a folder of its own under wandb/
with that id). W&B cannot purge history as TensorBoard does: online, the steps a crashed session
logged past its last checkpoint keep their first values, and the resumed session skips them (W&B
refuses a step lower than its last).
"""

from __future__ import annotations

import hashlib
import json
import netrc
import os
import pathlib
import sys
from typing import Any
from urllib.parse import urlsplit

INSTALL = "pip install 'reasoner[wandb]'"


def run_id(path: pathlib.Path) -> str:
  """The W&B id of the run in `path`: the same for every session in that folder."""
  return hashlib.sha1(str(pathlib.Path(path).resolve()).encode()).hexdigest()[:16]


def open_run(path: pathlib.Path, config: dict[str, Any]) -> WandbRun | None:
  """A W&B run logging into `path`/wandb; None (after one line) when it cannot start."""
  try:
    import wandb  # optional (the `wandb` extra): imported only when asked for
  except ImportError:
    _say(f"train.loggers: wandb is not installed ({INSTALL}); logging to TensorBoard only")
    return None
  # our console stays ours (tqdm's bar, the CLI's lines): wandb neither prints (its login line
  # too, which setup's settings govern) nor captures it, nor saves the code
  quiet = wandb.Settings(silent=True, console="off", save_code=False)
  try:
    wandb.setup(settings=quiet)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "reasoner", name=path.name,
                     dir=str(path), config=json.loads(json.dumps(config, default=str)),
                     id=run_id(path), resume="allow", mode=_mode(), settings=quiet)
  except Exception as e:  # network, authentication, a bad WANDB_MODE: its class only (the
    # message may quote a setting)
    _say(f"train.loggers: wandb did not start ({type(e).__name__}); logging to TensorBoard only")
    _teardown(wandb)
    return None
  if run.settings.mode in ("offline", "dryrun"):
    _say(f"train.loggers: W&B logs offline to {path / 'wandb'}; upload with: "
         f"wandb sync {path / 'wandb'}/offline-run-*")
  elif run.url:
    _say(f"train.loggers: W&B run {run.url}")
  return WandbRun(run)


class WandbRun:
  """A started W&B run: the steps it takes, and its end."""

  def __init__(self, run):
    self.run = run
    self.floor = run.starting_step  # a resumed run's next step; W&B refuses any below it

  def log(self, step: int, scalars: dict[str, float]) -> None:
    """Logs `scalars` at `step`; a step below W&B's last (a resumed run's repeated steps) is
    skipped, and a failure is one line that stops W&B, never the training."""
    if step < self.floor or self.run is None:
      return
    self.floor = step
    try:
      self.run.log(scalars, step=step)
    except Exception as e:
      _say(f"train.loggers: wandb stopped logging ({type(e).__name__}); the other logs go on")
      self.close()

  def close(self) -> None:
    if self.run is not None:
      run, self.run = self.run, None
      try:
        run.finish()
      except Exception as e:
        _say(f"train.loggers: wandb did not finish ({type(e).__name__})")
      import wandb

      _teardown(wandb)


def _teardown(wandb) -> None:
  """Stops wandb's service process and forgets the settings it read from the environment, so
  that the next run in this process (a notebook's, a test's) reads them afresh."""
  try:
    wandb.teardown()
  except Exception:  # the run's logs are written by then: nothing to report or to redo
    pass


def _mode() -> str | None:
  """'online' with credentials, else 'offline'; None (wandb reads it) where the user set
  WANDB_MODE."""
  if os.environ.get("WANDB_MODE"):
    return None
  return "online" if os.environ.get("WANDB_API_KEY") or _netrc_login() else "offline"


def _netrc_login() -> bool:
  """Whether `wandb login` saved a key for the W&B host in the netrc file (read, not shown).
  Newer wandb releases default to CoreWeave's host rather than api.wandb.ai: either counts."""
  base = os.environ.get("WANDB_BASE_URL")
  hosts = [urlsplit(base).netloc] if base else ["api.wandb.ai", "api.forge.coreweave.com"]
  path = os.environ.get("NETRC") or pathlib.Path.home() / ".netrc"
  try:
    found = netrc.netrc(path)
  except (OSError, netrc.NetrcParseError):
    return False
  return any(found.authenticators(h) for h in hosts)


def _say(line: str) -> None:
  print(line, file=sys.stderr, flush=True)
