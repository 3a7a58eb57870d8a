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

DEMO_STEPS ?= 300

.PHONY: venv test demo smoke bench bench-gpu clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(CPU_TORCH),$(BIN)/pip install -q $(CPU_TORCH))
	$(BIN)/pip install -q -e '.[test]'
	touch $@

test: venv
	$(BIN)/python -m pytest -q tests

# The main job on the bundled corpus: prepare it, then pretrain a tiny TUPE-R BERT with 2 CPU
# ranks (ZeRO-2) under the deepspeed launcher. Run again to resume; DEMO_STEPS=600 to go on.
demo: venv
	$(BIN)/tupe-prep --input data/sample --output build/sample-prep --vocab-size 8192 --workers 2
	$(BIN)/deepspeed --num_gpus 2 --module tupe_ds.pretrain --data build/sample-prep \
	  --model tiny --pos-encoding tupe-r --ds-config ds_configs/cpu_zero2.json --out build/demo-run \
	  --steps $(DEMO_STEPS) --seq-len 128 --eval-interval 100 --save-interval 100 \
	  --image-interval 100 --log-interval 20

# Every encoding, a few AdamW steps each, in one process (no launcher, no data).
smoke: venv
	$(BIN)/tupe-smoke

bench: venv
	$(BIN)/python bench/step_time.py
	$(BIN)/python bench/prep_throughput.py
	$(BIN)/deepspeed --num_gpus 2 bench/train_throughput.py --model tiny
	$(BIN)/deepspeed --num_gpus 2 bench/pipeline.py

# HF's BERT + torch AMP next to our DeepSpeed step, BERT-Large at seq 128 and 512, on one GPU (a
# tiny size on a CPU). Flags after ARGS=, e.g. make bench-gpu ARGS="--json build/bench-gpu.json".
bench-gpu: venv
	$(BIN)/python bench/gpu.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
