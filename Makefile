# mpstream developer entry points. `make run` and `make test` each create the
# virtual environment, install the pinned requirements (torch + torchvision
# from the registry), build the C++ extension and then run.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all setup build run test check bench clean

all: test

$(VENV)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $@

$(VENV)/.built: $(VENV)/.deps setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

setup: $(VENV)/.built

build: setup

# The main job: the tutorial's training experiment through the single-device
# ResNet50, the tutorial's models and mpstream (CPU-sized without a GPU).
run: setup
	$(VENV)/bin/mpstream bench --quick

# The whole test suite (CUDA tests skip without a GPU; benchmarks run once,
# untimed).
test: setup
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

# Static checks: types and lint.
check: setup
	$(PY) -m mypy
	$(VENV)/bin/ruff check mpstream tests

bench: setup
	$(VENV)/bin/mpstream bench

clean:
	rm -rf build mpstream/_C*.so mpstream/_build.json *.egg-info .pytest_cache .mypy_cache
