"""The pure parts of the connection limits (``serve/http_limits.py``), the open-file limit
the connection cap needs (``serve.__main__``), and the protocol on a uvicorn server in this
process with a plain app (the cap's choice of the connection to close among them); on the
gateway it is tested in ``tests/engine/test_connection_limits.py``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import struct
import subprocess
import sys
from types import SimpleNamespace

import h11
import pytest
import uvicorn

from serve.http_limits import (
    ConnectionLimits,
    ReceiveDeadline,
    bounded_http_protocol,
    raw_response,
)
from serve.settings import Settings
from tests.helpers import ROOT, free_port


def arrivals(deadline: ReceiveDeadline, start: float, rate: float, chunk: int, n: int):
    """Feed ``n`` chunks arriving at ``rate`` bytes/s; yield (arrival time, deadline)."""
    for k in range(1, n + 1):
        now = start + k * chunk / rate
        deadline.received(chunk)
        yield now, deadline.at


@pytest.mark.parametrize("rate", [500, 501, 5000])
def test_a_body_at_or_above_the_minimum_rate_never_reaches_its_deadline(rate):
    deadline = ReceiveDeadline(100.0, timeout_s=20, min_rate_bytes_s=500)
    for now, at in arrivals(deadline, 100.0, rate, chunk=1000, n=10_000):
        assert now < at


def test_a_trickled_body_reaches_its_deadline_about_the_timeout_after_it_starts():
    deadline = ReceiveDeadline(100.0, timeout_s=20, min_rate_bytes_s=500)
    late = [(now, at) for now, at in arrivals(deadline, 100.0, 5, chunk=10, n=100) if now >= at]
    assert late, "a 5 bytes/s body never reached its deadline"
    first_late = late[0][0]
    # 20 s, plus 1/500 s for each of the ~100 bytes received by then.
    assert 120 <= first_late <= 120 + 110 / 500 + 2


def test_a_flat_deadline_does_not_move_and_a_restart_gives_the_whole_timeout_again():
    deadline = ReceiveDeadline(0.0, timeout_s=20)
    deadline.received(10**6)
    assert deadline.at == 20
    deadline.restart(15.0)
    assert deadline.at == 35
    deadline.restart(1.0)  # never earlier than it was
    assert deadline.at == 35


@pytest.mark.parametrize("status", [408, 431, 503])
def test_answers_below_the_app_are_valid_http_with_an_openai_error(status):
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.receive_data(raw_response(status, "some reason"))
    response = client.next_event()
    body = b""
    while isinstance(event := client.next_event(), h11.Data):
        body += event.data
    assert isinstance(event, h11.EndOfMessage)
    headers = dict(response.headers)
    assert response.status_code == status and headers[b"connection"] == b"close"
    assert (b"retry-after" in headers) == (status == 503)
    error = json.loads(body)["error"]
    assert error["code"] == status and error["message"] == "some reason"


def test_connection_limits_come_from_the_settings():
    settings = Settings(max_connections=7, http_head_timeout_s=3)
    limits = ConnectionLimits.from_settings(settings)
    assert (limits.max_connections, limits.http_head_timeout_s) == (7, 3)
    assert limits.max_header_bytes == settings.max_header_bytes


def open_file_limit_after(max_connections: int, soft: int, hard: int) -> tuple[str, int]:
    """Run ``raise_open_file_limit`` in a child whose limit is ``soft``/``hard``: its message
    (empty when none) and the soft limit it left."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from serve.__main__ import raise_open_file_limit\n"
        "from serve.settings import Settings\n"
        f"msg = raise_open_file_limit(Settings(max_connections={max_connections}))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]); print(msg or '')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout.splitlines()
    return out[1] if len(out) > 1 else "", int(out[0])


def test_the_open_file_limit_is_raised_to_hold_the_connection_cap():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard open-file limit is {hard}")
    from serve.__main__ import RESERVED_FILES

    message, soft = open_file_limit_after(1000, soft=256, hard=2048)
    assert message == "" and soft == 1000 + RESERVED_FILES


