# rlake: the two commands are `make quickstart` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

SGLANG_STAMP := .venv-sglang/.installed

.PHONY: setup setup-sglang quickstart test lint bench clean

$(STAMP): requirements/base.txt requirements/lock.txt pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found (rlake needs Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/base.txt -c requirements/lock.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# SGLang's CPU environment, separate from .venv (it pins another torch): docs/sglang.md
$(SGLANG_STAMP): scripts/setup_sglang.sh scripts/sglang-cpu-requirements.txt scripts/sglang-cpu-lock.txt
	bash scripts/setup_sglang.sh
	touch $(SGLANG_STAMP)

setup-sglang: $(SGLANG_STAMP)

quickstart: $(STAMP)
	$(BIN)/rlake run configs/quickstart.yaml

# two workers: most of the suite waits on subprocesses (Prefect, MLflow, Ray, SGLang servers)
TEST_WORKERS ?= 2
test: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/quickstart.py

clean:
	rm -rf rlake-home .pytest_cache
