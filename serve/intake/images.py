"""Image intake policy: every image is decoded here, under caps, before vLLM sees it.

Pure functions (bytes in, bytes out) so the policy is testable without a server.

Policy (documented behaviour, also in the README):

- **Size caps.** A ``data:`` URL's base64 payload is measured *before* decoding (decoded size =
  3/4 of the payload): over ``max_bytes`` is 413. Pixels (width x height) are read from the
  image header before any pixel is decoded: over ``max_pixels`` is 413, so a decompression
  bomb (e.g. a 14000x14000 PNG of 24 KB) is refused without allocating it.
- **Formats.** Only the allowlisted Pillow formats (PNG, JPEG, GIF, WEBP, BMP, TIFF by
  default); anything else, empty, truncated or corrupt data is 400.
- **Orientation.** EXIF orientation is applied (a photo stored sideways is served upright).
- **Modes.** L, LA, P (with or without transparency), RGBA, CMYK, I;16/I/F and 1-bit images
  become 8-bit RGB; transparent pixels are composited on white (Phi-3-vision pads with white).
  16-bit and float images are scaled to 8 bits by their full range.
- **Animation.** Animated GIF/WEBP/APNG: the first frame only.
- **Tiny and extreme images.** Accepted: the HD transform upscales a tiny image to one 336-px
  crop and pads a thin strip with white, so a 1x1 pixel or a 2000x8 strip costs at most the
  tokens of its ``num_crops`` budget, like any other image.
- **Output.** The normalised image is re-encoded as PNG (lossless, fast compression) and
  handed to vLLM as a ``data:image/png`` URL: vLLM only ever decodes images we produced.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from serve.intake.errors import IntakeError

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)"
                       r"(?P<b64>;base64)?,", re.IGNORECASE)
#: Background for transparent pixels (white, as the HD transform's padding).
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class ImagePolicy:
    """Caps of the intake policy.

    Attributes:
        max_bytes: largest encoded image, bytes.
        max_pixels: largest width x height, pixels.
        formats: allowed Pillow format names (upper case).
    """

    max_bytes: int
    max_pixels: int
    formats: frozenset[str]


@dataclass(frozen=True)
class NormalizedImage:
    """An image after intake: 8-bit RGB PNG bytes and its size in pixels."""

    png: bytes
    width: int
    height: int
    source_format: str

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


def decode_data_url(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL, refusing oversize payloads before decoding.

    Raises:
        IntakeError: 400 malformed URL or base64, 413 decoded size over ``max_bytes``.
    """
    match = _DATA_URL.match(url)
    if not match or not match.group("b64"):
        raise IntakeError(400, "image data URL must look like data:image/<type>;base64,<data>",
                          param)
    payload = url[match.end():]
    estimated = len(payload) * 3 // 4
    if estimated > max_bytes:
        raise IntakeError(413, f"image is about {estimated} bytes; the limit is {max_bytes} "
                          "bytes per image", param, code="image_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise IntakeError(400, "image data URL is not valid base64", param) from None
    if not raw:
        raise IntakeError(400, "image is empty (0 bytes)", param)
    return raw


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB, transparency composited on :data:`BACKGROUND`."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        image = image.convert("I") if image.mode.startswith("I;16") else image
        lo, hi = image.getextrema()
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        image = image.point(lambda v: (v - lo) * scale).convert("L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if image.mode != "RGB":
        image = image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV
    return image


def normalize_image(raw: bytes, policy: ImagePolicy, param: str) -> NormalizedImage:
    """Check and normalise one encoded image (see the module docstring for the policy).

    Args:
        raw: the encoded image bytes.
        policy: caps.
        param: the request field this image came from, for error messages
            (e.g. ``messages[0].content[1].image_url``).

    Returns:
        the normalised image.

    Raises:
        IntakeError: 400 (corrupt, unsupported, empty), 413 (too many bytes or pixels).
    """
    if len(raw) > policy.max_bytes:
        raise IntakeError(413, f"image is {len(raw)} bytes; the limit is {policy.max_bytes} "
                          "bytes per image", param, code="image_too_large")
    if not raw:
        raise IntakeError(400, "image is empty (0 bytes)", param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))  # header only: no pixel decoded yet
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        # Pillow's own header check fired (its threshold is above max_pixels by default).
        raise IntakeError(413, f"image has too many pixels ({exc}); the limit is "
                          f"{policy.max_pixels} pixels", param, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise IntakeError(400, "image data is not a readable image (corrupt or unknown "
                          f"format; accepted: {', '.join(sorted(policy.formats))})",
                          param) from None
    with image:
        fmt = (image.format or "").upper()
        if fmt not in policy.formats:
            raise IntakeError(400, f"image format {fmt or 'unknown'} is not accepted; accepted:"
                              f" {', '.join(sorted(policy.formats))}", param)
        width, height = image.size
        if width < 1 or height < 1:
            raise IntakeError(400, f"image has no pixels ({width}x{height})", param)
        if width * height > policy.max_pixels:
            raise IntakeError(413, f"image is {width}x{height} = {width * height} pixels; the "
                              f"limit is {policy.max_pixels} pixels", param,
                              code="image_too_large")
        try:
            if getattr(image, "is_animated", False):
                image.seek(0)  # first frame of an animation
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image.load()
                upright = ImageOps.exif_transpose(image)
                rgb = _to_rgb(upright)
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombWarning,
                Image.DecompressionBombError) as exc:
            raise IntakeError(400, f"image data is truncated or corrupt ({exc})", param) from None
    out = io.BytesIO()
    rgb.save(out, format="PNG", compress_level=1)
    return NormalizedImage(out.getvalue(), rgb.width, rgb.height, fmt)
