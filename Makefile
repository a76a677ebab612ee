# hybridrl: `make demo` and `make test` work on a fresh machine (they create .venv themselves).
# torch: torch==2.13.0 unless a torch is already importable by $(PY_SYS) or TORCH_SPEC says otherwise.
SHELL := /bin/bash
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-distributed test-gpu bench lint clean

$(VENV)/.installed: setup.py
	@if [ ! -x $(PY) ]; then \
	  if $(PY_SYS) -c "import torch" 2>/dev/null; then \
	    echo "using the importable torch of $(PY_SYS)"; $(PY_SYS) -m venv --system-site-packages $(VENV); \
	  else $(PY_SYS) -m venv $(VENV); fi; fi
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then echo "installing $(TORCH_SPEC)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[dev,megatron]"
	@# shellcheck (Debian) lints the Slurm templates in the tests; best effort, the test skips without it
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -qq shellcheck >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && \
	   apt-get install -y -qq shellcheck >/dev/null 2>&1)) || echo "shellcheck not installed"; }
	@touch $@

install: $(VENV)/.installed

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) launcher/main.py conf/ppo_tiny.yaml trainer.overwrite=true $(ARGS)
	$(PY) -m launcher.report runs/ppo_tiny

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu" --timeout 900 $(PYTEST_ARGS)

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu and not distributed and not slow" $(PYTEST_ARGS)

test-distributed: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "distributed and not gpu" $(PYTEST_ARGS)

test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.train_step --model llama-1b --seq 2048 --batch 4
	$(PY) -m bench.generate --model llama-1b --batch 256 --prompt-len 128 --new-tokens 256 --engine both

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
