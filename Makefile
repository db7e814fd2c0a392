# Every target bootstraps its own virtual environment (.venv) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench docs check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP) ## run every example on the embedded default backend
	$(VENV)/bin/durable-trio examples run --all

# The tests not marked chaos wait mostly on sockets and real-time sleeps of the real brokers, so
# they run in 4 pytest-xdist workers; the chaos tests (real processes killed, wall-clock bounds)
# then run alone, one at a time. Both halves run; either failing fails the target. The package's
# bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set (CI), every process the tests
# spawn would otherwise compile what it imports.
test: $(STAMP) ## the whole test suite (starts its own private redis-server when needed)
	@$(PY) -m compileall -q durable_trio > /dev/null
	@status=0; \
	$(PY) -m pytest -q -n 4 -m "not chaos" || status=$$?; \
	$(PY) -m pytest -q -m chaos || status=$$?; \
	exit $$status

lint: $(STAMP) ## ruff + mypy --strict
	$(VENV)/bin/ruff check durable_trio tests benchmarks examples tools typings
	$(VENV)/bin/mypy

bench: $(STAMP) ## print our numbers (and the peers', where the harness names them)
	$(PY) -m benchmarks

docs: $(STAMP) ## regenerate the JSON Schemas and check every docs/ link
	$(PY) -m tools.docs

check: lint test docs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
