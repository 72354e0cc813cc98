# `make demo` and `make test` each set up .venv from nothing, then run.
# torch comes from TORCH_SPEC; on these machines torch==2.13.0 (CPU) lies on the local disk,
# so setup never pulls a multi-GB CUDA build. TRANSFORMERS_SPEC is the transformers version the
# suite runs against (the [hf] extra's range is wider; `make test-hf` runs another version).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TRANSFORMERS_SPEC ?= transformers==5.12.0
STAMP := $(VENV)/.pagedfuse-installed
HF_TESTS := tests/test_hf_continuous_batching.py tests/test_real_model.py tests/test_readme.py

.PHONY: setup test demo doctor bench-cpu lint test-hf clean

setup: $(STAMP)

# numpy before the build: setup.py imports torch, which warns without it.
$(STAMP): pyproject.toml setup.py Makefile $(wildcard csrc/*.cpp csrc/*.h csrc/host/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel "pybind11>=2.12" numpy
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,lint,hf,bench,model]" \
		"$(TRANSFORMERS_SPEC)"
	touch $(STAMP)

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/pagedfuse demo

doctor: $(STAMP)
	$(VENV)/bin/pagedfuse doctor

bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_cpu.py

lint: $(STAMP)
	$(PY) -m ruff check pagedfuse tests benchmarks

# The transformers tests under another transformers version (e.g. the [hf] range's upper end:
# make test-hf TRANSFORMERS=5.17.0), in a throwaway venv layered over .venv.
TRANSFORMERS ?= 5.17.0
HF_VENV := /tmp/pagedfuse-hf-$(TRANSFORMERS)
test-hf: $(STAMP)
	test -x $(HF_VENV)/bin/python || $(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -c "import sysconfig; print('$(abspath $(VENV))/lib/python' \
		+ sysconfig.get_python_version() + '/site-packages')" \
		> $$($(HF_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/base.pth
	$(HF_VENV)/bin/python -m pip install -q "transformers==$(TRANSFORMERS)"
	$(HF_VENV)/bin/python -m pytest -q -p no:cacheprovider $(HF_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info pagedfuse/*.so
