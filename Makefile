# The two quick-start commands: `make run` and `make test`. Each creates .venv
# when it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA ?= var/cluster

.PHONY: run test faults faults-tools bench venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Installed markers: reinstall when pyproject.toml changes.
$(VENV)/.installed-run: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[dev,spark]'
	touch $@ $(VENV)/.installed-run

venv: $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/delaymq cluster --data $(DATA)

# mypy cannot follow the package-dir mapping, so it reads a tree of links named as installed.
PARTS := protocol clock net storage wheel replication scheduler realtime metaserver client cli backlog bench

test: $(VENV)/.installed-dev
	$(BIN)/ruff check --quiet .
	$(BIN)/ruff format --check --quiet .
	$(BIN)/lint-imports --no-cache --no-logo
	rm -rf build/typecheck && mkdir -p build/typecheck/delaymq
	for part in $(PARTS); do ln -s ../../../$$part build/typecheck/delaymq/$$part; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml --cache-dir ../mypy-cache -p delaymq
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q


# The fault suite: real processes killed, stopped, starved of disk and flooded; a few
# minutes, outside `make test`; prints lost / early / duplicated / worst lateness.
faults: $(VENV)/.installed-dev faults-tools
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m faults tests/faults

# The partition tests (tests/faults/test_faults_partitions.py) put each server in a network
# namespace and cut links with nftables: as root (as CI runs) the tools are installed when
# missing; without root those tests are skipped.
faults-tools:
	@if [ "$$(id -u)" = 0 ]; then \
		missing=""; \
		command -v ip >/dev/null || missing="$$missing iproute2"; \
		command -v nft >/dev/null || missing="$$missing nftables"; \
		if [ -n "$$missing" ]; then \
			apt-get install -y -q $$missing || { apt-get update -q && apt-get install -y -q $$missing; }; \
		fi; \
	fi

bench: $(VENV)/.installed-dev
	PYTHONSAFEPATH=1 $(BIN)/delaymq bench all

clean:
	rm -rf $(VENV) build dist *.egg-info var
