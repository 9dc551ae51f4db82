"""The real-engine witness's arithmetic: episodes cut from the CPU suite, the paired
log-ratios over episodes, and the verdict with its A/A gate (the replay itself runs against
a real server in ``python -m bench.witness``)."""

from __future__ import annotations

import json
import math

import pytest

from bench import witness


def test_episodes_are_the_suite_cut_into_independent_pieces():
    eps = witness.episodes(0)
    assert set(eps) == {"T2/0", "T2/1", "T2/2", "T5/0", "T5/1", "T5/2", "T6/0", "T6/1",
                        "T1/0", "T1/1"}
    for name, trace in eps.items():
        assert trace.requests, name
        first = trace.requests[0].arrival_s
        assert first == pytest.approx(witness.LEAD_S), name  # starts from an idle engine
        assert [r.id for r in trace.requests] == list(range(len(trace.requests)))
        assert trace.requests[-1].arrival_s <= trace.duration_s + 1e-9
    # T2's episodes are its bursts: 2 x max_num_seqs requests within about a second.
    assert all(len(eps[f"T2/{c}"].requests) == 64 for c in range(3))
    assert max(r.arrival_s for r in eps["T2/0"].requests) < 1.5
    # Common random numbers: the same episode on another seed differs, on the same seed not.
    assert witness.episodes(0)["T6/0"] == eps["T6/0"] != witness.episodes(1)["T6/0"]


def test_episodes_are_sized_by_the_speed_the_server_showed():
    """On a server half as fast the same fractions of capacity: half the requests per
    second in the steady and overload windows; T2's bursts are 2 x max_num_seqs on any."""
    ref = witness.episodes(0)
    half = witness.sized(witness.CPU_CAPACITY.chat_rps / 2)
    assert half.vision_rps == pytest.approx(witness.CPU_CAPACITY.vision_rps / 2)
    assert half.long_rps == pytest.approx(witness.CPU_CAPACITY.long_rps / 2)
    slow = witness.episodes(0, half)
    for name in ("T1/0", "T1/1", "T6/0", "T6/1"):
        assert len(slow[name].requests) == pytest.approx(len(ref[name].requests) / 2, rel=0.3)
    assert len(slow["T2/0"].requests) == len(ref["T2/0"].requests) == 64
    assert max(r.arrival_s for r in slow["T2/0"].requests) < 1.5  # still within a second
    assert witness.sized(witness.CPU_CAPACITY.chat_rps) == witness.CPU_CAPACITY
    with pytest.raises(ValueError, match="chat_rps"):
        witness.sized(0.0)
    # the SLO's targets are times: on a host at half the speed, twice as long
    from bench.autotune import CPU_SLO
    slow_slo = witness.sized_slo(witness.CPU_CAPACITY.chat_rps / 2, CPU_SLO)
    assert slow_slo.ttft_s == pytest.approx(2 * CPU_SLO.ttft_s)
    assert slow_slo.itl_s == pytest.approx(2 * CPU_SLO.itl_s)
    assert witness.sized_slo(witness.CPU_CAPACITY.chat_rps, CPU_SLO) == CPU_SLO
    with pytest.raises(ValueError, match="chat_rps"):
        witness.sized_slo(-1.0, CPU_SLO)


def test_each_arm_gets_its_own_content_and_the_same_work():
    """The salt changes what every cache keys on (the text's first word, a crop's corner
    pixel) and nothing of the work: the same requests, words, crop sizes and token counts."""
    import base64
    import io
    import json

    from PIL import Image

    from bench.cpu_engine import build_bodies

    trace = witness.episodes(0)["T1/0"]
    trace = type(trace)(trace.phases, tuple(r for r in trace.requests if r.images)[:2],
                        trace.seed)
    a, b = (build_bodies(trace, "m", salt=witness.salt(arm, 0)) for arm in ("L16", "aa"))
    assert len(witness.salt("L16", 0)) == len(witness.salt("aa", 0)) == 8
    for x, y in zip(a, b, strict=True):
        (img_a, text_a), (img_b, text_b) = (
            [p["image_url"]["url"] if p["type"] == "image_url" else p["text"]
             for p in json.loads(body)["messages"][0]["content"]] for body in (x, y))
        assert text_a.split()[1:] == text_b.split()[1:] and text_a != text_b
        pa, pb = (Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1])))
                  for u in (img_a, img_b))
        assert pa.size == pb.size and img_a != img_b


