#!/usr/bin/env bash
# `make bench`'s blocked design on one GPU (H200 class) with the full-size Phi-3-vision
# architecture: dummy weights (`--load-format dummy`), the GPU defaults of serve/settings.py
# (bfloat16, num_crops=16, CUDA graphs, max_num_seqs 256, image workers sized to the host's
# cores), the three arms of bench/compare.py (ours, raw vLLM, raw2 the A/A control) plus a
# fourth, raw4: raw vLLM with --api-server-count 4 (four API processes, so four multimodal
# threads, on one engine), and a `photos` cell: 32 distinct 12 MP photos, 16 in flight,
# requests/s. The last lines before the verdict are the GPU targets of issue 31 point 11
# (bench/verdict.py GPU_*): photo requests/s ours/raw >= 1.5 and ours/raw4 >= 1.1, ours'
# image16 >= 9 requests/s, text64 >= 12000 output tokens/s.
#
#   bench/gpu.sh [OUT_DIR]          (default bench/results-gpu; BLOCKS=2 by default)
#
# Budget ~8 minutes on an H200 once vLLM is installed: the fewest blocks (2, one per half, each
# half starting the four servers once) and no extension blocks. The ledger and the verdict
# table go to OUT_DIR, never into the CPU history (bench/results/). Needs the GPU build of vLLM
# (`make install` on a machine where nvidia-smi answers installs vllm==0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results-gpu}
PY=${PY:-.venv/bin/python}
nvidia-smi -L
test -x "$PY" || make install
"$PY" -m pip install --quiet -e '.[bench]'
"$PY" -m serve.models.build --size full --out models/phi-3-vision-full
# Every server of the run reads these (Settings: PHI3V_* variables), raw vLLM's flags included.
# The four servers (four engines: raw4's API processes share its one) are all up at once on
# the one GPU: each engine gets a fifth of its memory, 80 % in all, the rest for the CUDA
# contexts and the free memory vLLM checks for at start: ~28 GiB of an H200 each, 7.7 GiB of
# weights, ~18 GiB of KV cache, 49k tokens (`python -m serve.plan --gpu-memory-utilization 0.2
# --max-model-len 32768`: 15 requests of one num_crops=16 image each without preemption). A
# 128k context does not fit in that share, so max_model_len is 32k here.
export PHI3V_MODEL=models/phi-3-vision-full PHI3V_LOAD_FORMAT=dummy
export PHI3V_GPU_MEMORY_UTILIZATION=${PHI3V_GPU_MEMORY_UTILIZATION:-0.2}
export PHI3V_MAX_MODEL_LEN=${PHI3V_MAX_MODEL_LEN:-32768}
mkdir -p "$OUT"
exec "$PY" -m bench.compare --out "$OUT" --blocks "${BLOCKS:-2}" --no-extend \
  --extra-arm raw4 --photo-throughput 16 --ledger "$OUT/ledger.jsonl" --md "$OUT/bench.md"
