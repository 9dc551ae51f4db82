"""Image workers (``--image-workers``) and JPEG draft decoding: the process pool gives the
serial path's bytes and errors, really runs elsewhere, is sized to the host, and the draft
decode keeps every image token and stays within a level of the full decode."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time

import numpy as np
import pytest
from PIL import Image, ImageOps

from serve.intake.budget import image_tokens
from serve.intake.cache import ImageCache
from serve.intake.errors import IntakeError
from serve.intake.images import ImagePolicy, PreparedImage, prepare_image
from serve.intake.middleware import IntakeMiddleware
from serve.intake.request import RequestLimits
from serve.intake.service import Intake
from serve.intake.urls import UrlPolicy
from serve.intake.workers import ImageWorkers
from serve.models.remote_code.processing_phi3_v import hd_resize, hd_transform_size
from serve.settings import Settings, auto_image_workers
from tests.helpers import IMAGES

#: The server's default policy (serve/settings.py): every format, 10 MiB, 40 MP.
DEFAULTS = Settings(device="cpu")
POLICY = ImagePolicy(DEFAULTS.max_image_bytes, DEFAULTS.max_image_pixels,
                     frozenset(DEFAULTS.image_formats))
#: Mean absolute difference (levels of 255) allowed between the draft decode and the full
#: decode + resize, per image: see test_jpeg_draft_keeps_every_token_and_stays_within_a_level.
DRAFT_MEAN_ABS_MAX = 1.0


def manifest() -> list[dict]:
    return json.loads((IMAGES / "MANIFEST.json").read_text())


def real_photos() -> list[str]:
    return [e["file"] for e in manifest() if e["kind"] == "real"]


def phone_jpeg(name: str, size=(4032, 3024), seed: int = 0, exif: Image.Exif | None = None,
               fmt: str = "JPEG") -> bytes:
    """A real photo at a phone's size with seeded noise, as a phone's JPEG (quality 90, the
    make bench photos: bench/workloads.py)."""
    rng = np.random.default_rng(seed)
    with Image.open(IMAGES / name) as im:
        base = np.asarray(im.convert("RGB").resize(size, Image.Resampling.BICUBIC), np.int16)
    noisy = np.clip(base + rng.integers(-8, 9, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    extra = {"exif": exif} if exif is not None else {}
    if fmt == "MPO":
        extra |= {"save_all": True, "append_images": [Image.new("RGB", (160, 120), "red")]}
    Image.fromarray(noisy).save(out, fmt, quality=90, **extra)
    return out.getvalue()


def outcome(fn, *args, **kwargs) -> PreparedImage | tuple:
    """The prepared image, or the refusal's fields."""
    try:
        return fn(*args, **kwargs)
    except IntakeError as err:
        return ("refused", err.status, err.message, err.param, err.code)


@pytest.fixture(scope="module")
def workers():
    pool = ImageWorkers(2)
    pids = pool.start()
    assert pids and os.getpid() not in pids
    yield pool
    pool.close()


# --- the setting ------------------------------------------------------------------------------
@pytest.mark.parametrize(("cores", "threads"), [(1, "1"), (2, "1"), (8, "7")])
def test_a_cpu_engine_leaves_the_api_process_a_core(monkeypatch, cores, threads):
    # vLLM's own CPU default reserves one core beside its workers (serve.settings.CPU_API_CORES).
    import serve.settings

    monkeypatch.setattr(serve.settings, "usable_cores", lambda: cores)
    env = Settings(device="cpu").engine_env()
    assert env["OMP_NUM_THREADS"] == threads and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "OMP_NUM_THREADS" not in Settings(device="cuda").engine_env()


