# `make test` and `make demo` each create .venv if it is missing, install jphantom into it, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.jphantom-installed

.PHONY: test test-all test-aot test-rocm demo venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Two pytest workers (pytest-xdist), each file in one worker so that tests sharing a compiled step
# share it: the suite is compile-bound and the machine has 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

test-all: $(STAMP) test-aot
	$(PY) -m pytest -q -n 2 --dist loadfile

# Ahead-of-time GPU compiles (tests/compile/test_aot.py) need XLA's GPU compiler and cuDNN, ~2.8 GB: their own
# environment, so that `make test` stays light (there they skip, saying so).
AOT_VENV ?= .venv-aot
$(AOT_VENV)/.jphantom-installed: pyproject.toml
	test -x $(AOT_VENV)/bin/python || $(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AOT_VENV)/bin/python -m pip install --quiet -e '.[test,aot,tpu]'
	touch $@

test-aot: $(AOT_VENV)/.jphantom-installed
	$(AOT_VENV)/bin/python -m pytest -q -n 2 --dist load tests/compile/test_aot.py

# Ahead-of-time AMD GPU compiles (tests/compile/test_rocm.py): XLA's ROCm compiler exists only as jax
# 0.12.0's ROCm plugin, for Python >= 3.12 (~0.45 GB); gcc and readelf build stand-ins for the ROCm
# runtime it links (jphantom.rocm.stubs). In `make test` those tests skip, saying so.
ROCM_VENV ?= .venv-rocm
ROCM_PYTHON ?= env PYENV_VERSION=3.12.1 python3.12
$(ROCM_VENV)/.jphantom-installed: pyproject.toml
	test -x $(ROCM_VENV)/bin/python || $(ROCM_PYTHON) -m venv $(ROCM_VENV)
	$(ROCM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ROCM_VENV)/bin/python -m pip install --quiet -e '.[test,rocm]'
	touch $@

test-rocm: $(ROCM_VENV)/.jphantom-installed
	$(ROCM_VENV)/bin/python -m pytest -q -p no:xdist tests/compile/test_rocm.py

demo: $(STAMP)
	$(VENV)/bin/jphantom demo

bench: $(STAMP)
	$(PY) benchmarks/phantom_vs_tp.py
	$(PY) benchmarks/transformer_strategies.py
	$(PY) benchmarks/zero_stages.py
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/pmm3d.py

clean:
	rm -rf $(VENV) $(AOT_VENV) $(ROCM_VENV) build *.egg-info .pytest_cache
