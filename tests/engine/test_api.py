"""The serving core end to end: real vLLM engine (tiny Phi-3-vision, CPU) behind our API.

Prompt-token arithmetic used below (vLLM 0.32's Phi-3-vision path, see
``serve/models/tokenizer.py``): an image prompt is the text-only prompt with ``<|image_k|>\\n``
placeholders added, each placeholder replaced by the image's tokens, and the template's BOS
dropped by vLLM's Phi-3-vision prompt re-encoding. So with k images:
``prompt_tokens(images) = prompt_tokens(text) - 1 (BOS) + k ("\\n") + sum(image tokens)``.
"""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import pytest
from openai import OpenAI
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from serve.models.remote_code.processing_phi3_v import hd_transform_size, num_image_tokens
from serve.sse import DONE, data_event
from tests.helpers import data_url, png_bytes

NUM_CROPS = 1  # the server's CPU default (serve/settings.py)
QUESTION = "What is in this image?"


def image_tokens(width: int, height: int, num_crops: int = NUM_CROPS) -> int:
    """Phi-3-vision image tokens for an image of ``width`` x ``height`` pixels."""
    return num_image_tokens(*hd_transform_size(width, height, num_crops)[2:4])


def user_message(text: str, *urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def chat(server, messages, max_tokens: int = 8, **extra) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": server.model, "messages": messages, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def text_prompt_tokens(server, text: str = QUESTION) -> int:
    return chat(server, [{"role": "user", "content": text}], max_tokens=1)["usage"][
        "prompt_tokens"]


async def stream_chat(client: httpx.AsyncClient, server, messages, max_tokens=8) -> dict:
    """One streamed chat over raw SSE. Returns status, content, finish reasons, usage, done."""
    out = {"status": None, "content": "", "finish": [], "usage": None, "done": False}
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{server.base_url}/v1/chat/completions",
                             json=body) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            event = data_event(line)
            if event == DONE:
                out["done"] = True
            if not isinstance(event, dict):
                continue
            for choice in event.get("choices", []):
                out["content"] += choice["delta"].get("content") or ""
                if choice.get("finish_reason"):
                    out["finish"].append(choice["finish_reason"])
            if event.get("usage"):
                out["usage"] = event["usage"]
    return out


# --- process and operational routes ------------------------------------------------------------
def test_ready_is_503_until_engine_serves(server):
    assert 503 in server.ready_statuses, "never saw the boot phase answer 503"
    assert server.ready_statuses[-1] == 200
    first_503 = server.ready_statuses.index(503)
    assert all(s == 503 for s in server.ready_statuses[first_503:-1])


def test_health_models_metrics(server):
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model]
    text = httpx.get(f"{server.base_url}/metrics").text
    # vLLM's series stay on our /metrics, for the dashboards and the endpoint picker (its
    # flags name what it reads: tests/engine/test_queue_metrics.py).
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds"):
        assert name in text, name


def test_token_chunks_take_the_stream_guards_o1_path(server):
    """vLLM's token chunks, as the client receives them through every layer, end as the stream
    guard's O(1) test expects (``serve.streamguard.TOKEN_EVENT_ENDS``): the per-token cost
    ``python -m bench.layers`` measures with the same shape. A vLLM that writes them otherwise
    sends every token through the general test (a regex scan) instead."""
    from serve.streamguard import ROLE_DELTA, TOKEN_EVENT_ENDS, needs_parse

    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": server.model, "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}) as answer:
        body = b"".join(answer.iter_bytes())
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    # The role chunk, a chunk per token (the last one finishes), [DONE]: random weights may
    # end an answer early, so at least one token chunk between the role and the finish.
    assert events[-1] == b"data: [DONE]\n\n" and len(events) >= 4, events
    tokens = events[1:-2]
    assert tokens and all(e.endswith(TOKEN_EVENT_ENDS) for e in tokens), tokens
    # The role event holds an empty content in the shape the guard passes unparsed.
    assert ROLE_DELTA in events[0] and not needs_parse(events[0]), events[0]


def test_one_http_account_of_every_response(server):
    """The gateway counts each response (``phi3v_http_responses_total``); vLLM's second
    account of the same responses (prometheus-fastapi-instrumentator's ``http_*`` series, a
    middleware on the event loop that streams every token) is taken off its app."""
    def chats_counted() -> float:
        text = httpx.get(f"{server.base_url}/metrics").text
        assert "http_request" not in text  # neither http_requests_total nor its histograms
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "phi3v_http_responses_total"
                   and sample.labels == {"route": "/v1/chat/completions", "code": "200"})

    before = chats_counted()
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hello"}]})
    assert answer.status_code == 200, answer.text
    assert chats_counted() == before + 1


# --- chat ---------------------------------------------------------------------------------------
def test_openai_client_streams_image_chat(server, images):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    url = data_url(images / "astronaut.png")
    stream = client.chat.completions.create(
        model=server.model, messages=[user_message(QUESTION, url)], max_tokens=12,
        stream=True, stream_options={"include_usage": True})
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert len(deltas) >= 2 and "".join(deltas)
    assert finish in ("length", "stop")
    assert usage is not None and usage.completion_tokens >= 1
    with Image.open(images / "astronaut.png") as im:
        n_img = image_tokens(*im.size)
    assert n_img == 313
    text_only = text_prompt_tokens(server)
    # -1 BOS, +1 "\n" after the placeholder (module docstring): exactly the image tokens more.
    assert usage.prompt_tokens - text_only == n_img


