# The two commands the README promises; CI runs `make test` (see .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo
setup: $(VENV)/.installed

# torch is pinned in pyproject.toml (2.13.0): a range would let pip fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: setup
	$(PY) -m pytest -q
