# Two commands do all the set-up:
#   make run    the walkthrough (kernel test reports now; profiling and fine-tuning as they land)
#   make test   the test suite (what CI runs)
# If `python3` can already import torch and triton (the NGC container, a prepared environment),
# it is used as is. Otherwise a virtual environment is made in .venv with torch, triton and
# requirements.txt. TORCH_SPEC / TORCH_INDEX choose the torch build for that environment, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu    (small CPU-only wheels)
PYTHON ?= python3
TORCH_SPEC ?= torch
TORCH_INDEX ?=
HAVE_TORCH := $(shell $(PYTHON) -c "import torch, triton" >/dev/null 2>&1 && echo yes)

ifeq ($(HAVE_TORCH),yes)
PY := $(PYTHON)
SETUP := .deps-system
else
PY := .venv/bin/python
SETUP := .venv/.done
endif

.PHONY: run test setup clean
run: $(SETUP)
	$(PY) walkthrough.py

test: $(SETUP)
	$(PY) -m pytest -q

setup: $(SETUP)

.deps-system: requirements.txt
	$(PY) -c "import transformers, accelerate, huggingface_hub, tabulate, tqdm, matplotlib, pytest" 2>/dev/null \
		|| $(PY) -m pip install -q -r requirements.txt
	@touch $@

.venv/.done: requirements.txt
	$(PYTHON) -m venv .venv
	.venv/bin/python -m pip install -q --upgrade pip
	.venv/bin/python -m pip install -q $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	.venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/python -m pip install -q triton
	.venv/bin/python -m pip install -q -r requirements.txt
	@touch $@

clean:
	rm -rf .venv .deps-system .pytest_cache __pycache__
