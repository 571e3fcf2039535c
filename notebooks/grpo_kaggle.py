# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Teaching Gemma to reason with GRPO on a Kaggle TPU v5e-8
#
# This notebook trains **Gemma 3 1B** (or Gemma 2 2B) to reason with its steps written out,
# using **GRPO** (group relative policy optimisation) with **LoRA** adapters, and hands in a
# model that Tunix's own Gemma code loads. Two paths, one parameter (`CONFIG`): grade-school
# math (GSM8K, checked against the reference answer), or **general reasoning**: GSM8K beside
# creative writing, summaries, science and code, the rest scored by a Gemma 3 12B-it rubric
# judge on four of the eight chips, with a table by category before and after. Every cell calls the
# `reasoner` library; nothing here is logic of its own, so what you read is what
# `python -m reasoner train --config <preset>` runs.
#
# What happens, in order:
# 1. **Plan**: per-chip memory and estimated step time, compiled ahead of time, and how many
#    steps fit in this session.
# 2. Optionally, **supervised fine-tuning** on worked solutions first, then **preference
#    optimisation** (SimPO, DPO, ORPO): the winning public recipe was SFT -> SimPO -> GRPO.
# 3. **Evaluate before training**: greedy answers on held-out problems.
# 4. **Train** until the configured steps or the session's deadline, saving checkpoints.
# 5. **Evaluate after**, compare completions before and after side by side and, on the general
#    path, the judge's scores and win rate by category.
# 6. **Export**: LoRA merged into the base weights, written as a Kaggle Flax checkpoint.
#
# A 9-hour Kaggle session is rarely enough for a full run: the last section says how a second
# session continues exactly where this one stopped.

# %% [markdown]
# ## Install
# On Kaggle, attach the `reasoner` repository as a dataset (*Add Input*), or set
# `REASONER_SOURCE` to a pip-installable location of it. Where the machine has a TPU (its
# device files or the variables its runtime sets, read before jax loads) this installs
# `reasoner[tpu]`, whose jax, jaxlib and libtpu match; elsewhere plain `reasoner`. It then
# prints their versions and the devices JAX sees; a TPU that JAX did not come up on is one
# line with the pip command that fixes it. Skipped, but for that check, when `reasoner` is
# importable.

# %%
import importlib.util
import os
import pathlib
import subprocess
import sys

if importlib.util.find_spec("reasoner") is None:
    found = sorted(pathlib.Path("/kaggle/input").glob("*/pyproject.toml"))
    source = os.environ.get("REASONER_SOURCE") or (str(found[0].parent) if found else None)
    if source is None:
        raise SystemExit("reasoner is not installed: attach its repository as a dataset or set "
                         "REASONER_SOURCE (a path or git URL pip can install)")
    script = pathlib.Path(source, "reasoner", "install.py")
    if not script.is_file():  # a git URL: reasoner alone first (its install module needs nothing)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", source],
                       check=True)
        importlib.invalidate_caches()
        script = pathlib.Path(importlib.util.find_spec("reasoner.install").origin)
    spec = importlib.util.spec_from_file_location("reasoner_install", script)
    installer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installer)
    installer.install(source)
    importlib.invalidate_caches()
from reasoner import install

install.check()

# %% [markdown]
# ## Parameters
# `CONFIG` is a preset from `configs/`: `configs/gemma3_1b.yaml` (GSM8K) or
# `configs/gemma3_1b_general.yaml` (general reasoning with a 12B rubric judge; attach
# `google/gemma-3/flax/gemma3-12b-it` too; its public datasets download on first use with the
# notebook's Internet on, or read a copy attached as a Kaggle dataset: see the preset).
# `OVERRIDES` are dotted settings on top of it (`train.steps=200`, `rollout.temperature=0.8`,
# `train.resume_from=...`). `SFT` and `PREFER`: None, or the overrides of a supervised
# fine-tuning stage and of a preference stage before GRPO (below). `UPLOAD`: None, or the Kaggle
# model handle `OWNER/MODEL/FRAMEWORK/VARIATION` the export is uploaded to as a new version (the
# notebook's Kaggle credentials; its notes: the config, the step, the held-out figures by
# category). Papermill sets them:
# `papermill grpo_kaggle.ipynb out.ipynb -p CONFIG configs/tiny.yaml`.

