"""The Chainlit UI (``ui/``): its helpers in-process, then the whole stack in a real browser.

Part 1 (no browser): image intake against the server's limits, the upload gate, the
old-image history policy, error messages, statistics. ``ui``'s helper modules import neither
Chainlit nor vLLM, so they load in this environment.

Part 2 (browser): headless Chromium (Debian's ``chromium``) driven by Playwright against the
session's API server (tiny random-weight model: answers are gibberish, so the assertions are
about streaming, limits, stopping and persistence, never content) and a UI started from
``ui/.venv`` (created like ``make ui-install`` if missing). Leaves ``test-artifacts/ui-chat.png``
(a finished image chat) and ``test-artifacts/ui.log``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import socket
import tomllib

import httpx
import pytest
from PIL import Image

from serve.settings import Settings
from tests.browser.helpers import (
    STATS_RE,
    UI_DIR,
)
from tests.helpers import IMAGES, png_bytes
from ui import errors, history, images
from ui.api import MAX_USER_CHARS, ApiClient, ServerLimits, Token, Usage, api_user
from ui.history import Conversation, HistoryImage, Turn
from ui.settings import UISettings
from ui.stats import AnswerStats

MAX_SIDE = UISettings().max_image_side_px
#: max_tokens of normal answers in the browser tests (~0.1 s per token on this CPU).
ANSWER_TOKENS = 24
RUNNING = "vllm:num_requests_running"


def server_default_limits() -> ServerLimits:
    """What ``GET /limits`` answers for the server's default settings, read as the UI does."""
    return ServerLimits.from_json(Settings().client_limits())


LIMITS = server_default_limits()


def prepare(name: str, raw: bytes | None = None, limits: ServerLimits = LIMITS):
    raw = (IMAGES / name).read_bytes() if raw is None else raw
    return images.prepare_image(name, raw, limits, MAX_SIDE)


# === Part 1: helpers ==========================================================================
# --- upload gate: one source of truth -----------------------------------------------------------
def test_config_toml_upload_gate_matches_server_defaults():
    """The fallback in .chainlit/config.toml (used until GET /limits answers) is what the
    server's defaults produce, so the two cannot silently drift."""
    config = tomllib.loads((UI_DIR / ".chainlit" / "config.toml").read_text())
    gate = config["features"]["spontaneous_file_upload"]
    spec = images.upload_spec(LIMITS)
    assert gate["enabled"] is True
    assert gate["accept"] == spec["accept"]
    assert "max_files" not in gate and spec["max_files"] is None  # counted by the handler
    assert gate["max_size_mb"] == spec["max_size_mb"]


def test_browser_gate_is_never_looser_than_the_server():
    for max_bytes in (1024, 999_999, 1_000_000, 20 * 2**20, 10**9 + 1):
        limits = dataclasses.replace(LIMITS, max_image_bytes=max_bytes)
        mb = images.upload_spec(limits)["max_size_mb"]
        assert mb >= 1
        assert mb * 1_000_000 <= max(max_bytes, 1_000_000)  # Chainlit's browser MB is 10^6 B
    assert images.accepted_mimes(LIMITS) == [
        "image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp", "image/tiff"]


# --- image intake -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["chelsea.png", "astronaut.png", "coffee.png", "rocket.jpg",
                                  "page.png", "coffee_cmyk.jpg", "coffee_rgba.png",
                                  "coffee_palette_transparent.png", "gray_16bit.png",
                                  "animated_30f.gif", "one_pixel.png", "strip_2000x8.png"])
def test_accepted_images_are_reencoded_rgb(name):
    out = prepare(name)
    img = Image.open(io.BytesIO(out.data))
    assert img.mode == "RGB"
    assert max(img.size) <= MAX_SIDE and img.size == out.size
    assert (img.format, out.mime) == (("JPEG", "image/jpeg") if name.endswith(".jpg")
                                      else ("PNG", "image/png"))
    assert out.data_url.startswith(f"data:{out.mime};base64,")


