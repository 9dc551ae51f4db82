"""Pages of other origins against a logged-in user's UI, in real Chromium.

A page served from another port of the same host (same site: the login cookie goes along
with its requests) reads nothing of the user's and cannot open the chat websocket; a page of
an origin listed in ``PHI3V_UI_ALLOWED_ORIGINS`` (a proxy's public origin) can; the UI's own
page logs in and chats. ui/README.md: "Origins and the login cookie".
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from pydantic import ValidationError

from tests.browser.helpers import STATS_RE, local_only, start_ui, stop_ui
from tests.browser.test_ui import ANSWER_TOKENS, browser, new_page  # noqa: F401 - fixture
from ui.settings import UISettings

#: What a page of another origin tries with the user's cookie: read ``/user``, read the
#: thread list, delete a thread (a preflighted request), open the chat socket (Socket.IO
#: over a websocket: the server's open packet ``0{...}``, then ``40{...}`` once Chainlit's
#: connect handler accepted the session). Each result: what the page could read, or the
#: error the browser gave it.
PROBE = """
async ([ui, deleteId]) => {
  const read = async (path, init) => {
    try {
      const r = await fetch(ui + path, {credentials: "include", ...init});
      return {status: r.status, body: await r.text()};
    } catch (e) { return {error: String(e)}; }
  };
  const json = (method, body) => ({method, headers: {"Content-Type": "application/json"},
                                    body: JSON.stringify(body)});
  const out = {};
  out.user = await read("/user");
  out.threads = await read("/project/threads",
                           json("POST", {pagination: {first: 20, cursor: null}, filter: {}}));
  if (deleteId) out.delete = await read("/project/thread", json("DELETE", {threadId: deleteId}));
  out.socket = await new Promise(resolve => {
    const frames = [];
    let opened = false;
    const done = () => resolve({opened, frames});
    const ws = new WebSocket(ui.replace(/^http/, "ws") +
                             "/ws/socket.io/?EIO=4&transport=websocket");
    ws.onopen = () => { opened = true; };
    ws.onmessage = (e) => {
      frames.push(String(e.data));
      if (frames.length === 1) {
        ws.send("40" + JSON.stringify({sessionId: "probe-" + Math.random(),
                                       clientType: "webapp", threadId: null,
                                       userEnv: "{}", chatProfile: null}));
      } else { ws.close(); done(); }
    };
    ws.onclose = done;
    setTimeout(done, 10000);
  });
  return out;
}
"""


class _PageHandler(BaseHTTPRequestHandler):
    """Serves one empty HTML page (the probe runs in it)."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>another origin</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def page_server() -> Iterator[str]:
    """A web server of another origin on a free loopback port; yields its origin."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def origins():
    """Two other origins: ``attacker`` (not listed) and ``listed`` (a proxy's origin)."""
    with page_server() as attacker, page_server() as listed:
        yield {"attacker": attacker, "listed": listed}


@pytest.fixture(scope="module")
def origins_ui(server, origins, tmp_path_factory):
    proc = start_ui(server.base_url, tmp_path_factory.mktemp("ui-origins"),
                    env={"PHI3V_UI_DEFAULT_MAX_TOKENS": str(ANSWER_TOKENS),
                         "PHI3V_UI_ALLOWED_ORIGINS": json.dumps([origins["listed"]])},
                    log_name="ui-origins")
    yield proc
    stop_ui(proc)


async def probe(page, origin: str, ui_url: str, delete_id: str | None = None) -> dict:
    """Open ``origin``'s page in ``page`` and run :data:`PROBE` there against the UI."""
    await page.goto(origin)
    return await page.evaluate(PROBE, [ui_url, delete_id])


async def test_other_origins_read_nothing_and_open_no_socket(browser, origins_ui,  # noqa: F811
                                                             origins):
    chat = await new_page(browser, origins_ui)
    context = chat.page.context
    await chat.login("demo", "demo")
    title = f"a private question {uuid.uuid4().hex[:6]}"
    await chat.send(title)
    await chat.sample_answer(after=0)
    (thread_id,) = [t["id"] for t in await threads(context, origins_ui.url)
                    if t["name"] == title]
    # The login cookie: HttpOnly, SameSite=Lax, not Secure on plain http (the default).
    (cookie,) = [c for c in await context.cookies() if c["name"] == "access_token"]
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["secure"]) == (True, "Lax", False)
    # The probes run in the same browser (same cookie jar), without the test's request routing.
    await context.unroute("**/*")

    attacked = await probe(chat.page, origins["attacker"], origins_ui.url, thread_id)
    for what in ("user", "threads", "delete"):
        assert "error" in attacked[what], (what, attacked[what])  # nothing readable
    assert attacked["socket"] == {"opened": False, "frames": []}
    assert thread_id in [t["id"] for t in await threads(context, origins_ui.url)]

    listed = await probe(chat.page, origins["listed"], origins_ui.url)
    assert listed["user"]["status"] == 200
    assert json.loads(listed["user"]["body"])["identifier"] == "demo"
    assert title in listed["threads"]["body"]
    assert listed["socket"]["opened"] and listed["socket"]["frames"][1].startswith("40{")

    # The UI's own page still logs in and chats.
    await context.route("**/*", local_only)
    await context.clear_cookies()
    await chat.login("demo", "demo")
    await chat.send("And again?")
    _, final = await chat.sample_answer(after=0)
    assert STATS_RE.search(final)
    await context.close()


