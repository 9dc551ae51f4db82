"""``python -m ui`` (``make ui``): run the Chainlit UI against a running API.

Every flag is a field of :class:`ui.settings.UISettings` (``--help`` lists them; each is also a
``PHI3V_UI_*`` environment variable), e.g.
``ui/.venv/bin/python -m ui --port 8080 --api-base-url http://127.0.0.1:8000``.
Run it with the UI's own interpreter (``ui/.venv``), from the project root.
"""

from __future__ import annotations

import os
import sys

from pydantic_settings import CliApp

from ui.settings import UI_DIR, UISettings


def main(argv: list[str] | None = None) -> None:
    settings = CliApp.run(UISettings, cli_args=argv if argv is not None else sys.argv[1:])
    # The Chainlit app (ui/app.py) reads its settings from the environment: hand the flags on.
    os.environ.update(settings.env())
    # Chainlit reads these when imported: its app root (.chainlit/config.toml) and address.
    os.environ["CHAINLIT_APP_ROOT"] = str(UI_DIR)
    os.environ["CHAINLIT_HOST"] = settings.host
    os.environ["CHAINLIT_PORT"] = str(settings.port)
    if settings.accounts == "header":
        # uvicorn replaces the client address with X-Forwarded-For's from loopback peers;
        # header logins must be judged on the TCP peer (the proxy) itself.
        os.environ["FORWARDED_ALLOW_IPS"] = ""

    # The login cookie's SameSite, read by Chainlit when imported (ui/README.md: why Lax).
    os.environ["CHAINLIT_COOKIE_SAMESITE"] = "lax"

    from ui.auth import ensure_auth_secret, login_summary

    ensure_auth_secret(settings.auth_secret_file)

    from chainlit.cli import run_chainlit
    from chainlit.config import config

    config.run.headless = True  # never try to open a browser
    print(f"UI: http://{settings.host}:{settings.port}  (API {settings.api_base_url}; "
          f"{login_summary(settings)})", flush=True)
    # Loads ui/app.py, which upgrades the store's schema and sets the server's keep-alive (the
    # same for `chainlit run ui/app.py`), then serves.
    run_chainlit(str(UI_DIR / "app.py"))


if __name__ == "__main__":
    main()
