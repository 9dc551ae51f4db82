"""Gateway-level HTTP accounting: every answer (ours and vLLM's) counted by route and status in
``phi3v_http_responses_total`` (declared in ``serve.metrics``)."""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import Message, Scope

from serve.asgi import REQUEST_STATE_KEY, ResponseChannel
from serve.routes import GENERATION_ROUTES

#: Routes with their own label value; everything else is ``other``.
ROUTES = (*GENERATION_ROUTES, "/v1/models")

def route_label(path: str) -> str:
    """The ``route`` label of ``path``."""
    return path if path in ROUTES else "other"


#: ``code`` label of a response that starts after its client left (nginx's convention).
CLIENT_CLOSED = "499"


def count_responses(scope: Scope, channel: ResponseChannel, responses: Counter) -> None:
    """Count the response's status once it starts (``499`` when the client had already left:
    nobody received that answer) in ``responses`` (``route``, ``code`` labels): a head hook
    on ``channel``, so counting costs nothing per streamed token. Adds
    :data:`~serve.asgi.REQUEST_STATE_KEY` to ``scope``; its ``status`` is set once the
    response has started, and ``code`` to the code counted (the access record's status,
    ``serve.logs``)."""
    route = route_label(scope.get("path", ""))
    state = scope.setdefault(REQUEST_STATE_KEY, {})

    def count(message: Message) -> Message:
        code = CLIENT_CLOSED if state.get("client_left") else str(message["status"])
        state["status"], state["code"] = message["status"], code
        responses.labels(route=route, code=code).inc()
        return message

    channel.on_head(count)