def test_image_workers_default_to_none_on_cpu_and_to_the_spare_cores_on_gpu(monkeypatch):
    assert Settings(device="cpu").resolved().image_workers == 0
    assert Intake.from_settings(Settings(device="cpu")).workers is None
    # GPU: cores - 2 (API process) - 1 (engine core) - 1 per GPU worker, within 0..16.
    assert auto_image_workers("cuda", 1, cores=16) == 12
    assert auto_image_workers("cuda", 2, cores=16) == 11
    assert auto_image_workers("cuda", 1, cores=4) == 0
    assert auto_image_workers("cuda", 1, cores=96) == 16
    assert auto_image_workers("cpu", 1, cores=96) == 0
    assert Settings(device="cuda").resolved().image_workers == auto_image_workers("cuda", 1)
    assert Settings(device="cuda", image_workers=0).resolved().image_workers == 0
    from serve.cli import parse_settings

    assert parse_settings(["--image-workers", "3"], environ={}).image_workers == 3
    monkeypatch.setenv("PHI3V_IMAGE_WORKERS", "5")
    assert Settings(device="cpu").resolved().image_workers == 5
    intake = Intake.from_settings(Settings(device="cpu", image_workers=2))
    assert intake.workers is not None and intake.workers.workers == 2
    assert intake.wrap(None).prepare_image == intake.workers.prepare


# --- the pool is the serial path, elsewhere ------------------------------------------------------
@pytest.mark.parametrize("crops", [1, 16])
def test_pool_gives_the_serial_bytes_and_errors_for_every_shared_file(workers, crops):
    """Every file of ../shared/images, real photos and hostile files alike: the same prepared
    image (url, size, action) or the same 4xx refusal, never a pickling error or a 500."""
    refused = 0
    for entry in manifest():
        raw = (IMAGES / entry["file"]).read_bytes()
        param = f"messages[0].content[{crops}].image_url"
        before = workers.jobs
        serial = outcome(prepare_image, raw, POLICY, crops, param)
        pooled = outcome(workers.prepare, raw, POLICY, crops, param)
        assert pooled == serial, entry["file"]
        if isinstance(serial, tuple):
            refused += 1
            assert 400 <= serial[1] < 500, entry
        else:
            assert workers.jobs == before + 1 and workers.last_pid != os.getpid()
        if entry["expect"] in ("400", "400 or 413"):
            assert isinstance(serial, tuple), entry["file"]
    assert refused >= 4  # truncated, random bytes, empty, the bomb


def test_pool_gives_the_serial_bytes_for_phone_photos_and_passthroughs(workers):
    """The draft path (phone JPEGs, EXIF-rotated, MPO) and a passthrough, whose URL the API
    process builds from the client's own base64 text."""
    rotated = Image.Exif()
    rotated[0x0112] = 6
    cases = [(phone_jpeg("rocket.jpg", seed=1), 16), (phone_jpeg("coffee.png", seed=2), 1),
             (phone_jpeg("chelsea.png", (3024, 4032), seed=3, exif=rotated), 4),
             (phone_jpeg("astronaut.png", (2000, 1500), seed=4, fmt="MPO"), 1)]
    for raw, crops in cases:
        serial = prepare_image(raw, POLICY, crops, "img")
        assert serial.action == "reduced"
        assert workers.prepare(raw, POLICY, crops, "img") == serial
    small = phone_jpeg("chelsea.png", (320, 240))
    payload = base64.b64encode(small).decode()
    pooled = workers.prepare(small, POLICY, 1, "img", base64_payload=payload)
    assert pooled.action == "passthrough"
    assert pooled == prepare_image(small, POLICY, 1, "img", base64_payload=payload)
    assert pooled.url == "data:image/jpeg;base64," + payload


async def test_the_intake_prepares_images_in_the_pool(workers):
    """A chat request through the intake with workers: the image is prepared in a worker
    process and the body forwarded to vLLM is byte for byte the serial intake's."""
    url = "data:image/jpeg;base64," + base64.b64encode(phone_jpeg("coffee.png")).decode()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is this?"}]}]}).encode()

    def intake(pool):
        return IntakeMiddleware(None, RequestLimits(max_images=4), POLICY,
                                UrlPolicy(enabled=False), cache=ImageCache(0),
                                default_num_crops=16, workers=pool)

    def forwarded_body(done) -> dict:
        sent = json.loads(done[0])
        sent.pop("request_id")  # made unique per request
        return sent

    before = workers.jobs
    pooled = await intake(workers).process(body)
    assert workers.jobs == before + 1 and workers.last_pid != os.getpid()
    serial = await intake(None).process(body)
    assert forwarded_body(pooled) == forwarded_body(serial)
    assert (pooled[1], pooled[3]) == (serial[1], serial[3]) and pooled[1] == 1


