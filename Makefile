# Set-up is two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install demo test lint clean bench test-frameworks

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

# The real-framework suite: DeepSpeed, megatron-core, HF Trainer, Lightning, DCP and Orbax
# write the checkpoints themselves. Its own environment (about 2 GB): torch first, then the
# pinned frameworks with torch held as a constraint (DeepSpeed builds no ops at install).
FWVENV ?= .venv-frameworks
FWPY   := $(FWVENV)/bin/python
FWSTAMP := $(FWVENV)/.installed

$(FWSTAMP): pyproject.toml tests/frameworks/requirements.txt
	$(PYTHON) -m venv $(FWVENV)
	$(FWPY) -m pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(FWPY) -m pip install --quiet -c tests/frameworks/constraints.txt \
		-r tests/frameworks/requirements.txt
	$(FWPY) -m pip install --quiet -c tests/frameworks/constraints.txt -e '.[dev]'
	@touch $(FWSTAMP)

test-frameworks: $(FWSTAMP)
	CKPTD_FRAMEWORKS=1 AWS_EC2_METADATA_DISABLED=true $(FWPY) -m pytest -q -n 2 tests/frameworks

# The layering in docs/DESIGN.md is checked by import-linter (contracts in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check ckptd tests
	$(VENV)/bin/mypy ckptd
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(FWVENV) .demo .pytest_cache .mypy_cache .ruff_cache
