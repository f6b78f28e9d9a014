# The two commands of the README, each self-contained on a fresh machine:
#   make demo   3 synthetic hospitals train MiniLM federated under DP, with
#               ledgers, an audit and a privacy report (clinfed demo)
#   make test   installs everything and runs the test suite
# torch is installed first and pinned: that version is a CPU wheel on local
# disk here, while an unpinned torch pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.clinfed-installed
DEMO   ?= demo

.PHONY: install demo test test-slow lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/clinfed demo --out $(DEMO)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache *.egg-info
