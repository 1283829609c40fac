# Two commands do everything (see README.md):
#   make demo   set up a virtual environment and run the main job
#   make test   set up a virtual environment and run the whole test suite
#   make docs   build the HTML documentation (API reference from the docstrings) into
#               docs/_build/html, warnings being errors
# Each target creates .venv on first use; torch is pinned to the CPU build 2.13.0+cpu
# *before* the package is installed so that no multi-GB CUDA build is pulled: the version's
# local segment `+cpu` matches only a CPU wheel (found where pip's configuration looks, else
# on PyTorch's CPU index), never a CUDA build (tests/docs/test_docs_install.py reads the
# installed wheel's version and `torch.version.cuda`).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# setuptools' boxed "Editable installation" notice (an InformationOnly UserWarning of the
# build backend) says nothing a user of `make` can act on
QUIET_BUILD := PYTHONWARNINGS=ignore::UserWarning

.PHONY: demo test lint docs clean

$(BIN)/python:
	@echo "[setup] creating the virtual environment $(VENV) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# [train] brings JAX, Optax and Flax: what `make demo` runs (no PyTorch).
$(VENV)/.core-installed: pyproject.toml | $(BIN)/python
	@echo "[setup] installing sage-optim with its [train] extra (JAX, Optax, Flax ...; a minute or two, pip's progress follows)"
	$(QUIET_BUILD) $(BIN)/python -m pip install --progress-bar on -e '.[train]'
	@echo "[setup] done"
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	@echo "[setup] installing $(TORCH) (PyTorch's CPU build)"
	$(BIN)/python -m pip install --quiet $(TORCH) 2>/dev/null || \
		$(BIN)/python -m pip install --quiet $(TORCH) --index-url $(TORCH_CPU_INDEX)
	@echo "[setup] installing sage-optim with its [all,dev] extras (a few minutes, pip's progress follows)"
	$(QUIET_BUILD) $(BIN)/python -m pip install --progress-bar on -e '.[all,dev]'
	@echo "[setup] done"
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