def test_a_connection_cap_above_the_hard_open_file_limit_is_refused_with_a_message():
    message, soft = open_file_limit_after(4000, soft=256, hard=1024)
    assert "--max-connections 4000" in message and "ulimit" in message
    assert soft == 256


# --- the protocol on a real uvicorn server in this process ------------------------------------
async def _ok(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def bounded_server(app=_ok, **overrides):
    """A uvicorn server running ``app`` with the bounded protocol on a free port; limits: head
    timeout 1 s, 8 connections, unless ``overrides`` (``ConnectionLimits`` fields) say."""
    limits = ConnectionLimits(**{
        "max_header_bytes": 65536, "http_head_timeout_s": 1.0, "http_body_timeout_s": 5.0,
        "http_body_min_rate_bytes_s": 500, "http_first_request_timeout_s": 5.0,
        "max_connections": 8, **overrides})
    refused: list[int] = []  # statuses written below the app
    protocol = bounded_http_protocol(limits, lambda status, path: refused.append(status))
    protocol.refused = refused
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol,
                                           lifespan="off", log_level="error",
                                           timeout_keep_alive=3600))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield port, protocol
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def small_server():
    """:func:`bounded_server` with its default limits."""
    async with bounded_server() as served:
        yield served


async def test_a_reset_connection_is_freed_at_once(small_server):
    """uvicorn cancels the keep-alive timer only on a clean close; after a reset the timer
    held the connection (headers and all) for the whole keep-alive."""

    port, protocol = small_server
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000 + b"\r\n\r\n")
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        assert (await loop.sock_recv(sock, 4096)).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
    await asyncio.sleep(0.3)
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, protocol)]
    assert alive == [], f"{len(alive)} reset connections still held"


async def test_a_head_that_begins_in_the_read_ending_the_last_request_has_its_deadline(
        small_server):
    """A complete request and the start of the next in one read: the second head is 408 at
    the head timeout (1 s), not left to the keep-alive."""
    port, _ = small_server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(-1), timeout=5)  # until the server closes
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in data, data


async def test_more_header_fields_than_the_count_limit_are_431():
    """``--max-header-count`` (vLLM's ``--h11-max-header-count``): a head with more fields
    is 431, one at the limit is served."""
    async with bounded_server(max_header_count=3) as (port, protocol):
        for fields, status in ((3, b"200"), (4, b"431")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(
                b"X-%d: v\r\n" % i for i in range(fields - 1))
            writer.write(head + b"\r\n")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(4096), timeout=5)
            writer.close()
            assert data.startswith(b"HTTP/1.1 " + status), (fields, data[:80])
        assert protocol.refused == [431]


def test_the_cap_skips_connections_without_a_keep_alive_timer():
    """uvicorn's connection set also holds websocket connections (no keep-alive timer):
    choosing an idle connection to close must pass over them, not raise."""

    protocol = bounded_http_protocol(ConnectionLimits(65536, 1, 1, 500, 1, 1))
    websocket = SimpleNamespace(transport=SimpleNamespace(is_closing=lambda: False))
    holder = SimpleNamespace(connections=[websocket])
    assert protocol.close_an_idle(holder) is False


async def test_chunked_trailers_count_against_the_head_limit(small_server):
    """Trailer fields of a chunked body join the request's headers: over the head limit
    (64 KiB here) they are 431, not held in memory until the body deadline."""
    port, protocol = small_server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\nab\r\n0\r\n")
    for _ in range(200):  # 200 x 1 KiB of trailer fields
        if writer.is_closing():
            break
        writer.write(b"X-T: " + b"a" * 1019 + b"\r\n")
        try:
            await writer.drain()
        except ConnectionError:
            break
    try:  # the server closes with unread trailers in its buffer: the 431 may be lost to a reset
        await asyncio.wait_for(reader.read(-1), timeout=10)
    except ConnectionResetError:
        pass
    writer.close()
    assert protocol.refused == [431]


