"""Image intake policy: every image is decoded here, under caps, before vLLM sees it.

Pure functions (bytes in, bytes out) so the policy is testable without a server.

Policy (documented behaviour, also in docs/intake-and-security.md):

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
- **JPEG draft decoding.** A JPEG at least twice its HD target in both dimensions (a phone
  photo: 4032x3024 against 1344x1008 at ``num_crops`` 16, 336x252 at 1) is decoded by libjpeg
  at 1/2, 1/4 or 1/8 scale (DCT scaling, ``Image.draft``), never below the target, then
  resized exactly to the target. The size, hence the image tokens, is exactly the
  full-decode path's; the pixels differ slightly from a full decode and resize (mean
  absolute difference 0.33-0.75 levels of 255 on the real test photos at phone sizes,
  tested under 1: ``tests/unit/test_image_workers.py``), for a decode and resize 1.7x (1/2),
  2.5x (1/4) and 3x (1/8) cheaper (127 ms for a 12 MP photo in full).
- **Where it runs.** :func:`prepare_image` is pure; the intake runs it in a worker thread,
  or with ``--image-workers`` in a process pool (``serve.intake.workers``), same bytes out.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass, replace

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


#: Smallest ratio of a JPEG's size to its HD target, in both dimensions, at which it is
#: decoded at a reduced DCT scale (libjpeg's 1/2, 1/4, 1/8: Pillow picks the largest scale
#: that keeps the decoded image at least the target).
DRAFT_MIN_RATIO = 2
#: EXIF orientations that swap width and height (transposed, rotated by 90 or 270 degrees).
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


@dataclass(frozen=True)
class _Draft:
    """A JPEG set to decode at a reduced scale: the exact HD target of the full image
    (upright) and whether the HD transform works on it transposed (portrait)."""

    size: tuple[int, int]
    transposed: bool


def _draft_jpeg(image: Image.Image, num_crops: int) -> _Draft | None:
    """Ask libjpeg to decode ``image`` (opened, not loaded) at a reduced scale when its HD
    target is at most 1/:data:`DRAFT_MIN_RATIO` of it in both dimensions (module docstring).

    The target is computed from the full upright size (EXIF orientation read from the header:
    a JPEG's EXIF precedes its pixels), so the result has exactly the size of the full-decode
    path. Returns None (nothing changed) for other formats, smaller ratios, or images the HD
    transform would not reduce.
    """
    if image.format not in ("JPEG", "MPO"):
        return None
    width, height = image.size
    swap = image.getexif().get(EXIF_ORIENTATION, 1) in _SWAPPING_ORIENTATIONS
    upright = (height, width) if swap else (width, height)
    target = reduced_size(*upright, num_crops)
    if target is None:
        return None
    stored = (target[1], target[0]) if swap else target
    if width < DRAFT_MIN_RATIO * stored[0] or height < DRAFT_MIN_RATIO * stored[1]:
        return None
    image.draft(None, stored)  # mode unchanged; the size becomes ceil(size / scale)
    return _Draft(target, transposed=upright[0] < upright[1])


def _resize_drafted(image: Image.Image, draft: _Draft) -> Image.Image:
    """``hd_resize``'s steps (transpose a portrait image, bilinear resize, transpose back) to
    the full image's target: ``hd_resize`` itself would compute the target from the drafted
    size, whose rounding (ceil of size / scale) may move it by a pixel."""
    width, height = draft.size
    if draft.transposed:
        landscape = image.transpose(Image.Transpose.TRANSPOSE)
        small = landscape.resize((height, width), Image.Resampling.BILINEAR)
        return small.transpose(Image.Transpose.TRANSPOSE)
    return image.resize((width, height), Image.Resampling.BILINEAR)


def prepare_pixels(raw: bytes, policy: ImagePolicy, num_crops: int,
                   param: str) -> PreparedImage:
    """:func:`prepare_image`'s pixel work, the part a process pool runs
    (``serve.intake.workers``): everything except the ``data:`` URL of a passthrough, which
    is left empty (the caller holds the client's base64 text; :func:`finish_passthrough`).

    Raises:
        IntakeError: as :func:`prepare_image`.
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
                draft = _draft_jpeg(image, num_crops)
                image.load()
                rotate = image.getexif().get(EXIF_ORIENTATION, 1) in range(2, 9)
                upright = ImageOps.exif_transpose(image) if rotate else image
                rgb = to_rgb(upright)
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombWarning,
                Image.DecompressionBombError) as exc:
            raise IntakeError(400, f"image data is truncated or corrupt ({exc})", param) from None
        if draft is not None:
            small = _resize_drafted(rgb, draft)
            return PreparedImage(png_data_url(small), small.width, small.height, fmt,
                                 "reduced")
        unchanged = (fmt in PASSTHROUGH_FORMATS and image.mode == "RGB" and not rotate
                     and not animated)
        width, height = rgb.size
        if reduced_size(width, height, num_crops) is not None:
            small = hd_resize(rgb, num_crops)
            return PreparedImage(png_data_url(small), small.width, small.height, fmt,
                                 "reduced")
        if not unchanged:
            return PreparedImage(png_data_url(rgb), width, height, fmt, "reencoded")
    return PreparedImage("", width, height, fmt, "passthrough")


def finish_passthrough(image: PreparedImage, raw: bytes,
                       base64_payload: str | None = None) -> PreparedImage:
    """``image`` (from :func:`prepare_pixels`) with the ``data:`` URL of a passthrough: the
    client's base64 text ``base64_payload`` of ``raw`` (None: ``raw`` encoded here). Other
    actions are returned as they are."""
    if image.action != "passthrough" or image.url:
        return image
    if base64_payload is None:
        base64_payload = base64.b64encode(raw).decode("ascii")
    url = f"data:{Image.MIME.get(image.source_format, 'image/png')};base64,{base64_payload}"
    return replace(image, url=url)


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
    return finish_passthrough(prepare_pixels(raw, policy, num_crops, param), raw,
                              base64_payload)
