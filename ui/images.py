"""Image intake: what the UI accepts, refuses, and sends.

The limits come from the server (``GET /limits``, :class:`ui.api.ServerLimits`); the UI adds
only its own sending policy (:class:`ui.settings.UISettings`): longest side at most
``max_image_side_px``, re-encoded as JPEG (photos that arrived as JPEG) or PNG (everything
else), EXIF orientation applied, first frame of animations, 8-bit RGB.

Two gates, one set of numbers:

1. **The browser** (Chainlit's upload button and drop zone): :func:`upload_spec` turns the
   limits into Chainlit's ``[features.spontaneous_file_upload]`` (``accept`` MIME types,
   ``max_size_mb``), so a file of the wrong type or too many bytes is refused before it is
   uploaded, with Chainlit's own message naming the limit ("File is larger than 10 MB").
   Chainlit counts a MB as 10^6 bytes in the browser and whole MB only, so the browser bound is
   the server's byte limit rounded *down* (never lets through what the server would refuse).
   The image count is *not* left to the browser: Chainlit checks it per drop only (two drops
   of 3 pass) and says "Too many files" without the limit; the handler counts every
   attachment of the message and says "at most N images per message" (:func:`check_count`).
   An empty file is refused at upload with its name (``ui.uploads``).
2. **The handler** (:func:`prepare_image`), authoritative: exact byte limit, the pixel limit
   (from the header, before decoding: decompression bombs), the format list, and whether the
   file decodes at all. Its :class:`ImageRefused` message names the file and the limit.

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image, ImageOps, UnidentifiedImageError

from ui.uploads import empty_upload_message

if TYPE_CHECKING:
    from ui.api import ServerLimits

#: MIME type of each Pillow format name the server may list in ``image_formats``.
FORMAT_MIME = {
    "PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp",
    "BMP": "image/bmp", "TIFF": "image/tiff",
}
#: Pillow formats that are another format's container (MPO: multi-picture JPEG from cameras).
FORMAT_ALIASES = {"MPO": "JPEG"}


class ImageRefused(Exception):
    """An image cannot be sent; ``message`` names the file and the limit it broke."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class PreparedImage:
    """An image ready to send: re-encoded bytes and their ``data:`` URL."""

    name: str
    mime: str
    data: bytes
    size: tuple[int, int]
    original_size: tuple[int, int]

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode()}"


def human_bytes(n: int) -> str:
    """``20971520`` -> ``"20 MiB"``, ``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if size == int(size) else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_pixels(n: int) -> str:
    """``40000000`` -> ``"40 MP"``."""
    mp = n / 1e6
    return f"{mp:.0f} MP" if mp == int(mp) else f"{mp:.1f} MP"


def accepted_mimes(limits: ServerLimits) -> list[str]:
    """MIME types of the formats the server accepts (the browser's ``accept`` list)."""
    return [FORMAT_MIME[f] for f in limits.image_formats if f in FORMAT_MIME]


def upload_spec(limits: ServerLimits) -> dict:
    """Chainlit's ``[features.spontaneous_file_upload]`` values for the server's limits."""
    return {
        "enabled": True,
        "accept": accepted_mimes(limits),
        "max_files": None,  # counted by the handler (module docstring), not per drop
        # Browser: whole MB of 10^6 bytes, rounded down so it is never looser than the server.
        "max_size_mb": max(1, limits.max_image_bytes // 1_000_000),
    }


def check_count(n: int, limits: ServerLimits) -> None:
    """Refuse a message carrying more images than one request may hold."""
    if n > limits.max_images_per_request:
        raise ImageRefused(
            f"{n} images attached: at most {limits.max_images_per_request} images per message "
            "(the server's max_images_per_request). Remove some and send again.")


#: What transparent pixels are composited on (white, as the server: ``serve.intake.images``).
BACKGROUND = (255, 255, 255)


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB, transparency composited on :data:`BACKGROUND`; 16-bit and float images
    stretched from their extrema to 0-255. The same pixels as the server's
    ``serve.intake.images.to_rgb`` (this venv does not import the server): one table tests
    both (``tests/unit/test_rgb_parity.py``)."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = img.convert("I") if img.mode.startswith("I;16") else img
        lo, hi = img.getextrema()
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        img = img.point(lambda v: (v - lo) * scale).convert("L")
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode == "La":  # premultiplied: Pillow converts it to LA only
        img = img.convert("LA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa"):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return img.convert("RGB") if img.mode != "RGB" else img


def prepare_image(name: str, raw: bytes, limits: ServerLimits, max_side_px: int,
                  jpeg_quality: int = 90) -> PreparedImage:
    """Check ``raw`` against the server's limits and re-encode it for sending.

    Raises:
        ImageRefused: empty, too many bytes, too many pixels, a format the server does not
            accept, or not decodable. The message names the file and the limit.
    """
    formats = ", ".join(limits.image_formats)
    if not raw:
        raise ImageRefused(empty_upload_message(name))
    if len(raw) > limits.max_image_bytes:
        raise ImageRefused(
            f"{name} is {human_bytes(len(raw))}: the server accepts images up to "
            f"{human_bytes(limits.max_image_bytes)} (max_image_bytes).")
    try:
        img = Image.open(io.BytesIO(raw))
        width, height = img.size  # header only: nothing decoded yet
    except Image.DecompressionBombError as exc:
        raise ImageRefused(
            f"{name} has too many pixels: the server accepts at most "
            f"{human_pixels(limits.max_image_pixels)} per image (max_image_pixels).") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageRefused(f"{name} is not a readable image; accepted formats: {formats}."
                           ) from exc
    fmt = FORMAT_ALIASES.get(img.format or "", img.format or "?")
    if fmt not in limits.image_formats:
        raise ImageRefused(f"{name} is {fmt}; accepted formats: {formats}.")
    if width * height > limits.max_image_pixels:
        raise ImageRefused(
            f"{name} is {width}×{height} = {human_pixels(width * height)}: the server "
            f"accepts at most {human_pixels(limits.max_image_pixels)} per image "
            "(max_image_pixels).")
    try:
        img.seek(0)  # first frame of an animation
        img.load()
        img = ImageOps.exif_transpose(img) or img
        img = to_rgb(img)
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageRefused(f"{name} is damaged and cannot be decoded ({exc}).") from exc
    if max(img.size) > max_side_px:
        img.thumbnail((max_side_px, max_side_px), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    if fmt == "JPEG":
        img.save(out, format="JPEG", quality=jpeg_quality)
        mime = "image/jpeg"
    else:
        img.save(out, format="PNG", optimize=False)
        mime = "image/png"
    return PreparedImage(name=name, mime=mime, data=out.getvalue(), size=img.size,
                         original_size=(width, height))