def test_small_images_keep_their_size_large_ones_are_downscaled():
    assert prepare("chelsea.png").size == (451, 300)
    big = png_bytes(Image.new("RGB", (3000, 1500), (10, 200, 30)))
    out = prepare("big.png", big)
    assert out.size == (MAX_SIDE, MAX_SIDE // 2) and out.original_size == (3000, 1500)
    assert prepare("strip_2000x8.png").size[0] == MAX_SIDE


def test_exif_orientation_is_applied():
    # stored sideways with EXIF orientation 8; displays as an upward arrow 200x400
    assert prepare("arrow_exif_rotated.jpg").size == (200, 400)


def test_gray_16bit_keeps_its_contrast():
    img = Image.open(io.BytesIO(prepare("gray_16bit.png").data)).convert("L")
    lo, hi = img.getextrema()
    assert hi - lo > 100, "16-bit levels collapsed when scaled to 8 bits"


def test_transparency_is_composited_on_white():
    src = Image.open(IMAGES / "coffee_rgba.png")
    alpha = src.getchannel("A")
    clear = next((x, y) for y in range(0, src.height, 7) for x in range(0, src.width, 7)
                 if alpha.getpixel((x, y)) == 0)
    img = Image.open(io.BytesIO(prepare("coffee_rgba.png").data))
    assert img.getpixel(clear) == (255, 255, 255)


@pytest.mark.parametrize("name, limits, expected", [
    ("empty.png", LIMITS, ["empty.png is empty"]),
    ("random_bytes.png", LIMITS, ["random_bytes.png is not a readable image",
                                  "accepted formats: PNG, JPEG, GIF, WEBP, BMP, TIFF"]),
    ("truncated.jpg", LIMITS, ["truncated.jpg"]),
    ("bomb_14000.png", LIMITS, ["bomb_14000.png", "at most 40 MP", "max_image_pixels"]),
    ("chelsea.png", dataclasses.replace(LIMITS, max_image_pixels=100_000),
     ["chelsea.png is 451×300 = 0.1 MP", "at most 0.1 MP", "max_image_pixels"]),
    ("chelsea.png", dataclasses.replace(LIMITS, max_image_bytes=100 * 1024),
     ["chelsea.png is 2", "up to 100 KiB", "max_image_bytes"]),
    ("rocket.jpg", dataclasses.replace(LIMITS, image_formats=("PNG", "GIF")),
     ["rocket.jpg is JPEG; accepted formats: PNG, GIF"]),
])
def test_refused_images_name_the_file_and_the_limit(name, limits, expected):
    with pytest.raises(images.ImageRefused) as info:
        prepare(name, limits=limits)
    for part in expected:
        assert part in info.value.message


def test_too_many_images_per_message_is_refused():
    images.check_count(LIMITS.max_images_per_request, LIMITS)
    with pytest.raises(images.ImageRefused, match=r"at most 4 images per message"):
        images.check_count(LIMITS.max_images_per_request + 1, LIMITS)


# --- history and the old-image policy ----------------------------------------------------------
def image_turn(text: str, *names: str) -> Turn:
    return Turn("user", text, [HistoryImage(n, f"data:image/png;base64,{n}") for n in names])


def test_history_sends_newest_images_and_notes_older_ones():
    conv = Conversation()
    conv.add(image_turn("first", "a.png", "b.png"))
    conv.add(Turn("assistant", "answer 1"))
    conv.add(image_turn("second", "c.png"))
    messages = conv.messages(keep=2)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    first = messages[0]["content"]
    assert first[0] == {"type": "text", "text": history.OMITTED_NOTE.format(name="a.png", keep=2)}
    assert first[1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,b.png"}}
    assert first[2] == {"type": "text", "text": "first"}
    assert messages[1] == {"role": "assistant", "content": "answer 1"}
    assert messages[2]["content"][0]["image_url"]["url"].endswith("c.png")
    conv.trim(keep=2)
    assert [img.data_url is None for t in conv.turns for img in t.images] == [True, False, False]


def test_window_counts_current_images_and_respects_the_server_cap():
    assert history.window_size(2, 0, 4) == 2
    assert history.window_size(2, 3, 4) == 3
    assert history.window_size(8, 1, 4) == 4
    assert history.window_size(0, 0, 4) == 0


def test_failed_turn_leaves_no_trace():
    conv = Conversation([Turn("user", "q"), Turn("assistant", "a")])
    conv.add(Turn("user", "refused"))
    conv.pop_unanswered()
    assert [t.text for t in conv.turns] == ["q", "a"]


async def test_conversation_from_persisted_thread():
    """Rebuilt from the data layer's steps: only answered user turns (our answers carry
    ANSWER_KEY metadata; SQLite returns it as text); images come back as storage keys."""
    meta = '{"phi3v": {"answer": "A1", "stats": {}}}'
    thread = {
        "steps": [
            {"id": "u1", "type": "user_message", "output": "Q1", "createdAt": "1"},
            {"id": "a1", "type": "assistant_message", "output": "A1\n\n*TTFT*",
             "metadata": meta, "createdAt": "2"},
            {"id": "u2", "type": "user_message", "output": "refused", "createdAt": "3"},
            {"id": "e2", "type": "assistant_message", "output": "Not sent.", "metadata": "{}",
             "createdAt": "4"},
            {"id": "u3", "type": "user_message", "output": "Q3", "createdAt": "5"},
            {"id": "a3", "type": "assistant_message", "output": "A3 partial",
             "metadata": {"phi3v": {"answer": "A3 partial"}}, "createdAt": "6"},
            {"id": "s3", "type": "assistant_message", "output": "Task manually stopped.",
             "metadata": {}, "createdAt": "7"},
        ],
        "elements": [
            {"id": "x", "type": "image", "forId": "u1", "name": "cat.png", "objectKey": "k/cat"},
            {"id": "y", "type": "image", "forId": "u2", "name": "bad.png", "objectKey": "k/bad"},
        ],
    }
    conv = history.conversation_from_thread(thread)
    assert [(t.role, t.text) for t in conv.turns] == [
        ("user", "Q1"), ("assistant", "A1"), ("user", "Q3"), ("assistant", "A3 partial")]
    assert [(i.name, i.object_key, i.data_url) for i in conv.turns[0].images] == [
        ("cat.png", "k/cat", None)]

    async def load(img):
        return f"data:image/png;base64,{img.object_key}"

    await conv.fill(keep=1, load=load)
    assert conv.turns[0].images[0].data_url == "data:image/png;base64,k/cat"


# --- errors: every failure becomes a readable sentence -----------------------------------------
def openai_error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": None,
                      "code": status}}


