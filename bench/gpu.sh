#!/usr/bin/env bash
# `make bench` on one GPU (H200 class) with the full-size Phi-3-vision architecture: dummy
# weights (`--load-format dummy`), the GPU defaults of serve/settings.py (bfloat16,
# num_crops=16, CUDA graphs, max_num_seqs 256), the same four servers (ours, raw vLLM, ours at
# limit 1, the A/A raw vLLM), workloads, table and last lines as on CPU. Budget: under 8
# minutes on an H200 once vLLM is installed.
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
# The four servers share the one GPU, all up at once: each gets a fifth of its memory (vLLM
# refuses to start when less than its share is free): ~28 GiB of an H200, 7.7 GiB of weights,
# ~18 GiB of KV cache, 49k tokens (`python -m serve.plan --gpu-memory-utilization 0.2
# --max-model-len 32768`: 15 requests of one num_crops=16 image each without preemption). A
# 128k context does not fit in that share, so max_model_len is 32k here.
export PHI3V_MODEL=models/phi-3-vision-full PHI3V_LOAD_FORMAT=dummy
export PHI3V_GPU_MEMORY_UTILIZATION=${PHI3V_GPU_MEMORY_UTILIZATION:-0.2}
export PHI3V_MAX_MODEL_LEN=${PHI3V_MAX_MODEL_LEN:-32768}
exec "$PY" -m bench.compare --out "$OUT" --no-readme
