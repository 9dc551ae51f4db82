"""Cross-origin browser access (CORS, ``--allowed-origins`` and friends): Starlette's
``CORSMiddleware`` in front of auth (``serve.app.Gateway``), over every route, ours and vLLM's.

- A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  here, before auth: a browser sends it without credentials, so behind auth it was a 401 and
  the browser never sent the request. From an allowed origin: 200 with the CORS headers;
  from another: Starlette's 400 without ``Access-Control-Allow-Origin``.
- Every other request goes on (the API key is still required); its answer carries the CORS
  headers when its ``Origin`` is allowed, errors of ours included (401, 404, 413, 429, 503),
  so a browser client can read why it was refused.
- vLLM's app puts its own ``CORSMiddleware`` on (``--allowed-origins`` is vLLM's flag too):
  ``serve.engine.drop_cors_middleware`` takes it off, so no answer carries the headers twice
  (a browser refuses two ``Access-Control-Allow-Origin`` values).

No ``--allowed-origins`` (the default): no layer, and no CORS header on any answer.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from serve.settings import Settings

#: Response headers of ours a browser script may read besides the CORS-safelisted ones
#: (``Content-Type`` and a few more; Fetch standard, "CORS-safelisted response-header name"):
#: the request id, the tool fields ``--tools ignore`` dropped, and when to retry a 429/503
#: and why admission refused it.
EXPOSED_HEADERS = ("X-Request-Id", "X-Tools-Ignored", "Retry-After", "X-Phi3v-Reject-Reason")


def cors_layer(app: ASGIApp, settings: Settings) -> ASGIApp:
    """``app`` behind Starlette's ``CORSMiddleware`` configured from ``settings``
    (``allowed_origins``, ``allowed_methods``, ``allowed_headers``, ``allow_credentials``), or
    ``app`` itself when no origin is allowed."""
    if not settings.allowed_origins:
        return app
    return CORSMiddleware(app, allow_origins=settings.allowed_origins,
                          allow_methods=settings.allowed_methods,
                          allow_headers=settings.allowed_headers,
                          allow_credentials=settings.allow_credentials,
                          expose_headers=EXPOSED_HEADERS)
