"""``--tools`` end to end on the real server: ``refuse`` (the default) is a 400 naming the
field, ``ignore`` answers without the tools and says so in ``X-Tools-Ignored`` (streamed or
not, chat and Responses API), ``pass`` hands the tools to vLLM (whose Phi-3-vision setup has
no tool parser: its own answers show the request reached it). ``ignore`` is the session's
``gateway`` (API keys on), ``pass`` its ``verbose_server``."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import GATEWAY_KEY

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}


#: The gateway's key (the other servers take none and ignore the header).
AUTH = {"Authorization": f"Bearer {GATEWAY_KEY}"}


@pytest.fixture(scope="module")
def ignoring(gateway):
    return gateway.server


@pytest.fixture(scope="module")
def passing(verbose_server):
    return verbose_server


def chat(server, messages: list | None = None, **fields) -> httpx.Response:
    body = {"model": server.model, "max_tokens": 3, "ignore_eos": True,  # random weights
            "messages": messages or [{"role": "user", "content": "Weather in Paris?"}],
            **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers=AUTH)


def test_refuse_is_a_400_naming_the_field(server):
    r = chat(server, tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = chat(server, tool_choice="auto")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = chat(server, [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": [CALL]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls"


def test_ignore_answers_without_the_tools_and_says_so(ignoring):
    r = chat(ignoring, tools=TOOLS, tool_choice="auto", parallel_tool_calls=True)
    assert r.status_code == 200, r.text
    assert r.headers["x-tools-ignored"] == "tools, tool_choice, parallel_tool_calls"
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] and not choice["message"].get("tool_calls")
    body = {"model": ignoring.model, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with httpx.stream("POST", f"{ignoring.base_url}/v1/chat/completions", json=body,
                      timeout=120, headers=AUTH) as streamed:
        text = streamed.read().decode()
    assert streamed.status_code == 200 and streamed.headers["x-tools-ignored"] == "tools"
    assert '"content"' in text and "data: [DONE]" in text
    responses = httpx.post(f"{ignoring.base_url}/v1/responses", timeout=120, headers=AUTH, json={
        "model": ignoring.model, "max_output_tokens": 3, "input": "Weather in Paris?",
        "tools": [{"type": "function", "name": "weather", "parameters": {}}]})
    assert responses.status_code == 200, responses.text
    assert responses.headers["x-tools-ignored"] == "tools"
    plain = chat(ignoring)
    assert plain.status_code == 200 and "x-tools-ignored" not in plain.headers
    # The history of a tool call is still refused: the model can read neither turn.
    r = chat(ignoring, [{"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
             tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].role"


def test_pass_forwards_the_tools_to_vllm(passing):
    # vLLM takes tools with tool_choice none, and a conversation with a call and its result.
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat(passing, history, tools=TOOLS, tool_choice="none")
    assert r.status_code == 200, r.text
    assert "x-tools-ignored" not in r.headers
    # tool_choice auto (the default with tools) reaches vLLM, which has no tool parser here.
    r = chat(passing, tools=TOOLS)
    assert r.status_code == 400 and "tool-call-parser" in r.json()["error"]["message"], r.text
