# Contributor commands: make test, make parity, make docs, make lint, make dist.
# Each builds .venv from the system python3 on first use (torch pinned to the
# 2.13.0 CPU build) with every extra that installs on a CPU machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPU_TORCH := torch==2.13.0
EXTRAS := torch,jax,test,upstream,docs,lint

.PHONY: test parity docs lint dist venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(CPU_TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "$(CPU_TORCH)" build twine
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -n 2 -q tests

parity: venv
	$(PY) -m parity

# the API reference and docs/ as a site in build/site; warnings are errors
docs: venv
	$(PY) -m mkdocs build --strict --site-dir build/site

lint: venv
	$(PY) -m ruff check

# sdist and wheel in dist/, checked by twine
dist: venv
	rm -rf dist
	$(PY) -m build
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) parity-report build dist
