# Fresh machine: `make demo` sets everything up and runs the CPU demo; `make test` sets up and runs the tests.
SHELL := /bin/bash
VENV := .venv
PY312 := $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	"$$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$c"; break; }; done)
STAMP := $(VENV)/.installed

.PHONY: setup postgres slurm demo lint test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PY312)" || { echo "error: python3.12 not found (megatron-core needs Python >= 3.12)" >&2; exit 1; }
	@test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $@

# The multi-worker test starts its own PostgreSQL server on 127.0.0.1 from these binaries; without them it fails.
# Installed with apt where the machine allows it.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; } || \
	  echo "note: PostgreSQL binaries are missing and could not be installed here (see tests/test_sweep_e2e.py)"

# The Slurm tests start a one-node cluster on localhost (munged, slurmctld, slurmd, and slurmdbd on a MariaDB server of
# their own, for sacct) from these binaries, as root; under CI=true they fail without them.
SLURM_BINS := munged mungekey slurmctld slurmd slurmdbd sbatch sacct mariadbd mariadb-install-db
slurm:
	@( for b in $(SLURM_BINS); do command -v $$b || [ -x /usr/sbin/$$b ] || exit 1; done ) >/dev/null || \
	  { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server >/dev/null; } || \
	  echo "note: Slurm (slurm-wlm, slurmdbd, munge, mariadb-server) is missing and could not be installed here (see tests/slurm_cluster.py)"

demo: $(STAMP)
	$(VENV)/bin/moe-vlm-sweep run -m sweep=cpu_demo
	@echo "Browse the trials: $(VENV)/bin/moe-vlm-sweep ui   (then open http://127.0.0.1:5000)"

# Lint, format check and type check (their settings are in pyproject.toml); the tests run only once these pass.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint postgres slurm
	$(VENV)/bin/python -m pytest -q -ra

test-fast: lint
	$(VENV)/bin/python -m pytest -q -ra -m 'not slow'

clean:
	rm -rf outputs multirun .pytest_cache
