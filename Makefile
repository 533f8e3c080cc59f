# Two commands do everything on a fresh machine:
#   make demo   set up what is missing, then train the tiny built-in model on CPU (the main job)
#   make test   set up what is missing, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel where one exists, so pip does not pull the CUDA build
	$(PY) -m pip install -q "torch==$${TORCH_VERSION:-2.13.0}" || $(PY) -m pip install -q torch
	# the Triton of the GPU machines we test on; on CPU it runs the kernels in its interpreter (TRITON_INTERPRET=1)
	$(PY) -m pip install -q "triton==$${TRITON_VERSION:-3.6.0}" || true
	$(PY) -m pip install -q -e ".[all]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tttv train configs/demo.toml

test: $(STAMP)
	$(PY) -m pytest -q --durations=10

clean:
	rm -rf $(VENV) runs outputs
