# Two entry points; both build the pinned CPU venv (.venv) on first use.
#   make demo   the CPU math demo end to end: SmolLM2-135M-Instruct learns single-digit sums with sparse
#               (R-KV) rollouts, Megatron PP=2, held-out accuracy before/after, dense and sparse; MLflow
#   make test   the test suite (4-12 min on 2 cores, with the machine's speed: docs/testing.md)
#   make test-fast   the pure tests alone (tier 'unit': no engine, no torchrun; about a minute)
#   make lint / make typecheck   ruff and mypy as CI runs them (pyproject.toml); make fmt   ruff's formatter
#   make demo-tiny   the same loop on a tiny locally built model (about a minute)
#   make long-chain  long responses (177 tokens) under R-KV 32: examples/cpu_long_chain.yaml, its data and
#               model built on first use (~19 min), then 30 iterations with held-out evaluations (~40 min)
#   make long-chain-study   that setting's study: dense, naive, sparse_rl x seeds 1-3, 12 iterations each
#               (~12 min a run; resumable: runs finished in runs/ablation/long_chain are kept)
#   make long-tail   long-tailed response lengths with partial rollouts: examples/cpu_long_tail.yaml, its data
#               and model built on first use (~80 s), then 12 iterations
#   again over an earlier run's folder: make demo ARGS=--resume (continue it) or ARGS=--overwrite (start anew)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export SGLANG_USE_CPU_ENGINE := 1
export HF_HUB_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

SMOLLM2 := runs/assets/smollm2-135m-instruct
RUN ?= runs/cpu_smollm2

.PHONY: env demo demo-tiny long-chain long-chain-study long-tail test test-fast lint typecheck fmt mlflow-ui clean

env:
	@bash tools/setup_env.sh $(VENV)

# a demo's run folder holds only that demo: each `make demo` starts it afresh (--overwrite), unless
# ARGS has --resume
FRESH = $(if $(findstring --resume,$(ARGS)),,--overwrite)

demo: env
	$(PY) tools/prepare_model.py --out $(SMOLLM2)
	$(PY) tools/prepare_data.py --benchmarks sums_train,sums_test --tokenizer $(SMOLLM2) \
		--instruction 'Put your final answer within \boxed{}.'
	$(PY) tools/launch.py examples/cpu_smollm2.yaml $(FRESH) $(ARGS)

demo-tiny: env
	$(PY) tools/launch.py examples/cpu_tiny.yaml $(FRESH) $(ARGS)

CHAIN_DATA = $(PY) tools/prepare_data.py --benchmarks chain_train,chain_test --arith-count 4000

long-chain: env
	$(CHAIN_DATA)
	$(PY) tools/launch.py examples/cpu_long_chain.yaml $(FRESH) $(ARGS)

long-chain-study: env
	$(CHAIN_DATA)
	$(PY) tools/ablation.py examples/cpu_long_chain.yaml --seeds 1,2,3 --iterations 12 \
		--set eval.interval=0 --set eval.before_training=false --out runs/ablation/long_chain $(ARGS)

long-tail: env
	$(PY) tools/prepare_data.py --benchmarks tail_train,tail_test --arith-count 1200
	$(PY) tools/launch.py examples/cpu_long_tail.yaml $(FRESH) $(ARGS)

test: env
	$(PY) -m pytest

test-fast: env
	$(PY) -m pytest -m unit

# the rules and the strict modules are in pyproject.toml (CONTRIBUTING.md)
lint: env
	$(VENV)/bin/ruff check .

typecheck: env
	$(VENV)/bin/mypy

# the files given (FILES=...), else the whole tree: not yet run repo-wide (CONTRIBUTING.md)
fmt: env
	$(VENV)/bin/ruff format $(or $(FILES),.)

# one process: MLflow's default 4 workers and its job runner (which no run here uses) each import MLflow
# first, and did not answer for minutes on a busy 2-core machine
PORT ?= 5000
mlflow-ui: env
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(RUN)/mlflow.db \
		--host 127.0.0.1 --port $(PORT) --workers 1

clean:
	rm -rf runs
