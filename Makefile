# SeamlessFlow testbed. `make` lists the targets. Every target creates the project virtual environment
# and installs what it needs on first use, in two layers:
#   sim:  the simulator and its experiments (pyyaml, simpy, matplotlib, tqdm)   -> .venv/.installed-sim
#   full: the sim layer plus the runtime (torch on CPU, transformers, aiohttp, openai, ray), the dev
#         tools (pytest, ruff) and tensorboardX (--tensorboard)                  -> .venv/.installed
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SIM_STAMP := $(VENV)/.installed-sim
FULL_STAMP := $(VENV)/.installed
POLICY ?= tag
CONFIG ?= sim/configs/default.yaml
SET ?=
OUT ?=
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU wheels. Empty: pip's own indexes only (PyPI's torch is the CUDA build); docs/usage.md: GPUs.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The GPU layer (`make setup-gpu`): the torch release vLLM pins (pyproject's `gpu` extra), the CUDA build from
# pip's own indexes; GPU_TORCH_INDEX adds an index of builds for another CUDA (docs/usage.md: GPUs).
GPU_TORCH_VERSION ?= 2.14.0
GPU_TORCH_INDEX ?=
GPU_STAMP := $(VENV)/.installed-gpu
PORT ?= 8000
ENGINES ?= 1
NOW := $(shell date +%Y%m%d-%H%M%S)
# A fresh store per run: sessions of separate runs would otherwise mix in one file.
STORE ?= results/serve-$(NOW).sqlite
SEED ?=
comma := ,
SET_ARGS := $(foreach s,$(subst $(comma), ,$(SET)),--set $(s))
OUT_ARG := $(if $(OUT),--out $(OUT),)
# Succeeds when the URL answers within 5 s. On an index that never answers, pip waits out its timeout
# (15 s, retried 5 times) for each of torch's ten packages, so an unreachable TORCH_INDEX is left out.
URL_ANSWERS := import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)

.PHONY: help setup setup-sim setup-gpu sim compare serve test test-fast test-gpu bench-trainer-gpu calibrate-gpu lint bench bench-sim bench-runtime bench-train bench-swe \
	figures figures-runtime train-math compare-train train-swe validate validate-swe staleness clean

help:  ## this list; the second column is what a target installs on first use
	@awk '/^[a-z][a-z0-9 -]*:.*## / { \
		layer = /SIM_STAMP/ ? "sim" : /FULL_STAMP/ ? "full" : ""; \
		split($$0, parts, ":.*## "); split(parts[1], names, ":"); \
		printf "  %-19s %-5s %s\n", names[1], layer, parts[2] }' $(MAKEFILE_LIST)

$(VENV)/pyvenv.cfg:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(SIM_STAMP): pyproject.toml | $(VENV)/pyvenv.cfg
	$(PY) -m pip install --quiet -e .
	touch $@

# Torch first, so that the `reference` extra finds it installed and pip never picks the CUDA build.
$(FULL_STAMP): pyproject.toml | $(VENV)/pyvenv.cfg
	@index="$(TORCH_INDEX)"; \
	if [ -n "$$index" ] && ! $(PY) -c '$(URL_ANSWERS)' "$$index/torch/" 2>/dev/null; then \
		echo "TORCH_INDEX=$$index does not answer: torch comes from pip's configured indexes and find-links alone"; \
		index=; \
	fi; \
	set -x; $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" $${index:+--extra-index-url "$$index"}
	$(PY) -m pip install --quiet -e ".[dev,reference,swe,tensorboard]"
	touch $(SIM_STAMP) $@

