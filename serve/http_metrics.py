"""Gateway-level Prometheus series: every HTTP answer (ours and vLLM's) and readiness."""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from starlette.types import Message, Scope, Send

from serve.asgi import REQUEST_STATE_KEY
from serve.routes import GENERATION_ROUTES

#: Routes with their own label value; everything else is ``other``.
ROUTES = (*GENERATION_ROUTES, "/v1/models")

RESPONSES = Counter("phi3v_http_responses",
                    "HTTP responses by route and status code, the gateway's own 401/413/429/503 "
                    "included.", ["route", "code"])
READY = Gauge("phi3v_ready", "1 while /ready answers 200 (the engine can serve), else 0.")

for _route in GENERATION_ROUTES:
    for _code in ("200", "400", "429", "500", "503"):
        RESPONSES.labels(route=_route, code=_code)


def route_label(path: str) -> str:
    """The ``route`` label of ``path``."""
    return path if path in ROUTES else "other"


#: ``code`` label of a response that starts after its client left (nginx's convention).
CLIENT_CLOSED = "499"


def counting(scope: Scope, send: Send) -> Send:
    """``send`` that counts the response status once it starts (``499`` when the client had
    already left: nobody received that answer). Adds :data:`REQUEST_STATE_KEY` to ``scope``."""
    route = route_label(scope.get("path", ""))
    state = scope.setdefault(REQUEST_STATE_KEY, {})

    async def _send(message: Message) -> None:
        if message["type"] == "http.response.start":
            code = CLIENT_CLOSED if state.get("client_left") else str(message["status"])
            RESPONSES.labels(route=route, code=code).inc()
        await send(message)

    return _send
