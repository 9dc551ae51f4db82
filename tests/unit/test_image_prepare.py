"""What vLLM receives for an image: never inflated, identical tokens and pixels, cached.

The processor here is the one vLLM runs for the model (``serve/models/remote_code``), so
"vLLM computes the same" is checked by running it on the client's image and on ours.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import numpy as np
import pytest
from PIL import Image

from serve.intake.budget import image_tokens
from serve.intake.cache import ImageCache, image_key
from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy, PreparedImage, prepare_image, reduced_size
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import RequestLimits
from serve.intake.urls import UrlPolicy
from serve.models.remote_code.processing_phi3_v import (
    OPENAI_CLIP_STD,
    Phi3VImageProcessor,
    hd_transform_size,
)
from tests.helpers import IMAGES

POLICY = ImagePolicy(16 * 2**20, 40_000_000, frozenset({"PNG", "JPEG", "GIF", "WEBP", "BMP"}))


def photo(size=(4032, 3024), seed=0, fmt="JPEG", **save) -> bytes:
    """A noisy upscaled real photo: a phone-sized image that compresses like one."""
    rng = np.random.default_rng(seed)
    base = Image.open(IMAGES / "chelsea.png").convert("RGB").resize(size)
    noisy = np.asarray(base, dtype=np.int16) + rng.integers(-6, 7, (size[1], size[0], 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buf, fmt, **save)
    return buf.getvalue()


def forwarded(image: PreparedImage) -> Image.Image:
    raw = base64.b64decode(image.url.split(",", 1)[1])
    out = Image.open(io.BytesIO(raw))
    out.load()
    return out


def vllm_view(image: Image.Image, crops: int):
    """What vLLM's Phi-3-vision processor makes of ``image``: pixel values and tokens."""
    out = Phi3VImageProcessor(num_crops=crops)(image.convert("RGB"), return_tensors="np")
    return out["pixel_values"], int(out["num_img_tokens"][0])


@pytest.mark.parametrize("size,crops,fmt", [((4032, 3024), 1, "JPEG"), ((3024, 4032), 1, "JPEG"),
                                            ((4032, 3024), 16, "JPEG"), ((1920, 1080), 4, "JPEG"),
                                            ((2000, 900), 1, "JPEG"), ((2000, 1500), 16, "JPEG"),
                                            ((1920, 1080), 4, "PNG"), ((2000, 900), 1, "PNG")])
