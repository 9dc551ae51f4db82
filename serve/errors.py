"""OpenAI-style error responses for errors raised by our own layers (not vLLM's).

Shape (as the OpenAI API and vLLM's ``ErrorResponse``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}
"""

from __future__ import annotations


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """The JSON body of an OpenAI-style error (``code`` is the HTTP status)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def openai_error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
):
    """A Starlette ``JSONResponse`` carrying :func:`error_body` with HTTP ``status``."""
    from starlette.responses import JSONResponse  # error_body stays importable without it

    return JSONResponse(error_body(status, message, type_, param), status_code=status,
                        headers=headers)
