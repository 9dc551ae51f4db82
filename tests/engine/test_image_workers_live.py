"""A server started with ``--image-workers 2`` (the session's ``verbose_server``) prepares
images in worker processes and answers image chats with the prompt tokens of the serial path
(``test_api``'s arithmetic: one image adds exactly its HD-transform tokens to the text prompt)
and its refusals."""

from __future__ import annotations

import httpx
import psutil

from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy, prepare_image
from serve.settings import Settings
from tests.engine.test_api import QUESTION, chat, image_tokens, text_prompt_tokens, user_message
from tests.helpers import IMAGES, data_url
from tests.unit.test_image_workers import phone_jpeg


def test_image_workers_serve_the_serial_tokens_and_refusals(verbose_server):
    server = verbose_server
    assert "image workers: pids" in server.log_path.read_text()
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert sum("forkserver" in " ".join(p.cmdline()) for p in children) >= 1
    base = text_prompt_tokens(server)
    for raw, size, mime in [
            (phone_jpeg("coffee.png", (4032, 3024), seed=7), (4032, 3024), "image/jpeg"),
            ((IMAGES / "rocket.jpg").read_bytes(), (427, 640), "image/jpeg"),
            ((IMAGES / "coffee_rgba.png").read_bytes(), (600, 400), "image/png")]:
        reply = chat(server, [user_message(QUESTION, data_url(raw, mime))], max_tokens=1)
        assert reply["usage"]["prompt_tokens"] == base + image_tokens(*size), size
    raw = (IMAGES / "truncated.jpg").read_bytes()
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "max_tokens": 1,
        "messages": [user_message(QUESTION, data_url(raw, "image/jpeg"))]})
    assert r.status_code == 400, r.text
    s = Settings(device="cpu")
    policy = ImagePolicy(s.max_image_bytes, s.max_image_pixels,
                         frozenset(s.image_formats))
    param = r.json()["error"]["param"]
    try:
        prepare_image(raw, policy, 1, param)
    except IntakeError as err:
        assert r.json()["error"]["message"] == err.message
    else:
        raise AssertionError("truncated.jpg was accepted by the serial path")
