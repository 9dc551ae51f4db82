"""Gateway-level Prometheus series: every HTTP answer (ours and vLLM's) and readiness."""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from starlette.types import Message, Scope, Send

#: Routes with their own label value; everything else is ``other``.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")

RESPONSES = Counter("phi3v_http_responses",
                    "HTTP responses by route and status code, the gateway's own 401/413/429/503 "
                    "included.", ["route", "code"])
READY = Gauge("phi3v_ready", "1 while /ready answers 200 (the engine can serve), else 0.")

for _route in ROUTES[:2]:
    for _code in ("200", "400", "429", "500", "503"):
        RESPONSES.labels(route=_route, code=_code)


def route_label(path: str) -> str:
    """The ``route`` label of ``path``."""
    return path if path in ROUTES else "other"


def counting(scope: Scope, send: Send) -> Send:
    """``send`` that counts the response status once it starts."""
    route = route_label(scope.get("path", ""))

    async def _send(message: Message) -> None:
        if message["type"] == "http.response.start":
            RESPONSES.labels(route=route, code=str(message["status"])).inc()
        await send(message)

    return _send
