"""Helpers of the UI tests: the Chainlit UI process (from ``ui/.venv``), headless Chromium
(Debian's ``chromium``, driven by Playwright) and the page actions a person performs.

The UI runs in its own virtual environment (Chainlit 2.12 pins ``mcp<2``, vLLM needs
``mcp>=2``). :func:`ensure_ui_venv` creates it exactly as ``make ui-install`` does (same stamp
file), so the tests run after ``make ui-install`` at no cost, or create it on first use
(about 2 minutes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ARTIFACTS, ROOT, ManagedServer, free_port, start_process, stop_group

UI_DIR = ROOT / "ui"
UI_VENV = UI_DIR / ".venv"
UI_PY = UI_VENV / "bin" / "python"
#: Written by `make ui-install` (and by :func:`ensure_ui_venv`) after a successful install.
UI_STAMP = UI_VENV / ".installed"
REQUIREMENTS = UI_DIR / "requirements.txt"
#: Debian's Chromium (`apt-get install -y chromium`); Playwright's own browser download does
#: not work without internet.
CHROMIUM = Path(os.environ.get("PHI3V_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
UI_READY_TIMEOUT_S = 90
#: The statistics line under each answer (ui/stats.py, shown by ui/public/elements/Stats.jsx),
#: e.g. "TTFT 0.42 s · 9.8 tok/s · 24 tokens · prompt 330 tokens".
STATS_RE = re.compile(r"TTFT (?P<ttft>[\d.]+) s · (?P<tps>[\d.]+|–) tok/s · (?P<tokens>\d+) "
                      r"tokens(?: · prompt (?P<prompt>\d+) tokens)?")


def ensure_ui_venv() -> Path:
    """``ui/.venv`` with ``ui/requirements.txt`` installed (what ``make ui-install`` does)."""
    if UI_STAMP.is_file() and UI_STAMP.stat().st_mtime >= REQUIREMENTS.stat().st_mtime:
        return UI_PY
    if not UI_PY.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(UI_VENV)], check=True)
    subprocess.run([str(UI_PY), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)],
                   check=True)
    UI_STAMP.touch()
    return UI_PY


class UIProcess(ManagedServer):
    """A running ``python -m ui`` (``url``: its address)."""


def start_ui(api_base_url: str, data_dir: Path, env: dict[str, str] | None = None,
             log_name: str = "ui") -> UIProcess:
    """Start the UI on a free port against ``api_base_url``, its database, stored images and
    auth secret under ``data_dir``; wait until it answers. Its output goes to
    ``test-artifacts/<log_name>.log``."""
    python = ensure_ui_venv()
    port = free_port()
    ui_env = {
        "PHI3V_UI_DATABASE_URL": f"sqlite+aiosqlite:///{data_dir / 'chat.db'}",
        "PHI3V_UI_STORAGE_DIR": str(data_dir / "files"),
        "PHI3V_UI_AUTH_SECRET_FILE": str(data_dir / "auth_secret"),
        **(env or {}),
    }
    cmd = [str(python), "-m", "ui", "--port", str(port), "--api-base-url", api_base_url]
    return start_process(cmd, port, ARTIFACTS / f"{log_name}.log", "/health", env=ui_env,
                         ready_timeout_s=UI_READY_TIMEOUT_S, server_cls=UIProcess,
                         unset=("CHAINLIT_AUTH_SECRET",))


def stop_ui(ui: UIProcess) -> None:
    """Stop the UI's process group (15 s grace)."""
    stop_group(ui.proc, 15)


async def local_only(route) -> None:
    """Playwright route handler: the page may reach loopback only (Chainlit's page links web
    fonts and a KaTeX stylesheet from CDNs; there is no internet here, and none is wanted)."""
    url = route.request.url
    if url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "http://localhost", "data:",
                       "blob:")):
        await route.continue_()
    else:
        await route.abort()


