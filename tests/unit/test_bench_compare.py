"""``make bench``'s report: the last line's contract, targets and the README table (pure)."""

from __future__ import annotations

import re

from bench import compare
from bench.workloads import percentile, pool_runs


def cell(rps: float, ttft_ms: float) -> dict:
    return {"request_throughput": rps, "output_throughput": rps * 128,
            "median_ttft_ms": ttft_ms, "p99_ttft_ms": 2 * ttft_ms, "median_itl_ms": 3.0,
            "p99_itl_ms": 9.0, "completed": 10, "failed": 0, "duration": 10 / rps}


def side(rps: float, ttft_ms: float, photo_s: float, non200: int = 0) -> dict:
    w1 = {k: {str(c): cell(rps * (2 if k == "text" else 1), ttft_ms)
              for c in compare.W1_CONCURRENCIES} for k in compare.W1_PLAN}
    return {"w1": w1, "w2_ttft_s": [photo_s] * 3, "w3_ttft_s": [[photo_s] * 4] * 2,
            "w4": {"n": 32, "makespan_s": 10.0, "makespans_s": [10.0, 10.0, 10.0],
                   "non200": non200},
            "w5_itls_s": [0.01] * 99 + [0.05], "w5_p99_by_repeat_s": [0.02, 0.03],
            "memory": {"peak_bytes": 3 << 30}}


def test_last_line_and_targets():
    m = {"ours": side(10.0, 100.0, 0.3), "raw": side(10.0, 100.0, 0.6),
         "sequential": {"w1": {k: {"16": cell(1.0, 50.0)} for k in compare.W1_PLAN}}}
    summary = compare.summarize(m)
    line = compare.last_line(summary["ratios"])
    assert re.fullmatch(
        r"ratios ours/raw ttft_p50=1\.00 throughput=1\.00 photo_ttft=0\.50 "
        r"multiturn_ttft=0\.50 burst_makespan=1\.00 itl_p99=1\.00 rss_peak=1\.00 "
        r"burst_non200=0 ours/sequential throughput@16=20\.00", line), line
    assert all(compare.met(summary["ratios"]).values())
    m["ours"]["w4"]["non200"] = 3
    m["ours"]["w1"]["image"]["64"]["request_throughput"] = 9.0  # 0.90 of raw: missed
    ratios = compare.summarize(m)["ratios"]
    ok = compare.met(ratios)
    assert not ok["burst_non200"] and not ok["throughput"] and ratios["throughput"] == 0.9
    assert "throughput MISSED" in compare.table(m, compare.summarize(m))
    assert compare.noise_line(compare.summarize(m)) is None  # no A/A control in this run


def test_itl_p99_is_the_pooled_p99_of_the_repeats():
    """W5's ratio is the p99 of every repeat's token gaps pooled, not a median of per-repeat
    p99 ratios (a repeat's p99 is its few largest gaps)."""
    m = {"ours": side(10.0, 100.0, 0.3), "raw": side(10.0, 100.0, 0.6),
         "sequential": {"w1": {k: {"16": cell(1.0, 50.0)} for k in compare.W1_PLAN}}}
    m["ours"]["w5_itls_s"] = [0.01] * 196 + [0.2, 0.2, 0.02, 0.02]
    m["raw"]["w5_itls_s"] = [0.01] * 196 + [0.02, 0.02, 0.2, 0.2]
    assert compare.summarize(m)["ratios"]["itl_p99"] == 1.0
    m["ours"]["w5_itls_s"][-2:] = [0.2, 0.2]  # ours stalls twice as often
    assert compare.summarize(m)["ratios"]["itl_p99"] == 10.0


def test_a_a_control_and_paired_burst():
    raw = side(10.0, 100.0, 0.6)
    m = {"ours": side(10.0, 100.0, 0.3), "raw": raw,
         "sequential": {"w1": {k: {"16": cell(1.0, 50.0)} for k in compare.W1_PLAN}},
         "raw2": {"w1": {"text": {"16": cell(19.0, 110.0), "64": cell(20.4, 100.0)}}}}
    m["ours"]["w4"]["makespans_s"] = [11.0, 10.0, 30.0]  # one slow spell: the median pair wins
    summary = compare.summarize(m)
    assert compare.noise_line(summary) == \
        "noise A/A raw2/raw throughput=0.95 ttft_p50=1.10 (W1 text c=16)"
    assert summary["ratios"]["burst_makespan"] == 1.1
    md = compare.table(m, summary)
    assert "A/A control, W1 text c=16" in md and "`noise A/A raw2/raw throughput=0.95" in md


