# `make test` and `make smoke` build their own virtual environment (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# DeepSpeed's extensions (a GPU run's; a CPU run builds none) compile once into the ignored
# build area.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/build/torch_extensions
export DS_ACCELERATOR ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
# With a GPU the machine's own torch is kept (the venv sees system packages); without one the
# CPU build of torch is installed.
HAVE_GPU := $(if $(shell command -v nvidia-smi 2>/dev/null),1,)
VENV_FLAGS := $(if $(HAVE_GPU),--system-site-packages,)
CPU_TORCH := $(if $(HAVE_GPU),,torch==2.13.0)

DEMO_STEPS ?= 2500
DEMO_OUT ?= build/demo-run
SAMPLE_PREP := build/sample-prep-2048
COMPARE_STEPS ?= 200
COMPARE_ENCODINGS ?= bert-a tupe-r
COMPARE_RECIPE ?= paper
COMPARE_FINETUNE ?=
COMPARE_FINETUNE_FLAGS ?= --tasks rte mrpc stsb cola --finetune-lr 1e-4 3e-4 \
  --finetune-seeds 1 2 3 --finetune-epochs 3 --finetune-max-length 128

.PHONY: venv test test-fast demo compare smoke bench bench-gpu bench-gpu-all docs clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(CPU_TORCH),$(BIN)/pip install -q $(CPU_TORCH))
	$(BIN)/pip install -q -e '.[test,docs]'
	touch $@

# The CPU suite, on a GPU machine too (its GPUs hidden), in 3 processes on the 2 cores (tests/conftest.py), then
# its 15 slowest tests (the suite's budget: 20 minutes on 2 cores).
test: venv
	CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -n 3 \
	  --durations=15 tests

# The inner loop's tier: the tests not marked slow (unit and property tests; no process started,
# nothing trained through DeepSpeed or compiled), in under 3 minutes on 2 cores.
test-fast: venv
	CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu $(BIN)/python -m pytest -q -n 3 -m "not slow" \
	  --durations=10 tests

# The main job on the bundled corpus: prepare it, then pretrain a tiny TUPE-R BERT under the
# deepspeed launcher: on every GPU found (up to 8, bf16 where they have it, else fp16), else with 2
# CPU ranks (ZeRO-2, fp32); then its validation against the most-frequent-token baseline and
# masks filled in held-out sentences. Run again to resume; DEMO_STEPS=4000 to go on, DEMO_OUT for
# another run folder.
demo: venv $(SAMPLE_PREP)/train.idx
	$(BIN)/python -m tupe_ds.demo.run --data $(SAMPLE_PREP) --steps $(DEMO_STEPS) --out $(DEMO_OUT)

# The bundled corpus, prepared once for demo and compare (a small vocabulary: a tiny model learns
# more than word frequencies from 1 MB of text in minutes).
$(SAMPLE_PREP)/train.idx: | venv
	$(BIN)/tupe-prep --input data/sample --out $(SAMPLE_PREP) --vocab-size 2048 --workers 2

# The second demo: BERT-A against TUPE-R, one tiny run each on the same batches (2 CPU ranks, or
# every GPU), then build/compare/report.md with its figures. Run again to resume or re-report;
# COMPARE_STEPS=400 to go on, COMPARE_ENCODINGS="bert-a tupe-r rope" for more.
# COMPARE_RECIPE=modern (docs/compare.md, "Recipes") trains under the modern recipe, into
# build/compare-modern, in micro-batches of 2 (room for its batch ramp: 4, 8, 12, 16 on 2 ranks).
# COMPARE_FINETUNE=GLUE_DIR (docs/export-finetune.md, "GLUE data") fine-tunes every run on GLUE's small tasks with
# a grid for the tiny model (COMPARE_FINETUNE_FLAGS; "" for the paper's) and adds Table 1.
compare: venv $(SAMPLE_PREP)/train.idx
	$(BIN)/tupe-compare run --data $(SAMPLE_PREP) --encodings $(COMPARE_ENCODINGS) \
	  --model tiny --steps $(COMPARE_STEPS) $(if $(HAVE_GPU),,--nproc 2) \
	  --out build/compare$(if $(filter-out paper,$(COMPARE_RECIPE)),-$(COMPARE_RECIPE)) \
	  --recipe $(COMPARE_RECIPE) $(if $(filter modern,$(COMPARE_RECIPE)),--micro-batch 2) \
	  --ds-config ds_configs/cpu_zero2.json --seq-len 128 \
	  --eval-interval 25 --save-interval 50 --log-interval 10 \
	  $(if $(COMPARE_FINETUNE),--finetune $(COMPARE_FINETUNE) $(COMPARE_FINETUNE_FLAGS))

# Every encoding, a few AdamW steps each, in one process (no launcher, no data).
smoke: venv
	$(BIN)/tupe-smoke

bench: venv
	$(BIN)/python bench/step_time.py
	$(BIN)/python bench/prep_throughput.py
	$(BIN)/python bench/data_stream.py --size tenth
	$(BIN)/deepspeed --num_gpus 2 bench/train_throughput.py --model tiny
	$(BIN)/deepspeed --num_gpus 2 bench/pipeline.py

# HF's BERT + torch AMP next to our DeepSpeed step, BERT-Large at seq 128 and 512, on one GPU (a
# tiny size on a CPU). Flags after ARGS=, e.g. make bench-gpu ARGS="--json build/bench-gpu.json".
bench-gpu: venv
	$(BIN)/python -m bench.gpu.step_time $(ARGS)

# Every GPU measurement in one go (bench/gpu/suite.py: step time against HF at seq 128 and 512,
# padded as the loader pads, each at the like-for-like micro-batch and at its best, with the host
# against device ms of each phase; ELECTRA, the attention candidates, the data stream, the ZeRO
# sweep). Each row is
# appended to build/bench-gpu-all.rows.jsonl as it is measured (an earlier run's file is moved
# aside, stamped); build/bench-gpu-all.json and .md are made from it after each part, and a cut
# run's with `python3 -m bench.gpu.suite --report-only`. Each model build and part runs only if its
# estimate fits in what is left of --budget-s (570 s since the process started); what is skipped
# is named in the report with its command. On a GPU machine where tupe_ds is installed: `make
# bench-gpu-all`; offline, with a folder of wheels .whl whose setup.sh installs them: `source
# .whl/setup.sh && make bench-gpu-all` (its python3). Its time estimate is from
# guessed timings, not measured.
# Without nvidia-smi: the tiny CPU plan in the venv (43 s idle on 2026-11-24; 128 s on 2026-11-27 with
# the micro-batch sweep, 2 warm-up steps and the phases, under load: bench/README.md).
bench-gpu-all: $(if $(HAVE_GPU),,venv)
	$(if $(HAVE_GPU),python3,$(BIN)/python) -m bench.gpu.suite

# The documentation site (docs/, mkdocs.yml) into build/site; broken links and missing pages fail.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

clean:
	rm -rf $(VENV) build *.egg-info
