# vitkit: the two commands of the README.
#   make demo   set up .venv if missing, then train a ViT on Fashion-MNIST and evaluate it
#   make test   set up .venv if missing, then run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch and torchvision must be a matching pair; the tests run with these two.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PINS) -e ".[all,dev]"
	touch $@

demo: setup
	bash scripts/demo.sh

# A pytest worker per core, at most 4 (TEST_WORKERS=0 runs the suite in one process): half the tests start
# processes (torchrun, servers, compilers) whose start-up leaves a core idle, which the other worker fills.
TEST_WORKERS ?= auto

test: setup
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal

lint: setup
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