# The full layer with vLLM and the CUDA torch it pins, replacing a CPU torch; the sim and full stamps are
# touched so that no other target puts the CPU torch back (after an edit of pyproject.toml, run it again).
$(GPU_STAMP): pyproject.toml | $(VENV)/pyvenv.cfg
	$(PY) -m pip install --quiet "torch==$(GPU_TORCH_VERSION)" $(if $(GPU_TORCH_INDEX),--extra-index-url "$(GPU_TORCH_INDEX)",)
	$(PY) -m pip install --quiet -e ".[dev,reference,swe,tensorboard,gpu]"
	@$(PY) -c 'import sys, torch; sys.exit(None if torch.version.cuda else "setup-gpu: torch " + torch.__version__ + \
		" is not a CUDA build (a CPU index or wheel in pip config?); set GPU_TORCH_INDEX to an index of CUDA builds")'
	touch $(SIM_STAMP) $(FULL_STAMP) $@

setup: $(FULL_STAMP)  ## create .venv with everything: the simulator, the runtime (CPU torch) and the dev tools

setup-sim: $(SIM_STAMP)  ## create .venv with the simulator's dependencies only

setup-gpu: $(GPU_STAMP)  ## on a GPU machine: the full layer plus vLLM (the gpu extra) and the CUDA torch it pins

sim: $(SIM_STAMP)  ## make sim POLICY=tag [CONFIG=sim/configs/swe.yaml] [SET=cluster.num_gpus=128,num_steps=10] [OUT=dir]
	$(PY) -m sim --policy $(POLICY) --config $(CONFIG) $(SET_ARGS) $(OUT_ARG)

compare: $(SIM_STAMP)  ## all five policies on one config, with ratios to colocated
	$(PY) -m sim --compare --config $(CONFIG) $(SET_ARGS) $(OUT_ARG)

figures: $(SIM_STAMP)  ## regenerate the simulator figures in experiments/out/ (headline, sensitivity)
	$(PY) -m experiments.headline
	$(PY) -m experiments.sensitivity

figures-runtime: $(FULL_STAMP)  ## regenerate the weight-update figure on the real runtime (about 2 minutes)
	$(PY) -m experiments.weight_updates

test: $(FULL_STAMP)  ## lint, then every CPU test (slow and docker-marked included; gpu-marked skipped)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not gpu" --durations=15

test-fast: $(FULL_STAMP)  ## the tests not marked slow or gpu, no lint
	$(PY) -m pytest -m "not gpu and not slow" -q

test-gpu: $(GPU_STAMP)  ## the gpu-marked tests (vLLM backend), on a GPU machine; installs the gpu layer first
	@$(PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "test-gpu: torch sees no CUDA GPU")'
	$(PY) -m pytest -m gpu -rs

bench-trainer-gpu: $(GPU_STAMP)  ## on a GPU machine: a bf16 FSDP trainer step (checkpointing, chunked loss) of random Qwen3-1.7B and 8B at 8k and 32k tokens, peak memory and tokens/s beside the simulator's
	@$(PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "bench-trainer-gpu: torch sees no CUDA GPU")'
	for m in qwen3-1.7b qwen3-8b; do for n in 8192 32768; do \
	  $(PY) -m benchmarks.trainer_memory --device cuda --ranks 1 --steps 2 --model $$m --tokens $$n || echo "$$m at $$n tokens: did not complete (above)"; done; done

calibrate-gpu: $(GPU_STAMP)  ## make calibrate-gpu [MODELS=qwen3-8b,qwen3-32b] [OUT=file.yaml] [PROCESSES=3]: measure this GPU into a profile for costs.profile (PROCESSES: each point the median of that many runs)
	@$(PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "calibrate-gpu: torch sees no CUDA GPU")'
	$(PY) -m benchmarks.gpu_calibration --cuda-graphs $(if $(MODELS),--models $(MODELS),) $(if $(OUT),--out $(OUT),) \
		$(if $(PROCESSES),--processes $(PROCESSES),)

lint: $(FULL_STAMP)  ## ruff check and ruff format --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: bench-sim bench-runtime bench-train bench-swe  ## every benchmark (prints the figures quoted in docs/)

bench-sim: $(SIM_STAMP)  ## speed of the simulator
	$(PY) -m benchmarks.sim_speed

