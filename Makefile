# Two commands work on a fresh machine: `make run` and `make test`.
# Both create .venv and install what they need on their own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The demo prompt (printf escapes): the bundled byte-level model continues code best mid-file.
PROMPT := class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):

.PHONY: run test test-all lint venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# On CPU-only hosts this takes the CPU wheel that lies on disk; it never downloads a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hispec generate "$$(printf '$(PROMPT)')" --max-new-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m ''

# ruff over the code and the tests, then mypy over the code ([tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check pipeline statemachines kernels tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
