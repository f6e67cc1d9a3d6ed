# Two entry points: `make test` and `make parity`. Both build .venv from the
# system python3 on first use (torch pinned to the 2.13.0 CPU build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPU_TORCH := torch==2.13.0

.PHONY: test parity venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(CPU_TORCH)"
	$(PY) -m pip install -q -e ".[torch,jax,test,upstream]" "$(CPU_TORCH)"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -n 2 -q tests

parity: venv
	$(PY) -m parity

clean:
	rm -rf $(VENV) parity-report
