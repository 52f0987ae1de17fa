# Set-up is two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install demo test lint clean bench

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "ckptd needs Python 3.11+ (set PYTHON=python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a range left open would pull a newer build with CUDA packages.
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ckptd demo

# Two workers: most tests wait on a daemon, a server or a subprocess, so two cores keep busy.
test: install lint
	AWS_EC2_METADATA_DISABLED=true $(PY) -m pytest -q -n 2

# The layering in docs/DESIGN.md is checked by import-linter (contracts in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check ckptd tests
	$(VENV)/bin/mypy ckptd
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
