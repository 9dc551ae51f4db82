"""What our request layers cost per streamed request, in-process: ``python -m bench.layers``.

``python -m bench.layers [--tokens 64] [--requests 200] [--repeats 5]``

The gateway (:class:`serve.app.Gateway`: auth, route table, HTTP accounting, body limit,
intake, admission, stream guard) runs in front of a scripted ASGI peer that answers like
vLLM's chat app: one SSE chunk per token (the compact JSON vLLM writes, ~300 bytes), the
role chunk first, the finish chunk and ``data: [DONE]`` last. The same peer alone is the
baseline, timed in the same run, alternating. No engine, no socket: what is left is the
Python our layers run on the event loop per request and per token, which on a 2-core CPU
server shares the loop that streams every answer (``bench/README.md`` explains
reading its numbers against this machine's noise).

Prints one line per round (a progress bar of the rounds on stderr) and ends with::

    layers us_per_request=X us_per_token=Y (tokens=N, over a bare peer of Z us)

``us_per_request``: the gateway's median over the peer's, microseconds per request;
``us_per_token``: that cost's slope over the answer length (a second run at 1 token).

``python -m bench.layers --marks [--tokens 64] [--requests 24]`` runs a fixed workload for
:mod:`bench.layers_gate` (``make bench-layers``), which counts its instructions under
cachegrind: no timing, and a marker child forked at each boundary of the counted region
(:func:`counted_workload`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import types

#: The chunks of a chat stream as vLLM 0.32 writes them (compact JSON, captured from the tiny
#: model): the role chunk, one chunk per token, the finish chunk. A token chunk takes the
#: stream guard's O(1) path (``serve.streamguard.TOKEN_EVENT_ENDS``), as in the server
#: (``tests/engine/test_api.py`` checks the server's own chunks end so).
_HEAD = (b'data: {"id":"chatcmpl-8d1e2f3a4b5c6d7e","object":"chat.completion.chunk",'
         b'"created":1764575000,"model":"phi-3-vision-tiny","choices":[{"index":0,')
ROLE_CHUNK = (_HEAD + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
              b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n')
TOKEN_CHUNK = (_HEAD + b'"delta":{"content":" hello"},"logprobs":null,'
               b'"finish_reason":null,"token_ids":null}]}\n\n')
FINISH_CHUNK = (_HEAD + b'"delta":{"content":" hello"},"logprobs":null,'
                b'"finish_reason":"length","stop_reason":null,"token_ids":null}],'
                b'"system_fingerprint":"vllm-0.32.0"}\n\n')
DONE = b"data: [DONE]\n\n"
CHAT_PATH = "/v1/chat/completions"


def scripted_chat(tokens: int):
    """An ASGI app answering every request with a ``tokens``-token SSE chat stream."""
    async def app(scope, receive, send) -> None:
        json.loads((await receive())["body"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": ROLE_CHUNK, "more_body": True})
        for _ in range(tokens - 1):
            await send({"type": "http.response.body", "body": TOKEN_CHUNK, "more_body": True})
        for chunk in (FINISH_CHUNK, DONE):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def chat_request(tokens: int) -> tuple[dict, bytes]:
    """The ASGI scope and body of a streamed text chat (~60 words, ``max_tokens`` set)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 60}],
                       "max_tokens": tokens, "stream": True, "temperature": 0}).encode()
    scope = {"type": "http", "method": "POST", "path": CHAT_PATH, "query_string": b"",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    return scope, body


async def serve_one(app, scope: dict, body: bytes) -> list[dict]:
    """Send one request through ``app``; returns the messages the client received."""
    sent, given = [], False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays: no disconnect

    async def send(message: dict) -> None:
        sent.append(message)

    await app({**scope, "headers": list(scope["headers"])}, receive, send)
    return sent


def gateway(peer):
    """A ready :class:`serve.app.Gateway` (default settings, a private Prometheus registry)
    whose OpenAI app is ``peer`` behind the gateway's own request layers."""
    from prometheus_client import CollectorRegistry

    from serve.app import Gateway, Phase, compose
    from serve.settings import Settings

    gw = Gateway(Settings(), registry=CollectorRegistry())
    gw.state.openai_app = compose(peer, gw.request_layers())
    gw.state.phase = Phase.READY
    return gw


async def check_stream(app, tokens: int) -> None:
    """Raise unless ``app`` answers the chat request with HTTP 200 and the whole stream (the
    role chunk, the tokens, ``[DONE]``): a benchmark of an error path would look cheap.

    Raises:
        RuntimeError: another status, or a stream that differs from the peer's.
    """
    scope, body = chat_request(tokens)
    sent = await serve_one(app, scope, body)
    stream = b"".join(m.get("body", b"") for m in sent[1:])
    if sent[0].get("status") != 200 or not stream.endswith(DONE) \
            or stream.count(b"\n\n") != tokens + 2:
        raise RuntimeError(f"not a full stream: {sent[0].get('status')} {stream[:200]!r}")


async def per_request_us(app, tokens: int, requests: int) -> float:
    """Mean microseconds per request of ``requests`` sequential requests through ``app``."""
    scope, body = chat_request(tokens)
    t0 = time.perf_counter()
    for _ in range(requests):
        await serve_one(app, scope, body)
    return (time.perf_counter() - t0) / requests * 1e6


async def measure(tokens: int, requests: int, repeats: int) -> dict:
    """Medians over ``repeats`` alternating rounds: the bare peer's and the gateway's
    microseconds per request at ``tokens`` and at 1 token. Keys: ``peer_us``, ``ours_us``,
    ``peer_1_us``, ``ours_1_us``. A progress bar of the rounds on stderr, drawn between the
    timed loops."""
    # Here, not at the top: the counted process (--marks) must not load tqdm (its module list
    # is part of bench.layers_gate's environment).
    from bench.progress import bar as progress_bar
    from bench.progress import say

    runs: dict[str, list[float]] = {"peer_us": [], "ours_us": [], "peer_1_us": [],
                                    "ours_1_us": []}
    apps = {n: scripted_chat(n) for n in (tokens, 1)}
    gateways = {n: gateway(app) for n, app in apps.items()}
    with progress_bar(repeats, "layers rounds", "round") as bar:
        bar.set_postfix_str("warm-up")
        for n in (tokens, 1):  # warm-up: first requests build caches, import lazily
            await check_stream(gateways[n], n)
            await per_request_us(gateways[n], n, 20)
        for k in range(repeats):
            bar.set_postfix_str(f"round {k + 1}")
            for n, suffix in ((tokens, ""), (1, "_1")):
                order = (("peer", apps[n]), ("ours", gateways[n]))
                for name, app in (order if k % 2 == 0 else order[::-1]):
                    runs[f"{name}{suffix}_us"].append(await per_request_us(app, n, requests))
            say(f"round {k + 1}: peer {runs['peer_us'][-1]:.1f} us, ours "
                f"{runs['ours_us'][-1]:.1f} us per {tokens}-token request")
            bar.update()
    return {key: statistics.median(values) for key, values in runs.items()}


def summary_line(m: dict, tokens: int) -> str:
    """The last line (module docstring)."""
    per_request = m["ours_us"] - m["peer_us"]
    fixed = m["ours_1_us"] - m["peer_1_us"]
    per_token = (per_request - fixed) / max(1, tokens - 1)
    return (f"layers us_per_request={per_request:.0f} us_per_token={per_token:.2f} "
            f"(tokens={tokens}, over a bare peer of {m['peer_us']:.0f} us)")


#: Modules replaced in the counted process (``--marks``) before the gateway is imported: what
#: the gateway takes from them. ``serve.intake.budget`` imports Phi-3-vision's processor file
#: for its pure token arithmetic, and that file imports torch and transformers for its image
#: processor classes: ~16 G instructions of import (~3 min under cachegrind), 100x the counted
#: region, on no path of a text request (the real server has them loaded by vLLM anyway).
STUBBED_MODULES = {"torch": (), "transformers": ("BatchFeature", "ProcessorMixin"),
                   "transformers.image_processing_utils": ("BaseImageProcessor",)}


def stub_heavy_imports() -> None:
    """Put :data:`STUBBED_MODULES` in ``sys.modules``: each named class is a placeholder whose
    instances cannot be made, and any other attribute is missing, so a measured path that
    used them would fail (:func:`check_stream`) instead of being counted cheaply. For the
    counted process only: a process that needs the real modules must not call it."""
    def unavailable(*args, **kwargs):
        raise RuntimeError("stubbed in bench.layers' counted process (STUBBED_MODULES)")

    for name, classes in STUBBED_MODULES.items():
        module = types.ModuleType(name, "bench.layers stub (STUBBED_MODULES)")
        for cls in classes:
            setattr(module, cls, type(cls, (), {"__init__": unavailable}))
        sys.modules[name] = module


def fork_mark(marks: list[int]) -> None:
    """Mark a boundary of the counted region: fork a child that exits at once, and append its
    pid to ``marks``. Cachegrind's forked child inherits the parent's counts and writes them
    when it exits, so the child's total is the parent's count at this point (plus its exit,
    the same for every mark). The parent's own cost of a mark (the fork, the wait) lands in
    the interval that follows it, the same in each, and cancels in :func:`slopes`."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # no Python shutdown: nothing after the fork but the exit
    os.waitpid(pid, 0)
    marks.append(pid)


#: The counted intervals of each side, in order: (label, requests as a multiple of
#: ``requests``, tokens per answer as ``tokens`` or 1). :func:`slopes` differences them.
INTERVALS = (("n_x_1", 1, False), ("2n_x_1", 2, False), ("n_x_t", 1, True))


async def counted_workload(tokens: int, requests: int, mark) -> list[tuple[str, str]]:
    """The workload :mod:`bench.layers_gate` counts, for the bare peer and then the gateway:
    warm-up (every lazy import and cache of a first request, checked streams), then
    ``mark()`` before and after each of :data:`INTERVALS`. Sequential requests, no timer
    that fires (the client's receive waits an hour, cancelled at the end of each response),
    the heap at rest (``gc.freeze`` after a full collection): the same Python runs every
    time, so the counts are the same.

    Args:
        tokens: tokens per answer in the long interval (>= 2).
        requests: requests in the short intervals (the long-count one has twice as many).
        mark: called with no argument at each boundary (:func:`fork_mark` under cachegrind).

    Returns:
        ``(side, boundary)`` per ``mark()`` call, in order: side ``peer`` or ``ours``,
        boundary ``start`` or an :data:`INTERVALS` label (the interval just ended).

    Raises:
        RuntimeError: an answer that is not the whole stream (:func:`check_stream`).
    """
    peers = {n: scripted_chat(n) for n in (tokens, 1)}
    sides = {"peer": peers, "ours": {n: gateway(app) for n, app in peers.items()}}
    requests_of = {n: chat_request(n) for n in (tokens, 1)}
    for apps in sides.values():
        for n, app in apps.items():
            await check_stream(app, n)
            for _ in range(20):
                await serve_one(app, *requests_of[n])
    gc.collect()
    gc.freeze()  # the imports' objects leave the collector's generations
    boundaries = []
    for side, apps in sides.items():
        mark()
        boundaries.append((side, "start"))
        for label, times, long in INTERVALS:
            n = tokens if long else 1
            app, (scope, body) = apps[n], requests_of[n]
            for _ in range(requests * times):
                await serve_one(app, scope, body)
            mark()
            boundaries.append((side, label))
    for apps in sides.values():  # still whole streams at the end of the counted region
        for n, app in apps.items():
            await check_stream(app, n)
    return boundaries


def slopes(counts: dict[tuple[str, str], int], tokens: int, requests: int) -> dict:
    """Instructions per request and per streamed token from the counts at the boundaries of
    :func:`counted_workload` (same keys). The intervals n x 1 token (``a``), 2n x 1 (``b``)
    and n x ``tokens`` (``c``) each hold the same constant (the mark's own cost), which
    cancels: per request (of a 1-token answer) ``(b - a) / n``, per further token
    ``(c - a) / (n * (tokens - 1))``.

    Returns:
        ``{"peer": {...}, "ours": {...}, "layers": {...}}``, each with
        ``instructions_per_request`` and ``instructions_per_token`` (floats); ``layers`` is
        ours minus the peer's: what the gateway's layers add.
    """
    out = {}
    for side in ("peer", "ours"):
        order = ["start"] + [label for label, _, _ in INTERVALS]
        a, b, c = (counts[(side, order[i + 1])] - counts[(side, order[i])] for i in range(3))
        out[side] = {"instructions_per_request": (b - a) / requests,
                     "instructions_per_token": (c - a) / (requests * (tokens - 1))}
    out["layers"] = {key: out["ours"][key] - out["peer"][key] for key in out["ours"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per round (default 200); with --marks, per short "
                             "interval (default 24)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--marks", action="store_true",
                        help="the counted workload for bench.layers_gate (run under cachegrind)")
    args = parser.parse_args(argv)
    if args.marks:
        return count_marks(args.tokens, args.requests or 24)
    args.requests = args.requests or 200
    m = asyncio.run(measure(args.tokens, args.requests, args.repeats))
    print(summary_line(m, args.tokens))
    return 0


def count_marks(tokens: int, requests: int) -> int:
    """``--marks``: run :func:`counted_workload` with :func:`fork_mark` and print, after the
    counted region, one line ``mark SIDE BOUNDARY PID`` per mark and one line ``modules
    NAME...`` (the top-level modules loaded, for the baseline's environment)."""
    stub_heavy_imports()
    pids: list[int] = []
    boundaries = asyncio.run(counted_workload(tokens, requests, lambda: fork_mark(pids)))
    for (side, boundary), pid in zip(boundaries, pids, strict=True):
        print(f"mark {side} {boundary} {pid}")
    stubbed = {name.partition(".")[0] for name in STUBBED_MODULES}
    loaded = {name.partition(".")[0] for name in sys.modules} - stubbed
    print("modules", " ".join(sorted(loaded)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
