# Two entry points (README Quick start): `make demo` and `make test`. Both create .venv when missing.
# GPU users: install into your own environment instead: `pip install -e '.[dev]'` (your CUDA torch stays).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.ds-nvfp4-installed

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
	bash launch/demo.sh

test: $(STAMP)
	$(BIN)/ruff check .
	bash tests/cluster/setup.sh
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not slow'

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m pip install -q torchao --no-deps
	$(BIN)/python bench/quantize.py
	$(BIN)/python bench/gemm.py
	$(BIN)/python bench/zero.py

clean:
	rm -rf $(VENV) runs build *.egg-info
