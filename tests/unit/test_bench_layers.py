"""``python -m bench.layers``: the gateway's layers in front of a scripted vLLM-like peer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench import layers, layers_gate


async def test_the_gateway_streams_the_whole_answer_through_every_layer():
    peer = layers.scripted_chat(5)
    await layers.check_stream(peer, 5)
    gw = layers.gateway(peer)
    await layers.check_stream(gw, 5)  # 200, role chunk, 5 tokens' chunks, [DONE]
    sent = await layers.serve_one(gw, *layers.chat_request(5))
    headers = dict(sent[0]["headers"])
    assert headers[b"x-accel-buffering"] == b"no" and b"x-request-id" in headers
    with pytest.raises(RuntimeError, match="not a full stream"):
        await layers.check_stream(gw, 6)  # a stream that differs from the request's


async def test_summary_line():
    m = await layers.measure(tokens=4, requests=3, repeats=2)
    line = layers.summary_line(m, 4)
    assert re.fullmatch(r"layers us_per_request=-?\d+ us_per_token=-?\d+\.\d\d "
                        r"\(tokens=4, over a bare peer of \d+ us\)", line), line
    assert m["ours_us"] > 0 and m["peer_us"] > 0


def test_the_scripted_peer_streams_what_the_guard_passes_in_o1():
    """bench.layers times the path the server takes: vLLM 0.32's token chunk ends as the
    stream guard's O(1) test expects (``tests/engine/test_api.py`` checks the live server's);
    the role and finish chunks do not and take the general test."""
    from serve.streamguard import TOKEN_EVENT_ENDS, ordinary_chunk

    assert layers.TOKEN_CHUNK.endswith(TOKEN_EVENT_ENDS) and ordinary_chunk(layers.TOKEN_CHUNK)
    assert not layers.ROLE_CHUNK.endswith(TOKEN_EVENT_ENDS)
    assert not layers.FINISH_CHUNK.endswith(TOKEN_EVENT_ENDS)


# --- make bench-layers: the instruction-count gate (bench.layers --marks, bench.layers_gate) ---

def test_slopes_recover_per_request_and_per_token_costs_whatever_the_marks_cost():
    """A synthetic count: start-up, a constant per mark (the fork and wait) and per request
    ``fixed + per_token * tokens``; the slopes give back the per-request and per-token parts,
    and ``layers`` is ours minus the peer's."""
    tokens, n = 64, 24
    cost = {"peer": (50_000, 2_500), "ours": (600_000, 14_000)}
    counts, total = {}, 10**9  # start-up and imports: cancel
    for side, (fixed, per_token) in cost.items():
        total += 777  # the mark
        counts[(side, "start")] = total
        for label, times, long in layers.INTERVALS:
            k = tokens if long else 1
            total += n * times * (fixed + per_token * k) + 777
            counts[(side, label)] = total
    out = layers.slopes(counts, tokens, n)
    assert out["peer"] == {"instructions_per_request": 52_500, "instructions_per_token": 2_500}
    assert out["ours"] == {"instructions_per_request": 614_000, "instructions_per_token": 14_000}
    assert out["layers"] == {"instructions_per_request": 561_500,
                             "instructions_per_token": 11_500}


async def test_counted_workload_marks_each_boundary_of_each_side():
    pids: list[int] = []
    boundaries = await layers.counted_workload(3, 2, lambda: layers.fork_mark(pids))
    labels = ["start"] + [label for label, _, _ in layers.INTERVALS]
    assert boundaries == [(side, label) for side in ("peer", "ours") for label in labels]
    assert len(set(pids)) == len(boundaries) and all(p > 0 for p in pids)
    for pid in pids:  # every marker child has exited and been reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_the_counted_process_runs_end_to_end_without_torch():
    """``python -m bench.layers --marks`` at a tiny size, natively: what the gate runs under
    cachegrind, with torch and transformers stubbed (a text request never reaches them)."""
    run = subprocess.run([sys.executable, "-m", "bench.layers", "--marks", "--tokens", "3",
                          "--requests", "1"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "0"})
    assert run.returncode == 0, run.stderr
    marks = [m.groups() for m in map(layers_gate.MARK_LINE.fullmatch, run.stdout.splitlines())
             if m]
    assert [(side, label) for side, label, _ in marks][:4] == [
        ("peer", "start"), ("peer", "n_x_1"), ("peer", "2n_x_1"), ("peer", "n_x_t")]
    assert len(marks) == 8
    modules = run.stdout.splitlines()[-1].split()
    assert modules[0] == "modules" and "starlette" in modules and "serve" in modules
    assert "torch" not in modules and "transformers" not in modules


def test_summary_ir_reads_the_total_of_a_cachegrind_file(tmp_path):
    out = tmp_path / "cg.123"
    out.write_text("desc: I1 cache: ...\ncmd: python\nevents: Ir\nfl=x.c\nfn=f\n1 5\n"
                   + "2 7\n" * 2000 + "summary: 1234567\n")
    assert layers_gate.summary_ir(out) == 1234567
    with pytest.raises(RuntimeError, match="no cachegrind output"):
        layers_gate.summary_ir(tmp_path / "cg.404")


ENV = {"python": "3.11.7", "valgrind": "valgrind-3.19.0", "packages": {"starlette": "1.10.0"}}
WORKLOAD = {"tokens": 64, "requests": 24}


