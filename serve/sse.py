"""The two SSE dialects of vLLM's generation routes (pure data and byte tests, no parsing).

- **chat** (``/v1/chat/completions``, ``/v1/completions``): ``data: {chunk}`` events, a normal
  end is ``data: [DONE]``, an error is ``data: {"error": {...}}`` (OpenAI's convention; the
  ``openai`` SDK raises ``APIError`` on it).
- **responses** (``/v1/responses``): ``event: <type>`` + ``data: {...}`` events with a
  ``sequence_number``; a normal end is ``response.completed`` or ``response.incomplete``
  (answer cut by ``max_output_tokens``), an error is ``error`` or ``response.failed``
  (OpenAI Responses streaming reference; the SDK yields a ``ResponseErrorEvent``).

**The end of a cut Responses answer**: the server's ``--responses-incomplete-event``, one of
:data:`INCOMPLETE_EVENTS` (the stream guard names the event). Its response says ``status:
"incomplete"`` and ``incomplete_details.reason: "max_output_tokens"`` either way; only the
event's name differs.

- ``completed`` (default): ``response.completed``, as vLLM 0.32 sends it. The pinned
  ``openai`` SDK (3.57) stores the final response of ``client.responses.stream(...)`` only
  on ``response.completed`` (``openai/lib/streaming/responses/_responses.py``,
  ``ResponseStreamState.accumulate_event``); on any other end ``get_final_response()`` raises
  ``RuntimeError: Didn't receive a `response.completed` event.``, so with this name the
  helper returns every cut answer, and a client that ends on ``response.completed`` alone
  (as LangChain did until langchain-ai/langchain#33871) ends and finds the usage. A client
  that follows the reference tells a cut answer by ``response.status``.
- ``incomplete``: ``response.incomplete``, the event OpenAI's reference names for it
  (platform.openai.com/docs/api-reference/responses-streaming/response/incomplete) and the
  one OpenAI's API sends for a ``max_output_tokens`` cut (openai/openai-python#3263,
  langchain-ai/langchain#33840), for clients that branch on the event name (the ``openai``
  Node SDK's accumulator ends on either, as openai/openai-python#3538 notes). The pinned
  Python SDK's ``get_final_response()`` then raises on every cut answer, as it does against
  OpenAI's API, until openai/openai-python#3538 (open) ships; iterating the events works.

vLLM writes compact JSON in which a newline never occurs unescaped, so a marker at the start
of an event (or after a newline) cannot come from answer text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serve.errors import error_body
from serve.routes import CHAT, COMPLETIONS, GENERATION_ROUTES, RESPONSES


@dataclass(frozen=True)
class SseDialect:
    """How one protocol's event stream ends and fails.

    Attributes:
        name: the protocol (``serve.routes``).
        done: event prefixes of a normal end of stream.
        error: event prefixes of an error event (the stream ends after it); the chat dialect
            has none (its errors are recognised by parsing the JSON, see ``streamguard``).
        chunks: the events are chat/completions chunks (``choices``, ``finish_reason``).
        tokens: event prefixes of events that carry answer tokens (TTFT and ITL are timed on
            them); empty: every event (a chat chunk is sent per engine step).
    """

    name: str
    done: tuple[bytes, ...]
    error: tuple[bytes, ...]
    chunks: bool
    tokens: tuple[bytes, ...] = ()

    def carries_tokens(self, data: bytes) -> bool:
        """Whether a streamed message (one or more events) carries answer tokens."""
        return not self.tokens or _holds(data, self.tokens)

    def has_done(self, data: bytes) -> bool:
        """Whether ``data`` (any slice of the stream, one or more events) holds a normal end.

        A chat stream's end, ``data: [DONE]``, is its last event (vLLM writes nothing after
        it, and the stream guard forwards nothing after it), so a slice holding it ends with
        it: an O(1) suffix test on every streamed chunk instead of a scan."""
        if self.chunks:
            return data.endswith(CHAT_END)
        return _holds(data, self.done)

    def error_event(self, message: str, sequence_number: int = 0) -> bytes:
        """One SSE error event of this dialect (an OpenAI-style ``server_error``)."""
        if self.chunks:
            return b"data: " + json.dumps(error_body(500, message, "server_error")).encode() \
                + b"\n\n"
        data = {"type": "error", "code": "server_error", "message": message, "param": None,
                "sequence_number": sequence_number}
        return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"


def is_event_stream(start: dict) -> bool:
    """Whether an ASGI ``http.response.start`` message starts an SSE (``text/event-stream``)
    answer."""
    return b"text/event-stream" in dict(start.get("headers") or []).get(b"content-type", b"")


def _holds(data: bytes, prefixes: tuple[bytes, ...]) -> bool:
    """Whether an event of ``data`` starts with one of ``prefixes``. Runs on every streamed
    chunk: a plain substring test first (C speed, false for almost every chunk), the position
    check only on a hit."""
    for m in prefixes:
        if m in data and (data.startswith(m) or b"\n" + m in data):
            return True
    return False


#: Names a Responses stream cut by ``max_output_tokens`` may end with (``response.<name>``),
#: the default first (module docstring; ``Settings.responses_incomplete_event``).
INCOMPLETE_EVENTS = ("completed", "incomplete")
#: The last bytes of a chat stream that ended normally.
CHAT_END = b"data: [DONE]\n\n"
CHAT_SSE = SseDialect(CHAT, (CHAT_END.rstrip(),), (), chunks=True)
RESPONSES_SSE = SseDialect(
    RESPONSES, (b"event: response.completed", b"event: response.incomplete"),
    (b"event: error", b"event: response.failed"), chunks=False,
    tokens=(b"event: response.output_text.delta",))
DIALECTS = {CHAT: CHAT_SSE, COMPLETIONS: CHAT_SSE, RESPONSES: RESPONSES_SSE}


#: What :func:`data_event` returns for the chat dialect's last event, ``data: [DONE]``.
DONE = "[DONE]"


def data_event(line: str) -> dict | str | None:
    """One line of a chat/completions event stream as a client reads it: the event's JSON
    object, :data:`DONE` for ``data: [DONE]``, None for any other line (blank, ``event:``,
    comments). The one client-side parser of the benchmarks and tests.

    Raises:
        ValueError: a ``data:`` line whose payload is not JSON.
    """
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    return DONE if payload == DONE else json.loads(payload)


def dialect(path: str | None) -> SseDialect:
    """The SSE dialect of a request path (the chat dialect for any other path)."""
    return DIALECTS[GENERATION_ROUTES.get(path, CHAT)]
