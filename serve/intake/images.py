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
- **Output: never inflate.** What vLLM receives costs it no more than the client's original
  (see :func:`prepare_image`): an image larger than the Phi-3-vision HD transform's resize
  target for the request's ``num_crops`` is reduced to exactly that size with the processor's
  own resize (``hd_resize``), so vLLM's resize becomes the identity and tokens and pixels are
  those vLLM would compute from the original; an image that needs no change (8-bit RGB JPEG,
  PNG, WEBP or BMP, upright, single frame, not over the target) goes to vLLM as it came; only
  an image that must change (mode, orientation, animation, format) and cannot be reduced is
  re-encoded at its own size. Re-encoding is PNG (lossless, fast compression) and
  deterministic, so the same image always reaches vLLM as the same bytes and hits vLLM's
  multimodal cache.
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
from serve.models.remote_code.processing_phi3_v import hd_resize, hd_transform_size

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


#: Formats vLLM decodes exactly as we do (same Pillow), so an image in one of them that needs no
#: change may be forwarded as it came. TIFF and GIF are always re-encoded (multi-page, palette).
PASSTHROUGH_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "BMP"})
#: EXIF tag of the orientation (TIFF/EXIF 2.3, tag 274); values 2-8 need a transpose.
EXIF_ORIENTATION = 0x0112


@dataclass(frozen=True)
class PreparedImage:
    """An image after intake, ready for vLLM.

    Attributes:
        url: the ``data:`` URL forwarded to vLLM.
        width, height: pixel size of the forwarded image (its token count equals the
            original's: see :func:`prepare_image`).
        source_format: Pillow format name of the client's image.
        action: ``"passthrough"`` (the client's bytes), ``"reduced"`` (resized to the HD
            transform's target, PNG) or ``"reencoded"`` (normalised at its own size, PNG).
    """

    url: str
    width: int
    height: int
    source_format: str
    action: str

    @property
    def nbytes(self) -> int:
        """Memory held by :attr:`url`, bytes (for cache accounting)."""
        return len(self.url)


def png_data_url(image: Image.Image) -> str:
    """A deterministic ``data:image/png`` URL of an RGB image (fast zlib level 1)."""
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def reduced_size(width: int, height: int, num_crops: int) -> tuple[int, int] | None:
    """The size the HD transform resizes a ``width`` x ``height`` image to, when that is a
    reduction vLLM would not change again, else None.

    None when the transform would upscale (we never inflate) or when the target is not a
    fixed point of :func:`hd_transform_size` (float truncation makes about 5 % of arbitrary
    sizes, none of the common photo sizes, resize once more by a pixel row; those images are
    not reduced, so tokens and pixels stay exactly vLLM's).
    """
    new_w, new_h, padded_w, padded_h, top, transposed = hd_transform_size(width, height,
                                                                        num_crops)
    if new_w >= max(width, height):
        return None
    size = (new_h, new_w) if transposed else (new_w, new_h)
    if hd_transform_size(*size, num_crops)[:5] != (new_w, new_h, padded_w, padded_h, top):
        return None
    return size


