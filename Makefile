# `make test` and `make smoke` build their own virtual environment (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# DeepSpeed's CPU extensions compile once into the ignored build area.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions
export DS_ACCELERATOR ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
# With a GPU the machine's own torch is kept (the venv sees system packages); without one the
# CPU build of torch is installed.
HAVE_GPU := $(if $(shell command -v nvidia-smi 2>/dev/null),1,)
VENV_FLAGS := $(if $(HAVE_GPU),--system-site-packages,)
CPU_TORCH := $(if $(HAVE_GPU),,torch==2.13.0)

.PHONY: venv test smoke bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(CPU_TORCH),$(BIN)/pip install -q $(CPU_TORCH))
	$(BIN)/pip install -q -e '.[test]'
	touch $@

test: venv
	$(BIN)/python -m pytest -q tests

smoke: venv
	$(BIN)/tupe-smoke

bench: venv
	$(BIN)/python bench/step_time.py

clean:
	rm -rf $(VENV) build *.egg-info
