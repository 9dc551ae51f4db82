"""Turn what went wrong between the UI and the API into one sentence a person can act on.

Every failure of a request ends as an :class:`ApiError` whose ``message`` is shown in the chat
as is. The server's own OpenAI-style error text (``{"error": {"message": ...}}``) is always
quoted, prefixed by what the status means for the user:

- 400 / 413 / 422: the request was refused; the server's message says what was wrong.
- 401 / 403: the API key was refused (``PHI3V_UI_API_KEY``).
- 429: the server is busy; retry after ``Retry-After`` seconds.
- 503: the server is starting (engine booting) or draining (shutting down).
- connection refused: the API is not running at ``PHI3V_UI_API_BASE_URL``.

No Chainlit import: this module is unit-tested in the main test environment.
"""

from __future__ import annotations

import json

import httpx

#: Longest server message quoted in the chat, characters (validation errors can be long).
MAX_QUOTED_CHARS = 600


class ApiError(Exception):
    """A request to the API failed; ``message`` is ready to show to the user."""

    def __init__(self, message: str, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s


def server_message(body: bytes | str) -> str:
    """The human part of an error body: OpenAI ``error.message``, FastAPI ``detail``, or text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    message = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message = err.get("message")
        elif isinstance(err, str):
            message = err
        if message is None and "detail" in data:
            detail = data["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)
        if message is None and isinstance(data.get("message"), str):
            message = data["message"]
    message = (message or text).strip() or "(no details)"
    if len(message) > MAX_QUOTED_CHARS:
        message = message[:MAX_QUOTED_CHARS] + "…"
    return message


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def from_response(status: int, body: bytes | str, headers: httpx.Headers | None = None
                  ) -> ApiError:
    """The :class:`ApiError` for a non-200 answer of the API."""
    headers = headers or httpx.Headers()
    quoted = server_message(body)
    retry = _retry_after(headers)
    if status == 413:
        text = f"The request is too large for the server (413): {quoted}"
    elif status in (400, 422):
        text = f"The server refused the request ({status}): {quoted}"
    elif status in (401, 403):
        text = (f"The API refused the credentials ({status}): {quoted} "
                "Check PHI3V_UI_API_KEY.")
    elif status == 429:
        when = f"Retry in {retry:g} s." if retry is not None else "Retry in a moment."
        text = f"The server is busy (429): {quoted} {when}"
    elif status == 503:
        when = f" Retry in {retry:g} s." if retry is not None else ""
        text = (f"The server is starting or draining and cannot answer now (503): "
                f"{quoted}{when}")
    elif status >= 500:
        text = f"The server failed ({status}): {quoted}"
    else:
        text = f"Unexpected answer from the server ({status}): {quoted}"
    return ApiError(text, status=status, retry_after_s=retry)


def from_transport(exc: httpx.TransportError, base_url: str, read_timeout_s: float
                   ) -> ApiError:
    """The :class:`ApiError` for a connection-level failure (no HTTP answer)."""
    if isinstance(exc, httpx.ConnectError):
        return ApiError(f"The API at {base_url} is down (connection refused). Start it "
                        "(make demo) or check PHI3V_UI_API_BASE_URL.")
    if isinstance(exc, httpx.ConnectTimeout):
        return ApiError(f"The API at {base_url} does not accept connections (timed out).")
    if isinstance(exc, httpx.ReadTimeout):
        return ApiError(f"The API at {base_url} sent nothing for {read_timeout_s:g} s; "
                        "gave up on this answer.")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return ApiError(f"The API at {base_url} closed the connection mid-answer "
                        "(server restarted or crashed?).")
    return ApiError(f"Could not talk to the API at {base_url}: {type(exc).__name__}: {exc}")


def from_stream_event(event: dict) -> ApiError:
    """The :class:`ApiError` for an error object sent inside an SSE stream."""
    err = event.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) else None
    return ApiError(f"The server stopped this answer with an error: "
                    f"{server_message(json.dumps(event))}", status=status)
