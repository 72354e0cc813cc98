# `make demo` and `make test` each set up .venv from nothing, then run.
# torch comes from TORCH_SPEC; on these machines torch==2.13.0 (CPU) lies on the local disk,
# so setup never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.pagedfuse-installed

.PHONY: setup test demo bench-cpu lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=64" wheel "pybind11>=2.12"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench,model]"
	touch $(STAMP)

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/pagedfuse demo

bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_cpu.py

lint: $(STAMP)
	$(PY) -m ruff check pagedfuse tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info pagedfuse/*.so