# %% tags=["parameters"]
CONFIG = "configs/gemma3_1b.yaml"
OVERRIDES = []
SFT = None  # e.g. ["train.steps=300", "train.batch_size=16", "optim.learning_rate=1e-4"]
PREFER = None  # e.g. [] (the preset's prefer section) or ["prefer.pairs=policy", "train.steps=100"]
UPLOAD = None  # e.g. "<you>/gemma3-1b-grpo/flax/gemma3-1b-it": upload the export as a Kaggle model

# %% [markdown]
# ## The run
# The preset fixes the model, data, rewards and hyperparameters; on Kaggle the run is written
# under `/kaggle/working/runs` and the session's deadline defaults to 8h30m from the kernel's
# start (`train.deadline`), leaving half an hour of the 9 hours for the cells after training.
#
# **Hyperparameters and why** (the 1B preset):
# - **G = 8 completions per prompt, 4 prompts a step**: GRPO's advantage is each completion's
#   reward against its own group's mean, so groups need enough spread to carry a signal; the
#   plan below shows what the 32 sequences of 256 + 768 tokens take a chip.
# - **LoRA rank 64 on every attention and MLP projection**: few enough parameters that the
#   optimizer state is small, and the KL reference is the base weights themselves (LoRA at
#   zero), never a second copy of the model.
# - **Learning rate 3e-5, 20 warm-up steps, cosine decay**: GRPO's updates are noisy; a low rate
#   keeps the policy close to the instruction-tuned model it starts from.
# - **beta = 0.04 (KL to the base), clip 0.2 / 0.28 (DAPO's clip-higher)**: the KL keeps the
#   language fluent; the wider upper clip lets rare good completions gain probability faster.
# - **Temperature 0.9, top-k 64, top-p 0.95** for rollouts: diverse enough for group contrast;
#   evaluation is greedy.

# %%
from reasoner import notebook as nb

cfg = nb.configure(CONFIG, OVERRIDES)

# %% [markdown]
# ## Plan: memory and time before spending TPU hours
# Both steps compiled for this machine's chips: arguments, temporaries and outputs per chip
# against the 16 GiB of a v5e, and a roofline estimate of the step time (a lower bound). The
# deadline, not this estimate, decides when training stops.

# %%
plan = nb.show_plan(cfg)

# %% [markdown]
# ## Data and prompt format
# Questions come from **GSM8K** (grade-school math word problems with a numeric answer; the
# held-out split is disjoint from training). Instruction-tuned models get Gemma's chat template;
# base models a two-shot prompt. Either asks for
# `<reasoning>...</reasoning><answer>...</answer>`, so the answer can be checked by a parser:

# %%
from reasoner.data import prompts

print(prompts.render(cfg.data.template, "A baker made 24 rolls and sold 9. How many are left?"))

# %% [markdown]
# ## Optional: supervised fine-tuning, then preference optimisation
# With `SFT` set, the LoRA first learns the data's worked solutions (GSM8K's, written in the
# answer format), with the loss on the solutions' tokens only, under the run name
# `<run_name>-sft`; GRPO then starts from its LoRA (`lora.init_from`). SFT teaches the format
# and the method from written examples; GRPO then reinforces what the model itself samples.
# On the embedded 270M, 32 SFT steps took held-out accuracy from 0 to 0.81 on a prompt without
# examples, where 16 GRPO steps alone reached 0.70 with a two-shot prompt (both in-template:
# held out by record, docs/sft.md).
#
# With `PREFER` set, a preference stage follows (`<run_name>-prefer`, from the SFT LoRA where
# there is one), with the preset's `prefer` section (`PREFER = []`) or overrides of it. Pairs
# are the policy's own with `prefer.pairs: policy` (the general preset's): G completions a
# prompt scored by the preset's rewards (the judge included), the best against the worst where
# their rewards differ by `prefer.min_margin`; or the records' `chosen` and `rejected`
# responses (`prefer.pairs: file`). SimPO needs no reference forward; DPO's reference is the
# LoRA the stage started from. The stage is there to stop verbose answers and invented steps
# before RL rewards them.

# %%
OVERRIDES = nb.stage(CONFIG, OVERRIDES, "sft", SFT)
OVERRIDES = nb.stage(CONFIG, OVERRIDES, "prefer", PREFER)
cfg = nb.configure(CONFIG, OVERRIDES)

# %% [markdown]
# ## Load the model and evaluate it before training
# The weights are restored from Kaggle straight into their shards over the 8 chips, then, where
# the base takes at most a quarter of a chip (`mesh.weights: auto`; Gemma 3 1B on a v5e), gathered
# whole onto each chip once, so that a LoRA step gathers no weights; LoRA adapters are added in
# place. Greedy decoding on the held-out problems gives the starting point.

