# hyperfsdp developer targets. Uses the active virtualenv, or creates .venv.
PYTHON ?= python3
ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := $(CURDIR)/.venv/bin/python
endif
TORCH_PIN ?= torch==2.13.0
# plugins/ (ours) and examples/ (the example third-party plugin): each its own distribution
PLUGIN_DIRS := $(sort $(dir $(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml)))
TEST_DIRS := tests $(wildcard plugins/*/tests) $(wildcard examples/*/tests)
DIST_DIR ?= dist
STAMP := $(dir $(PY)).hyperfsdp-installed
PYTEST_ARGS ?=

.PHONY: install test test-lowest test-lowest-all demo bench charts lint dist wheels clean gpu-check

$(PY):
	$(PYTHON) -m venv $(dir $(PY))..

# Installs whatever is missing: torch (pinned CPU build) if absent, the core
# editable with its test/demo/lint extras, every plugin under plugins/ and examples/, and
# the benchmark suite benchmarks/ (hyperfsdp-bench: `hyperfsdp bench`, a plugin adding
# that command) with its charts extra (matplotlib, for the charts and their test).
$(STAMP): $(PY) pyproject.toml benchmarks/pyproject.toml $(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test,demo,lint]" $(foreach d,$(PLUGIN_DIRS),-e $(d)) -e "./benchmarks[charts]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -n auto $(PYTEST_ARGS) $(TEST_DIRS)

# The lowest supported torch (docs/fsdp2-compat.md, "Supported torch versions"): a venv of
# its own (.venv-lowest) with the core and every plugin, and a smoke subset of the suite.
# PyPI's x86-64 torch 2.11 is a CUDA build (about 4 GB with its libraries, cached by pip
# after the first install); it runs on a CPU-only host.
TORCH_LOWEST ?= torch==2.11.0
LOWEST := $(CURDIR)/.venv-lowest/bin/python
LOWEST_STAMP := $(CURDIR)/.venv-lowest/.hyperfsdp-installed
SMOKE_TESTS ?= tests/test_parity.py tests/test_uneven.py tests/test_mixed_precision.py \
	tests/test_collectives.py tests/test_gloo_routes.py tests/test_gpu_check.py \
	plugins/offload/tests/test_offload.py
# The venv holds what `make install` installs (the extras, every plugin, the benchmark suite),
# on the lowest torch, so that the whole suite runs there too: `make test-lowest-all`.
$(LOWEST_STAMP): pyproject.toml benchmarks/pyproject.toml $(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml)
	$(PYTHON) -m venv $(CURDIR)/.venv-lowest
	$(LOWEST) -m pip install -q "$(TORCH_LOWEST)"
	$(LOWEST) -m pip install -q -e ".[test,demo,lint]" $(foreach d,$(PLUGIN_DIRS),-e $(d)) -e "./benchmarks[charts]"
	$(LOWEST) -c "import torch; print('lowest venv: torch', torch.__version__)"
	touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST) -m pytest -n auto $(PYTEST_ARGS) $(SMOKE_TESTS)

# The whole suite on the lowest torch (about 14 minutes on 2 cores; not in CI's run).
test-lowest-all: $(LOWEST_STAMP)
	$(LOWEST) -m pytest -n auto $(PYTEST_ARGS) $(TEST_DIRS)

demo: install
	$(PY) -m hyperfsdp_core demo

bench: install
	$(PY) -m hyperfsdp_core bench

# The prepared GPU check (benchmarks/gpu_check.py): hyperfsdp beside FSDP2 on one CUDA device,
# one report file (gpu-check-report.md; GPU_CHECK_ARGS="--report PATH --budget S --only CASE").
# On a GPU machine it uses the python3 that holds torch (GPU_PY) and installs the checkout
# offline first; `make gpu-check DEVICE=cpu` is the dry run (gloo, tiny models) in this venv.
DEVICE ?= cuda
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
ifeq ($(DEVICE),cpu)
gpu-check: install
	$(PY) benchmarks/gpu_check.py --device cpu $(GPU_CHECK_ARGS)
else
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --install --device $(DEVICE) $(GPU_CHECK_ARGS)
endif

# Redraw the charts from stored results: make charts CHARTS_FROM="a.json b.json" CHARTS_DIR=docs/charts
CHARTS_FROM ?= benchmarks/results/latest.json
CHARTS_DIR ?= docs/charts
charts: install
	$(PY) -m hyperfsdp_core bench $(foreach f,$(CHARTS_FROM),--replot $(f)) --charts $(CHARTS_DIR)

lint: install
	$(PY) -m ruff check .

# Wheels of the core and of every plugin under plugins/ (pip install --find-links $(DIST_DIR) ...).
# Not the benchmark suite: it is a tool for the checkout (results go to benchmarks/results,
# charts to docs/charts); `pip wheel --no-deps benchmarks` builds it if you want one.
dist: install wheels

# the wheels alone, with the build tools already in $(PY) (tests build them in a copy)
wheels:
	rm -rf $(DIST_DIR) build $(addsuffix build,$(PLUGIN_DIRS))
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST_DIR) . $(sort $(dir $(wildcard plugins/*/pyproject.toml)))

clean:
	rm -rf build dist *.egg-info hyperfsdp_core/*.egg-info plugins/*/*.egg-info plugins/*/build examples/*/*.egg-info examples/*/build benchmarks/*.egg-info benchmarks/build