def test_readme_table_is_replaced_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{compare.README_BEGIN}\nold\n{compare.README_END}\nb\n")
    assert compare.update_readme("| new |\n", readme)
    assert readme.read_text() == f"a\n{compare.README_BEGIN}\n| new |\n{compare.README_END}\nb\n"
    plain = tmp_path / "other.md"
    plain.write_text("no markers")
    assert not compare.update_readme("x", plain) and plain.read_text() == "no markers"


def test_pooled_w1_cell_and_percentile():
    runs = [{"duration": 2.0, "completed": 4, "failed": 0, "total_output_tokens": 400,
             "ttfts": [0.1, 0.2, 0.3, 0.4], "errors": ["", "", "", ""],
             "itls": [[0.01, 0.02]] * 4},
            {"duration": 2.0, "completed": 3, "failed": 1, "total_output_tokens": 300,
             "ttfts": [0.5, 0.6, 0.7, 9.9], "errors": ["", "", "", "boom"],
             "itls": [[0.03]] * 3 + [[]]}]
    pooled = pool_runs(runs)
    assert pooled["request_throughput"] == 7 / 4 and pooled["output_throughput"] == 700 / 4
    assert pooled["median_ttft_ms"] == 400.0  # 7 successful TTFTs; the failed one is left out
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([5], 99) == 5


def test_paired_ratio_is_robust_to_one_slow_segment():
    ours = {"request_throughput": 1.0, "segments": [{"r": 10.0}, {"r": 9.0}, {"r": 5.0},
                                                     {"r": 10.0}]}
    raw = {"request_throughput": 2.0, "segments": [{"r": 10.0}, {"r": 10.0}, {"r": 10.0},
                                                    {"r": 10.0}]}
    assert compare.paired_ratio(ours, raw, "r") == 0.95  # median of 1.0, 0.9, 0.5, 1.0
    pooled = compare.paired_ratio({"request_throughput": 1.0}, {"request_throughput": 2.0},
                                  "request_throughput")
    assert pooled == 0.5  # no segments recorded: the pooled ratio


def test_ttft_added_in_front_of_the_engine():
    """Per W1 cell: (client mean TTFT - vLLM's engine-side mean) of ours minus raw's, median
    over segment pairs; the engine-side part, which drifts between segments, cancels."""
    def seg(client_ms: float, engine_ms: float) -> dict:
        return {"mean_ttft_ms": client_ms, "engine_mean_ttft_ms": engine_ms}

    ours = {"segments": [seg(40, 30), seg(60, 50), seg(35, 20)]}  # adds 10, 10, 15
    raw = {"segments": [seg(25, 16), seg(52, 43), seg(30, 21)]}   # adds 9, 9, 9
    assert compare.added_ttft_ms(ours, raw) == 1.0
    assert compare.added_ttft_ms({"segments": [{}]}, raw) is None
    line = compare.added_line({"added_ttft_ms": {"text c=4": 1.0, "text c=16": None}})
    assert line == ("ttft added ours-raw in front of vLLM's engine (client - engine-side "
                    "mean, ms) text:c=4=+1.0")
    pooled = pool_runs([{"duration": 1.0, "completed": 2, "failed": 0,
                         "total_output_tokens": 2, "ttfts": [0.1, 0.3], "errors": ["", ""],
                         "itls": [[0.01]], "engine_mean_ttft_ms": 150.0}])
    assert pooled["mean_ttft_ms"] == 200.0 and pooled["engine_mean_ttft_ms"] == 150.0


def test_engine_ttft_totals_read_vllm_histogram(monkeypatch):
    """The sum and count of ``vllm:time_to_first_token_seconds`` in a real Prometheus text
    exposition (prometheus-client writes it; the peer serving it is faked, not the parser)."""
    import httpx
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from bench import workloads

    registry = CollectorRegistry()
    hist = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"],
                     registry=registry)
    for v in (0.1, 0.2, 0.3):
        hist.labels(model_name="m").observe(v)
    Histogram("vllm:e2e_request_latency_seconds", "E2E", registry=registry).observe(5.0)
    body = generate_latest(registry)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    real = httpx.Client
    monkeypatch.setattr(workloads.httpx, "Client",
                        lambda **kw: real(transport=transport, **kw))
    total, count = workloads.engine_ttft_totals("http://peer")
    assert count == 3 and abs(total - 0.6) < 1e-9