class ChatPage:
    """What a person does in the Chainlit UI, as Playwright actions (async API)."""

    ASSISTANT = "[data-step-type=assistant_message]"
    USER = "[data-step-type=user_message]"

    def __init__(self, page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        #: Socket.IO events the page received, as (event name, payload dict), in order.
        self.events: list[tuple[str, dict]] = []
        page.on("websocket", lambda ws: ws.on("framereceived", self._on_frame))

    def _on_frame(self, frame) -> None:
        """Record one websocket frame if it is a Socket.IO event (``42["name", {...}]``)."""
        text = frame if isinstance(frame, str) else frame.decode(errors="replace")
        if not text.startswith("42["):
            return
        try:
            name, *args = json.loads(text[2:])
        except ValueError:
            return
        self.events.append((name, args[0] if args and isinstance(args[0], dict) else {}))

    def tokens_since(self, start: int) -> list[str]:
        """The pieces in which an answer reached the browser since event number ``start``:
        the first in Chainlit's ``stream_start`` (the new message, its ``output``), the rest
        one ``stream_token`` event each."""
        return [e.get("output", "") if name == "stream_start" else e.get("token", "")
                for name, e in self.events[start:] if name in ("stream_start", "stream_token")]

    async def login(self, user: str, password: str) -> None:
        await self.page.goto(f"{self.base_url}/login")
        await self.page.fill("#email", user)
        await self.page.fill("#password", password)
        await self.page.click("button[type=submit]")
        await self.wait_session()

    async def wait_session(self) -> None:
        """Until the chat session runs: the settings button appears once on_chat_start sent
        the chat settings (uploading before that fails with 'Session not found')."""
        await self.page.wait_for_selector("#chat-settings-open-modal", timeout=30_000)

    async def new_chat(self) -> None:
        await self.page.goto(self.base_url)
        await self.wait_session()

    async def open_thread(self, tid: str) -> None:
        """Open thread ``tid`` by its address and wait until it resumed: its session runs (the
        composer is there) and its first answer has rendered."""
        await self.page.goto(f"{self.base_url}/thread/{tid}")
        await self.wait_session()
        await self.page.locator(self.ASSISTANT).first.wait_for(timeout=20_000)

    async def attach(self, *files) -> None:
        """Choose files with the upload button (paths, or Playwright file payload dicts)."""
        await self.page.set_input_files("#upload-button-input", list(files))

    async def wait_attached(self, n: int) -> None:
        """Until ``n`` attachments sit in the composer, uploaded (no progress ring left)."""
        await self.page.wait_for_function(
            "n => { const a = document.querySelector('#attachments');"
            " return a && a.children.length >= n && !a.querySelector('svg circle'); }",
            arg=n, timeout=30_000)

    async def press_stop(self, running) -> bool:
        """Press Stop on the answer being generated; False when the answer ended on its own
        first (the tiny model may sample its end-of-text token at any step), which Chainlit
        shows by disabling the button.

        ``running`` is an async callable giving the server's running requests. Raises
        AssertionError when Stop cannot be pressed while the server still generates."""
        from playwright.async_api import TimeoutError as PlaywrightTimeout
        try:
            # 30 s: a page busy rendering a fast stream on a loaded machine can take seconds
            # to scroll the button into view
            await self.page.click("#stop-button", timeout=30_000)
            return True
        except PlaywrightTimeout:
            assert await running() == 0, "Stop could not be pressed while the server generated"
            return False

    async def send(self, text: str) -> None:
        await self.page.fill("#chat-input", text)
        await self.page.click("#chat-submit")

    async def count(self, selector: str) -> int:
        return await self.page.locator(selector).count()

    async def assistant_texts(self) -> list[str]:
        return await self.page.eval_on_selector_all(self.ASSISTANT,
                                                    "els => els.map(e => e.innerText)")

    async def wait_assistant(self, after: int, contains: str, timeout_s: float = 60) -> str:
        """The text of the first assistant message past the first ``after`` that contains
        ``contains``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for text in (await self.assistant_texts())[after:]:
                if contains in text:
                    return text
            await self.page.wait_for_timeout(100)
        raise AssertionError(f"no assistant message with {contains!r}; have "
                             f"{(await self.assistant_texts())[after:]!r}")

    async def sample_answer(self, after: int, timeout_s: float = 60) -> tuple[list[str], str]:
        """Sample the new answer's text every 50 ms until its statistics appear.
        Returns (distinct texts seen while streaming, final text)."""
        samples: list[str] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            texts = (await self.assistant_texts())[after:]
            if texts:
                text = texts[0]
                if STATS_RE.search(text):
                    return samples, text
                if text.strip() and (not samples or samples[-1] != text):
                    samples.append(text)
            await self.page.wait_for_timeout(50)
        raise AssertionError(f"answer did not finish in {timeout_s}s; samples {samples!r}")

    async def toast(self, timeout_ms: int = 10_000) -> str:
        """Text of the newest toast notification (Chainlit shows upload refusals there)."""
        loc = self.page.locator("[data-sonner-toast]").last
        await loc.wait_for(timeout=timeout_ms)
        return await loc.inner_text()
