"""Connection limits (``serve/http_limits.py``) on a real server, over raw sockets: slow and
silent clients are cut at their deadlines (408 where an answer is possible), the connection
cap makes room by closing an idle connection or refuses, slow but honest clients get through,
an idle connection outlives uvicorn's default keep-alive, and ``--image-urls`` under a burst:
one valid URL among 13 that hang or drip, round after round, is answered every time while each
bad one gets its own documented 400 (the fetch deadline, naming the field), never a 5xx.

One server for the module with short limits, set through ``PHI3V_*`` variables (a server
without these settings ignores them, so on such a server these tests fail on the behaviour,
not on an unknown flag).
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import os
import selectors
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from tests.helpers import IMAGES, ImagePeer, data_url, png_bytes, start_server, stop_server

HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
MIN_RATE = 500  # bytes/s
FIRST_REQUEST_TIMEOUT_S = 4.0
KEEP_ALIVE_S = 12.0  # above uvicorn's default (5 s)
MAX_CONNECTIONS = 48
#: Slack on every deadline: the server's timer, the event loop and the test's own reads on a
#: two-core machine that also runs the engine.
SLACK_S = 2.0
IMAGE_DELAY_S = 3.0  # the slow image host: longer than the head and body deadlines
#: --image-url-timeout-s: above the slow image host's delay, which must be served.
URL_DEADLINE_S = 4.0
#: How long the burst rounds run (each takes about the URL deadline; 5 rounds at least).
STRESS_S = 20.0
FIELD = "messages[0].content[0].image_url"


@pytest.fixture(scope="module")
def slow_image_host():
    """An HTTP server on 127.0.0.2 that answers an image after ``IMAGE_DELAY_S``."""
    png = png_bytes(Image.new("RGB", (48, 48), (200, 30, 30)))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(IMAGE_DELAY_S)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.2:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def limited():
    env = {"PHI3V_HTTP_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
           "PHI3V_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
           "PHI3V_HTTP_BODY_MIN_RATE_BYTES_S": str(MIN_RATE),
           "PHI3V_HTTP_FIRST_REQUEST_TIMEOUT_S": str(FIRST_REQUEST_TIMEOUT_S),
           "PHI3V_HTTP_KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_S),
           "PHI3V_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    srv = start_server(["--image-urls", "--image-url-allowlist", json.dumps(["127.0.0.2"]),
                        "--image-url-allowed-networks", json.dumps(["127.0.0.2/32"]),
                        "--image-url-timeout-s", str(URL_DEADLINE_S)],
                       env=env, name="limited-server")
    yield srv
    stop_server(srv)


def connect(srv) -> socket.socket:
    port = int(srv.base_url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes | None:
    """Everything the server sends until it closes the connection, or None when it is still
    open after ``timeout_s``."""
    sock.settimeout(timeout_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return out


def trickle(sock: socket.socket, data: bytes, piece: int, every_s: float, give_up_s: float
            ) -> tuple[bytes | None, float]:
    """Send ``data``, ``piece`` bytes every ``every_s``, until the server answers or closes
    the connection. Returns what it sent back (None: it did neither within ``give_up_s``)
    and the seconds it took."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    t0, sent = time.monotonic(), 0
    while time.monotonic() - t0 < give_up_s:
        if sel.select(timeout=every_s):
            break
        if sent < len(data):
            try:
                sock.sendall(data[sent:sent + piece])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += piece
    else:
        return None, time.monotonic() - t0
    took = time.monotonic() - t0
    return read_until_closed(sock, SLACK_S), took


def responses(srv, route: str, code: str) -> float:
    """``phi3v_http_responses_total{route,code}`` (0 before its first answer)."""
    try:
        return srv.metric("phi3v_http_responses_total", {"route": route, "code": code})
    except KeyError:
        return 0.0


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def chat_json(srv, content, **extra) -> bytes:
    return json.dumps({"model": srv.model, "max_tokens": 3,
                       "messages": [{"role": "user", "content": content}], **extra}).encode()