@pytest.mark.parametrize("status, body, headers, expected", [
    (400, openai_error(400, "max_tokens=99999 cannot be greater than max_model_len=8192."),
     {}, ["refused the request (400)", "max_tokens=99999 cannot be greater"]),
    (413, openai_error(413, "Image is 30 MiB; the limit is 20 MiB."), {},
     ["too large for the server (413)", "the limit is 20 MiB"]),
    (429, openai_error(429, "Queue full."), {"Retry-After": "7"},
     ["busy (429)", "Queue full.", "Retry in 7 s."]),
    (503, openai_error(503, "The server is starting; the model is not ready."),
     {"Retry-After": "5"}, ["starting or draining", "not ready", "Retry in 5 s."]),
    (401, openai_error(401, "Missing or invalid API key."), {},
     ["refused the credentials (401)", "invalid API key", "PHI3V_UI_API_KEY"]),
    (500, {"detail": "boom"}, {}, ["server failed (500): boom"]),
])
async def test_http_errors_become_readable_messages(status, body, headers, expected):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body,
                                                                   headers=headers))
    client = ApiClient(UISettings(api_base_url="http://api.test"), transport=transport)
    with pytest.raises(errors.ApiError) as info:
        async for _ in client.stream_chat({"model": "m", "messages": []}):
            pass
    for part in expected:
        assert part in info.value.message
    assert info.value.status == status
    await client.aclose()


async def test_api_down_says_so():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ApiClient(UISettings(api_base_url=f"http://127.0.0.1:{port}"))
    for call in (client.limits(), client.stream_chat({}).__anext__()):
        with pytest.raises(errors.ApiError, match=r"is down \(connection refused\)"):
            await call
    await client.aclose()