def test_a_dead_worker_is_replaced_and_the_image_still_prepared():
    pool = ImageWorkers(1)
    try:
        (pid,) = pool.start()
        raw = (IMAGES / "coffee.png").read_bytes()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # the pool sees its worker gone
        assert pool.prepare(raw, POLICY, 1, "img") == prepare_image(raw, POLICY, 1, "img")
        assert pool.restarts == 1 and pool.last_pid not in (pid, os.getpid())
    finally:
        pool.close()
    # Closed: images are prepared in the calling thread.
    assert pool.prepare(raw, POLICY, 1, "img") == prepare_image(raw, POLICY, 1, "img")


# --- JPEG draft decoding ------------------------------------------------------------------
def full_decode_reference(raw: bytes, crops: int) -> Image.Image:
    """What the intake forwarded before draft decoding: every pixel decoded, EXIF orientation
    applied, then the HD transform's own resize (the pixels vLLM computes from the original)."""
    with Image.open(io.BytesIO(raw)) as im:
        return hd_resize(ImageOps.exif_transpose(im).convert("RGB"), crops)


def forwarded(image: PreparedImage) -> Image.Image:
    with Image.open(io.BytesIO(base64.b64decode(image.url.split(",", 1)[1]))) as out:
        return out.convert("RGB")


#: One phone size and num_crops per real photo: decode at 1/2 (12 MP at 16 crops), 1/4
#: (portrait 12 MP at 4, 2 MP at 4) and 1/8 (12 MP at 1); the page (text) at the largest scale.
DRAFT_CASES = {"astronaut.png": ((4032, 3024), 16), "chelsea.png": ((3024, 4032), 4),
               "coffee.png": ((1920, 1080), 4), "rocket.jpg": ((4032, 3024), 1),
               "page.png": ((4032, 3024), 1)}


def test_draft_cases_cover_every_real_photo():
    assert sorted(DRAFT_CASES) == sorted(real_photos())


@pytest.mark.parametrize("name,size,crops", [(n, *c) for n, c in DRAFT_CASES.items()])
def test_jpeg_draft_keeps_every_token_and_stays_within_a_level(name, size, crops):
    """A real photo at a phone's size as a phone's JPEG: the forwarded image has exactly the
    full-decode path's size (so the same image tokens), and its pixels differ from the full
    decode + resize by a mean of under :data:`DRAFT_MEAN_ABS_MAX` level, 99th percentile at
    most 6 levels. Measured on all five photos at 12 MP landscape (16 and 1 crops), 12 MP
    portrait (4) and 2 MP (4), 20 images: mean 0.33-0.75 levels, 99th percentile 1-5, largest
    single difference 15."""
    raw = phone_jpeg(name, size, seed=sum(size) + crops)
    ours = prepare_image(raw, POLICY, crops, "img")
    reference = full_decode_reference(raw, crops)
    assert ours.action == "reduced"
    assert (ours.width, ours.height) == reference.size
    new_w, new_h, *_ = hd_transform_size(*size, crops)
    assert sorted(reference.size) == sorted((new_w, new_h))
    assert image_tokens(ours.width, ours.height, crops) == image_tokens(*size, crops)
    diff = np.abs(np.asarray(forwarded(ours), np.int16) - np.asarray(reference, np.int16))
    assert 0 < diff.mean() < DRAFT_MEAN_ABS_MAX, diff.mean()  # > 0: the draft path ran
    assert np.percentile(diff, 99) <= 6


def test_no_draft_below_twice_the_target_nor_for_other_formats():
    """A JPEG less than twice its target, and a PNG of any size, are decoded in full: the
    forwarded pixels are exactly the HD transform's resize of the original."""
    jpeg = phone_jpeg("rocket.jpg", (2000, 1500), seed=9)  # 1344x1008 at 16 crops: 1.5x
    png = io.BytesIO()
    with Image.open(io.BytesIO(phone_jpeg("chelsea.png", (1920, 1080)))) as im:
        im.save(png, "PNG", compress_level=1)
    for raw, crops in ((jpeg, 16), (png.getvalue(), 4)):
        ours = prepare_image(raw, POLICY, crops, "img")
        assert ours.action == "reduced"
        assert np.array_equal(np.asarray(forwarded(ours)),
                              np.asarray(full_decode_reference(raw, crops)))
