"""The one error type of the intake layer: a client mistake, with the field it concerns."""

from __future__ import annotations

from serve.errors import error_body


class IntakeError(Exception):
    """A request the server refuses, as an OpenAI-style error.

    Args:
        status: HTTP status (400, 401, 413, 415, ...).
        message: what was wrong, for the client.
        param: the request field at fault (``messages[0].content[1].image_url``), or None.
        code: optional machine-readable code (e.g. ``image_too_large``); the ``type`` is
            ``invalid_request_error`` as in the OpenAI API.
        headers: response headers the refusal carries (``Accept-Encoding`` of a 415).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self):
        # Rebuilt from its fields when it crosses a process boundary (the image workers,
        # serve.intake.workers): Exception's own pickling calls IntakeError(message) only.
        return type(self), (self.status, self.message, self.param, self.code, self.headers)

    def response(self):
        """The HTTP response for this error (a Starlette ``JSONResponse``)."""
        from starlette.responses import JSONResponse  # the rules above stay stdlib-only

        body = error_body(self.status, self.message, "invalid_request_error", self.param)
        if self.code:
            body["error"]["code"] = self.code
        return JSONResponse(body, status_code=self.status, headers=self.headers)
