"""API-key authentication (``Authorization: Bearer <key>``), compared in constant time."""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import Scope

from serve.errors import error_body


class ApiKeys:
    """The accepted API keys. No keys: authentication is off.

    Comparison uses :func:`hmac.compare_digest` against *every* key (no early exit), so the
    time taken does not reveal which key or how much of it matched.
    """

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def load(cls, keys: list[str], key_file: Path | None) -> "ApiKeys":
        """Keys from a list plus a file (one key per line, blank lines and ``#`` comments
        ignored).

        Raises:
            FileNotFoundError: ``key_file`` is set but missing.
        """
        all_keys = list(keys)
        if key_file is not None:
            for line in Path(key_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    all_keys.append(line)
        return cls(all_keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, presented: str | None) -> bool:
        """True when ``presented`` equals one of the keys."""
        if not self._keys:
            return True
        candidate = (presented or "").encode()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(candidate, key)
        return ok

    def permits(self, scope: Scope) -> bool:
        """Whether the request's ``Authorization: Bearer`` header carries a valid key."""
        if not self._keys:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and self.check(token.strip())


def unauthorized() -> JSONResponse:
    """401 with an OpenAI-style error (as the OpenAI API answers a bad key)."""
    body = error_body(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                      "invalid_request_error")
    body["error"]["code"] = "invalid_api_key"
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
