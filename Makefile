# Two entry points, both from a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

# torch first, pinned, so nothing later pulls a CUDA build from the registry.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[local,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m trainguard.face.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
