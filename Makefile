# mdlmpe_ds developer entry points. `make test` and `make demo` are the README's two commands:
# both create .venv on first use with the exact versions of requirements/constraints.txt (torch from
# the CPU wheel first, so no package can pull a CUDA build), then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
# A new stamp (a reinstall) whenever the declared dependencies or their pins change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(CONSTRAINTS) | cksum | cut -d' ' -f1)
export OMP_NUM_THREADS ?= 1
# DeepSpeed finds CUDA by itself; only a machine without an NVIDIA GPU is told "cpu" (a GPU node
# given DS_ACCELERATOR=cpu would train on the CPU). nvidia-smi needs no venv, so this holds on a
# first `make demo` too. An explicit DS_ACCELERATOR in the environment wins either way.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
ifneq ($(HAS_NVIDIA_GPU),yes)
export DS_ACCELERATOR ?= cpu
endif
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED = 1

.PHONY: venv test test-all test-unit test-dist lint format demo pretrain-demo compare bench gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c $(CONSTRAINTS) torch
	$(BIN)/pip install -q --disable-pip-version-check -c $(CONSTRAINTS) -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# `make test` (CI) leaves out the tests marked slow: the long sweeps (e.g. the fused kernels' shape
# sweep in tests/unit/test_attention_shapes.py, tens of minutes); `make test-all` runs everything.
# Three phases: tests/unit in UNIT_WORKERS pytest-xdist workers (each test file whole on one worker,
# `--dist loadfile`, so a module's fixtures are built once); then tests/dist in DIST_WORKERS workers
# the same way (each dist test is two DeepSpeed processes, but one file's launches alone used 0.6 to
# 1.1 of the 2 cores: imports before the ranks start, polling for kill points, checks in the test
# process; two files at a time fill the gaps, and every comparison is between runs made in one test
# with one thread per rank, so no number depends on it); then tests/gpu serially (one device). The
# two dist-marked torchrun checks in tests/unit stay with their files' fixtures in the first phase.
# Every phase runs even when an earlier one fails, so CI shows every failure; the target fails if any
# phase failed.
UNIT_WORKERS ?= 2
XDIST := -n $(UNIT_WORKERS) --dist loadfile
DIST_WORKERS ?= 2
DIST_XDIST := -n $(DIST_WORKERS) --dist loadfile
PHASES = $(BIN)/python -m pytest -q tests/unit $(XDIST) $(1); unit=$$?; \
	$(BIN)/python -m pytest -q tests/dist $(DIST_XDIST) $(1); dist=$$?; \
	$(BIN)/python -m pytest -q tests/gpu $(1); gpu=$$?; \
	exit $$(( unit ? unit : dist ? dist : gpu ))

test: venv
	$(call PHASES,-m "not slow")

test-all: venv
	$(call PHASES,)

test-unit: venv
	$(BIN)/python -m pytest -q tests -m "not dist" $(XDIST)

test-dist: venv
	$(BIN)/python -m pytest -q tests -m dist

lint: venv
	$(BIN)/ruff check mdlmpe_ds launch tests benchmarks
	$(BIN)/ruff format --check mdlmpe_ds launch tests benchmarks

format: venv
	$(BIN)/ruff format mdlmpe_ds launch tests benchmarks
	$(BIN)/ruff check --fix mdlmpe_ds launch tests benchmarks

# The demos start from scratch each time: an earlier demo's checkpoints and logs in its output_dir
# are replaced (a plain launch refuses an output_dir holding checkpoints; `DEMO_ARGS=--resume auto`
# continues instead).
DEMO_ARGS ?= --overwrite_output_dir true

demo: venv
	PATH=$(CURDIR)/$(BIN):$$PATH deepspeed launch/sft.py --deepspeed ds_configs/zero3.json $(DEMO_ARGS)

pretrain-demo: venv
	PATH=$(CURDIR)/$(BIN):$$PATH deepspeed launch/pretrain.py --deepspeed ds_configs/zero3.json $(DEMO_ARGS)

compare: venv
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python launch/compare_pe.py

bench: venv
	$(BIN)/python benchmarks/bench_attention.py

# GPU runbook (launch/gpu_check.py): memory plan, tests/gpu, the GPU attention benchmark, a 3-update
# 1-GPU ZeRO-3 smoke run of LLaDA-8B widths x 2 layers. Without a GPU: prints the plan, "no GPU:
# stopping", exit 0. DeepSpeed picks its accelerator itself here (CUDA when present).
gpu-check: venv
	env -u DS_ACCELERATOR PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python launch/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