async def test_stream_parses_tokens_usage_and_error_events():
    sse = ('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
           'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
           'data: {"choices":[{"delta":{"content":"lo"},"finish_reason":"length"}]}\n\n'
           'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
           'data: [DONE]\n\n')
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = request.read()
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    client = ApiClient(UISettings(api_base_url="http://api.test", api_key="k"),
                       transport=httpx.MockTransport(handler))
    events = [e async for e in client.stream_chat({"model": "m", "messages": []})]
    assert [e.text for e in events if isinstance(e, Token)] == ["Hel", "lo"]
    assert [e.usage for e in events if isinstance(e, Usage)] == [
        {"prompt_tokens": 9, "completion_tokens": 2}]
    assert b'"stream":true' in seen["body"] and b'"include_usage":true' in seen["body"]
    assert seen["auth"] == "Bearer k"  # PHI3V_UI_API_KEY

    bad = httpx.MockTransport(lambda r: httpx.Response(
        200, text='data: {"error": {"message": "engine died", "code": 500}}\n\n'))
    client = ApiClient(UISettings(api_base_url="http://api.test"), transport=bad)
    with pytest.raises(errors.ApiError, match="engine died"):
        async for _ in client.stream_chat({}):
            pass


async def test_each_chat_request_names_the_logged_in_user():
    """``user`` carries the UI's user identifier (the API shares a trusted front end's capacity
    among its users); an identifier longer than the API accepts goes as its stable digest."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.read()))
        return httpx.Response(200, text="data: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    client = ApiClient(UISettings(api_base_url="http://api.test", api_key="k"),
                       transport=httpx.MockTransport(handler))
    long_name = "github:" + "a" * 300
    for user in ("alice", long_name, long_name):
        [e async for e in client.stream_chat({"model": "m", "messages": []}, user=user)]
    assert sent[0]["user"] == "alice"
    assert sent[1]["user"] == sent[2]["user"] == api_user(long_name)
    assert sent[1]["user"].startswith("sha256:") and len(sent[1]["user"]) <= MAX_USER_CHARS
    [e async for e in client.stream_chat({"model": "m", "messages": []})]
    assert "user" not in sent[3]
    await client.aclose()
    from serve.intake.request import MAX_USER_CHARS as API_MAX_USER_CHARS

    assert MAX_USER_CHARS == API_MAX_USER_CHARS


# --- statistics --------------------------------------------------------------------------------
def test_answer_stats():
    now = iter([10.0, 10.5, 10.7, 10.9, 11.5]).__next__
    stats = AnswerStats(clock=now)  # request sent at 10.0
    for _ in range(4):
        stats.on_token()  # first at 10.5, last at 11.5
    stats.on_usage({"completion_tokens": 4, "prompt_tokens": 330})
    assert stats.ttft_s == pytest.approx(0.5)
    assert stats.tokens_per_s == pytest.approx(3.0)  # 3 tokens after the first in 1.0 s
    assert stats.line() == "TTFT 0.50 s · 3.0 tok/s · 4 tokens · prompt 330 tokens"
    assert STATS_RE.search(stats.line())
    stopped = AnswerStats(clock=iter([0.0, 1.0]).__next__)
    stopped.on_token()
    stopped.stopped = True
    assert stopped.line() == "TTFT 1.00 s · – tok/s · 1 tokens · stopped"


def test_streamed_tokens_reach_the_page_in_pieces_at_most_every_interval():
    from ui.throttle import TokenBatcher

    now = [0.0]
    batcher = TokenBatcher(0.05, clock=lambda: now[0])
    assert batcher.add("Once") == "Once"  # the first token at once: the TTFT the user sees
    sent = []
    for k in range(10):  # 10 tokens over 45 ms: kept
        now[0] += 0.0045
        sent.append(batcher.add(f" t{k}"))
    assert sent == [None] * 10
    now[0] = 0.051
    assert batcher.add(" end") == "".join(f" t{k}" for k in range(10)) + " end"
    now[0] = 0.06
    assert batcher.add(" tail") is None
    assert batcher.rest() == " tail" and batcher.rest() == ""
