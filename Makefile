# mpstream developer entry points. `make run` and `make test` each create the
# virtual environment, install the pinned requirements (torch + torchvision
# from the registry), build the C++ extension and then run.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
DOCTOR_ARGS ?=
# SYSTEM_TORCH=1: build $(VENV) on the torch and torchvision that $(PYTHON)
# already has (--system-site-packages) instead of installing the pinned pair,
# which the registry offers only as torch's CUDA build: about 5 GB with its
# nvidia-* wheels, even on a machine without a GPU. Applies when $(VENV) is
# created (a fresh clone, or after `rm -rf $(VENV)`).
SYSTEM_TORCH ?=

.PHONY: all setup build run doctor test check bench bench-suite clean

all: test

# What SYSTEM_TORCH=1 needs: mpstream's torch (>= 2.7) and a torchvision that
# imports with it (the registry's torchvision does not with a CPU-only torch).
define SYSTEM_TORCH_CHECK
import sys
try:
    import torch
    import torchvision
except Exception as error:
    sys.exit(f"SYSTEM_TORCH=1: {sys.executable} cannot import torch and torchvision "
             f"({type(error).__name__}: {error}); install a matching pair there, "
             f"or leave SYSTEM_TORCH out to install the pinned one into the venv")
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 7):
    sys.exit(f"SYSTEM_TORCH=1: {sys.executable} has torch {torch.__version__}; "
             f"mpstream needs torch >= 2.7")
print(f"SYSTEM_TORCH=1: torch {torch.__version__} and torchvision "
      f"{torchvision.__version__} from {sys.executable}")
endef
export SYSTEM_TORCH_CHECK

$(VENV)/.deps: requirements.txt
ifeq ($(SYSTEM_TORCH),1)
	@$(PYTHON) -c "$$SYSTEM_TORCH_CHECK"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --upgrade pip
	grep -vE '^(torch|torchvision)==' requirements.txt > $(VENV)/requirements-no-torch.txt
	$(PY) -m pip install -r $(VENV)/requirements-no-torch.txt
else
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
endif
	touch $@

$(VENV)/.built: $(VENV)/.deps setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

setup: $(VENV)/.built

build: setup

# The main job: `mpstream bench`, the tutorial's training experiment through
# the single-device ResNet50, the tutorial's models and mpstream, with the
# tutorial's figures and a JSON in mpstream-bench/ (--quick without a GPU).
run: setup
	$(VENV)/bin/mpstream bench $$($(PY) -c "import torch; print('' if torch.cuda.is_available() else '--quick')")

# `mpstream doctor`: on this machine's GPUs, results equal to the CPU's,
# measured overlap, the CUDA sanitizers, memory, the tutorial's experiment,
# a profile and the cost model; report in mpstream-doctor/. Without a GPU it
# runs the quick sizes and SKIPs the GPU steps. E.g. DOCTOR_ARGS="--model resnet101".
doctor: setup
	$(VENV)/bin/mpstream doctor $(DOCTOR_ARGS)

# The whole test suite: unit tests (CUDA tests skip without a GPU), then the
# benchmark suite once each, untimed. Both run in TEST_WORKERS processes
# (pytest-xdist), each taking a whole file at a time so that a module's
# fixtures run once. By default one per core, at most 8, on a machine without
# a GPU, and none (all in make's own pytest process) on one with a GPU: CUDA
# tests side by side would share the device and disturb each other's
# overlap timings and memory peaks.
TEST_WORKERS ?= $$($(PY) -c "import os, torch; print(0 if torch.cuda.is_available() else min(os.cpu_count() or 1, 8))")
XDIST = -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PY) -m pytest tests -q $(XDIST) $(PYTEST_ARGS)
	$(PY) -m pytest benchmarks -q --benchmark-disable $(XDIST) $(PYTEST_ARGS)

# The benchmark suite, timed; results saved under .benchmarks/ for
# `pytest benchmarks --benchmark-compare`.
bench-suite: setup
	$(PY) -m pytest benchmarks --benchmark-autosave --benchmark-json=benchmark.json

# Static checks: types, lint and formatting.
check: setup
	$(PY) -m mypy
	$(VENV)/bin/ruff check mpstream tests benchmarks setup.py conftest.py
	$(VENV)/bin/ruff format --check mpstream tests benchmarks setup.py conftest.py

bench: setup
	$(VENV)/bin/mpstream bench

clean:
	rm -rf build mpstream/_C*.so mpstream/_build.json *.egg-info .pytest_cache .mypy_cache
