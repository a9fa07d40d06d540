# The two commands the README promises (`make demo`, `make test`); CI runs `make test` (see .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-fast test-gpu demo figures
setup: $(VENV)/.installed

# pyproject.toml declares ranges; constraints.txt pins the versions CI tests, torch==2.13.0 among
# them (without that pin pip may pick a newer torch, a multi-GB CUDA build on a CPU machine).
$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The dev extra: what `make test` runs (demo, plots, eval extras and the test tools).
$(VENV)/.installed: pyproject.toml setup.py constraints.txt | $(PY)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

# The demo extra only (no triton, lm-eval or transformers): what `make demo` runs on a fresh clone.
$(VENV)/.installed-demo: pyproject.toml setup.py constraints.txt | $(PY)
	$(PY) -m pip install -q -c constraints.txt -e '.[demo]'
	touch $@

# The linter first (settings in pyproject.toml [tool.ruff]), then the suite.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25

# The inner loop: the linter and every test not marked slow (tests/conftest.py says which are).
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow"

# The GPU suite (tests/gpu, or the files GPU_TESTS names) on a CUDA machine: exllamav3 from the kit in .device-cache/
# if present (made for python3).
GPU_PYTHON ?= python3
GPU_TESTS ?= tests/gpu
test-gpu: SHELL := /bin/bash
test-gpu:
	if [ -f .device-cache/setup.sh ]; then source .device-cache/setup.sh || exit 1; fi; \
	$(GPU_PYTHON) -m pytest -q $(GPU_TESTS)

# The main job on the embedded default: the bundled small model at 2.5, 2.9 and 3.5 bpw, four methods.
demo: $(VENV)/.installed-demo
	$(VENV)/bin/quantizer demo

# The README's figures, the demo rows the notebook reads, and the notebook with its outputs. The demo
# encodes every (tensor, K) its plans need: about 5 minutes on 2 idle cores.
FIGURES := docs/figures
figures: setup
	$(VENV)/bin/quantizer fit --model-config deepseek-v4.1-flash --recipe configs/recipes/2.9.yaml --sparks 2 \
		--context 512K --plot $(FIGURES)/fit-2.9-2sparks.png > /dev/null
	$(VENV)/bin/quantizer demo --json --plot $(FIGURES)/quality.png > $(FIGURES)/demo.json.tmp
	mv $(FIGURES)/demo.json.tmp $(FIGURES)/demo.json
	$(PY) notebooks/execute.py notebooks/first_look.ipynb --in-place
