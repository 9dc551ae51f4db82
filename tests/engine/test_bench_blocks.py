"""``make bench``'s measurement path against a live server (``bench.compare``): two blocks of
every gated cell, the session's server standing in for all three arms, appended to a ledger
and judged by ``bench.verdict``. The cells are shrunk (fewer prompts, small photos) so the
test takes about a minute; what it checks is that every metric the verdict needs is measured
from the real server, its ``/metrics`` and ``/proc``."""

from __future__ import annotations

import io
import re

from bench import compare, verdict
from bench import workloads as w
from bench.cpu_engine import IMAGES_DIR, real_photos
from bench.process import TINY_MODEL

SMALL = {"text4": compare.W1Cell("text", 4, 4), "text16": compare.W1Cell("text", 16, 4),
         "text64": compare.W1Cell("text", 64, 4), "image16": compare.W1Cell("image", 16, 2)}


def test_two_blocks_against_a_live_server_are_measured_recorded_and_judged(
        server, tmp_path, monkeypatch):
    for cell, spec in SMALL.items():
        monkeypatch.setitem(compare.GATED, cell, spec)
    sources = real_photos(IMAGES_DIR)
    inputs = compare.Inputs(server.model, TINY_MODEL, sources, 4, io.StringIO(), {})
    for block in (0, 1):  # small photos in the cache the cells take their photos from
        seeds = compare.photo_seeds(0, block)
        inputs.photos.update(zip(seeds, w.small_image_urls(sources, len(seeds), seeds[0]),
                                 strict=True))
    arms = dict.fromkeys(compare.ARMS, server)
    run = compare.Run("test-run", "c" * 40, False, tmp_path / "ledger.jsonl", 0)
    pending: list = []
    compare.run_blocks(run, arms, 0, range(2), inputs, pending)

    records = verdict.read_ledger(run.ledger)
    assert len(records) == 2 * len(compare.GATED) * len(compare.ARMS)
    for r in records:
        m = r["metrics"]
        assert r["run"] == "test-run" and r["commit"] == "c" * 40, r
        # /proc counts CPU in clock ticks (10 ms): a small segment may read 0 (summed below)
        assert m["api_cpu_ms"] >= 0 and m["engine_cpu_ms"] >= 0, r
        assert 0 <= r["machine"]["steal"] <= 1 and 0 <= r["machine"]["foreign_cpu"] <= 1, r
        if r["cell"] in SMALL:
            assert m["completed"] == SMALL[r["cell"]].prompts and m["failed"] == 0, r
            assert m["rps"] > 0 and m["tok_s"] > m["rps"], r
            # vLLM's engine-side TTFT starts when the request reaches the engine: the
            # client's mean, which includes the HTTP path in front of it, is longer.
            assert 0 < m["engine_ttft_mean_ms"] < m["ttft_mean_ms"], r
        elif r["cell"] == "photo":
            assert m["ttft_ms"] > 0, r
        elif r["cell"] == "history":
            assert len(m["ttft_turns_ms"]) == compare.HISTORY_TURNS, r
            assert m["ttft_late_ms"] == sum(m["ttft_turns_ms"][2:]) / 2, r
        else:
            assert r["cell"] == "burst" and m["non200"] == 0 and m["n"] == 4, r
            assert m["makespan_s"] > 0, r
    # The API processes' CPU is measured: all segments together read more than nothing.
    assert sum(r["metrics"]["api_cpu_ms"] for r in records) > 0
    # Each (block, cell) ran every arm once, in the block plan's order.
    plan = dict(compare.block_plan(0, range(2)))
    for block in (0, 1):
        for cell, order in plan[block]:
            rows = sorted((r for r in records if r["block"] == block and r["cell"] == cell),
                          key=lambda r: r["position"])
            assert tuple(r["arm"] for r in rows) == order

    v = verdict.judge([*records, {"kind": "run", "run": "test-run",
                                  "rss_peak_mib": {"ours": 900.0, "raw": 900.0}}])
    assert v.blocks == 2 and v.burst_non200 == 0
    assert all(t.blocks == 2 for name, t in v.targets.items() if t.kind in ("ratio", "ms"))
    line = verdict.verdict_line(v)
    assert re.fullmatch(
        r"verdict valid=(yes|no)( \w+=-?\d+\.\d+\[-?\d+\.\d+,-?\d+\.\d+\]){7} burst_non200=0 "
        r"rss=1\.000 result=(pass|fail|inconclusive|unresolved)", line), line