def test_two_images_in_one_message(server, images):
    urls = [data_url(images / "chelsea.png"), data_url(images / "rocket.jpg")]
    sizes = []
    for name in ("chelsea.png", "rocket.jpg"):
        with Image.open(images / name) as im:
            sizes.append(im.size)
    images_before = server.metric("phi3v_request_images_sum")
    reply = chat(server, [user_message("Compare the two images.", *urls)])
    assert server.metric("phi3v_request_images_sum") - images_before == 2
    expected = (text_prompt_tokens(server, "Compare the two images.") - 1 + 2
                + sum(image_tokens(*s) for s in sizes))
    assert reply["usage"]["prompt_tokens"] == expected
    assert reply["choices"][0]["message"]["content"]


def test_images_across_turns(server, images):
    first = data_url(images / "coffee.png")
    second = data_url(images / "page.png")
    messages = [user_message("What is this?", first),
                {"role": "assistant", "content": "A cup of coffee."},
                user_message("And this one?", second)]
    reply = chat(server, messages)
    with Image.open(images / "coffee.png") as a, Image.open(images / "page.png") as b:
        n = image_tokens(*a.size) + image_tokens(*b.size)
    text_only = chat(server, [{"role": "user", "content": "What is this?"},
                              {"role": "assistant", "content": "A cup of coffee."},
                              {"role": "user", "content": "And this one?"}],
                     max_tokens=1)["usage"]["prompt_tokens"]
    # Each image prompt chunk is re-encoded by vLLM's Phi-3-vision path: BOS dropped once,
    # one "\n" per placeholder.
    assert reply["usage"]["prompt_tokens"] == text_only - 1 + 2 + n
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")


def _variants(images) -> list[tuple[str, bytes]]:
    """16 distinct images: the real photos plus resized portrait/landscape variants."""
    out = []
    for name in ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "page.png"):
        out.append((name, (images / name).read_bytes()))
    sizes = [(200, 600), (900, 300), (336, 336), (1000, 700), (480, 1280), (1500, 1000),
             (640, 360), (360, 640), (128, 96), (2000, 500), (700, 1400)]
    for i, size in enumerate(sizes):
        src = ("chelsea.png", "rocket.jpg", "coffee.png", "astronaut.png")[i % 4]
        with Image.open(images / src) as im:
            out.append((f"{src}@{size[0]}x{size[1]}", png_bytes(im.convert("RGB").resize(size))))
    assert len(out) == 16
    return out


def _size(raw: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(raw)) as im:
        return im.size


async def test_16_concurrent_streams_with_distinct_images(server, images):
    variants = _variants(images)
    base = text_prompt_tokens(server)
    async with httpx.AsyncClient(timeout=300) as client:
        results = await asyncio.gather(*[
            stream_chat(client, server, [user_message(QUESTION, data_url(raw))])
            for _, raw in variants])
    for (name, raw), res in zip(variants, results, strict=False):
        assert res["status"] == 200, name
        assert res["done"], f"{name}: no [DONE]"
        assert res["finish"], f"{name}: no finish_reason"
        assert res["usage"]["prompt_tokens"] == base + image_tokens(*_size(raw)), name


async def test_same_image_repeated_sequential_and_pairs(server, images):
    url = data_url(images / "chelsea.png")
    messages = [user_message(QUESTION, url)]
    prompt_tokens = set()
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(5):
            res = await stream_chat(client, server, messages)
            assert res["status"] == 200 and res["done"]
            prompt_tokens.add(res["usage"]["prompt_tokens"])
        for _ in range(3):
            pair = await asyncio.gather(*[stream_chat(client, server, messages)
                                          for _ in range(2)])
            for res in pair:
                assert res["status"] == 200 and res["done"]
                prompt_tokens.add(res["usage"]["prompt_tokens"])
    assert len(prompt_tokens) == 1  # prefix/mm cache hits never change the accounting


# --- client disconnects -------------------------------------------------------------------------
def _wait_running(server, predicate, timeout_s: float) -> float | None:
    """Poll ``vllm:num_requests_running`` until ``predicate(value)``; seconds taken or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate(server.metric("vllm:num_requests_running")):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def test_stream_closed_early_is_aborted_within_2s(server, images):
    body = {"model": server.model, "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "messages": [user_message(QUESTION, data_url(images / "coffee.png"))]}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 3:
                    break
            assert server.metric("vllm:num_requests_running") >= 1
    # Leaving the block closed the connection mid-stream.
    took = _wait_running(server, lambda v: v == 0, 2.0)
    assert took is not None, "engine request still running 2 s after the client left"


async def test_non_streaming_disconnect_is_aborted_within_2s(server):
    body = {"model": server.model, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    async with httpx.AsyncClient(timeout=120) as client:
        task = asyncio.create_task(client.post(f"{server.base_url}/v1/chat/completions",
                                               json=body))
        deadline = time.monotonic() + 30
        while server.metric("vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "request never started"
            await asyncio.sleep(0.05)
        task.cancel()  # the client gives up: httpx closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    start = time.monotonic()
    while server.metric("vllm:num_requests_running") > 0:
        assert time.monotonic() - start < 2.0, "engine request still running 2 s later"
        await asyncio.sleep(0.05)
