"""API-key authentication (``Authorization: Bearer <key>``), compared in constant time, and
the tenant each key belongs to (:class:`Auth`).

- With a keys file (``--keys-file``, :mod:`serve.keys`): a key of the file is its tenant's.
- Keys of ``--api-keys``, ``--api-key-file`` and vLLM's ``--api-key`` (:class:`ApiKeys`), with
  a keys file or without, belong to the tenant ``default``: weight 1, no limits, admin, unless
  the keys file defines a tenant of that name, whose settings then apply.
- No key configured at all: every request is :data:`serve.tenants.ANONYMOUS`'s.

A refused key gets the same 401 whatever the reason (unknown, revoked, malformed, missing), so
an answer never tells whether a key exists. ``/admin/*`` routes need an ``admin`` tenant (403
otherwise).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from serve.admission.fair import DEFAULT_TENANT
from serve.errors import error_body, openai_error
from serve.keys import KeyStore
from serve.logs import note
from serve.tenants import ANONYMOUS, TENANT_SCOPE_KEY, Tenant

if TYPE_CHECKING:  # pragma: no cover
    from serve.settings import Settings

#: Path prefix of the routes only an ``admin`` tenant may call.
ADMIN_PREFIX = "/admin/"


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
        token = bearer_token(scope)
        return token is not None and self.check(token)


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's ``Authorization: Bearer <token>`` header, or None (also
    for two such headers: a proxy in front may read the first where we would read the last,
    and each would take the request for another caller's)."""
    values = [v for k, v in scope.get("headers") or () if k == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class Auth:
    """Who a request is (module docstring): the keys of a keys file and the plain keys.

    Args:
        static: the keys of ``--api-keys`` / ``--api-key-file`` / ``--api-key``.
        store: the keys file's keys, or None (no ``--keys-file``).
    """

    def __init__(self, static: ApiKeys, store: KeyStore | None = None) -> None:
        self.static = static
        self.store = store

    @classmethod
    def from_settings(cls, settings: Settings) -> Auth:
        """The keys of ``settings``.

        Raises:
            serve.keys.KeysFileError: the keys file does not load.
        """
        store = KeyStore(settings.keys_file) if settings.keys_file is not None else None
        return cls(ApiKeys.load(settings.api_keys, settings.api_key_file), store)

    @property
    def enabled(self) -> bool:
        """Requests need a key."""
        return self.store is not None or self.static.enabled

    def tenant(self, scope: Scope) -> Tenant | None:
        """The tenant of the request's bearer key; None: refused. Both kinds of key are
        checked every time, so the time taken does not tell which kind matched."""
        if not self.enabled:
            return ANONYMOUS
        token = bearer_token(scope)
        if token is None:
            return None
        found = self.store.lookup(token) if self.store is not None else None
        plain = self.static.enabled and self.static.check(token)
        if found is not None:
            return found
        if plain:
            named = self.store.tenant(DEFAULT_TENANT) if self.store is not None else None
            return named or ANONYMOUS
        return None

    def check(self, scope: Scope) -> Response | None:
        """Authenticate an HTTP request: its tenant goes in ``scope[TENANT_SCOPE_KEY]`` and
        the access record (``tenant``); returns the refusal to send instead (401, or 403 on
        an ``/admin/*`` route for a tenant that is not ``admin``), or None."""
        tenant = self.tenant(scope)
        if tenant is None:
            return unauthorized()
        scope[TENANT_SCOPE_KEY] = tenant
        note(tenant=tenant.name)
        if scope.get("path", "").startswith(ADMIN_PREFIX) and not tenant.admin:
            return admin_only()
        return None

    def on_sighup(self, loop) -> Callable[[], None]:
        """Reload the keys file on SIGHUP (:meth:`KeyStore.on_sighup`); returns what removes
        the handler (nothing to remove without a keys file)."""
        return self.store.on_sighup(loop) if self.store is not None else (lambda: None)


def unauthorized() -> JSONResponse:
    """401 with an OpenAI-style error (as the OpenAI API answers a bad key)."""
    body = error_body(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                      "invalid_request_error")
    body["error"]["code"] = "invalid_api_key"
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def admin_only() -> Response:
    """403 with an OpenAI-style error: an ``/admin/*`` route for a tenant that is not admin."""
    return openai_error(403, "This API key may not call /admin routes: its tenant is not an "
                        "admin tenant of the keys file.", type_="permission_error")
