#!/usr/bin/env bash
# `make bench` on one GPU (H200 class) with the full-size Phi-3-vision architecture: dummy
# weights (`--load-format dummy`), the GPU defaults of serve/settings.py (bfloat16,
# num_crops=16, CUDA graphs, max_num_seqs 256), the same three servers, workloads, table and
# last line as on CPU. Budget: under 8 minutes on an H200 once vLLM is installed.
#
#   bench/gpu.sh [OUT_DIR]          (default bench/results-gpu)
#
# Needs the GPU build of vLLM (`make install` on a machine where nvidia-smi answers installs
# vllm==0.32.0). The README's CPU table is not touched (--no-readme).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results-gpu}
PY=${PY:-.venv/bin/python}
nvidia-smi -L
test -x "$PY" || make install
"$PY" -m pip install --quiet -e '.[bench]'
"$PY" -m serve.models.build --size full --out models/phi-3-vision-full
# Every server of the run reads these (Settings: PHI3V_* variables), raw vLLM's flags included.
export PHI3V_MODEL=models/phi-3-vision-full PHI3V_LOAD_FORMAT=dummy
exec "$PY" -m bench.compare --out "$OUT" --no-readme
