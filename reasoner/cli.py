"""`python -m reasoner train|sft|prefer|distill|eval|sample|data|plan|export|config --config FILE
[key=value ...]`: parse, build, call."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shlex
import signal
import sys

import yaml

from reasoner.config import ConfigError, load_config
from reasoner.errors import UserError, write_error
from reasoner.planner import libtpu

DEFAULT_CONFIG = "configs/embedded.yaml"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="reasoner", description=__doc__)
  p.add_argument("--debug", action="store_true",
                 help="show tracebacks (also REASONER_DEBUG=1); may stand anywhere")
  sub = p.add_subparsers(dest="command", required=True)
  for name, text in (("train", "run GRPO (resumes from the run's latest checkpoint)"),
                     ("sft", "supervised fine-tuning on responses (data.response_field), "
                             "before GRPO (lora.init_from=<this run>)"),
                     ("prefer", "preference optimisation (DPO, IPO, SimPO, ORPO: prefer.loss) "
                                "on pairs from a file or sampled by the policy"),
                     ("distill", "on-policy distillation: the policy samples, a teacher "
                                 "(distill.teacher or distill.teacher_lora) scores each token"),
                     ("eval", "greedy accuracy and format rate on the held-out split"),
                     ("sample", "print completions for one question"),
                     ("data", "what the model will be shown, with no model loaded: "
                              "each source's records, categories, token lengths against the "
                              "budgets, and two rendered examples"),
                     ("plan", "per-chip HBM and step time on a TPU slice, compiled ahead of "
                              "time on this machine"),
                     ("export", "the run's LoRA merged into the base, as a Kaggle Flax checkpoint "
                                "Tunix loads (and Hugging Face safetensors)"),
                     ("config", "print the preset as resolved (with its overrides); --docs: "
                                "write the configuration reference")):
    c = sub.add_parser(name, help=text)
    c.add_argument("--config", default=DEFAULT_CONFIG, help="YAML preset (configs/)")
    c.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
    if name == "sample":
      c.add_argument("--question", required=True)
      c.add_argument("-n", type=int, default=1, help="completions (1: greedy)")
      c.add_argument("--category", help="its prompt's category (default math: a number)")
    if name == "data":
      c.add_argument("--stage", choices=("grpo", "sft", "prefer", "distill"), default="grpo",
                     help="whose response budget: grpo and distill rollout.max_new_tokens, sft "
                          "sft.max_response_tokens, prefer prefer.max_response_tokens")
    if name == "plan":
      c.add_argument("--topology", default="v5e:2x4",
                     help="TPU topology, 'local' (this host's accelerators) or 'cpu'")
      c.add_argument("--no-search", dest="search", action="store_false",
                     help="only the configured batch, no search for the largest that fits")
      c.add_argument("--analytic", action="store_true", help="estimate; compile nothing")
      c.add_argument("--ahead", action="store_true",
                     help="also every split of the chips into rollout.devices and training, "
                          "each compiled, and the fastest")
    if name == "config":
      c.add_argument("--docs", nargs="?", const="docs/configuration.md", default=None,
                     metavar="PATH", help="write the reference of every key (default "
                     "docs/configuration.md) instead")
    if name == "export":
      c.add_argument("--out", required=True, help="a new (or empty) directory")
      c.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
      c.add_argument("--format", action="append", choices=("orbax", "safetensors"),
                     help="orbax (always written) and/or safetensors (Hugging Face names)")
      c.add_argument("--upload", metavar="HANDLE", default=None,
                     help="then upload DIR as a new version of the Kaggle model "
                          "OWNER/MODEL/FRAMEWORK/VARIATION (e.g. you/gemma3-1b-grpo/flax/1b-it), "
                          "notes from the run; a DIR already holding an export is uploaded as is")
  r = sub.add_parser("report", help="RUN/report/: plots and report.md (the figures, the "
                                    "samples, the stages) from a run's own files")
  r.add_argument("run", help="the run's folder (train.run_dir / train.run_name)")
  return p


def loop_interrupted():
  """`reasoner.loop.Interrupted` once jax is loaded (the loop saved, then stopped); else a class
  nothing raises, so that a bad config never imports jax."""
  loop = sys.modules.get("reasoner.loop")
  return loop.Interrupted if loop else type("NeverRaised", (Exception,), {})


class Terminated(BaseException):
  """SIGTERM outside the training loop, which has its own handler (the load, the first compile,
  an evaluation): a BaseException, as KeyboardInterrupt is, so that no `except Exception` on the
  way swallows it."""


def _terminated(signum, frame):
  raise Terminated()


def _say(text: str) -> None:
  """One write: a background thread printing meanwhile cannot split the line."""
  sys.stderr.write(text)
  sys.stderr.flush()


def _config(args) -> None:
  """`reasoner config`: the preset as resolved, as YAML; or, with --docs, the reference."""
  from reasoner.config import Config, reference

  if args.docs:
    path = pathlib.Path(args.docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reference.markdown(Config))
    _say(f"wrote {path}\n")
    return
  plain = lambda v: ([plain(x) for x in v] if isinstance(v, (list, tuple)) else
                     {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v)
  print(yaml.safe_dump(plain(load_config(args.config, args.overrides).to_dict()),
                       sort_keys=False, width=100), end="")


def _run(args, cfg, argv: list[str]) -> None:
  """The command, once the config is valid: each imports what it runs here, so that jax and
  the model code load only after that (a bad config is one line in a second)."""
  libtpu.start_backends()  # without libtpu's start-up lines on a host with no TPU
  if args.command in ("train", "sft", "prefer", "distill"):
    from reasoner import loop

    again = shlex.join(["python", "-m", "reasoner", *argv])
    loop.train(cfg, command=again, stage="grpo" if args.command == "train" else args.command)
  elif args.command == "export":
    from reasoner import export

    if args.upload:
      export.check_handle(args.upload)  # before minutes of merging, not after
    if not (args.upload and (pathlib.Path(args.out) / "export.json").is_file()):
      export.export(cfg, args.out, args.step, tuple({"orbax", *(args.format or [])}))
    if args.upload:
      export.upload_run(cfg, args.out, args.upload, args.config)
  elif args.command == "plan":
    from reasoner.planner import ahead, report

    if args.ahead and args.analytic:
      raise ConfigError("plan --ahead compiles every split of the chips: drop --analytic")
    say = lambda s: print(s, file=sys.stderr, flush=True)
    found = ahead.plan_run(cfg, args.topology, args.search, args.analytic, log=say)
    print(report.format_report(found))
    if args.ahead:
      print(ahead.format_pick(ahead.pick(cfg, args.topology, found["chips"], say,
                                         known={cfg.rollout.devices: found})))
  elif args.command == "eval":
    from reasoner import evaluation

    evaluation.eval_only(cfg)
  else:
    from reasoner import evaluation

    for i, text in enumerate(evaluation.sample(cfg, args.question, args.n, args.category)):
      print(f"[{i}] {text}")


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  debug = "--debug" in argv or os.environ.get("REASONER_DEBUG", "") not in ("", "0")
  argv = [a for a in argv if a != "--debug"]
  args, extra = parser.parse_known_args(argv)  # overrides may follow flags: a=1 --flag b=2
  unknown = [x for x in extra if "=" not in x or x.startswith("-")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  args.overrides = [*getattr(args, "overrides", []), *(x for x in extra if x not in unknown)]
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  for noisy in ("absl", "jax._src", "orbax", "etils"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  old = signal.signal(signal.SIGTERM, _terminated)  # the loop's own replaces it while it runs
  try:
    return _main(args, argv, debug)
  finally:
    signal.signal(signal.SIGTERM, old)


def _main(args, argv: list[str], debug: bool) -> int:
  """main's body: the errors a user sees, each one line (`errors`), and the exit status."""
  try:
    if args.command == "config":
      _config(args)
      return 0
    if args.command == "report":  # the run's own files: no config, no model
      from reasoner import report

      report.main(args.run)
      return 0
    cfg = load_config(args.config, args.overrides)
    if args.command == "data":  # no devices started: it reads no model
      from reasoner import datareport

      datareport.report(cfg, args.stage)
      return 0
    _run(args, cfg, argv)
  except (UserError, FileNotFoundError, FloatingPointError) as e:
    if debug:
      raise
    _say("".join(f"error: {line}\n" for line in str(e).splitlines()))
    return 2
  except OSError as e:  # a full disk, a read-only folder: where, and the space left
    if debug or not e.filename:
      raise
    _say(f"error: cannot use {e.filename}: {write_error(e, pathlib.Path(e.filename).parent)}\n")
    return 2
  except loop_interrupted() as e:
    _say(f"{e}\n")
    return e.code
  except (KeyboardInterrupt, Terminated) as e:
    name, code = ("SIGINT", 130) if isinstance(e, KeyboardInterrupt) else ("SIGTERM", 143)
    _say(f"{name}: stopped outside the training loop; the latest checkpoint is intact, re-run "
         "the same command to resume\n")
    return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
