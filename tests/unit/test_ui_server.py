"""The UI's server as a proxy in front of it and a user starting it see it, through both entry
points: ``python -m ui`` and Chainlit's own ``chainlit run ui/app.py``.

- Keep-alive (``PHI3V_UI_KEEP_ALIVE_S``, ``ui/serving.py``): an idle connection outlives
  uvicorn's default 5 s, so a proxy that keeps it for its own idle timeout (nginx, AWS ALB:
  60 s) never sends a request on a connection the UI has closed; a small setting closes it.
- ``chainlit run`` brings the store's schema to the newest revision, as ``python -m ui`` does.

Each UI runs from ``ui/.venv`` (made like ``make ui-install`` if missing) against an API
address where nothing listens (the UI starts without it), its store in a temporary directory.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.helpers import (
    UI_READY_TIMEOUT_S,
    UI_VENV,
    UIProcess,
    ensure_ui_venv,
    start_ui,
    stop_ui,
)
from tests.helpers import ARTIFACTS, ROOT, free_port, start_process

#: uvicorn's own timeout_keep_alive: what the UI's server kept before the setting.
UVICORN_DEFAULT_KEEP_ALIVE_S = 5
#: The keep-alive of the ``chainlit run`` UI: short, to see it close within the test.
SHORT_KEEP_ALIVE_S = 2


def store_env(data_dir: Path) -> dict[str, str]:
    """The UI's store, stored images and auth secret under ``data_dir``; an API address where
    nothing listens."""
    return {"PHI3V_UI_DATABASE_URL": f"sqlite+aiosqlite:///{data_dir / 'chat.db'}",
            "PHI3V_UI_STORAGE_DIR": str(data_dir / "files"),
            "PHI3V_UI_AUTH_SECRET_FILE": str(data_dir / "auth_secret"),
            "PHI3V_UI_API_BASE_URL": f"http://127.0.0.1:{free_port()}"}


@pytest.fixture(scope="module")
def ui(tmp_path_factory) -> Iterator[UIProcess]:
    """``python -m ui`` with its default keep-alive."""
    env = store_env(tmp_path_factory.mktemp("ui"))
    server = start_ui(env["PHI3V_UI_API_BASE_URL"], tmp_path_factory.mktemp("ui-data"),
                      log_name="ui-server")
    try:
        yield server
    finally:
        stop_ui(server)


@pytest.fixture(scope="module")
def chainlit_run(tmp_path_factory) -> Iterator[tuple[UIProcess, dict[str, str]]]:
    """``chainlit run ui/app.py`` (Chainlit's command, settings from ``PHI3V_UI_*`` only) with
    a short keep-alive, on a new store; and its environment."""
    env = {**store_env(tmp_path_factory.mktemp("chainlit-run")),
           "PHI3V_UI_KEEP_ALIVE_S": str(SHORT_KEEP_ALIVE_S),
           # Chainlit's app root (its config.toml), as python -m ui sets it.
           "CHAINLIT_APP_ROOT": str(ROOT / "ui")}
    ensure_ui_venv()
    port = free_port()
    server = start_process([str(UI_VENV / "bin" / "chainlit"), "run", "ui/app.py", "--headless",
                            "--port", str(port)], port, ARTIFACTS / "ui-chainlit-run.log",
                           "/health", env=env, ready_timeout_s=UI_READY_TIMEOUT_S,
                           server_cls=UIProcess, unset=("CHAINLIT_AUTH_SECRET",))
    try:
        yield server, env
    finally:
        stop_ui(server)


def health_on(conn: http.client.HTTPConnection) -> int | None:
    """``GET /health`` on ``conn``'s open connection, as a proxy reuses one from its pool: the
    status, or None when the UI had closed the connection (no new one is opened)."""
    sock = conn.sock
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        return None
    assert conn.sock is sock, "http.client opened a new connection"
    return response.status


def idle_then_health(base_url: str, idle_s: float) -> int | None:
    """A request, ``idle_s`` seconds of silence, then another on the same connection: the
    second's status, or None when the UI closed the connection while it was idle."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=10)
    conn.connect()
    try:
        assert health_on(conn) == 200
        time.sleep(idle_s)
        return health_on(conn)
    finally:
        conn.close()


def test_idle_connection_outlives_uvicorns_default_keep_alive(ui):
    """``python -m ui``: a connection idle longer than uvicorn's default keep-alive still
    serves the next request (before: the UI had closed it, the proxy's 502)."""
    assert idle_then_health(ui.base_url, UVICORN_DEFAULT_KEEP_ALIVE_S + 2) == 200


def test_chainlit_run_keeps_idle_connections_for_its_setting(chainlit_run):
    """``chainlit run``: PHI3V_UI_KEEP_ALIVE_S applies too; a connection idle within it serves
    the next request, one idle past it has been closed (uvicorn's 5 s would still be open)."""
    server, _ = chainlit_run
    assert idle_then_health(server.base_url, SHORT_KEEP_ALIVE_S / 4) == 200
    assert idle_then_health(server.base_url, SHORT_KEEP_ALIVE_S + 1.5) is None


def test_chainlit_run_upgrades_the_store(chainlit_run):
    """``chainlit run`` brings a new store to the newest revision before it serves, as
    ``python -m ui`` does (before: no tables, every save failed)."""
    _, env = chainlit_run
    current = subprocess.run([UI_VENV / "bin" / "alembic", "-c",
                              ROOT / "ui" / "migrations" / "alembic.ini", "current"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
    assert current.returncode == 0, current.stderr
    assert "(head)" in current.stdout, current.stdout + current.stderr
