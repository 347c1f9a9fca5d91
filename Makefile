# rlake: the two commands are `make quickstart` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup quickstart test lint bench clean

$(STAMP): requirements/base.txt requirements/lock.txt pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found (rlake needs Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/base.txt -c requirements/lock.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/rlake run configs/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/quickstart.py

clean:
	rm -rf rlake-home .pytest_cache
