"""Run by ``tests/unit/test_ui_stop.py`` with the UI's interpreter (``ui/.venv``): Stop, as the
UI meets it, against a streaming peer.

``python tests/unit/ui_stop_probe.py N``: imports Chainlit's command line first, which applies
``nest_asyncio`` to the event loop as ``chainlit run`` (so ``python -m ui``) does. Then, N
times, a task streams one answer with :class:`ui.api.ApiClient` from a local peer that sends a
token every 10 ms, awaiting a slow page update after each token as ``ui.app.stream_answer``
does, and is cancelled (Stop) while it awaits the page. The peer notes when each connection
is closed. Prints ``{"n": N, "late": [...]}``: the runs whose connection was still open 2 s
after the cancelled task ended (the server would still be generating).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import chainlit.cli  # noqa: E402,F401  (applies nest_asyncio, as `chainlit run` does)

from ui.api import ApiClient, Token  # noqa: E402
from ui.settings import UISettings  # noqa: E402

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        b'data: {"choices":[{"delta":{"content":"Once"}}]}\n\n')
TOKEN = b'data: {"choices":[{"delta":{"content":" upon"}}]}\n\n'


async def main(n: int) -> dict:
    closed: list[asyncio.Event] = []

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gone = asyncio.Event()
        closed.append(gone)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)

        async def tokens() -> None:
            with contextlib.suppress(OSError):
                while True:
                    await asyncio.sleep(0.01)
                    writer.write(TOKEN)
                    await writer.drain()

        sender = asyncio.create_task(tokens())
        with contextlib.suppress(OSError):
            while await reader.read(65536):  # b"": the client closed its connection
                pass
        gone.set()
        sender.cancel()
        writer.close()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = ApiClient(UISettings(api_base_url=f"http://127.0.0.1:{port}"))
    late = []

    async def answer(in_page: asyncio.Event) -> None:
        events = api.stream_chat({"model": "m", "messages": []})
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Token):
                    in_page.set()
                    await asyncio.sleep(0.05)  # the page update (stream_token)

    for run in range(n):
        in_page = asyncio.Event()
        task = asyncio.create_task(answer(in_page))
        await in_page.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:
            await asyncio.wait_for(closed[run].wait(), 2)
        except asyncio.TimeoutError:
            late.append(run)
    await api.aclose()
    server.close()
    return {"n": n, "late": late}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1])))))
