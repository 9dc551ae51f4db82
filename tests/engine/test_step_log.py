"""vLLM's per-step details reach ``GET /admin/bench/steps`` (the session's ``verbose_server``,
started with ``--bench-admin --enable-logging-iteration-details``): the calibration of the
simulator's cpu profile (``python -m bench.calibrate``) reads what the real engine scheduled
in each step and when."""

from __future__ import annotations

import io
import os

import httpx
from PIL import Image

from tests.engine.test_api import QUESTION, chat, image_tokens, user_message
from tests.helpers import IMAGES, data_url


def test_each_engine_step_of_an_image_chat_is_reported_with_what_it_scheduled(verbose_server):
    server = verbose_server
    steps_url = f"{server.base_url}/admin/bench/steps"
    httpx.get(steps_url, timeout=30).raise_for_status()  # forget the other tests' steps
    # An image no other test sent: nothing of the prompt is in vLLM's prefix cache.
    photo = Image.open(IMAGES / "rocket.jpg").convert("RGB")
    photo.putpixel((0, 0), tuple(os.urandom(3)))
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    reply = chat(server, [user_message(QUESTION, data_url(buf.getvalue(), "image/png"))],
                 max_tokens=6, temperature=0, ignore_eos=True)
    got = httpx.get(steps_url, timeout=30).json()
    steps = got["steps"]
    assert got["dropped"] == 0
    prompt = reply["usage"]["prompt_tokens"]
    # The prompt was prefilled (in one chunk or more), its image encoded once ...
    assert sum(s["prefill_tokens"] for s in steps) == prompt, steps
    assert sum(s["encoder_tokens"] for s in steps) >= image_tokens(427, 640) - 1, steps
    # ... then one decode step per token after the first (the first comes with the prefill).
    assert sum(s["decode_tokens"] for s in steps) == reply["usage"]["completion_tokens"] - 1
    assert all(s["elapsed_s"] > 0 for s in steps)
    assert [s["t_s"] for s in steps] == sorted(s["t_s"] for s in steps)
    assert steps[-1]["running"] == 0  # the last step finished the request
    assert httpx.get(steps_url, timeout=30).json()["steps"] == []  # a read drains the log
