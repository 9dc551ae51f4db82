"""One table, two implementations: the server's and the UI's image-to-RGB conversions (the UI
runs in its own venv and does not import the server) give the same pixels for every mode."""

from __future__ import annotations

import pytest
from PIL import Image

from serve.intake.images import to_rgb as server_to_rgb
from ui.images import to_rgb as ui_to_rgb


def _palette(transparent: bool) -> Image.Image:
    img = Image.new("P", (4, 2), 1)
    img.putpalette([0, 0, 0, 200, 30, 30] + [0, 0, 0] * 254)
    img.putpixel((0, 0), 0)
    if transparent:
        img.info["transparency"] = 0
    return img


def _sixteen_bit(mode: str) -> Image.Image:
    img = Image.new(mode, (4, 2), 1000)
    img.putpixel((0, 0), 3000)
    return img


#: (case, image, expected RGB of pixel (0, 0), of pixel (1, 0)).
TABLE = [
    ("RGB", Image.new("RGB", (4, 2), (10, 20, 30)), (10, 20, 30), (10, 20, 30)),
    ("L", Image.new("L", (4, 2), 77), (77, 77, 77), (77, 77, 77)),
    ("1", Image.new("1", (4, 2), 1), (255, 255, 255), (255, 255, 255)),
    ("LA half", Image.new("LA", (4, 2), (0, 128)), (127, 127, 127), (127, 127, 127)),
    ("La", Image.new("La", (4, 2), (0, 0)), (255, 255, 255), (255, 255, 255)),
    ("RGBA clear", Image.new("RGBA", (4, 2), (200, 0, 0, 0)), (255, 255, 255), (255, 255, 255)),
    ("RGBA opaque", Image.new("RGBA", (4, 2), (200, 0, 0, 255)), (200, 0, 0), (200, 0, 0)),
    ("PA", Image.new("PA", (4, 2), (0, 0)), (255, 255, 255), (255, 255, 255)),
    ("P", _palette(False), (0, 0, 0), (200, 30, 30)),
    ("P transparent", _palette(True), (255, 255, 255), (200, 30, 30)),
    ("CMYK", Image.new("CMYK", (4, 2), (0, 255, 255, 0)), (255, 0, 0), (255, 0, 0)),
    ("I;16", _sixteen_bit("I;16"), (255, 255, 255), (0, 0, 0)),
    ("I", _sixteen_bit("I"), (255, 255, 255), (0, 0, 0)),
    ("F", _sixteen_bit("F"), (255, 255, 255), (0, 0, 0)),
]


@pytest.mark.parametrize("case,image,first,second", TABLE, ids=[t[0] for t in TABLE])
@pytest.mark.parametrize("to_rgb", [server_to_rgb, ui_to_rgb], ids=["server", "ui"])
def test_every_mode_becomes_the_same_8_bit_rgb(to_rgb, case, image, first, second):
    out = to_rgb(image.copy() if image.mode != "P" else image)
    assert out.mode == "RGB" and out.size == image.size
    for got, want in ((out.getpixel((0, 0)), first), (out.getpixel((1, 0)), second)):
        assert all(abs(g - w) <= 1 for g, w in zip(got, want, strict=True)), (case, got, want)
