# `make test` and `make demo` each create .venv if it is missing, install jphantom into it, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.jphantom-installed

.PHONY: test test-all demo venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/jphantom demo

bench: $(STAMP)
	$(PY) benchmarks/phantom_vs_tp.py
	$(PY) benchmarks/transformer_strategies.py
	$(PY) benchmarks/zero_stages.py
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/pmm3d.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