def test_large_photo_is_reduced_to_what_vllm_computes(size, crops, fmt):
    """The same tokens always, and a bit-identical model input, except for a JPEG at least
    twice its target in both dimensions: that one is decoded at a reduced DCT scale first
    (draft decoding, serve/intake/images.py), so its model input is within a mean of one level
    of 255 of what vLLM computes from the original (per-photo bounds: test_image_workers)."""
    raw = photo(size, fmt=fmt, **({"compress_level": 1} if fmt == "PNG" else {}))
    image = prepare_image(raw, POLICY, crops, "img")
    assert image.action == "reduced"
    new_w, new_h, *_ = hd_transform_size(*size, crops)
    assert sorted((image.width, image.height)) == sorted((new_w, new_h))
    ours = forwarded(image)
    assert ours.format == "PNG" and ours.size == (image.width, image.height)
    original = Image.open(io.BytesIO(raw))
    pixels_raw, tokens_raw = vllm_view(original, crops)
    pixels_ours, tokens_ours = vllm_view(ours, crops)
    assert tokens_ours == tokens_raw == image_tokens(*size, crops)
    drafted = fmt == "JPEG" and min(max(size) // new_w, min(size) // new_h) >= 2
    if drafted:
        # Normalised pixel values back to levels of 255 (x 255 x the channel's CLIP std).
        levels = np.abs(pixels_ours - pixels_raw) * 255 * np.array(OPENAI_CLIP_STD)[:, None, None]
        assert 0 < levels.mean() < 1, levels.mean()
    else:
        assert np.array_equal(pixels_ours, pixels_raw)  # bit-identical model input
    assert image.width * image.height < size[0] * size[1]  # never inflated
    if size == (4032, 3024) and crops == 1:
        assert len(image.url) < len(raw) // 4  # 336 px wide: a fraction of the phone JPEG


def test_unchanged_image_goes_to_vllm_as_it_came():
    raw = photo((320, 240), fmt="JPEG", quality=90)
    payload = base64.b64encode(raw).decode()
    image = prepare_image(raw, POLICY, 1, "img", base64_payload=payload)
    assert image.action == "passthrough"
    assert image.url == "data:image/jpeg;base64," + payload
    assert (image.width, image.height) == (320, 240)


def test_images_that_must_change_are_normalised_at_their_size():
    cmyk = (IMAGES / "coffee_cmyk.jpg").read_bytes()
    image = prepare_image(cmyk, POLICY, 16, "img")
    assert image.action == "reencoded" and forwarded(image).mode == "RGB"
    rotated = prepare_image((IMAGES / "arrow_exif_rotated.jpg").read_bytes(), POLICY, 16, "img")
    assert rotated.action == "reencoded" and (rotated.width, rotated.height) == (200, 400)
    # Rotated and larger than the target at num_crops 1: reduced in its upright orientation.
    small = prepare_image((IMAGES / "arrow_exif_rotated.jpg").read_bytes(), POLICY, 1, "img")
    assert small.action == "reduced" and small.height > small.width


def test_phone_mpo_jpeg_is_a_jpeg():
    first = Image.open(io.BytesIO(photo((640, 480))))
    second = Image.new("RGB", (160, 120), "red")
    buf = io.BytesIO()
    first.save(buf, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    image = prepare_image(buf.getvalue(), POLICY, 1, "img")
    assert image.source_format == "JPEG" and image.action == "reduced"
    assert forwarded(image).size == (336, 252)


def test_sizes_the_transform_would_move_again_are_not_reduced():
    # 22x375 at num_crops 1 resizes to 19x336, which vLLM's transform would take to 18x336.
    assert reduced_size(22, 375, 1) is None
    assert reduced_size(4032, 3024, 1) == (336, 252)
    assert reduced_size(300, 200, 1) is None  # upscaled by the transform: never inflate
    buf = io.BytesIO()
    Image.new("RGB", (22, 375), "blue").save(buf, "PNG")
    assert prepare_image(buf.getvalue(), POLICY, 1, "img").action == "passthrough"


def test_truncated_image_is_refused_even_when_it_would_pass_through():
    raw = photo((320, 240))
    with pytest.raises(IntakeError) as err:
        prepare_image(raw[: len(raw) // 2], POLICY, 1, "messages[0].content[0].image_url")
    assert err.value.status == 400 and err.value.param == "messages[0].content[0].image_url"


def test_cache_is_bounded_lru_by_bytes():
    cache = ImageCache(max_bytes=4000)
    entries = [PreparedImage("x" * 900, 1, 1, "PNG", "reduced") for _ in range(6)]
    keys = [image_key(str(i), 1) for i in range(6)]
    for key, entry in zip(keys, entries, strict=False):
        cache.put(key, entry)
        cache.get(keys[0])  # keep the first one hot
    assert cache.nbytes <= 4000 and len(cache) == 4
    assert cache.get(keys[0]) is entries[0] and cache.get(keys[1]) is None
    cache.put(image_key("big", 1), PreparedImage("x" * 1001, 1, 1, "PNG", "reduced"))
    assert cache.get(image_key("big", 1)) is None  # over a quarter: not stored
    assert image_key("a", 1) != image_key("a", 16)  # num_crops is part of the key


class _RecordingIntake(IntakeMiddleware):
    """The real intake, noting which thread did the CPU work."""

    threads: list[str]

    def finish(self, request, fetched):
        self.threads.append(threading.current_thread().name)
        return super().finish(request, fetched)


def _body(url: str, turns: int) -> bytes:
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": f"turn {t}"}]})
        messages.append({"role": "assistant", "content": "ok"})
    return json.dumps({"model": "m", "messages": messages[:-1]}).encode()


async def test_history_image_is_prepared_once_off_the_event_loop():
    url = "data:image/jpeg;base64," + base64.b64encode(photo()).decode()
    intake = _RecordingIntake(None, RequestLimits(max_images=4), POLICY,
                              UrlPolicy(enabled=False), cache=ImageCache(64 * 2**20),
                              default_num_crops=1)
    intake.threads = []
    first, n1, *_ = await intake.process(_body(url, 1))
    third, n3, *_ = await intake.process(_body(url, 3))
    assert (n1, n3) == (1, 3)
    assert intake.cache.misses == 1 and intake.cache.hits == 3
    sent = {p["image_url"]["url"] for m in json.loads(third)["messages"]
            if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image_url"}
    (only,) = sent  # every turn forwards the same bytes: vLLM's multimodal cache hits
    assert only == json.loads(first)["messages"][0]["content"][0]["image_url"]["url"]
    assert len(only) < len(url) // 4
    assert threading.main_thread().name not in intake.threads
    assert asyncio.get_running_loop() is not None


def test_prompt_bound_never_undercounts(tmp_path):
    """The budget's cheap bound is always >= the exact token count, so skipping the exact
    count when the bound fits can never let an over-long prompt through."""
    import random

    from transformers import AutoTokenizer

    from serve.intake.budget import PromptBudget
    from serve.intake.request import parse_chat_request
    from tests.helpers import ensure_tiny_model

    budget = PromptBudget(AutoTokenizer.from_pretrained(ensure_tiny_model()), 8192, 1)
    rng = random.Random(0)
    alphabet = "ab Zé漢字🙂\n\t<|>{}" + "".join(chr(c) for c in range(0x20, 0x7f))
    for _ in range(60):
        messages = []
        for i in range(rng.randint(1, 5)):
            role = ("system", "user", "assistant")[rng.randint(0, 2)] if i else "user"
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
            if role == "user" and rng.random() < 0.5:
                content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,A"}},
                           {"type": "text", "text": text}, {"type": "text", "text": text[:9]}]
            else:
                content = text
            messages.append({"role": role, "content": content})
        request = parse_chat_request({"messages": messages}, RequestLimits(max_images=8))
        sizes = [(640, 480)] * len(request.images)
        exact = budget.count(request, sizes)
        assert exact.text <= budget.text_token_bound(request)
        assert budget.fits(request, sizes) == (budget.check(request, sizes) is None)


def test_prompt_estimate_for_admission_is_close_to_the_exact_count():
    """The intake's estimate of a prompt's tokens (a burst's prefill budget counts them):
    image tokens exact, English text within 15 % of the tokenizer's count, a raw
    completions prompt from its ids or text."""
    import random

    from transformers import AutoTokenizer

    from bench.cpu_engine import prompt_text
    from serve.intake.budget import PromptBudget, image_tokens
    from serve.intake.request import parse_chat_request, parse_completion_request
    from tests.helpers import ensure_tiny_model

    budget = PromptBudget(AutoTokenizer.from_pretrained(ensure_tiny_model()), 8192, 16)
    rng = random.Random(1)
    for n in (40, 200, 1500):
        text = prompt_text(rng, n)
        for images in (0, 2):
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,A"}}
                       ] * images + [{"type": "text", "text": text}]
            request = parse_chat_request({"messages": [{"role": "user", "content": content}]},
                                         RequestLimits(max_images=8))
            sizes = [(1344, 1008), (500, 4000)][:images]
            exact = budget.count(request, sizes)
            estimate = budget.estimate(request, sizes)
            assert exact.image == sum(image_tokens(w, h, 16) for w, h in sizes)
            assert abs(estimate - exact.image - exact.text) <= 0.15 * exact.text + 8
    limits = RequestLimits(max_images=4)
    ids = parse_completion_request({"prompt": [1, 2, 3, 4, 5]}, limits)
    assert budget.estimate(ids) == 5
    text = parse_completion_request({"prompt": prompt_text(rng, 500)}, limits)
    exact = len(budget.tokenizer.encode(text.body["prompt"], add_special_tokens=False))
    assert abs(budget.estimate(text) - exact) <= 0.15 * exact
    # A batch of one counts as its prompt (a batch of more is refused at intake).
    assert budget.estimate(parse_completion_request({"prompt": [[1, 2, 3]]}, limits)) == 3
    one = parse_completion_request({"prompt": [text.body["prompt"]]}, limits)
    assert budget.estimate(one) == budget.estimate(text)


def _receiving(body: bytes):
    """An ASGI ``receive`` that sends ``body`` once, then a disconnect."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    return receive


async def _ignore(message) -> None:
    """An ASGI ``send`` that drops what it is sent."""


async def test_the_intake_hands_its_estimate_to_admission():
    from transformers import AutoTokenizer

    from serve.asgi import PROMPT_TOKENS_SCOPE_KEY
    from serve.intake.budget import PromptBudget
    from serve.intake.request import parse_chat_request
    from tests.helpers import ensure_tiny_model

    seen = []

    async def app(scope, receive, send):
        seen.append(scope.get(PROMPT_TOKENS_SCOPE_KEY))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    budget = PromptBudget(AutoTokenizer.from_pretrained(ensure_tiny_model()), 8192, 1)
    intake = IntakeMiddleware(app, RequestLimits(max_images=4), POLICY,
                              UrlPolicy(enabled=False), budget, ImageCache(0),
                              default_num_crops=1)
    url = "data:image/jpeg;base64," + base64.b64encode(photo((800, 600))).decode()
    for body in (_body(url, 1), json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "hello there"}]}).encode()):
        await intake({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                      "headers": []}, _receiving(body), _ignore)
    request = parse_chat_request(json.loads(_body(url, 1)), RequestLimits(max_images=4))
    assert seen[0] == budget.estimate(request, [(800, 600)]) > budget.estimate(request)
    assert 0 < seen[1] < 30
