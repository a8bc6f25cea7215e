# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite).
PYTHON ?= python3
VENV   ?= .venv
PIP     = $(VENV)/bin/pip

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hisparse demo

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
