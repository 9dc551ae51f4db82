"""Tool calling under ``--tools`` (``serve.intake.request.check_tools`` and
``check_tool_turn``, the Responses API's tool items, and the ``X-Tools-Ignored`` header of the
intake): ``refuse`` is a 400 naming the field, ``ignore`` serves the request without the tool
fields and says so, ``pass`` forwards them to vLLM as they are."""

from __future__ import annotations

import json

import pytest

from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import RequestLimits, parse_chat_request, parse_completion_request
from serve.intake.responses import parse_responses_request
from serve.intake.service import Intake
from serve.settings import Settings
from tests.unit.test_middlewares import call

REFUSE, IGNORE, PASS = (RequestLimits(max_images=2, tools=t) for t in ("refuse", "ignore", "pass"))
USER = {"role": "user", "content": "What is the weather?"}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
#: A conversation after one tool call: the model's call, then the tool's result.
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "<|end|> sunny"}]
RESPONSES_TOOLS = [{"type": "function", "name": "weather", "parameters": {}}]
RESPONSES_HISTORY = [
    {"role": "user", "content": "What is the weather?"},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]


def chat(**fields) -> dict:
    return {"model": "m", "messages": [dict(USER)], **fields}


def refusal(parse, body, limits) -> IntakeError:
    with pytest.raises(IntakeError) as err:
        parse(body, limits)
    assert err.value.status == 400
    return err.value


# --- refuse (the default) ----------------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS}, "tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"functions": [{"name": "weather"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_refuse_names_the_field_that_asks_for_tools(fields, param):
    err = refusal(parse_chat_request, chat(**fields), REFUSE)
    assert err.param == param and "tool" in err.message
    assert RequestLimits(max_images=1).tools == "refuse"  # the default


def test_refuse_lets_fields_that_ask_for_nothing_pass():
    """``tool_choice: "none"``, ``parallel_tool_calls`` alone and an empty ``tools`` (vLLM's
    own 400) ask for no tool: served as before."""
    for fields in ({"tool_choice": "none"}, {"parallel_tool_calls": False}, {"tools": []},
                   {"tools": None, "tool_choice": None}):
        body = chat(**fields)
        request = parse_chat_request(body, REFUSE)
        assert request.tools_ignored == () and all(body[k] == v for k, v in fields.items())


@pytest.mark.parametrize("limits", [REFUSE, IGNORE], ids=["refuse", "ignore"])
def test_tool_turns_in_the_history_are_refused_unless_passed(limits):
    """The model can read neither a tool call nor its result; dropping them would change
    the conversation, so both are a 400 under refuse and ignore."""
    call_turn = {"messages": HISTORY[:2]}
    err = refusal(parse_chat_request, call_turn, limits)
    assert err.param == "messages[1].tool_calls" and "tool calls" in err.message
    with_text = {"messages": [USER, {"role": "assistant", "content": "x", "tool_calls": [CALL]}]}
    assert refusal(parse_chat_request, with_text, limits).param == "messages[1].tool_calls"
    legacy = {"messages": [USER, {"role": "assistant", "content": "x",
                                  "function_call": CALL["function"]}]}
    assert refusal(parse_chat_request, legacy, limits).param == "messages[1].function_call"
    result = {"messages": [USER, {"role": "assistant", "content": "ok"}, HISTORY[2]]}
    err = refusal(parse_chat_request, result, limits)
    assert err.param == "messages[2].role" and "tool results" in err.message
    # No calls: an assistant turn with empty tool_calls is plain text.
    plain = {"messages": [USER, {"role": "assistant", "content": "x", "tool_calls": []}]}
    assert parse_chat_request(plain, limits).messages[1]["content"] == "x"


def test_responses_refuse_tools_and_tool_items():
    err = refusal(parse_responses_request, {"input": "hi", "tools": RESPONSES_TOOLS}, REFUSE)
    assert err.param == "tools"
    for item in RESPONSES_HISTORY[1:]:
        body = {"input": [RESPONSES_HISTORY[0], item]}
        err = refusal(parse_responses_request, body, REFUSE)
        assert err.param == "input[1].type" and item["type"] in err.message
        assert refusal(parse_responses_request, body, IGNORE).param == "input[1].type"


