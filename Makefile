# The two commands of the README, each self-contained on a fresh machine:
#   make demo   trains on a synthetic 3-site corpus with the bundled MiniLM
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
	$(BIN)/clinfed data synth i2b2 --out $(DEMO)/data --sites 3 --docs 40 --seed 0
	$(BIN)/clinfed baseline --task i2b2 --data $(DEMO)/data --kind dictionary
	$(BIN)/clinfed train --task i2b2 --data $(DEMO)/data --strategy centralized --epochs 4 --out $(DEMO)/run
	$(BIN)/clinfed score --task i2b2 --gold $(DEMO)/data/test --pred $(DEMO)/run/predictions

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache *.egg-info
