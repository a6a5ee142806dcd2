# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.dartspec-installed

.PHONY: demo test lint install clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel of this exact version; anything looser pulls CUDA builds.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,bench,serve]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dartspec demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs

lint: $(STAMP)
	$(BIN)/ruff check dartspec tests && $(BIN)/ruff format --check dartspec tests

clean-venv:
	rm -rf $(VENV)