def test_preflights_of_other_origins_are_refused(origins_ui, origins):
    """Starlette's CORS answer to a preflight: 400 without Access-Control-Allow-Origin for
    an origin not listed; the listed origin is allowed, by name (never ``*``)."""
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{origins_ui.url}/project/threads", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})

    refused = preflight(origins["attacker"])
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    allowed = preflight(origins["listed"])
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == origins["listed"]


def test_socket_handshake_origin_rule(origins_ui, origins):
    """engineio's Origin check, on: a browser's handshake (it always sends Origin) is taken
    from the request's own origin, also as a TLS-terminating proxy forwards it
    (X-Forwarded-Proto), and from a listed one; from any other origin it is a 400. A client
    that is no browser page sends no Origin (and carries no user's cookie): Chainlit's login
    check decides."""
    url = f"{origins_ui.url}/ws/socket.io/?EIO=4&transport=polling"

    def handshake(**headers: str) -> int:
        return httpx.get(url, headers=headers, timeout=30).status_code

    own = origins_ui.url.removeprefix("http://")
    assert handshake(Origin=origins_ui.url) == 200
    assert handshake(Origin=origins["listed"]) == 200
    assert handshake() == 200
    assert handshake(Origin=origins["attacker"]) == 400
    public = {"Host": "chat.example.com", "Origin": "https://chat.example.com"}
    assert handshake(**public, **{"X-Forwarded-Proto": "https"}) == 200
    assert handshake(**public) == 400  # http://chat.example.com is its own origin then
    assert handshake(Origin=f"https://{own}") == 400


def test_secure_cookie_setting(server, tmp_path):
    """PHI3V_UI_COOKIE_SECURE=true (users on HTTPS): the login cookie is Secure, still
    SameSite=Lax and HttpOnly."""
    ui = start_ui(server.base_url, tmp_path, env={"PHI3V_UI_COOKIE_SECURE": "true"},
                  log_name="ui-secure-cookie")
    try:
        done = httpx.post(f"{ui.url}/login", data={"username": "demo", "password": "demo"},
                          timeout=30)
        assert done.status_code == 200
        (set_cookie,) = [v for v in done.headers.get_list("set-cookie")
                         if v.startswith("access_token=")]
        attributes = {a.strip().lower() for a in set_cookie.split(";")[1:]}
        assert {"httponly", "secure", "samesite=lax"} <= attributes, set_cookie
    finally:
        stop_ui(ui)


@pytest.mark.parametrize("value", ["*", "null", "https://chat.example.com/",
                                   "https://chat.example.com/ui", "chat.example.com",
                                   "HTTPS://Chat.example.com", "ftp://chat.example.com"])
def test_allowed_origins_setting_takes_only_origins(value):
    with pytest.raises(ValidationError, match="allowed_origins"):
        UISettings(allowed_origins=[value])
    assert UISettings(allowed_origins=["https://chat.example.com:8443"]).allowed_origins == [
        "https://chat.example.com:8443"]


async def threads(context, ui_url: str) -> list[dict]:
    answer = await context.request.post(
        f"{ui_url}/project/threads",
        data={"pagination": {"first": 20, "cursor": None}, "filter": {}})
    assert answer.status == 200
    return (await answer.json())["data"]