bench-runtime: $(FULL_STAMP)  ## trajectory manager overhead (against an anchor proxy), overload, memory budget, big bodies' memory, prefix-tree append cost, an engine call's prompt on the wire, built-in engine throughput
	$(PY) -m benchmarks.proxy_overhead
	$(PY) -m benchmarks.overload
	$(PY) -m benchmarks.manager_memory
	$(PY) -m benchmarks.big_bodies
	$(PY) -m benchmarks.prefix_tree
	$(PY) -m benchmarks.engine_wire
	$(PY) -m benchmarks.engine_throughput

bench-swe: $(FULL_STAMP)  ## SWE sandboxes: start, exec and removal latency, 8 at once; a 2-step SWE training run: episodes/min, shares of generating, sandboxes and training (needs a Docker daemon: .ci/docker-setup)
	$(PY) -m benchmarks.swe_sandbox
	$(PY) -m benchmarks.swe_training

bench-train: $(FULL_STAMP)  ## trainer tokens/s against plain transformers, weight hand-off time, share of matmul FLOP/s, control-plane cost per decision, a step after a publish or others' work against one right after a step
	$(PY) -m benchmarks.train_speed
	$(PY) -m benchmarks.driver_overhead
	$(PY) -m benchmarks.trainer_cold

serve: $(FULL_STAMP)  ## make serve [PORT=8000] [ENGINES=1] [STORE=file.sqlite]: engines + trajectory manager (OpenAI server)
	@echo "make serve: trajectories go to $(STORE) (STORE=FILE picks another; python -m reference check --store FILE reads one)"
	$(PY) -m reference serve --port $(PORT) --engines $(ENGINES) --store $(STORE)

train-math: $(FULL_STAMP)  ## GRPO on the math task from a random start, on CPU: make train-math [POLICY=tag] [SEED=0] [SET=policy.num_steps=300]
	$(PY) -m reference train --task math --policy $(POLICY) $(if $(SEED),--seed $(SEED),) $(SET_ARGS) $(OUT_ARG)

compare-train: $(FULL_STAMP)  ## the five policies on the runtime, one after another, with ratios to colocated
	$(PY) -m reference train --compare $(SET_ARGS) $(OUT_ARG)

validate: $(FULL_STAMP)  ## the simulator against the runtime: 3 rounds (REPEATS=), each measuring the parts alone, then running the five policies; the simulator predicts each round from its parts (21-25 minutes on a quiet machine)
	$(PY) -m experiments.validate --overwrite $(if $(STEPS),--steps $(STEPS),) $(if $(REPEATS),--repeats $(REPEATS),) $(OUT_ARG)

validate-swe: $(FULL_STAMP)  ## the same on the SWE workload (make train-swe's recipe in Docker sandboxes, from one warm start): reported, not yet bound by the 10% (about 70 minutes; STEPS= REPEATS= OUT=)
	$(PY) -m experiments.validate --workload swe --overwrite $(if $(STEPS),--steps $(STEPS),) $(if $(REPEATS),--repeats $(REPEATS),) $(OUT_ARG)

staleness: $(FULL_STAMP)  ## staleness against convergence on the runtime: colocated, tag, async and streaming at bounds 1, 2, 4 on the math task, 3 seeds (about 50 minutes)
	$(PY) -m experiments.staleness $(if $(SEEDS),--seeds $(SEEDS),) $(OUT_ARG)

train-swe: $(FULL_STAMP)  ## warm start, then GRPO on the SWE suite in Docker sandboxes: make train-swe [AGENT=mini-swe-agent] [SEED=0] [SET=...]
	$(PY) -m reference train --config reference/configs/swe.yaml \
		$(if $(filter mini-swe-agent,$(AGENT)),--config reference/configs/swe-mini.yaml,$(if $(AGENT),--set task.options.agent=$(AGENT),)) \
		$(if $(SEED),--seed $(SEED),) $(SET_ARGS) $(OUT_ARG)

clean:  ## remove .venv, results/ and caches
	rm -rf $(VENV) results .pytest_cache .ruff_cache
