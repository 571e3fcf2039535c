# reasoner: `make train` and `make test` set themselves up (a .venv stamped on pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/embedded.yaml
ARGS   ?=
BENCH  ?=
PRESET ?= gemma3_1b
DEVICES ?= 8
# `make test` runs its files on this many pytest processes (a file's tests stay together, so
# its shared builds are built once): `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 2

.PHONY: setup train sft prefer distill general general_grpo eval sample test check docs multihost bench notebook rehearse soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m reasoner train --config $(CONFIG) $(ARGS)

# Two stages: SFT on worked solutions (configs/embedded_sft.yaml), then GRPO from its LoRA
# (sampling at temperature 1 with dynamic sampling: after SFT most groups agree).
sft: $(STAMP)
	$(PY) -m reasoner sft --config configs/embedded_sft.yaml $(ARGS)
	$(PY) -m reasoner train --config configs/embedded.yaml lora.init_from=runs/embedded_sft \
	  data.template=plain train.run_name=embedded_sft_grpo rollout.temperature=1.0 \
	  grpo.dynamic_sampling=true grpo.max_sample_batches=2 optim.learning_rate=3e-5

# Three stages on the medium arithmetic set: SFT, preference optimisation (SimPO on the policy's
# own pairs: a right answer against a wrong one, configs/embedded_prefer.yaml), then GRPO.
prefer: $(STAMP)
	$(PY) -m reasoner sft --config configs/embedded_sft.yaml data.difficulty=medium \
	  data.num_eval=256 train.run_name=medium_sft eval.batch_size=64 $(ARGS)
	$(PY) -m reasoner prefer --config configs/embedded_prefer.yaml lora.init_from=runs/medium_sft $(ARGS)
	$(PY) -m reasoner train --config configs/embedded.yaml lora.init_from=runs/medium_prefer \
	  data.template=plain data.difficulty=medium data.num_eval=256 eval.batch_size=64 \
	  train.run_name=medium_prefer_grpo train.eval_before=false rollout.temperature=1.0 \
	  grpo.dynamic_sampling=true grpo.max_sample_batches=2 optim.learning_rate=3e-5 $(ARGS)

# Instructions that code checks, learnt: the base model's own right answers to 512 arithmetic
# problems (written once), then SFT on the generated instructions beside them
# (configs/embedded_general_sft.yaml); held out: instructions in new constraint combinations and
# new tasks (IFEval's numbers), arithmetic in new wordings and the retention set, each before
# and after. `make general_grpo`: the GRPO mixture alone (configs/embedded_general.yaml).
OWN_ANSWERS := runs/embedded_general_own.jsonl
general: $(STAMP) $(OWN_ANSWERS)
	$(PY) -m reasoner sft --config configs/embedded_general_sft.yaml $(ARGS)

$(OWN_ANSWERS): | $(STAMP)
	$(PY) tools/own_answers.py --config configs/embedded_general.yaml --category math \
	  --num 512 --max-new-tokens 40 --out $@ train.run_name=embedded_general_own

general_grpo: $(STAMP)
	$(PY) -m reasoner train --config configs/embedded_general.yaml $(ARGS)

# On-policy distillation: a fresh LoRA on the plain prompt learns from `make sft`'s result.
distill: $(STAMP)
	test -d runs/embedded_sft_grpo/checkpoints || $(MAKE) sft
	$(PY) -m reasoner distill --config configs/embedded_distill.yaml $(ARGS)

eval: $(STAMP)
	$(PY) -m reasoner eval --config $(CONFIG) $(ARGS)

sample: $(STAMP)
	$(PY) -m reasoner sample --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=30 $(ARGS)

# The quick tier, after every change (a few minutes): pyflakes, the package's own rules and the
# tests that load no model and start no process (those marked slow are left to `make test`).
check: $(STAMP)
	$(PY) -m pyflakes reasoner tests bench tools
	$(PY) -m pytest tests -m "not slow and not multihost and not extended" -n $(TEST_WORKERS) \
	  --dist loadfile $(ARGS)

# docs/configuration.md, generated from the typed config (a test fails when it is stale).
docs: $(STAMP)
	$(PY) -m reasoner config --docs docs/configuration.md

# The whole loop on 4 processes x 2 devices (a decode layout, resume, export), a teacher and a
# judge across two hosts, each against one process of 8 devices; a signal to one of two
# processes, a reward late on one of two (`make test` keeps one 2-process case).
multihost: $(STAMP)
	$(PY) -m pytest tests/test_multihost.py -m multihost $(ARGS)

bench: $(STAMP)
	$(PY) -m bench $(BENCH)

# A TPU preset on 8 fake CPU devices against a random checkpoint of its real shapes (slow).
rehearse: $(STAMP)
	$(PY) tools/rehearse.py $(PRESET) --devices $(DEVICES)

# 200 tiny steps through 21 faults (kill -9, signals, a damaged checkpoint, a full disk, a
# read-only run directory, a reward past its time limit), then bit-equal to a run without them;
# then the whole runs that repeat a `make test` case with a setting changed (pytest -m extended).
soak: $(STAMP)
	$(PY) tools/soak.py $(ARGS)
	$(PY) -m pytest tests -m extended -n $(TEST_WORKERS) --dist loadfile

# notebooks/grpo_kaggle.ipynb is generated from grpo_kaggle.py (a test checks they agree).
notebook: $(STAMP)
	$(VENV)/bin/jupytext --to ipynb notebooks/grpo_kaggle.py

clean:
	rm -rf $(VENV) runs bench/results
