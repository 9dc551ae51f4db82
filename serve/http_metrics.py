"""Gateway-level HTTP accounting: every answer (ours and vLLM's) counted by route and status in
``phi3v_http_responses_total`` (declared in ``serve.metrics``)."""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import Message, Scope, Send

from serve.asgi import REQUEST_STATE_KEY
from serve.routes import GENERATION_ROUTES

#: Routes with their own label value; everything else is ``other``.
ROUTES = (*GENERATION_ROUTES, "/v1/models")

def route_label(path: str) -> str:
    """The ``route`` label of ``path``."""
    return path if path in ROUTES else "other"


#: ``code`` label of a response that starts after its client left (nginx's convention).
CLIENT_CLOSED = "499"


def counting(scope: Scope, send: Send, responses: Counter) -> Send:
    """``send`` that counts the response status once it starts (``499`` when the client had
    already left: nobody received that answer) in ``responses`` (``route``, ``code`` labels).
    Adds :data:`~serve.asgi.REQUEST_STATE_KEY` to ``scope``; its ``status`` is set once the
    response has started."""
    route = route_label(scope.get("path", ""))
    state = scope.setdefault(REQUEST_STATE_KEY, {})

    async def _send(message: Message) -> None:
        if message["type"] == "http.response.start":
            code = CLIENT_CLOSED if state.get("client_left") else str(message["status"])
            state["status"] = message["status"]
            responses.labels(route=route, code=code).inc()
        await send(message)

    return _send
