# The two commands: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m rayapp.demo

lint: $(STAMP)
	$(BIN)/ruff check rayapp tests bench

test: lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/pool.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