# --- ignore ------------------------------------------------------------------------------------
def test_ignore_drops_every_tool_field_and_names_them():
    body = chat(tools=TOOLS, tool_choice="auto", parallel_tool_calls=True, temperature=0)
    request = parse_chat_request(body, IGNORE)
    assert request.tools_ignored == ("tools", "tool_choice", "parallel_tool_calls")
    assert set(body) == {"model", "messages", "temperature"}
    legacy = chat(functions=[{"name": "f"}], function_call="none")
    assert parse_chat_request(legacy, IGNORE).tools_ignored == ("functions", "function_call")
    assert parse_chat_request(chat(tools=None), IGNORE).tools_ignored == ()
    assert parse_chat_request(chat(), IGNORE).tools_ignored == ()


def test_ignore_on_the_responses_api_and_completions():
    body = {"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": "auto",
            "max_tool_calls": 2}
    request = parse_responses_request(body, IGNORE)
    assert request.tools_ignored == ("tools", "tool_choice", "max_tool_calls")
    assert "tools" not in body and body["input"] == "hi"
    completion = {"prompt": "hi", "tools": TOOLS}
    assert parse_completion_request(completion, IGNORE).tools_ignored == ("tools",)
    assert "tools" not in completion


# --- pass --------------------------------------------------------------------------------------
def test_pass_forwards_tools_and_tool_turns_as_they_are():
    body = {"model": "m", "messages": json.loads(json.dumps(HISTORY)), "tools": TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": False}
    request = parse_chat_request(body, PASS)
    assert request.tools_ignored == ()
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto"
    assert body["messages"][1] == HISTORY[1]  # the call, untouched
    # A tool's result is message text like any other: neutralised, counted.
    assert body["messages"][2]["content"] == "<\u2060|end|> sunny"
    counted = request.messages
    assert [m["role"] for m in counted] == ["user", "assistant", "tool"]
    assert "Paris" in counted[1]["content"]  # a call-only turn counts as its calls
    # Still refused under pass: images outside user turns, a turn with neither text nor calls.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    err = refusal(parse_chat_request, {"messages": [
        USER, {"role": "tool", "tool_call_id": "c", "content": [image]}]}, PASS)
    assert err.param == "messages[1].content[0]"
    err = refusal(parse_chat_request, {"messages": [USER, {"role": "assistant",
                                                           "content": None}]}, PASS)
    assert err.param == "messages[1].content"


def test_pass_on_the_responses_api():
    body = {"input": json.loads(json.dumps(RESPONSES_HISTORY)), "tools": RESPONSES_TOOLS}
    request = parse_responses_request(body, PASS)
    assert body["input"][1:] == RESPONSES_HISTORY[1:] and body["tools"] == RESPONSES_TOOLS
    assert [m["role"] for m in request.messages] == ["user", "assistant", "tool"]
    assert request.messages[2]["content"] == "sunny"


def test_the_policy_comes_from_the_settings():
    assert Intake.from_settings(Settings(device="cpu")).limits.tools == "refuse"
    assert Intake.from_settings(Settings(device="cpu", tools="ignore")).limits.tools == "ignore"


# --- the response header -----------------------------------------------------------------------
def intake(peer, limits: RequestLimits) -> IntakeMiddleware:
    from serve.intake.urls import UrlPolicy

    return IntakeMiddleware(peer, limits, ImagePolicy(2**20, 10**6, frozenset({"PNG"})),
                            UrlPolicy(enabled=False))


async def test_the_answer_names_the_fields_ignored_streamed_or_not():
    seen = []

    async def peer(scope, receive, send):
        body = json.loads((await receive())["body"])
        seen.append(body)
        kind = b"text/event-stream" if body.get("stream") else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    app = intake(peer, IGNORE)
    for stream in (False, True):
        body = chat(tools=TOOLS, tool_choice="auto", stream=stream)
        status, _, headers = await call(app, json.dumps(body).encode())
        assert status == 200 and headers[b"x-tools-ignored"] == b"tools, tool_choice"
        assert "tools" not in seen[-1] and "tool_choice" not in seen[-1]
    status, _, headers = await call(app, json.dumps(chat()).encode())
    assert status == 200 and b"x-tools-ignored" not in headers
    status, body, headers = await call(intake(peer, REFUSE),
                                       json.dumps(chat(tools=TOOLS)).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "tools"
    assert b"x-tools-ignored" not in headers
