# Two commands do all set-up on a fresh machine:
#   make train   the main job (today: the codec and collective benchmarks; issue [3] makes it training)
#   make test    the test suite (CI: .ci/run)
# Both create .venv (Python 3.12, megatron-core 0.19) and build the C++ kernels when missing.

PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null) python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench bench-codecs bench-collectives cuda-build clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/include/zpp/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.15.*" "setuptools>=69" wheel ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $@

train: $(STAMP)
	$(PY) tools/bench_codecs.py
	$(PY) tools/bench_collectives.py

bench: train

bench-codecs: $(STAMP)
	$(PY) tools/bench_codecs.py $(ARGS)

bench-collectives: $(STAMP)
	$(PY) tools/bench_collectives.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

cuda-build: $(STAMP)
	$(PY) tools/cuda_build.py

clean:
	rm -rf build megatron_zpp/*.so $(STAMP)