def wait_closed_by_server(socks: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    """The sockets of ``socks`` the server has closed within ``timeout_s`` (EOF or reset)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    closed: list[socket.socket] = []
    deadline = time.monotonic() + timeout_s
    while len(closed) < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(timeout=left):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed.append(key.fileobj)
    return closed


@pytest.mark.parametrize("prefix", [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
                                    b"\r\n" * 40], ids=["request-line", "blank-lines"])
def test_a_trickled_head_is_408_at_the_head_timeout(limited, prefix):
    before = responses(limited, "other", "408")
    with connect(limited) as sock:
        raw, took = trickle(sock, prefix, piece=1, every_s=0.2,
                            give_up_s=HEAD_TIMEOUT_S + 3 * SLACK_S)
    assert raw is not None, "a head trickled byte by byte kept its connection open"
    assert status_of(raw) == 408 and b'"code": 408' in raw, raw
    assert took < HEAD_TIMEOUT_S + SLACK_S
    assert responses(limited, "other", "408") == before + 1


def test_a_trickled_body_is_408_and_counted_on_its_route(limited):
    before = responses(limited, "/v1/chat/completions", "408")
    body = chat_json(limited, "hello " * 200)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n")
    with connect(limited) as sock:
        sock.sendall(head)
        # 10 bytes per 0.5 s: 20 bytes/s, far below the minimum rate.
        raw, took = trickle(sock, body, piece=10, every_s=0.5,
                            give_up_s=BODY_TIMEOUT_S + 3 * SLACK_S)
    assert raw is not None, "a body trickled at 20 bytes/s kept its connection open"
    assert status_of(raw) == 408 and b"body not received in time" in raw, raw
    # The deadline moved on by 1/500 s per byte received: under 0.2 s here.
    assert took < BODY_TIMEOUT_S + SLACK_S
    assert responses(limited, "/v1/chat/completions", "408") == before + 1


def test_silent_connections_are_closed_at_the_first_request_timeout(limited):
    socks = [connect(limited) for _ in range(MAX_CONNECTIONS - 8)]
    try:
        t0 = time.monotonic()
        closed = wait_closed_by_server(socks, FIRST_REQUEST_TIMEOUT_S + 2 * SLACK_S)
        took = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} silent connections open"
    assert took < FIRST_REQUEST_TIMEOUT_S + SLACK_S


def test_at_the_cap_a_new_connection_closes_the_oldest_idle_one(limited):
    time.sleep(0.5)  # the server has seen earlier tests' connections close
    socks = []
    for _ in range(MAX_CONNECTIONS):
        socks.append(connect(limited))
        time.sleep(0.01)  # in order: the first is the oldest
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.get(f"{limited.base_url}/v1/models", timeout=10)
        assert r.status_code == 200
        # Long before the first-request timeout, the oldest silent connection made room.
        closed = wait_closed_by_server(socks[:1], FIRST_REQUEST_TIMEOUT_S / 4)
        assert closed == socks[:1], "no idle connection was closed at the cap"
        assert time.monotonic() - t0 < FIRST_REQUEST_TIMEOUT_S / 2
    finally:
        for s in socks:
            s.close()


def test_at_the_cap_with_no_idle_connection_a_new_one_is_refused_503(limited):
    time.sleep(0.5)
    before = responses(limited, "other", "503")
    busy = []
    try:
        # Each receiving a body (its deadline 2 s + 2 s for the 1,000 bytes sent): neither
        # idle nor mid-head, so the cap has nothing it may close for room.
        for _ in range(MAX_CONNECTIONS):
            s = connect(limited)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: 100000\r\n\r\n" + b" " * 1000)
            busy.append(s)
        time.sleep(0.2)
        with connect(limited) as extra:
            raw = read_until_closed(extra, HEAD_TIMEOUT_S / 2)
        assert raw is not None, "a connection over the cap was held open"
        assert status_of(raw) == 503 and b"retry-after" in raw.lower(), raw
    finally:
        for s in busy:
            s.close()
    time.sleep(0.5)
    assert responses(limited, "other", "503") == before + 1


def test_a_slow_honest_upload_above_the_minimum_rate_succeeds(limited):
    """An image sent at twice the minimum rate, for longer than the body timeout, is served."""
    noise = Image.frombytes("RGB", (40, 40), os.urandom(40 * 40 * 3))
    body = chat_json(limited, [{"type": "image_url", "image_url": {"url": data_url(
        png_bytes(noise))}}, {"type": "text", "text": "What is this?"}])
    rate = 2 * MIN_RATE
    assert len(body) / rate > BODY_TIMEOUT_S + SLACK_S, "the upload would be over too soon"
    with connect(limited) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n")
        for i in range(0, len(body), rate // 10):
            sock.sendall(body[i:i + rate // 10])
            time.sleep(0.1)
        sock.settimeout(120)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        answer = resp.read()
    assert resp.status == 200, answer
    assert json.loads(answer)["usage"]["prompt_tokens"] > 300  # the image's tokens counted


def test_an_answer_slower_than_the_deadlines_is_not_cut(limited, slow_image_host):
    """The deadlines cover receiving the request only: an image URL fetched for longer than
    the head and body timeouts, then a streamed answer, arrive whole."""
    body = json.loads(chat_json(limited, [
        {"type": "image_url", "image_url": {"url": f"{slow_image_host}/img.png"}},
        {"type": "text", "text": "What is this?"}], stream=True))
    t0 = time.monotonic()
    with httpx.stream("POST", f"{limited.base_url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    assert time.monotonic() - t0 > IMAGE_DELAY_S
    assert text.rstrip().endswith("data: [DONE]"), text[-300:]


def test_an_idle_connection_outlives_uvicorns_default_keep_alive(limited):
    """A connection idle for longer than uvicorn's default keep-alive (5 s), less than
    ``--http-keep-alive-timeout-s``, still carries the next request."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(limited) as sock:
        for pause in (0, 7.0):
            time.sleep(pause)
            try:
                sock.sendall(request)
                resp = http.client.HTTPResponse(sock)
                resp.begin()
            except (http.client.RemoteDisconnected, ConnectionError):
                pytest.fail(f"the server closed a connection idle for {pause} s")
            resp.read()
            assert resp.status == 200


# --- image URLs under a burst -------------------------------------------------------------
@pytest.fixture(scope="module")
def peer():
    server = ImagePeer((IMAGES / "chelsea.png").read_bytes())
    yield server.base
    server.close()


async def ask(client: httpx.AsyncClient, srv, url: str, stream: bool) -> tuple[int, str]:
    body = {"model": srv.model, "max_tokens": 2, "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What is this?"}]}]}
    async with client.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
        return r.status_code, (await r.aread()).decode()


