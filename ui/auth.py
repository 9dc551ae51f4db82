"""Login for the UI: the account sources, the proxy check and Chainlit's JWT secret.

History needs an owner, so the UI requires a login. ``PHI3V_UI_ACCOUNTS`` picks the source
(``ui/app.py`` registers the matching Chainlit callback):

- ``demo``: one user from settings (:func:`check_password`);
- ``users-file``: names and Argon2 hashes (:mod:`ui.users`), failed logins rate-limited;
- ``oauth``: Chainlit's OAuth providers (their ``OAUTH_*`` environment variables);
- ``header``: the user name in ``PHI3V_UI_AUTH_HEADER``, accepted only from an address of
  ``PHI3V_UI_TRUSTED_PROXIES`` (:func:`header_user`).

Chainlit's login callbacks get the name and password, or the headers, but not the client's
address; :class:`ClientAddress` (an ASGI middleware on the login routes) puts it in
:data:`CLIENT_ADDRESS` for them. Chainlit signs its session tokens with
``CHAINLIT_AUTH_SECRET``; when the environment has none (the demo), :func:`ensure_auth_secret`
generates one once and keeps it in ``PHI3V_UI_AUTH_SECRET_FILE`` (mode 0600), so logins survive
restarts. In production set ``CHAINLIT_AUTH_SECRET``.

This module imports neither Chainlit nor the API.
"""

from __future__ import annotations

import contextvars
import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from ui.settings import UISettings


def ensure_auth_secret(secret_file: Path) -> str:
    """Set ``CHAINLIT_AUTH_SECRET`` from the environment, else from ``secret_file`` (created
    with a random secret if missing). Returns the secret."""
    secret = os.environ.get("CHAINLIT_AUTH_SECRET")
    if not secret:
        if secret_file.is_file():
            secret = secret_file.read_text().strip()
        if not secret:
            secret = secrets.token_urlsafe(48)
            secret_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secret + "\n")
        os.environ["CHAINLIT_AUTH_SECRET"] = secret
    return secret


def check_password(settings: UISettings, username: str, password: str) -> bool:
    """True for the configured demo user's name and password (constant-time compare)."""
    user_ok = hmac.compare_digest(username.encode(), settings.demo_user.encode())
    password_ok = hmac.compare_digest(password.encode(), settings.demo_password.encode())
    return user_ok and password_ok


#: The client address of the login request being handled ("" outside one).
CLIENT_ADDRESS: contextvars.ContextVar[str] = contextvars.ContextVar("client_address",
                                                                     default="")
#: Chainlit's login routes (password form, header login).
LOGIN_PATHS = ("/login", "/auth/header")


class ClientAddress:
    """ASGI middleware: set :data:`CLIENT_ADDRESS` from the connection's peer address for
    requests to :data:`LOGIN_PATHS` (the address the TCP connection came from; forwarded-for
    headers are not trusted: they are whatever the client wrote)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") in LOGIN_PATHS:
            client = scope.get("client")
            token = CLIENT_ADDRESS.set(client[0] if client else "")
            try:
                await self.app(scope, receive, send)
            finally:
                CLIENT_ADDRESS.reset(token)
            return
        await self.app(scope, receive, send)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` parsed, an IPv4-mapped IPv6 address as its IPv4 (None if not an IP)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def client_key(address: str) -> str:
    """The login limiter's key for a client address: the address itself for IPv4 (mapped
    IPv6 included), its /64 network for IPv6 (one host owns a whole /64: per-address keys
    would give it unlimited guesses)."""
    ip = _ip(address)
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip) if ip else address


def trusted(address: str, networks: list[str]) -> bool:
    """Whether ``address`` is in one of ``networks`` (addresses or CIDR networks).

    Raises:
        ValueError: an entry of ``networks`` is not an address or network.
    """
    ip = _ip(address)
    if ip is None:
        return False
    return any(ip in ipaddress.ip_network(n, strict=False) for n in networks)


def header_user(headers: Mapping[str, str], address: str, settings: UISettings) -> str | None:
    """The user name an authenticating proxy put in ``settings.auth_header``, or None: when
    the header is missing, empty or given more than once (a proxy that appends its own
    would leave the client's forged one first), or the request did not come from one of
    ``settings.trusted_proxies`` (then the header is anyone's to write)."""
    if not trusted(address, settings.trusted_proxies):
        return None
    values = (headers.getlist(settings.auth_header) if hasattr(headers, "getlist")
              else [v for k, v in headers.items() if k.lower() == settings.auth_header.lower()])
    if len(values) != 1:
        return None
    name = values[0].strip()
    return name if name and len(name) <= 256 and name.isprintable() else None


def login_summary(settings: UISettings) -> str:
    """Where logins come from, in a few words (the start banner of ``python -m ui``)."""
    if settings.accounts == "demo":
        return f"login {settings.demo_user!r}"
    if settings.accounts == "users-file":
        return f"accounts from {settings.users_file}"
    if settings.accounts == "header":
        return (f"user name from the {settings.auth_header} header of "
                f"{', '.join(settings.trusted_proxies)}")
    return f"OAuth login, {len(settings.oauth_allowed)} entries in PHI3V_UI_OAUTH_ALLOWED"


def oauth_allowed(identifier: str, allowed: list[str]) -> bool:
    """Whether the OAuth user ``identifier`` (the provider's e-mail or login) may log in:
    it is in ``allowed``, or ``allowed`` holds its e-mail domain as ``@domain``. An empty
    list lets nobody in: any account of a public provider could log in otherwise."""
    name = identifier.strip().lower()
    domain = "@" + name.rsplit("@", 1)[1] if "@" in name else None
    return any(a.strip().lower() in (name, domain) for a in allowed)