def data_url_payload(url: str, max_bytes: int, param: str) -> str:
    """The base64 text of a ``data:`` URL, checked for shape and size without decoding it.

    Raises:
        IntakeError: 400 malformed URL, 413 decoded size (3/4 of the text) over ``max_bytes``.
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
    return payload


def decode_base64(payload: str, param: str) -> bytes:
    """The bytes of a base64 text (strict alphabet).

    Raises:
        IntakeError: 400 invalid base64 or empty.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise IntakeError(400, "image data URL is not valid base64", param) from None
    if not raw:
        raise IntakeError(400, "image is empty (0 bytes)", param)
    return raw


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB, transparency composited on :data:`BACKGROUND`; 16-bit and float images
    stretched from their extrema to 0-255. The UI's ``ui.images.to_rgb`` (its own venv, no
    import of this package) must give the same pixels: one table tests both
    (``tests/unit/test_rgb_parity.py``)."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        image = image.convert("I") if image.mode.startswith("I;16") else image
        lo, hi = image.getextrema()
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        image = image.point(lambda v: (v - lo) * scale).convert("L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode == "La":  # premultiplied: Pillow converts it to LA only
        image = image.convert("LA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa"):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if image.mode != "RGB":
        image = image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV
    return image


def _format(image: Image.Image) -> str:
    """Pillow's format name of ``image``, upper case; phone JPEGs with a multi-picture
    extension (Pillow's ``MPO``) are JPEGs."""
    fmt = (image.format or "").upper()
    return "JPEG" if fmt == "MPO" else fmt


def _open_checked(raw: bytes, policy: ImagePolicy, param: str) -> Image.Image:
    """Open ``raw`` reading only its header; enforce bytes, format and pixel caps.

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
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        # Pillow's own header check fired (its threshold is above max_pixels by default).
        raise IntakeError(413, f"image has more pixels than the limit of {policy.max_pixels} "
                          "pixels", param, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise IntakeError(400, "image data is not a readable image (corrupt or unknown "
                          f"format; accepted: {', '.join(sorted(policy.formats))})",
                          param) from None
    fmt = _format(image)
    if fmt not in policy.formats:
        image.close()
        raise IntakeError(400, f"image format {fmt or 'unknown'} is not accepted; accepted:"
                          f" {', '.join(sorted(policy.formats))}", param)
    width, height = image.size
    if width < 1 or height < 1:
        image.close()
        raise IntakeError(400, f"image has no pixels ({width}x{height})", param)
    if width * height > policy.max_pixels:
        image.close()
        raise IntakeError(413, f"image is {width}x{height} = {width * height} pixels; the "
                          f"limit is {policy.max_pixels} pixels", param,
                          code="image_too_large")
    return image


def prepare_image(raw: bytes, policy: ImagePolicy, num_crops: int, param: str,
                  base64_payload: str | None = None) -> PreparedImage:
    """Check, normalise and size one encoded image for vLLM (policy: module docstring).

    Every pixel is decoded (truncated or corrupt data is caught here, never in vLLM), EXIF
    orientation applied and the mode made 8-bit RGB; then the cheapest faithful form is chosen:
    ``reduced`` to the HD transform's target when larger, else ``passthrough`` when nothing
    had to change, else ``reencoded``.

    Args:
        raw: the encoded image bytes.
        policy: caps.
        num_crops: the request's Phi-3-vision ``num_crops`` (the HD transform's K).
        param: the request field this image came from, for error messages
            (e.g. ``messages[0].content[1].image_url``).
        base64_payload: the client's base64 text of ``raw`` (from its ``data:`` URL), reused
            for a passthrough instead of encoding ``raw`` again (None: encode ``raw``).

    Returns:
        the prepared image.

    Raises:
        IntakeError: 400 (corrupt, unsupported, empty), 413 (too many bytes or pixels).
    """
    image = _open_checked(raw, policy, param)
    with image:
        fmt = _format(image)
        try:
            animated = bool(getattr(image, "is_animated", False))
            if animated:
                image.seek(0)  # first frame of an animation
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image.load()
                rotate = image.getexif().get(EXIF_ORIENTATION, 1) in range(2, 9)
                upright = ImageOps.exif_transpose(image) if rotate else image
                rgb = to_rgb(upright)
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombWarning,
                Image.DecompressionBombError) as exc:
            raise IntakeError(400, f"image data is truncated or corrupt ({exc})", param) from None
        unchanged = (fmt in PASSTHROUGH_FORMATS and image.mode == "RGB" and not rotate
                     and not animated)
        width, height = rgb.size
        if reduced_size(width, height, num_crops) is not None:
            small = hd_resize(rgb, num_crops)
            return PreparedImage(png_data_url(small), small.width, small.height, fmt,
                                 "reduced")
        if not unchanged:
            return PreparedImage(png_data_url(rgb), width, height, fmt, "reencoded")
    if base64_payload is None:
        base64_payload = base64.b64encode(raw).decode("ascii")
    url = f"data:{Image.MIME.get(fmt, 'image/png')};base64,{base64_payload}"
    return PreparedImage(url, width, height, fmt, "passthrough")
