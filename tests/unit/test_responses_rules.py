"""Rules of the OpenAI Responses API path and of request ids (pure), and the stream guard and
goodput tracker on Responses events (scripted ASGI peers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve.admission.middleware import ResponseTracker
from serve.asgi import ResponseChannel
from serve.intake.errors import IntakeError
from serve.intake.request import (
    MAX_REQUEST_ID_CHARS,
    RequestLimits,
    check_request_id,
    parse_completion_request,
)
from serve.intake.responses import parse_responses_request
from serve.sse import CHAT_SSE, RESPONSES_SSE
from tests.unit.test_intake import run_guard

LIMITS = RequestLimits(max_images=2, max_n=1, max_num_crops=16)
URL = "data:image/png;base64,iVBORw0KGgo="


def user(*parts, role="user"):
    return {"role": role, "content": list(parts)}


def image(url=URL, **extra):
    return {"type": "input_image", "image_url": url, **extra}


def text(value):
    return {"type": "input_text", "text": value}


# --- parsing (pure) --------------------------------------------------------------------------
def test_responses_shapes_are_read_as_chat_messages_and_neutralised():
    body = {"instructions": "be <|assistant|> brief", "input": [
        user(text("look <|image_1|>"), image(detail=None)),
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"role": "developer", "content": "plain"}]}
    request = parse_responses_request(body, LIMITS)
    assert [ref.param for ref in request.images] == ["input[0].content[1].image_url"]
    assert request.answer_fields == ("max_output_tokens",) and request.prompt_field == "input"
    assert "<|" not in body["instructions"] and "<|" not in body["input"][0]["content"][0]["text"]
    assert request.messages == [
        {"role": "system", "content": body["instructions"]},
        {"role": "user", "content": [{"type": "text", "text": "look <\u2060|image_1|>"},
                                     {"type": "image_url"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "system", "content": "plain"}]
    request.images[0].set_url("data:image/png;base64,AAAA")
    assert body["input"][0]["content"][1] == {"type": "input_image",
                                              "image_url": "data:image/png;base64,AAAA"}
    string = parse_responses_request({"input": "hi <|end|>"}, LIMITS)
    assert string.messages == [{"role": "user", "content": "hi <\u2060|end|>"}]


REFUSED = [
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
     "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [user(image(url=""))]}, "input[0].content[0].image_url"),
    ({"input": [user(image(file_id="file-1"))]}, "input[0].content[0].file_id"),
    ({"input": [user(image(detail="ultra"))]}, "input[0].content[0].detail"),
    ({"input": [user({"type": "input_file", "file_data": "x"})]}, "input[0].content[0].type"),
    ({"input": [user(image(), role="assistant")]}, "input[0].content[0]"),
    ({"input": [user(image(), image(), image())]}, "input[0].content[2]"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "mm_processor_kwargs": {"num_crops": 99}}, "mm_processor_kwargs.num_crops"),
    ({"input": "x", "request_id": "a" * (MAX_REQUEST_ID_CHARS + 1)}, "request_id"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[p for _, p in REFUSED])
def test_responses_refusals_name_the_field(body, param):
    with pytest.raises(IntakeError) as err:
        parse_responses_request(body, LIMITS)
    assert err.value.status == 400 and err.value.param == param and err.value.message


def test_request_ids_are_checked_and_made_unique():
    a, b = check_request_id("same", "request_id"), check_request_id("same", "request_id")
    assert a != b and a.startswith("same-") and b.startswith("same-")
    for bad in ("", "a" * (MAX_REQUEST_ID_CHARS + 1), "a\nb", "a\x00b", "a\x85b", 7):
        with pytest.raises(IntakeError) as err:
            check_request_id(bad, "X-Request-Id")
        assert err.value.status == 400 and err.value.param == "X-Request-Id"
    completion = parse_completion_request({"prompt": "x", "request_id": "r"}, LIMITS)
    assert completion.body["request_id"].startswith("r-") and completion.messages is None


# --- stream guard and goodput tracking on Responses events (scripted upstream) ---------------
def event(kind: str, seq: int, **data) -> bytes:
    return (f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": seq,
                                                    **data}) + "\n\n").encode()


async def test_guard_keeps_a_complete_responses_stream_and_ends_a_cut_one_with_one_error():
    complete = [event("response.created", 0), event("response.output_text.delta", 1, delta="a"),
                event("response.completed", 2)]
    events = await run_guard(complete, path="/v1/responses")
    assert len(events) == 3 and events[-1].startswith("event: response.completed")
    for chunks, exc in ((complete[:2], False), (complete[:2], True)):
        events = await run_guard(chunks, raise_after=exc, path="/v1/responses")
        assert len(events) == 3 and events[-1].startswith("event: error\n")
        error = json.loads(events[-1].split("data: ", 1)[1])
        assert error["type"] == "error" and error["sequence_number"] == 2
    upstream_error = event("error", 2, code="server_error", message="boom")
    events = await run_guard([*complete[:2], upstream_error, event("response.completed", 3)],
                             path="/v1/responses")
    assert len(events) == 3 and events[-1].startswith("event: error")


def test_tracker_times_responses_tokens_and_sees_their_end():
    now = [0.0]
    tracker = ResponseTracker(0.0, lambda: now[0], sse=RESPONSES_SSE)
    sent = []

    async def send(message):
        sent.append(message)

    async def play():
        wrapped = tracker.attach(ResponseChannel(send))
        await wrapped({"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", b"text/event-stream")]})
        for t, chunk in ((0.1, event("response.created", 0)),
                         (0.5, event("response.output_text.delta", 1, delta="a")),
                         (0.7, event("response.output_text.delta", 2, delta="b")),
                         (0.8, event("response.completed", 3))):
            now[0] = t
            await wrapped({"type": "http.response.body", "body": chunk, "more_body": True})
        await wrapped({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(play())
    assert tracker.completed and tracker.ttft_s() == 0.5  # the first token, not the preamble
    assert abs(tracker.mean_itl_s() - 0.2) < 1e-9
    assert CHAT_SSE.has_done(b"data: {}\n\ndata: [DONE]\n\n")
    assert not CHAT_SSE.has_done(b'data: {"content": "data: [DONE]"}\n\n')
