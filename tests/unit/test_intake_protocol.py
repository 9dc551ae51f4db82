"""Protocol details of the generation routes, in-process: compressed bodies (415), non-finite
numbers, the field a validation error names, and the end event of a cut Responses stream."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import List, Union, get_args

import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputParam
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict

from serve.errors import client_field_error
from serve.intake.body import decode_body, encode_body
from serve.intake.errors import IntakeError
from serve.intake.request import RequestLimits, parse_chat_request, parse_completion_request
from serve.intake.responses import parse_responses_request
from serve.settings import Settings
from serve.sse import INCOMPLETE_EVENTS
from serve.streamguard import StreamGuardMiddleware, incomplete_end_as
from tests.unit.test_intake import run_guard
from tests.unit.test_middlewares import call, intake

LIMITS = RequestLimits(max_images=2)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# --- Content-Encoding ---------------------------------------------------------------------------
async def _peer(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


@pytest.mark.parametrize("coding,body", [
    ("gzip", gzip.compress(json.dumps(CHAT).encode())),
    ("deflate", zlib.compress(json.dumps(CHAT).encode())),
    ("br", b"\x8b\x03\x80" + json.dumps(CHAT).encode()),  # any bytes: never inflated
    ("identity, gzip", gzip.compress(json.dumps(CHAT).encode())),
], ids=["gzip", "deflate", "br", "identity-then-gzip"])
async def test_a_compressed_body_is_415_naming_the_encoding(coding, body):
    status, data, headers = await call(intake(_peer), body,
                                       headers=[(b"content-encoding", coding.encode()),
                                                (b"x-request-id", b"zip")])
    err = json.loads(data)["error"]
    assert status == 415 and err["param"] == "Content-Encoding"
    assert coding.split(", ")[-1] in err["message"] and err["type"] == "invalid_request_error"
    assert headers[b"accept-encoding"] == b"identity"
    assert headers[b"x-request-id"].startswith(b"zip-")  # like every refusal


async def test_identity_encoding_passes():
    status, _, _ = await call(intake(_peer), json.dumps(CHAT).encode(),
                              headers=[(b"content-encoding", b"identity")])
    assert status == 200


# --- non-finite numbers -------------------------------------------------------------------------
NON_FINITE = [
    ('"logit_bias": {"100": NaN}', "logit_bias.100"),
    ('"temperature": Infinity', "temperature"),
    ('"presence_penalty": -Infinity', "presence_penalty"),
    ('"top_p": 1e999', "top_p"),  # valid JSON, but beyond a double: parsed as infinity
    ('"stop": ["a"], "metadata": {"x": [1, NaN]}', "metadata.x[1]"),
]


@pytest.mark.parametrize("field,param", NON_FINITE, ids=[p for _, p in NON_FINITE])
def test_non_finite_numbers_are_400_naming_the_field(field, param):
    def decoded(base: dict) -> dict:
        return json.loads(json.dumps(base)[:-1] + ", " + field + "}")

    for parse, base in ((parse_chat_request, CHAT),
                        (parse_completion_request, {"model": "m", "prompt": "hi"}),
                        (parse_responses_request, {"model": "m", "input": "hi"})):
        with pytest.raises(IntakeError) as err:
            parse(decoded(base), LIMITS)
        assert err.value.status == 400 and err.value.param == param
        assert "finite" in err.value.message


def test_finite_numbers_pass():
    body = {**CHAT, "temperature": 0.7, "logit_bias": {"100": -100.0}, "top_p": 1e-300}
    assert parse_chat_request(body, LIMITS).body["logit_bias"] == {"100": -100.0}


async def test_the_intake_refuses_nan_from_the_raw_body():
    raw = json.dumps(CHAT)[:-1].encode() + b', "logit_bias": {"100": NaN}}'
    status, data, _ = await call(intake(_peer), raw)
    assert status == 400 and json.loads(data)["error"]["param"] == "logit_bias.100"


VALID_BODIES = [
    b'{"a": 12345678901234567890123, "b": -0.0, "c": 1e-300, "d": 0.1}',  # big int, floats
    b'{"t": "\\ud83d\\ude00 \xc3\xa9 \\u2028", "k\xc3\xa9": [true, null, {}]}',  # a pair
    '{"utf16": "\u00e9"}'.encode("utf-16"),  # Python's json detects the encoding
    b'{"a": 1, "a": 2}',  # a repeated key: the last one, as json
]


@pytest.mark.parametrize("raw", VALID_BODIES)
def test_decode_body_reads_what_json_reads(raw):
    assert decode_body(raw) == json.loads(raw)
    assert json.loads(encode_body(decode_body(raw))) == json.loads(raw)


@pytest.mark.parametrize("raw,param", [
    (b'{"stop": ["a", "\\ud800"]}', "stop[1]"),  # a lone surrogate
    (b'{"x": {"y": [1, NaN]}}', "x.y[1]"),
    (b'{"top_p": 1e999}', "top_p"),
    (b'{"\\udfff": 1}', None),  # in a key: no field to name but the key's object
])
def test_decode_body_names_the_field_it_refuses(raw, param):
    with pytest.raises(IntakeError) as err:
        decode_body(raw)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("raw,words", [(b'{"a": ', "not valid JSON"),
                                       (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                                       (b"\xff{}", "not valid JSON")])
def test_decode_body_refuses_what_is_not_json(raw, words):
    with pytest.raises(IntakeError) as err:
        decode_body(raw)
    assert err.value.status == 400 and words in err.value.message


# --- the field a validation error names (real pydantic errors, OpenAI's own schema) -----------
def _validation_errors(schema, body: dict) -> list[dict]:
    """The errors pydantic reports for ``body``, as FastAPI passes them on (``loc`` under
    ``body``)."""
    with pytest.raises(ValidationError) as err:
        TypeAdapter(schema).validate_python(body)
    return [{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()]


class ChatBody(TypedDict):
    """Two union-typed fields of a chat body, in the ``openai`` SDK's own types."""

    messages: List[ChatCompletionMessageParam]
    stop: Union[str, List[str]]


