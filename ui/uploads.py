"""A readable refusal for an empty upload, before Chainlit's upload endpoint sees it.

Chainlit's ``POST /project/file`` answers a zero-byte file with a 500 (its ``persist_file``
refuses empty content): the browser shows a generic "Failed to upload empty.png: Upload
failed" and the UI log a traceback. :class:`EmptyUploadGuard` answers such an upload with 400
and a JSON ``detail`` naming the file, which Chainlit's browser shows as the reason ("Failed
to upload empty.png: empty.png is empty (0 bytes) ...").

Only bodies that could hold an empty file are parsed: a multipart body of one empty file is a
few hundred bytes (boundary, part headers, file name), so a body declared larger than
:data:`MAX_EMPTY_UPLOAD_BODY` bytes passes untouched (no second parse of real uploads).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOAD_PATH = "/project/file"
#: Largest multipart body that may carry a zero-byte file: part headers (~150 bytes), two
#: boundaries (~2 x 70) and a file name of at most 255 bytes (percent-encoded: x3), rounded up.
MAX_EMPTY_UPLOAD_BODY = 2048


def empty_upload_message(name: str) -> str:
    """The refusal shown for an empty file (also used by the message handler)."""
    return f"{name} is empty (0 bytes); attach an image file."


class EmptyUploadGuard:
    """ASGI middleware: an upload whose file is empty gets 400 ``{"detail": ...}``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" \
                or not scope.get("path", "").endswith(UPLOAD_PATH):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_EMPTY_UPLOAD_BODY:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []

        async def recording() -> Message:
            message = await receive()
            messages.append(message)
            return message

        request = Request(scope, recording)
        form = await request.form()
        upload = form.get("file")
        if upload is not None and not isinstance(upload, str) and upload.size == 0:
            await form.close()
            await JSONResponse({"detail": empty_upload_message(upload.filename or "the file")},
                               status_code=400)(scope, receive, send)
            return
        await form.close()

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def quota_refusal(used: int, incoming: int, quota: int) -> str | None:
    """The refusal for a message whose files would take a user past their storage quota, or
    None. ``used``: bytes the user's stored files take now; ``incoming``: bytes of this
    message's files; ``quota``: ``PHI3V_UI_USER_QUOTA_BYTES`` (0: no quota)."""
    if not quota or used + incoming <= quota:
        return None

    def mb(n: int) -> str:
        return f"{n / 2**20:.1f} MB"

    return (f"Not sent: your stored images take {mb(used)} of your {mb(quota)}, and this "
            f"message's {mb(incoming)} would not fit. Delete old conversations (their images "
            "go with them) to make room.")
