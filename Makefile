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

.PHONY: install test demo bench charts lint dist wheels clean

$(PY):
	$(PYTHON) -m venv $(dir $(PY))..

# Installs whatever is missing: torch (pinned CPU build) if absent, the core
# editable with its test/demo/lint/bench extras (bench: matplotlib, for the charts and
# their test; users get it only with hyperfsdp[bench]), and every plugin under plugins/.
$(STAMP): $(PY) pyproject.toml $(wildcard plugins/*/pyproject.toml examples/*/pyproject.toml)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test,demo,lint,bench]" $(foreach d,$(PLUGIN_DIRS),-e $(d))
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -n auto $(PYTEST_ARGS) $(TEST_DIRS)

demo: install
	$(PY) -m hyperfsdp_core demo

bench: install
	$(PY) -m hyperfsdp_core bench

# Redraw the charts from stored results: make charts CHARTS_FROM="a.json b.json" CHARTS_DIR=docs/charts
CHARTS_FROM ?= benchmarks/results/latest.json
CHARTS_DIR ?= docs/charts
charts: install
	$(PY) -m hyperfsdp_core bench $(foreach f,$(CHARTS_FROM),--replot $(f)) --charts $(CHARTS_DIR)

lint: install
	$(PY) -m ruff check .

# Wheels of the core and of every plugin under plugins/ (pip install --find-links $(DIST_DIR) ...)
dist: install wheels

# the wheels alone, with the build tools already in $(PY) (tests build them in a copy)
wheels:
	rm -rf $(DIST_DIR) build $(addsuffix build,$(PLUGIN_DIRS))
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST_DIR) . $(sort $(dir $(wildcard plugins/*/pyproject.toml)))

clean:
	rm -rf build dist *.egg-info hyperfsdp_core/*.egg-info plugins/*/*.egg-info plugins/*/build examples/*/*.egg-info examples/*/build
