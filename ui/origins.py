"""Which web pages may use the UI with a user's login: the UI's own, and the origins of
``PHI3V_UI_ALLOWED_ORIGINS``. Rules (ui/README.md: "Origins and the login cookie"):

1. **HTTP (CORS).** Chainlit's CORS middleware (Starlette's ``CORSMiddleware``) allows exactly
   the listed origins, by name (Chainlit's default ``*`` echoes any caller's origin with
   credentials allowed, so any page could read a user's data). The UI's own page needs no
   CORS: a browser sends its same-origin requests and reads their answers whatever the
   server says. Any other origin gets no ``Access-Control-Allow-Origin`` (its page reads
   nothing) and a 400 to its preflights (it cannot send JSON, DELETE or custom headers).
   :func:`restrict_cors`.
2. **Websocket.** Browsers apply no CORS to websockets, and Chainlit turns python-engineio's
   Origin check off (``cors_allowed_origins=[]``); :func:`socket_origin_check` turns it back
   on: a handshake whose ``Origin`` is neither the request's own (engineio's rule: the scheme
   from ``X-Forwarded-Proto``, the ``Host`` or ``X-Forwarded-Host``) nor listed is answered
   400 before Chainlit sees it. Requests without ``Origin`` (not from a browser page) carry
   no browser's cookie and are left to Chainlit's login check.
3. **The login cookie** stays Chainlit's: ``HttpOnly``, ``SameSite=Lax``; ``Secure`` when
   ``PHI3V_UI_COOKIE_SECURE`` (set in ``ui/__main__.py`` and ``ui/app.py``).

This module imports neither Chainlit nor the API.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any


def own_origins(environ: Mapping[str, str]) -> set[str]:
    """The origins a same-origin page of this request has, as python-engineio 4's default
    check computes them (``BaseServer._cors_allowed_origins``): ``scheme://Host``, and with
    ``X-Forwarded-Proto`` or ``X-Forwarded-Host`` (a proxy) the forwarded scheme and host.
    ``environ``: the WSGI-style environ engineio builds from the ASGI scope."""
    scheme, host = environ.get("wsgi.url_scheme"), environ.get("HTTP_HOST")
    if not scheme or not host:
        return set()
    origins = {f"{scheme}://{host}"}
    if "HTTP_X_FORWARDED_PROTO" in environ or "HTTP_X_FORWARDED_HOST" in environ:
        fwd_scheme = environ.get("HTTP_X_FORWARDED_PROTO", scheme).split(",")[0].strip()
        fwd_host = environ.get("HTTP_X_FORWARDED_HOST", host).split(",")[0].strip()
        origins.add(f"{fwd_scheme}://{fwd_host}")
    return origins


def socket_origin_check(allowed: Collection[str]) -> Callable[[str | None, Mapping], bool]:
    """The ``cors_allowed_origins`` callable of python-engineio's server (called with the
    request's ``Origin`` and its environ): True for the request's own origin
    (:func:`own_origins`) and for ``allowed``."""
    extra = frozenset(allowed)

    def check(origin: str | None, environ: Mapping[str, str]) -> bool:
        return origin is not None and (origin in extra or origin in own_origins(environ))

    return check


def restrict_cors(app: Any, allowed: Collection[str]) -> None:
    """Make the CORS middleware Chainlit added to its FastAPI ``app`` allow exactly
    ``allowed`` (Chainlit's other CORS choices kept). Call before the app serves.

    Raises:
        RuntimeError: ``app`` has no ``CORSMiddleware`` (a Chainlit upgrade moved it: then
            this policy would silently not apply).
    """
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    for i, layer in enumerate(app.user_middleware):
        if layer.cls is CORSMiddleware:
            app.user_middleware[i] = Middleware(
                CORSMiddleware, *layer.args, **{**layer.kwargs, "allow_origins": list(allowed)})
            return
    raise RuntimeError("Chainlit's app has no CORSMiddleware: the UI's origin policy "
                       "(ui/origins.py) cannot apply")