async def test_a_valid_url_among_hanging_and_dripping_ones(limited, peer):
    srv = limited
    errors_before = srv.metric("phi3v_http_responses_total",
                               {"route": "/v1/chat/completions", "code": "500"})
    rounds = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        end = time.monotonic() + STRESS_S
        while time.monotonic() < end or rounds < 5:
            # The valid one (non-streaming) first, the others right behind it; half of those
            # streaming. Query strings keep every URL distinct.
            jobs = [ask(client, srv, f"{peer}/img.png?{rounds}", stream=False)]
            jobs += [ask(client, srv, f"{peer}/{'hang' if i % 2 else 'drip'}/{rounds}-{i}",
                         stream=i % 4 < 2) for i in range(13)]
            (status, text), *bad = await asyncio.gather(*jobs)
            assert status == 200, (rounds, status, text[:300])
            assert json.loads(text)["choices"][0]["finish_reason"], text[:300]
            for code, text in bad:
                assert code == 400, (rounds, code, text[:300])
                error = json.loads(text)["error"]
                assert error["param"] == FIELD, error
                assert error["message"] == f"image URL did not deliver within {URL_DEADLINE_S:g} s"
            rounds += 1
    assert srv.metric("phi3v_http_responses_total",
                      {"route": "/v1/chat/completions", "code": "500"}) == errors_before