# --- the connection cap (rule 5) on a real server ---------------------------------------------
CAP = 8
#: Head and body timeouts of the cap tests: far longer than they run, so any close they see is
#: the cap's.
LONG_TIMEOUT_S = 60.0


def body_reading_app(release: asyncio.Event):
    """An app that answers 200 once the whole body is read, ``/wait`` only once ``release``
    is set (a request being served)."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (message := await receive()).get("more_body"):
            pass
        if message["type"] == "http.disconnect":
            return
        if scope["path"] == "/wait":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


@pytest.fixture
async def cap_server():
    """:func:`bounded_server` with ``CAP`` connections, long head and body timeouts and
    :func:`body_reading_app`, which holds ``/wait`` until the test ends."""
    release = asyncio.Event()
    async with bounded_server(body_reading_app(release), max_connections=CAP,
                              http_head_timeout_s=LONG_TIMEOUT_S,
                              http_body_timeout_s=LONG_TIMEOUT_S) as served:
        try:
            yield served
        finally:
            release.set()


async def open_sending(port: int, data: bytes
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent ``data``, once the server has read it (so the order in which
    they are opened is the order their heads began)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(0.05)
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes | None:
    """What the server sent before closing the connection, or None while it is still open
    after ``timeout_s``."""
    try:
        return await asyncio.wait_for(reader.read(-1), timeout=timeout_s)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


async def get_health(port: int) -> bytes:
    """A full ``GET /health`` on a new connection: the answer, until the server closes or 5 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    try:
        return await closed_within(reader, 5.0) or b""
    finally:
        writer.close()


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHo"  # the first bytes of a head, no blank line
BODY_BEGUN = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10
BEING_SERVED = b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_at_the_cap_a_new_connection_closes_the_oldest_slow_head(cap_server):
    """``CAP`` connections each holding the first bytes of a head lock nobody out: a new
    ``GET /health`` gets its 200 and the connection trickling its head longest is closed
    (408), long before its head timeout; the others stay open."""
    port, protocol = cap_server
    slow = [await open_sending(port, SLOW_HEAD) for _ in range(CAP)]
    try:
        answer = await get_health(port)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        first = await closed_within(slow[0][0], 2.0)
        assert first is not None and first.startswith(b"HTTP/1.1 408"), first
        for reader, _ in slow[1:]:
            assert await closed_within(reader, 0.05) is None, "a younger slow head was closed"
        assert protocol.refused == [408]
    finally:
        for _, writer in slow:
            writer.close()


async def test_the_cap_never_closes_a_request_being_served_or_a_body_being_received(
        cap_server):
    """Older connections receiving a body or being served are passed over for the one slow
    head; once only they hold the cap, a new connection is refused 503 and they all stay
    open."""
    port, protocol = cap_server
    busy = [await open_sending(port, BODY_BEGUN) for _ in range(CAP // 2)]
    busy += [await open_sending(port, BEING_SERVED) for _ in range(CAP // 2 - 1)]
    slow_reader, slow_writer = await open_sending(port, SLOW_HEAD)
    try:
        answer = await get_health(port)  # closes the slow head, then its own connection
        assert answer.startswith(b"HTTP/1.1 200"), answer
        closed = await closed_within(slow_reader, 2.0)
        assert closed is not None and closed.startswith(b"HTTP/1.1 408"), closed
        busy.append(await open_sending(port, BODY_BEGUN))  # the cap again, none closable
        await asyncio.sleep(0.2)  # the server has seen the two closed connections go
        answer = await get_health(port)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        for reader, _ in busy:
            assert await closed_within(reader, 0.05) is None, "a busy connection was closed"
        assert protocol.refused == [408, 503]
    finally:
        slow_writer.close()
        for _, writer in busy:
            writer.close()
