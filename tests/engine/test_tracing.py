"""Traces over OTLP from the real server (``serve.tracing``): ``--otlp-traces-endpoint`` (vLLM's
flag) sends the gateway's spans and vLLM's ``llm_request`` to one collector, here a minimal
OTLP/gRPC receiver on loopback (the protocol vLLM and the gateway use by default), and each
request is one tree: the gateway's server span (continuing the client's ``traceparent``) with
``intake``, ``admission`` and vLLM's ``llm_request`` as its children. The server is the
session's ``gateway``; its other tests' traces go to the same receiver."""

from __future__ import annotations

import time

import httpx
import pytest

from serve.tracing import SERVICE_NAME, VLLM_SERVICE_NAME
from tests.helpers import GATEWAY_KEY
from tests.otlp import Receiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER_SPAN = "POST /v1/chat/completions"
#: Seconds the spans of both requests may take to arrive (batches leave every 0.2 s here).
EXPORT_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def traced(gateway):
    """The session's ``gateway``, whose spans and vLLM's go to its OTLP receiver."""
    return gateway.server, gateway.receiver


def attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def wait_for_trees(receiver: Receiver, trace_ids: set[bytes]) -> list[tuple[str, object]]:
    """The received spans once every trace in ``trace_ids`` has vLLM's ``llm_request`` and the
    gateway's server span."""
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        spans = receiver.snapshot()
        done = {(s.trace_id, s.name) for _, s in spans}
        if all((t, n) in done for t in trace_ids for n in ("llm_request", SERVER_SPAN)):
            return spans
        assert time.monotonic() < deadline, sorted((t.hex(), n) for t, n in done)
        time.sleep(0.2)


def test_one_trace_per_request_from_the_client_through_the_gateway_to_vllm(traced):
    srv, receiver = traced
    body = {"model": srv.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}
    url = f"{srv.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {GATEWAY_KEY}"}
    with_parent = httpx.post(url, json=body, timeout=120, headers={
        **auth, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert with_parent.status_code == 200, with_parent.text
    without = httpx.post(url, json=body, timeout=120, headers=auth)
    assert without.status_code == 200, without.text

    # The second request's trace is the gateway's: find it by its request id.
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    new_trace = None
    while new_trace is None:
        new_trace = next((s.trace_id for _, s in receiver.snapshot() if s.name == SERVER_SPAN
                          and attributes(s).get("phi3v.request_id")
                          == without.headers["x-request-id"]), None)
        assert new_trace is not None or time.monotonic() < deadline
        time.sleep(0.2)
    client_trace = bytes.fromhex(CLIENT_TRACE)
    assert new_trace != client_trace
    spans = wait_for_trees(receiver, {client_trace, new_trace})

    for trace_id, parent in ((client_trace, bytes.fromhex(CLIENT_SPAN)), (new_trace, b"")):
        tree = {s.name: (service, s) for service, s in spans if s.trace_id == trace_id}
        service, server = tree[SERVER_SPAN]
        assert service == SERVICE_NAME and server.parent_span_id == parent
        assert attributes(server)["http.response.status_code"] == 200
        for name in ("intake", "admission"):
            assert tree[name][0] == SERVICE_NAME
            assert tree[name][1].parent_span_id == server.span_id, name
        assert attributes(tree["intake"][1])["phi3v.intake.outcome"] == "accepted"
        admission = attributes(tree["admission"][1])
        assert admission["phi3v.admission.outcome"] == "admitted"
        assert admission["phi3v.admission.limit"] >= 1
        # vLLM's own span, from its exporter, is a child of the gateway's server span.
        service, llm = tree["llm_request"]
        assert service == VLLM_SERVICE_NAME and llm.parent_span_id == server.span_id
        assert attributes(llm)["gen_ai.usage.completion_tokens"] >= 1
