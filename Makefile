# SeamlessFlow testbed. Every target creates and uses the project virtual environment on its own.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
POLICY ?= tag
CONFIG ?= sim/configs/default.yaml
SET ?=
OUT ?=
TORCH_VERSION ?= 2.13.0
PORT ?= 8000
ENGINES ?= 1
SEED ?=
comma := ,
SET_ARGS := $(foreach s,$(subst $(comma), ,$(SET)),--set $(s))
OUT_ARG := $(if $(OUT),--out $(OUT),)

.PHONY: setup sim compare serve test test-fast test-gpu lint bench bench-sim bench-runtime bench-train figures train-math compare-train train-swe validate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin torch first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,reference]"
	touch $(STAMP)

sim: $(STAMP)  ## make sim POLICY=tag [CONFIG=sim/configs/swe.yaml] [SET=cluster.num_gpus=128,num_steps=10]
	$(PY) -m sim --policy $(POLICY) --config $(CONFIG) $(SET_ARGS) $(OUT_ARG)

compare: $(STAMP)  ## all four policies on one config, with ratios to colocated
	$(PY) -m sim --compare --config $(CONFIG) $(SET_ARGS) $(OUT_ARG)

test: $(STAMP)  ## lint, then every CPU test (slow and docker-marked included; gpu-marked skipped)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not gpu"

test-fast: $(STAMP)
	$(PY) -m pytest -m "not gpu and not slow" -q

test-gpu: $(STAMP)  ## on a GPU machine
	$(PY) -m pytest -m gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: bench-sim bench-runtime bench-train  ## every benchmark (prints the figures quoted in the README)

bench-sim: $(STAMP)  ## speed of the simulator
	$(PY) -m benchmarks.sim_speed

bench-runtime: $(STAMP)  ## trajectory manager overhead (against an anchor proxy), overload, memory budget, prefix-tree append cost, built-in engine throughput
	$(PY) -m benchmarks.proxy_overhead
	$(PY) -m benchmarks.overload
	$(PY) -m benchmarks.manager_memory
	$(PY) -m benchmarks.prefix_tree
	$(PY) -m benchmarks.engine_throughput

serve: $(STAMP)  ## make serve [PORT=8000] [ENGINES=1]: engines + trajectory manager (OpenAI server)
	$(PY) -m reference serve --port $(PORT) --engines $(ENGINES)

figures: $(STAMP)  ## regenerate the simulator figures in experiments/out/
	$(PY) -m experiments.headline
	$(PY) -m experiments.sensitivity
	$(PY) -m experiments.weight_updates

train-math: $(STAMP)  ## GRPO on the math task from a random start, on CPU: make train-math [POLICY=tag] [SEED=0] [SET=policy.num_steps=300]
	$(PY) -m reference train --task math --policy $(POLICY) $(if $(SEED),--seed $(SEED),) $(SET_ARGS) $(OUT_ARG)

compare-train: $(STAMP)  ## the four policies on the runtime, one after another, with ratios to colocated
	$(PY) -m reference train --compare $(SET_ARGS) $(OUT_ARG)

bench-train: $(STAMP)  ## trainer tokens/s against plain transformers, weight hand-off time, share of matmul FLOP/s, control-plane cost per decision
	$(PY) -m benchmarks.train_speed
	$(PY) -m benchmarks.driver_overhead

train-swe validate:
	@echo "make $@: not built yet (see README, 'Status')." >&2; exit 1

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache
