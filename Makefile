# Two entry points; both build the pinned CPU venv (.venv) on first use.
#   make demo   the CPU example end to end (tiny model, SGLang engine with KV eviction, Megatron PP=2, MLflow)
#   make test   the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export SGLANG_USE_CPU_ENGINE := 1
export HF_HUB_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: env demo test mlflow-ui clean

env:
	@bash tools/setup_env.sh $(VENV)

demo: env
	@echo "(SGLang and Megatron print warnings about CUDA-only features; they are expected on CPU)"
	$(PY) tools/launch.py examples/cpu_tiny.yaml

test: env
	$(PY) -m pytest

mlflow-ui: env
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///runs/cpu_tiny/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf runs