def good_table(n: int, auto: float, l8: float, l16: float, off: float, aa: float,
               noise: float = 0.0) -> dict:
    table = {}
    for i in range(n):
        wobble = 1 + (noise if i % 2 else -noise)
        name = ("T2/" if i % 3 == 0 else "T6/" if i % 3 == 1 else "T1/") + str(i)
        table[name] = {"auto": round(100 * auto * wobble), "L8": round(100 * l8),
                       "L16": round(100 * l16), "off": round(100 * off),
                       "aa": round(100 * aa * wobble)}
    return table


def test_the_verdict_passes_fails_and_is_unresolved_by_its_gate():
    line = witness.verdict_line(good_table(9, auto=1.0, l8=0.95, l16=1.0, off=0.5, aa=1.0,
                                           noise=0.02))
    assert line.startswith("witness episodes=9 aa=[") and line.endswith("result=pass"), line
    iv, _ = witness.judge(good_table(9, 1.0, 0.95, 1.0, 0.5, 1.0, noise=0.02))
    assert iv["auto/L8"][1] > 1.0 and iv["auto/off_overload"][1] > 1.9
    # Auto as good as plain vLLM under overload: inside no margin of 1.2, a fail.
    assert witness.judge(good_table(9, 1.0, 1.0, 1.0, 1.0, 1.0, noise=0.02))[1] == "fail"
    # Too few episodes to bound anything: inconclusive.
    assert witness.judge(good_table(2, 1.0, 1.0, 1.0, 0.5, 1.0, noise=0.3))[1] \
        in ("inconclusive", "unresolved")
    iv, result = witness.judge(good_table(9, 0.5, 1.0, 1.0, 0.5, 1.0, noise=0.02))
    assert result == "fail" and iv["auto/L16"][2] < 0.85
    # The A/A control far apart: the run does not count, whatever auto did.
    iv, result = witness.judge(good_table(9, 1.0, 0.5, 0.5, 0.5, 2.0))
    assert result == "unresolved" and iv["aa"][1] > 1.18


def test_a_ratio_keeps_episodes_where_both_arms_got_nothing():
    assert witness.log_ratios({"T2/0": {"auto": 0, "off": 0}}, "auto", "off") == [0.0]
    assert witness.log_ratios({"T2/0": {"auto": 1}}, "auto", "off") == []
    assert all(math.isnan(x) for x in witness.interval([0.1]))


def test_the_verdict_does_not_depend_on_the_episodes_order():
    """A run is judged from its replay order when it ends and from its ledger record (sorted
    keys) when pooled: the same counts give the same intervals either way."""
    import random

    rng = random.Random(3)
    good = {f"T{k}/{i}": {a: rng.randint(0, 60) for a in witness.ARMS}
            for k in (1, 2, 5, 6) for i in range(3)}
    shuffled = dict(sorted(good.items(), key=lambda _: rng.random()))
    assert list(shuffled) != list(good)
    assert witness.judge(shuffled) == witness.judge(good)


def test_the_combined_line_fails_with_the_simulator_and_is_never_pass_uncalibrated():
    from bench.simjudge import TraceVerdict, sim_head

    verdicts = [TraceVerdict("p", "T1", 10, (0.97, 8, 1), {8: 1.0}, 1.0, 1.0, 1.0, True),
                TraceVerdict("p", "T2", 10, (0.99, 16, 2), {16: 1.0}, 1.0, 1.2, 1.0, True)]
    sim = {"head": sim_head(verdicts, 10), "passed": True}
    good = good_table(9, 1.0, 0.95, 1.0, 0.5, 1.0, noise=0.02)  # the witness alone: pass
    line = witness.combined_line(sim, good)
    assert line.startswith("autotune sim seeds=10 worst auto/L=0.970 auto/unlimited=1.000 "
                           "| calib=off | cpu aa=[")
    assert line.endswith("result=unresolved")  # no calibrated profile: no pass
    calibrated = witness.combined_line(sim, good, calibrated=True)
    assert "| calib=ok |" in calibrated and calibrated.endswith("result=pass")
    sim["passed"] = False
    assert witness.combined_line(sim, good, calibrated=True).endswith("result=fail")