class ResponsesBody(TypedDict):
    """The union-typed ``input`` of a Responses body (a string or a list of items)."""

    input: Union[str, ResponseInputParam]


UNION_CASES = [
    # The case: every member's errors are reported, the developer member's first.
    ({"messages": [{"role": "user", "content": "hi", "name": 123}], "stop": "x"},
     "messages[0].name", "valid string"),
    ({"messages": [{"role": "system", "content": "a"},
                   {"role": "assistant", "content": "b", "name": ["n"]}], "stop": "x"},
     "messages[1].name", "valid string"),
    # The tag is the fault: every member refuses it.
    ({"messages": [{"role": "wizard", "content": "hi"}], "stop": "x"},
     "messages[0].role", "'developer'"),
    # A union of types: a number is neither a string nor a list.
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop", "valid string"),
    # A missing field is named where the client would put it.
    ({"messages": [{"role": "tool", "content": "x"}], "stop": "x"},
     "messages[0].tool_call_id", "required"),
]


@pytest.mark.parametrize("body,param,words", UNION_CASES, ids=[c[1] for c in UNION_CASES])
def test_union_errors_name_the_field_the_client_sent(body, param, words):
    errors = _validation_errors(ChatBody, body)
    found, message = client_field_error(errors, body)
    assert found == param and param in message and words in message


def test_a_list_where_a_string_fits_is_read_as_the_list():
    """``input`` is a string or a list of items: the list's error, not "should be a string"."""
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}
    found, message = client_field_error(_validation_errors(ResponsesBody, body), body)
    assert found == "input[0].content[0].text" and "valid string" in message


def test_errors_outside_the_body_are_left_to_vllm():
    assert client_field_error(["Unsupported Media Type"], None) is None
    body = {"tool_calls": [{"id": 1}]}  # a validator re-raised an inner model's errors
    assert client_field_error([{"type": "missing", "loc": ("body", 0, "Call", "function"),
                                "msg": "Field required"}], body) is None


# --- the end event of a cut Responses stream ----------------------------------------------------
def _end_event(name: str, status: str) -> bytes:
    """A Responses end event as vLLM 0.32 writes it (compact JSON, one line)."""
    data = {"response": {"id": "resp_1", "status": status, "incomplete_details":
                         {"reason": "max_output_tokens"} if status == "incomplete" else None},
            "sequence_number": 7, "type": f"response.{name}"}
    return f"event: response.{name}\ndata: ".encode() + json.dumps(
        data, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("sent", ["completed", "incomplete"])
@pytest.mark.parametrize("wanted", INCOMPLETE_EVENTS)
def test_a_cut_answer_ends_with_the_configured_event(sent, wanted):
    out = incomplete_end_as(_end_event(sent, "incomplete"), wanted)
    head, _, payload = out.partition(b"\n")
    data = json.loads(payload.removeprefix(b"data: "))
    assert head == f"event: response.{wanted}".encode() and data["type"] == f"response.{wanted}"
    assert data["response"]["status"] == "incomplete" and data["sequence_number"] == 7
    assert out.endswith(b"\n\n")


@pytest.mark.parametrize("wanted", INCOMPLETE_EVENTS)
def test_a_completed_answer_keeps_its_event(wanted):
    event = _end_event("completed", "completed")
    assert incomplete_end_as(event, wanted) == event


@pytest.mark.parametrize("setting", [None, *INCOMPLETE_EVENTS])
async def test_the_guard_ends_a_cut_stream_as_configured(setting):
    """The default ends a cut answer with ``response.completed`` (the event the pinned
    ``openai`` SDK's ``get_final_response()`` accepts); the other setting with
    ``response.incomplete``."""
    options = {} if setting is None else {"incomplete_event": setting}
    events = await run_guard([b'event: response.created\ndata: {"type":"response.created"}\n\n',
                              _end_event("completed", "incomplete")], path="/v1/responses",
                             **options)
    assert events[-1].startswith(f"event: response.{setting or 'completed'}\n")
    assert len(events) == 2  # the end was recognised: no "ended before completion" error


def test_the_setting_offers_the_guard_s_choices():
    field = Settings.model_fields["responses_incomplete_event"]
    assert get_args(field.annotation) == INCOMPLETE_EVENTS
    assert field.default == INCOMPLETE_EVENTS[0]
    with pytest.raises(ValueError):
        Settings(responses_incomplete_event="done")
    with pytest.raises(ValueError):
        StreamGuardMiddleware(None, "done")
