# Two entry points (README Quick start): `make demo` and `make test`. Both create .venv when missing.
# GPU users: install into your own environment instead: `pip install -e '.[dev]'` (your CUDA torch stays).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.ds-nvfp4-installed
# The venv's tools first on PATH for every process the tests and the demo start: torch's and DeepSpeed's JIT op
# builds (the CPU shm all-reduce, CPU Adam) run `ninja` from PATH, and two ninja versions alternating (the system's
# 1.11 for processes started without the venv on PATH, the venv's 1.13 for the launch scripts' ranks) rebuild an op
# from scratch at every switch: ninja discards a build log another version wrote (`ninja -d explain`: "command
# line not found in log")
RUN     := PATH="$(abspath $(BIN)):$$PATH"
# One pytest process by default. XDIST="-n 2 --dist loadfile" make test runs two pytest-xdist workers (20:24 against
# 26:55 on a 2-core EPYC), but two of three full runs with them failed a load-sensitive test (the allocator probe of
# `ds-nvfp4 env`, a gloo abort at exit): not the default until those are robust.
XDIST   ?=

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml setup.py ds_nvfp4_autohook.pth
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0 CPU comes from local disk on the reference machine; any other version downloads GBs.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(RUN) bash launch/demo.sh

test: $(STAMP)
	$(BIN)/ruff check .
	bash tests/cluster/setup.sh
	$(RUN) $(BIN)/python -m pytest $(XDIST)

test-fast: $(STAMP)
	$(RUN) $(BIN)/python -m pytest $(XDIST) -m 'not slow'

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m pip install -q torchao --no-deps
	$(BIN)/python bench/quantize.py
	$(BIN)/python bench/gemm.py
	$(BIN)/python bench/zero.py

clean:
	rm -rf $(VENV) runs build *.egg-info
