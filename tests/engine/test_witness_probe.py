"""The witness's speed probe on the real engine (``bench.witness.measure_chat_rps``): a
backlog of chat requests with no gateway limit, served and drained, read as finished
requests per second (the figure the witness sizes its episodes by)."""

from __future__ import annotations

import math
from dataclasses import replace

import httpx
import pytest

from bench import witness
from bench.trace import CPU_CAPACITY


def test_the_speed_probe_measures_a_drained_backlog_with_no_gateway_limit(verbose_server):
    url = verbose_server.base_url
    small = replace(CPU_CAPACITY, ceiling=4)  # 4 unscored, then 8 measured chat requests
    try:
        rps = witness.measure_chat_rps(url, seed=11, capacity=small, n=8, drain_s=300)
        state = httpx.get(f"{url}/admin/autotuner", timeout=30).json()
        assert state["mode"] == "off" and state["in_flight"] == 0 and state["pending"] == 0
        # 8 answers of 16-128 tokens each cannot all finish within a decode step (>= 1 ms)
        assert math.isfinite(rps) and 0 < rps < 8 / 1e-3, rps
        sized = witness.sized(rps)
        assert sized.chat_rps == rps
        assert sized.long_rps / sized.chat_rps == pytest.approx(
            CPU_CAPACITY.long_rps / CPU_CAPACITY.chat_rps)
    finally:  # the other tests on this server meet the mode it booted in
        httpx.post(f"{url}/admin/bench/admission", json={"mode": "auto"},
                   timeout=30).raise_for_status()