def test_the_run_checks_a_cpu_profile_fitted_to_its_own_engine_steps(tmp_path, capsys):
    from bench.sim import CPU_PROFILE_PATH
    from tests.unit.test_calibrate import TRUE, measured, synthetic_steps

    eps = {k: v for k, v in witness.episodes(0).items() if k in ("T1/0", "T6/0")}
    good, ttfts = measured(eps, TRUE)
    kv = {"num_gpu_blocks": 1024, "block_size": 128}
    steps = synthetic_steps(TRUE, noise=0.0)  # an engine the model describes exactly
    engine, source, record = witness.run_profile(steps, kv, None, {"seed": 0})
    assert source.startswith("fitted to this run's engine steps") and record is not None
    assert record["engine"]["num_gpu_blocks"] == 1024
    calib = witness.calibration(eps, good, ttfts, engine, source)
    assert calib["ok"], calib["table"]
    # a profile given replaces the fit; without steps, the committed profile is checked
    given = witness.run_profile(steps, kv, CPU_PROFILE_PATH, {})
    assert given[1] == str(CPU_PROFILE_PATH) and given[2] is None
    assert witness.run_profile([], None, None, {})[1].startswith("the committed")
    # --from judges an earlier run again without replaying
    (tmp_path / "w.json").write_text(json.dumps({"seed": 0, "good": good, "ttfts": ttfts,
                                                 "calibration": calib}))
    assert witness.main(["--from", str(tmp_path / "w.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "calib=ok" in out[-2] and out[-1].startswith("witness episodes=2 ")
    # a run sized by a slower server is judged on the episodes it replayed: checked against
    # the reference-sized ones, the same good counts no longer agree with the profile
    (tmp_path / "w.json").write_text(json.dumps({"seed": 0, "chat_rps": 3.0, "good": good,
                                                 "ttfts": ttfts, "calibration": calib}))
    assert witness.main(["--from", str(tmp_path / "w.json")]) == 0
    assert "calib=off" in capsys.readouterr().out.splitlines()[-2]


def test_sanity_line_compares_plain_vllm_with_the_off_arm_on_the_same_episodes():
    good = {"T1/0": {"off": 10, "auto": 30}, "T1/1": {"off": 30, "auto": 40},
            "T2/0": {"auto": 5}}
    line = witness.sanity_line(good, {"T1/0": 12, "T1/1": 28, "T2/0": 3})
    # T2/0 has no off arm: left out of the line and of the pooled ratio (40 / 40).
    assert line == "sanity plain vLLM vs off: T1/0 12/10  T1/1 28/30  pooled 1.00", line
    assert witness.sanity_line(good, {}) == "sanity plain vLLM: not run"
    assert set(witness.PLAIN_EPISODES) <= set(witness.episodes(0))


def test_the_sanity_arm_is_split_by_request_kind():
    """Plain vLLM and the off arm read by kind: which requests plain vLLM loses, and whether
    by TTFT or ITL. Text: 2 requests, one good; image: 1, late (TTFT 3 s over a 2-s target)."""
    from bench.sim import RequestResult
    from bench.trace import TraceRequest
    from serve.admission.goodput import SloTargets

    def result(i, images, first, finish, tokens=11):
        req = TraceRequest(i, 0.0, 300, 313 * images, images, tokens, "T1")
        return RequestResult(req, admitted_s=0.0, first_token_s=first, finish_s=finish,
                             tokens=tokens)

    slo = SloTargets(2.0, 0.05)
    kinds = witness.kind_summary([result(0, 0, 0.5, 0.8), result(1, 0, 0.4, 1.4),
                                  result(2, 1, 3.0, 3.3)], slo)
    assert kinds["text"] == {"n": 2, "good": 1, "ttft_p50_s": 0.4,
                             "itl_p50_s": pytest.approx(0.03)}
    assert kinds["image"]["n"] == 1 and kinds["image"]["good"] == 0
    assert kinds["image"]["ttft_p50_s"] == 3.0
    good = {"T1/0": {"off": 3}}
    line = witness.sanity_line(good, {"T1/0": 1}, {"T1/0": {"off": kinds}},
                               {"T1/0": kinds})
    head, plain, off = line.splitlines()
    assert head == "sanity plain vLLM vs off: T1/0 1/3  pooled 0.33"
    assert plain == ("  plain vLLM: text 1/2 TTFT p50 0.40 s ITL p50 30 ms, "
                     "image 0/1 TTFT p50 3.00 s ITL p50 30 ms")
    assert off.startswith("  off:        text 1/2")
