# The two commands the README promises (`make demo`, `make test`); CI runs `make test` (see .ci/run).
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

# The main job on the embedded default: the bundled small model at 2.5, 2.9 and 3.5 bpw, four methods.
demo: setup
	$(VENV)/bin/quantizer demo