# %%
from reasoner.loop import Run

run = Run(cfg, command="re-run this notebook")
before = run.evaluate_before()
nb.table(nb.eval_rows(run.path, "before"))

# %% [markdown]
# ## Train
# **Reward design.** Each completion gets a weighted mean of plain functions, each in [0, 1]:
# `format_exact` (weight 0.2) is 1 when the completion is exactly
# `<reasoning>...</reasoning><answer>...</answer>`; `correct` (weight 0.8) is 1 when the answer
# equals the reference: numbers by value (`12`, `12.0`, `$12` and `1,200`-style commas agree),
# anything else (fractions, LaTeX) through `math-verify`.
# Correctness dominates: format alone cannot earn more than 0.2, so the policy cannot settle on
# a well-formatted wrong answer.
#
# Each step samples G completions per prompt, scores them, and updates LoRA with the clipped
# GRPO objective (token-mean over the batch). Checkpoints are written every
# `train.checkpoint_every` steps and when the deadline stops the loop.

# %%
stopped = run.train()
print(stopped or f"trained to step {run.step} of {cfg.train.steps}")

# %% [markdown]
# ### Reward during training
# Each dot is one step's mean rollout reward (sampled, so noisy); the line its 5-step mean; the
# circles the held-out greedy evaluations.

# %%
nb.show_plot(run.writer.plot())

# %% [markdown]
# ## Evaluate after training

# %%
after = run.evaluate_after()
summary, pairs = nb.compare(run)
summary

# %% [markdown]
# ### What changed, with its noise
# Each evaluation set's change from before training, paired by question (the standard error is
# that of the per-question differences): the held-out split, and the retention set, what the
# model could already do before training. A retention set that fell beyond noise is marked, and
# the run printed one warning line about it.

# %%
nb.changes(run.results)

# %% [markdown]
# ### Completions before and after, on the same held-out questions

# %%
pairs

# %% [markdown]
# ### By category
# On the general path: each category's held-out mean reward before and after (the judge's
# rubric scores for the categories it grades, `correct` for math), and the judge's win rate of
# the trained model against the model before training, asked in both orders so that the
# judge's preference for the first or second answer cancels (0.5: no difference). Below them,
# each set of checkable instructions (the general presets' generated set): the share of prompts
# whose every instruction was followed, and the share of instructions followed (IFEval's strict
# figures; the loose ones are in eval.json).

# %%
nb.by_category(run.results)

# %% [markdown]
# ## The report
# The run's figures in one place, from its own files (`python -m reasoner report <run>` writes
# the same): reward by category, completion length, KL, entropy and clip fraction over the
# steps, the before/after table with standard errors, completions before and after, and the
# stages the run came from. The PNGs and report.md are in the run's `report/` folder.

# %%
from IPython.display import Markdown

from reasoner import report

Markdown(report.report(cfg.run_path).read_text())

# %% [markdown]
# ## Export the trained model
# LoRA is merged into the base weights (in the base dtype) and written in the upstream Kaggle
# Flax layout with its `tokenizer.model`. Tunix loads it with its own code:
#
# ```python
# from tunix.models.gemma3 import model, params
# m = params.create_model_from_checkpoint(f"{out}/gemma3-1b-it", model.ModelConfig.gemma3_1b_it())
# ```
#
# and `reasoner` with `model.path=<out>`. With `UPLOAD` set, the folder is uploaded as a new
# version of that Kaggle model, with the run's notes, and the cell prints the model's ID; with no
# credentials, or offline, it prints one line and the export stays on disk (the same as
# `python -m reasoner export --config <preset> --out <dir> --upload <handle>`).

# %%
run.close()
out = nb.export(run)
print(sorted(p.name for p in out.iterdir()))
if UPLOAD:
    from reasoner import export
    from reasoner.errors import UserError

    try:
        print(f"model ID: {export.upload_run(cfg, out, UPLOAD, CONFIG)}")
    except UserError as e:
        print(e)

# %% [markdown]
# ## Continuing in a second session
# When the deadline stops training, the last checkpoint is in this notebook's output. In a new
# session, add this notebook's output as an input (Kaggle mounts it read-only under
# `/kaggle/input/<notebook>`) and set:
#
# ```python
# OVERRIDES = ["train.resume_from=/kaggle/input/<notebook>/runs/<run_name>"]
# ```
#
# The run continues from the saved step with the same optimizer state, data order and random
# keys, so two sessions end where one long session would; its logs carry the first session's
# rows. Re-running the notebook in the same session resumes from the run's own checkpoints.
