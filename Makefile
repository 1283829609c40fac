# Two commands do everything (see README.md):
#   make demo   set up a virtual environment and run the main job
#   make test   set up a virtual environment and run the whole test suite
#   make docs   build the HTML documentation (API reference from the docstrings) into
#               docs/_build/html, warnings being errors
# Each target creates .venv on first use; torch is pinned to the CPU build 2.13.0
# *before* the package is installed so that no multi-GB CUDA build is pulled.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0

.PHONY: demo test lint docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# [train] brings JAX, Optax and Flax: what `make demo` runs (no PyTorch).
$(VENV)/.core-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[train]'
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $@ $(VENV)/.core-installed

# The main job: the paper's memory table, then a few minutes of pretraining the `small`
# LLaMA on the embedded standard-library corpus with SAGE-Hybrid (loss curve PNG in runs/).
demo: $(VENV)/.core-installed
	$(BIN)/python -m sage_repro.memory_report
	$(BIN)/sage-train --model small --optimizer sage-hybrid --steps 300 --batch-size 16 \
		--seq-len 128 --eval-every 100 --run-dir runs/demo

test: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --durations=10

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/mypy

docs: $(VENV)/.dev-installed
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache docs/_build