@pytest.fixture
def baseline_file(tmp_path):
    path = tmp_path / "layers-baseline.json"
    path.write_text(json.dumps({"instructions_per_request": 500_000.0,
                                "instructions_per_token": 10_000.0,
                                "workload": WORKLOAD, "environment": ENV}))
    return path


@pytest.mark.parametrize(("per_request", "per_token", "status", "result"), [
    (505_000, 10_100, 0, "result=pass"),            # +1 % both
    (500_000, 10_300, 1, "result=fail"),            # +3 % per token
    (515_000, 10_000, 1, "result=fail"),            # +3 % per request
    (485_000, 9_700, 0, "result=pass (more than"),  # -3 %: passes, says to keep the gain
])
def test_the_gate_fails_past_two_percent_over_the_baseline(baseline_file, per_request,
                                                             per_token, status, result):
    measured = {"instructions_per_request": per_request, "instructions_per_token": per_token}
    line, code = layers_gate.verdict(measured, layers_gate.load_baseline(baseline_file), ENV,
                                     WORKLOAD)
    assert code == status and result in line, line
    change = f"{100 * (per_request / 500_000 - 1):+.2f}%/{100 * (per_token / 10_000 - 1):+.2f}%"
    assert line.startswith(f"layers-gate instructions_per_request={per_request} "
                           f"instructions_per_token={per_token}.0 baseline=500000/10000.0 "
                           f"change={change} "), line


def test_another_environment_is_not_compared(baseline_file, tmp_path):
    """Counts from another interpreter build or library version are not comparable: the gate
    says what differs and passes (exit 0) instead of failing on a +3 % it cannot judge."""
    measured = {"instructions_per_request": 515_000, "instructions_per_token": 10_300}
    baseline = layers_gate.load_baseline(baseline_file)
    newer = {**ENV, "packages": {"starlette": "1.11.0"}}
    line, code = layers_gate.verdict(measured, baseline, newer, WORKLOAD)
    assert code == 0 and "result=stale" in line and "starlette: 1.10.0 -> 1.11.0" in line
    line, code = layers_gate.verdict(measured, baseline, ENV, {"tokens": 32, "requests": 24})
    assert code == 0 and "result=stale" in line and "tokens: 64 -> 32" in line
    line, code = layers_gate.verdict(measured, layers_gate.load_baseline(tmp_path / "none"),
                                     ENV, WORKLOAD)
    assert code == 0 and "baseline=none result=stale" in line


def test_the_committed_baseline_is_for_the_gates_workload():
    baseline = layers_gate.load_baseline(layers_gate.BASELINE)
    assert baseline["workload"] == {"tokens": layers_gate.TOKENS,
                                    "requests": layers_gate.REQUESTS}
    assert baseline["instructions_per_request"] > 0 and baseline["instructions_per_token"] > 0
    assert {"python", "valgrind", "libc", "cpu_flags", "packages"} <= set(
        baseline["environment"])


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_reference_is_the_commit_that_last_changed_the_baseline(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    baseline = tmp_path / "layers-baseline.json"
    baseline.write_text("{}")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "baseline")
    first = git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "code")
    baseline.write_text('{"edited": 1}')  # an uncommitted refresh does not count yet
    assert layers_gate.reference_commit(baseline) == first
    assert layers_gate.reference_commit(tmp_path / "nowhere" / "x.json") is None
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{tmp_path}", str(shallow))
    assert layers_gate.reference_commit(shallow / "layers-baseline.json") is None


def test_a_stale_baseline_is_recounted_here_and_judged(tmp_path, monkeypatch, capsys):
    """The stored figures come from another environment (a newer library): the gate counts
    the baseline commit's code here and judges against that count: +3 % over it fails."""
    stored = tmp_path / "layers-baseline.json"
    stored.write_text(json.dumps({"instructions_per_request": 400_000.0,
                                  "instructions_per_token": 9_000.0, "workload": WORKLOAD,
                                  "environment": {**ENV, "packages": {"idna": "0.1"}}}))
    figures = {layers_gate.ROOT: (515_000, 10_300), tmp_path: (500_000, 10_000)}
    monkeypatch.setattr(layers_gate, "valgrind_version", lambda: "valgrind-3.19.0")
    monkeypatch.setattr(layers_gate, "environment", lambda modules, valgrind: ENV)
    monkeypatch.setattr(layers_gate, "reference_commit", lambda path: "abcdef0123456789")
    monkeypatch.setattr(layers_gate, "count",
                        lambda tokens, requests, root=layers_gate.ROOT: (figures[root], []))
    monkeypatch.setattr(layers_gate, "slopes", lambda counts, tokens, requests: {
        side: {"instructions_per_request": counts[0], "instructions_per_token": counts[1]}
        for side in ("layers", "peer", "ours")})
    recounted = []

    def recount(commit, tokens, requests):
        recounted.append(commit)
        return layers_gate.slopes(layers_gate.count(tokens, requests, tmp_path)[0], 0, 0)["layers"]

    monkeypatch.setattr(layers_gate, "recount_reference", recount)
    assert layers_gate.main(["--baseline", str(stored)]) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert recounted == ["abcdef0123456789"]
    assert "baseline=500000/10000.0@abcdef01 (recounted here) change=+3.00%/+3.00%" in line
    assert line.endswith("result=fail (more than +2% over the baseline)"), line
