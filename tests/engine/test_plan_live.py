"""The capacity planner (``python -m serve.plan``) against the running tiny engine: its block
count for the server's KV-cache size is vLLM's own, and the KV-safe figure the server computed
at boot is the planner's."""

from __future__ import annotations

import json

import httpx

from serve import plan
from serve.admission.capacity import tokens_per_request
from serve.settings import Settings
from tests.helpers import TINY_MODEL


def test_planner_blocks_match_vllm_and_the_boot_figure(server, capsys):
    kv = httpx.get(f"{server.base_url}/admin/autotuner", timeout=10).json()["kv_capacity"]
    s = Settings(device="cpu").resolved()  # the session server runs the CPU defaults
    assert kv["kv_cache_memory_bytes"] == s.cpu_kv_cache_bytes
    assert kv["kv_cache_tokens"] == kv["num_gpu_blocks"] * kv["block_size"]

    argv = ["--model", str(TINY_MODEL), "--dtype", s.dtype,
            "--kv-cache-bytes", str(kv["kv_cache_memory_bytes"]),
            "--block-size", str(kv["block_size"]), "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs), "--num-crops", str(s.num_crops)]
    assert plan.main(argv) == 0
    printed = capsys.readouterr().out
    shape = plan.ModelShape.from_config(json.loads((TINY_MODEL / "config.json").read_text()),
                                        s.dtype)
    dep = plan.Deployment(max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                          num_crops=s.num_crops, block_size=kv["block_size"])
    row = plan.plan_row("server", kv["kv_cache_memory_bytes"], shape, dep)
    with capsys.disabled():
        print(f"\nplanner {row.blocks} blocks vs vLLM num_gpu_blocks {kv['num_gpu_blocks']} "
              f"(block_size {kv['block_size']})")
    assert f"| {row.blocks:,} | {row.kv_tokens:,} |" in printed
    assert abs(row.blocks - kv["num_gpu_blocks"]) <= 0.05 * kv["num_gpu_blocks"]

    # The server's boot figure is the planner's arithmetic on vLLM's measured blocks.
    assert kv["tokens_per_request"] == tokens_per_request(s.num_crops)
    same_cache = plan.plan_row("measured", kv["num_gpu_blocks"] * kv["block_size"]
                               * plan.kv_bytes_per_token(shape), shape, dep)
    assert same_cache.concurrency == kv["kv_safe_seqs"] == server.metric("phi3v_kv_safe_seqs")
    # ... and logged once.
    log = server.log_path.read_text()
    assert sum("serve.app" in line and "KV cache:" in line for line in log.splitlines()) == 1
    assert f"KV-safe capacity {kv['kv_safe_seqs']} requests" in log
