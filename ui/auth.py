"""Login for the UI: one demo user (password from settings) and Chainlit's JWT secret.

History needs an owner, so the UI requires a login (``@cl.password_auth_callback`` in
``ui/app.py`` calls :func:`check_password`). Chainlit signs its session tokens with
``CHAINLIT_AUTH_SECRET``; when the environment has none (the demo), :func:`ensure_auth_secret`
generates one once and keeps it in ``PHI3V_UI_AUTH_SECRET_FILE`` (mode 0600), so logins survive
restarts. In production set ``CHAINLIT_AUTH_SECRET`` (and ``PHI3V_UI_DEMO_PASSWORD``, or
replace the callback with OAuth/header auth).
"""

from __future__ import annotations

import hmac
import os
import secrets
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
