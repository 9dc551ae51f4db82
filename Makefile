# Phi-3-vision serving stack. `make demo` runs it, `make test` tests it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
TINY_MODEL := models/phi-3-vision-tiny
FULL_MODEL := models/phi-3-vision-full
REAL_MODEL := models/phi-3-vision-128k-instruct
# Where `make serve` looks for the downloaded microsoft/Phi-3-vision-128k-instruct files.
WEIGHTS ?= weights/Phi-3-vision-128k-instruct
# vLLM build: `gpu` where an NVIDIA GPU answers, else `cpu` (same vLLM release either way).
VLLM_FLAVOUR := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(VLLM_FLAVOUR)
UI_VENV := ui/.venv
UI_PY := $(UI_VENV)/bin/python
UI_STAMP := $(UI_VENV)/.installed
UI_PORT ?= 8080

.PHONY: install demo serve serve-full model test test-fast clean help system-deps ui-install ui monitoring-check prometheus bench bench-autotune bench-layers lint

help:
	@echo "make demo   - API + chat UI on the tiny model; prints both URLs when ready (login demo/demo)"
	@echo "make ui     - the chat UI on http://$(HOST):$(UI_PORT) against a running API (own venv ui/.venv)"
	@echo "make test   - run the test suite (real tiny engine on CPU)"
	@echo "make test-fast - the unit tier only (no engine, no browser; under a minute)"
	@echo "make lint   - ruff (configured in pyproject.toml) over the whole tree"
	@echo "make bench-layers - our layers' instructions per request and per token under cachegrind (~30 s); fails past +2 % of bench/layers-baseline.json"
	@echo "make bench  - ours vs raw vLLM vs raw vLLM (A/A), interleaved blocks (~15 min); one verdict line"
	@echo "make bench-autotune - the autotuner vs every fixed limit and plain vLLM: simulator, seeds 0-9, then the real engine (~18 min)"
	@echo "make serve  - serve the real $(notdir $(REAL_MODEL)) from WEIGHTS=$(WEIGHTS)"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[$(VLLM_FLAVOUR),test]'
ifeq ($(VLLM_FLAVOUR),cpu)
	# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch
	# ("operator torchvision::nms does not exist"); vLLM runs without them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $@

model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(STAMP)
	$(PY) -m serve.models.build --size tiny --out $(TINY_MODEL)

# The chat UI has its own venv: Chainlit 2.12 pins mcp<2, vLLM needs mcp>=2.
ui-install: $(UI_STAMP)

$(UI_STAMP): ui/requirements.txt
	test -x $(UI_PY) || $(PYTHON) -m venv $(UI_VENV)
	$(UI_PY) -m pip install --quiet -r ui/requirements.txt
	touch $@

ui: ui-install
	$(UI_PY) -m ui --host $(HOST) --port $(UI_PORT) --api-base-url http://$(HOST):$(PORT)

demo: install model ui-install
	PY=$(PY) UI_PY=$(UI_PY) MODEL=$(TINY_MODEL) HOST=$(HOST) PORT=$(PORT) UI_PORT=$(UI_PORT) bash ui/demo.sh

serve: install
	@$(PY) -m serve.models.build --real-from $(WEIGHTS) --out $(REAL_MODEL) || { \
	  echo "make serve: the real weights are not at $(WEIGHTS)." >&2; \
	  echo "  Download microsoft/Phi-3-vision-128k-instruct there (or pass WEIGHTS=DIR)," >&2; \
	  echo "  or run 'make demo' for the tiny random-weight model." >&2; exit 2; }
	$(PY) -m serve --model $(REAL_MODEL) --served-model-name microsoft/Phi-3-vision-128k-instruct --host $(HOST) --port $(PORT)

serve-full: install
	$(PY) -m serve.models.build --size full --out $(FULL_MODEL)
	$(PY) -m serve --model $(FULL_MODEL) --load-format dummy --host $(HOST) --port $(PORT)

# Debian packages the tests drive for real: Chromium (UI tests; Playwright's own browser
# download needs internet), Prometheus + promtool (monitoring tests) and valgrind
# (`make bench-layers` counts instructions under its cachegrind).
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v promtool >/dev/null \
	    || ! command -v prometheus >/dev/null || ! command -v valgrind >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium prometheus valgrind; \
	fi

lint: install
	$(PY) -m ruff check .

test-fast: install model
	$(PY) -m pytest -q tests/unit

test: install model ui-install system-deps
	$(PY) -m pytest -q

# Ours against raw vLLM with a second raw vLLM as the A/A control, in interleaved blocks
# (~15 min on this CPU, alone on the machine); appends to bench/results/ledger.jsonl, writes
# bench/results/bench.md and ends with one `verdict ... result=...` line (bench/README.md).
bench: install model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.compare $(BENCH_ARGS)

# The deterministic gate on our per-token cost: our layers in front of a scripted vLLM-like peer
# (no engine) under cachegrind, instructions per request and per streamed token over the bare
# peer's (~30 s); exits 1 past +2 % of bench/layers-baseline.json (bench/README.md).
# BENCH_ARGS=--update-baseline rewrites that file.
bench-layers: install system-deps
	$(PY) -m bench.layers_gate $(BENCH_ARGS)

# Goodput of the max_num_seqs autotuner vs every static limit and no limit on the engine
# simulator (six traces, two profiles, seeds 0-9; ~6 min), then on the real tiny engine in
# paired episodes (~12 min, alone on the machine); one line at the end (bench/README.md).
bench-autotune: install model
	$(PY) -m bench.simjudge --out bench/out
	$(PY) -m bench.witness --out bench/out --sim bench/out/simjudge.json $(BENCH_ARGS)

monitoring-check:
	promtool check config monitoring/prometheus/prometheus.yml
	promtool test rules monitoring/prometheus/tests/*.yml

prometheus:  # local Prometheus scraping `make demo` (127.0.0.1:8000), UI on 127.0.0.1:9090
	prometheus --config.file=monitoring/prometheus/prometheus.yml --storage.tsdb.path=/tmp/phi3v-prometheus --web.listen-address=127.0.0.1:9090

clean:
	rm -rf $(VENV) $(UI_VENV) models .pytest_cache