def test_goodput_per_w1_cell_pooled_and_reported():
    """W1's goodput (vLLM's ``request_goodput`` per segment) pools as good requests over the
    summed durations; the ratio is None where raw vLLM had no good request or a side was not
    scored; the report names the SLO it judged by."""
    runs = [{"duration": 2.0, "completed": 4, "failed": 0, "total_output_tokens": 4,
             "ttfts": [0.1] * 4, "errors": [""] * 4, "itls": [[0.01]] * 4,
             "request_goodput": 1.5},
            {"duration": 6.0, "completed": 4, "failed": 0, "total_output_tokens": 4,
             "ttfts": [0.1] * 4, "errors": [""] * 4, "itls": [[0.01]] * 4,
             "request_goodput": 0.0}]
    assert pool_runs(runs)["request_goodput"] == 3 / 8  # 3 good requests in 8 s
    runs[1]["request_goodput"] = None  # one segment not scored: the cell is not either
    assert "request_goodput" not in pool_runs(runs)
    assert compare.goodput_ratio({"request_goodput": 0.5}, {"request_goodput": 0.25}) == 2.0
    assert compare.goodput_ratio({"request_goodput": 0.5}, {"request_goodput": 0.0}) is None
    assert compare.goodput_ratio({}, {"request_goodput": 0.25}) is None

    m = {"ours": side(10.0, 100.0, 0.3), "raw": side(10.0, 100.0, 0.6),
         "sequential": {"w1": {k: {"16": cell(1.0, 50.0)} for k in compare.W1_PLAN}}}
    assert compare.goodput_line(m, compare.summarize(m)) is None  # not scored
    for name, good in (("ours", 3.0), ("raw", 2.0)):
        m[name]["w1_slo"] = {"ttft_s": 10.0, "itl_s": 0.5}
        m[name]["w1"]["image"]["64"]["request_goodput"] = good
    summary = compare.summarize(m)
    line = compare.goodput_line(m, summary)
    assert line == ("goodput ours/raw (W1 requests/s with TTFT <= 10 s and TPOT <= 0.5 s; "
                    "not a target) image:c=64=1.50")
    md = compare.table(m, summary)
    assert "| W1 image c=64: goodput, requests/s within the SLO (not a target) | 2.00 | " \
           "3.00 | 1.50 |" in md and line in md
    assert "text c=64: goodput" not in md  # a cell not scored has no row


def test_control_run_puts_raw_vllm_in_ours_place(monkeypatch, tmp_path):
    """``--control``: the same run with a second raw vLLM as the ``ours`` side (every cell an
    A/A cell, so no separate raw2), its own output folder, the README left alone. The server
    starters are replaced by recorders: what is tested is which servers the run asks for."""
    started = []

    def raw(name, out, model):
        started.append(("raw", name))
        return compare.Side(name, None)

    def serve(args, log_path, model_dir):
        started.append(("ours", log_path.stem, tuple(args)))
        return None

    monkeypatch.setattr(compare, "start_raw", raw)
    monkeypatch.setattr(compare, "start_serve", serve)
    monkeypatch.setattr(compare, "model_dir", lambda: tmp_path)
    sides = {}
    compare.start_sides(tmp_path, sides, control=True)
    assert started == [("raw", "control"), ("raw", "raw"),
                       ("ours", "sequential", ("--autotune", "static", "--admission-limit", "1"))]
    assert set(sides) == {"ours", "raw", "sequential"}
    started.clear()
    compare.start_sides(tmp_path, {}, control=False)
    assert [s[:2] for s in started] == [("ours", "ours"), ("raw", "raw"), ("ours", "sequential"),
                                        ("raw", "raw2")]

    args = compare.parse_args(["--control"])
    assert args.no_readme and args.out == compare.ROOT / "bench" / "out" / "control"
    args = compare.parse_args([])
    assert not args.no_readme and args.out == compare.ROOT / "bench" / "results"
    assert compare.parse_args(["--control", "--out", str(tmp_path)]).out == tmp_path

