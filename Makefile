# Two commands work on a fresh machine: `make run` and `make test`.
# Both create .venv and install what they need on their own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The demo prompt (printf escapes): the bundled byte-level model continues code best mid-file.
PROMPT := class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):

.PHONY: run test test-all proptest mutation gpu-check gpu-wheels lint venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# On CPU-only hosts this takes the CPU wheel that lies on disk; it never downloads a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the CPU's compiled loops, once per install (numba's cache), so no first request waits for them
	$(BIN)/python -m pipeline.precompile
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hispec generate "$$(printf '$(PROMPT)')" --max-new-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m ''

# every state machine (the tests marked proptest) with the thorough hypothesis profile: many more
# and longer runs than `make test` (tests/conftest.py; README, "Property tests")
proptest: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q -p no:cacheprovider -m proptest

# the memory logic's mutation score, the mutants killed by the property tests alone (docs/mutation.md):
# a benchmark, not part of `make test`. One worker at low priority; MUTATION_EVERY=N runs the mutants
# whose name hashes to 0 modulo N (1: all of them, hours).
MUTATION_EVERY ?= 10
mutation: $(STAMP)
	@$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install -q -e '.[mutation]'
	nice -n 15 $(BIN)/python tests/mutation_run.py run --every $(MUTATION_EVERY)
	$(BIN)/python tests/mutation_run.py report

# the prepared device check: the tests marked cuda, then a benchmark at V3.2's attention shapes
# (docs/benchmarks.md, "Device check"); without CUDA the same at CPU sizes, in .venv. A GPU machine
# whose python3 has a CUDA build of torch (and no package index) runs it from the tree with that
# python3, installing first the wheels `make gpu-wheels` saved in .whl/ (what its image lacks).
GPU_SITE := /tmp/hispec-gpu-site
gpu-check:
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		if [ -d .whl ]; then $(PY) -m pip install -q --no-index --no-deps --no-compile --upgrade \
			--target $(GPU_SITE) .whl/*.whl || exit 1; fi; \
		PYTHONPATH=$(CURDIR):$(GPU_SITE) $(PY) -m pipeline.cli bench gpu-check --out bench-gpu-check.json; \
	else \
		$(MAKE) --no-print-directory venv && $(BIN)/hispec bench gpu-check --out bench-gpu-check.json; \
	fi

# the pure-Python wheels a GPU image lacks, for `make gpu-check` there (where pip reaches an index)
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl structlog==26.1.0

# ruff over the code and the tests, then mypy over the code ([tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check pipeline statemachines kernels tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
