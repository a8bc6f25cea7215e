# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite).
#
# Knobs (CI sets them; a user needs none):
#   PYTHON       interpreter the venv is made from (python3)
#   VENV         where the venv goes (.venv)
#   TEST_EXTRAS  extras `make test` installs: `test` (with the torch + transformers references) or `test-core`
#   CONSTRAINTS  a pip constraints file, e.g. .ci/jax-lowest.txt to pin the lowest supported jax
#   PYTEST_ARGS  extra pytest arguments (CI: its leg's -m filter, which only shares the slow tests out between the
#                legs, and --durations=0 --durations-min=2: every test phase of 2 s or more, where CI's time goes;
#                without it `make test` runs every test, all of which must pass)
#   TEST_JOBS    pytest processes `make test` runs at once (2): they share the test files out between them
#                (tests/parallel.py; 1 runs one plain pytest)
#   GPU_BUILD=1  also install the deviceless sm_90 compile tools: jax-cuda13-plugin / -pjrt of exactly the
#                installed jax version, nvidia-cuda-nvcc (ptxas) and nvidia-nvvm (libdevice); jax >= 0.11 only
PYTHON      ?= python3
VENV        ?= .venv
TEST_EXTRAS ?= test
CONSTRAINTS ?=
GPU_BUILD   ?=
PYTEST_ARGS ?=
TEST_JOBS   ?= 2
PIP          = $(VENV)/bin/pip
PIP_INSTALL  = $(PIP) install --quiet $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS))

.PHONY: demo test test-setup gpu-build-tools clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[plot]'
	touch $@

$(VENV)/.installed-$(TEST_EXTRAS): $(VENV)/.installed pyproject.toml
	$(PIP_INSTALL) -e '.[$(TEST_EXTRAS)]'
	touch $@

# The CUDA plugin must be the installed jax's own version (jaxlib refuses another); read it, don't guess it.
$(VENV)/.installed-gpu-build: $(VENV)/.installed
	v=$$($(VENV)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(PIP_INSTALL) "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v" nvidia-cuda-nvcc nvidia-nvvm
	touch $@

gpu-build-tools: $(VENV)/.installed-gpu-build

demo: $(VENV)/.installed
	$(VENV)/bin/hisparse demo

# what `make test` needs installed, without running it (CI installs both legs at once)
test-setup: $(VENV)/.installed-$(TEST_EXTRAS) $(if $(GPU_BUILD),$(VENV)/.installed-gpu-build)

test: test-setup
	$(VENV)/bin/python tests/parallel.py -j $(TEST_JOBS) -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
