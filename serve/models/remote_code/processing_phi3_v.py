# Our own Phi-3-vision processor, copied next to config.json by
# `python -m serve.models.build` and loaded by transformers / vLLM with
# trust_remote_code=True. It must stay self-contained (transformers' dynamic
# module loader only resolves relative imports of sibling files) and must not
# need torchvision: Pillow, numpy and torch only.
"""Phi-3-vision image processor and processor, without torchvision.

A re-implementation of Microsoft's published ``image_processing_phi3_v.py`` /
``processing_phi3_v.py`` (microsoft/Phi-3-vision-128k-instruct), whose
torchvision calls are replaced by their Pillow / torch equivalents:

* ``torchvision.transforms.functional.resize(img, [h, w])`` on a PIL image is
  ``img.resize((w, h), Image.BILINEAR)`` (torchvision's default interpolation
  for PIL input is bilinear, computed by Pillow);
* ``torchvision.transforms.functional.pad(..., fill=[255, 255, 255])`` is a
  paste onto a white canvas;
* ``ToTensor`` + ``Normalize`` is ``(x / 255 - mean) / std`` in float32.

HD transform (``hd_transform_size`` / ``hd_transform``), for ``num_crops`` K:

1. transpose if width < height (so width >= height);
2. ``ratio = w / h``; ``scale = 1; while scale * ceil(scale / ratio) <= K:
   scale += 1``; ``scale -= 1``;
3. ``new_w = int(scale * 336)``, ``new_h = int(new_w / ratio)``; resize
   (bilinear) to ``(new_w, new_h)``;
4. pad the height to ``ceil(new_h / 336) * 336`` with white (255), top
   padding ``int((target - new_h) / 2)``, the rest at the bottom;
5. transpose back.

The padded image is cut into ``h_tiles x w_tiles`` 336-px crops (``h_tiles =
padded_h // 336``), preceded by a "global" view (the whole padded image
bicubically resized to 336x336) and zero-padded to K + 1 crops.
Token count per image (Microsoft's ``calc_num_image_tokens_from_image_size``
and vLLM's ``Phi3HDImageEmbedding``: 12x12 merged patches per crop, one
separator per row, one global/sub separator)::

    (h_tiles * w_tiles + 1) * 144 + 1 + (h_tiles + 1) * 12

e.g. 1500x1000 at K=4 -> 2x2 tiles -> 757 tokens; at K=16 -> 3x4 -> 1921;
a square image at K=16 -> 4x4 -> 2509.

One deliberate deviation: ``new_h`` is clamped to at least 1 pixel, so
extreme strips (where Microsoft's code would resize to height 0 and fail)
get one row of tiles instead of an error. Counting and pixel processing share
the same helper, so the token count always matches ``image_sizes``.
"""


import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature, ProcessorMixin
from transformers.image_processing_utils import BaseImageProcessor

CROP_SIZE = 336
"""Side of one CLIP ViT-L/14-336 crop, pixels."""
TOKENS_PER_CROP = 144
"""(336/14/2)^2: 24x24 patches merged 2x2."""
TOKENS_PER_ROW_SEPARATOR = 12
"""336/14/2 merged patches per crop row; each row of the HD grid adds one separator per 12."""
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGE_PLACEHOLDERS = 1000
"""Length of ``Phi3VProcessor.img_tokens`` (``<|image_1|>`` .. ``<|image_1000|>``)."""


def hd_transform_size(width, height, num_crops):
    """Size after the HD transform (resize + pad), without touching pixels.

    Args:
        width, height: input image size in pixels (>= 1).
        num_crops: K, the maximum number of 336-px sub-crops (>= 1).

    Returns:
        ``(resized_w, resized_h, padded_w, padded_h, top_pad, transposed)``,
        sizes in the original orientation except ``resized_*``, ``top_pad``
        which are in the transposed (landscape) frame. ``padded_w`` and
        ``padded_h`` are multiples of 336.

    Raises:
        ValueError: on a non-positive size or ``num_crops``.
    """
    width, height, num_crops = int(width), int(height), int(num_crops)
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if num_crops < 1:
        raise ValueError(f"num_crops must be >= 1, got {num_crops}")
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * CROP_SIZE)
    new_h = max(1, int(new_w / ratio))  # clamp: see module docstring
    target_h = int(np.ceil(new_h / CROP_SIZE) * CROP_SIZE)
    top = int((target_h - new_h) / 2)
    padded_w, padded_h = new_w, target_h
    if transposed:
        padded_w, padded_h = padded_h, padded_w
    return new_w, new_h, padded_w, padded_h, top, transposed


def num_image_tokens(padded_width, padded_height):
    """Image tokens for an HD-transformed image of the given padded size.

    ``(h * w + 1) * 144 + 1 + (h + 1) * 12`` with ``h = padded_height // 336``
    and ``w = padded_width // 336`` (Microsoft's ``image_processing_phi3_v.py``;
    matches the embedding count of vLLM's ``Phi3HDImageEmbedding``).
    """
    h = padded_height // CROP_SIZE
    w = padded_width // CROP_SIZE
    return (h * w + 1) * TOKENS_PER_CROP + 1 + (h + 1) * TOKENS_PER_ROW_SEPARATOR


def _to_rgb(image):
    """A PIL RGB image from a PIL image or an HWC / HW uint8 array.

    Like Microsoft's code this is ``image.convert("RGB")`` (alpha is dropped,
    not composited), except that 16/32-bit grayscale is scaled to 8 bits
    first, where Pillow's direct conversion would clip.
    """
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        arr = image
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.transpose(arr, (1, 2, 0))  # CHW -> HWC
        if arr.dtype != np.uint8:
            arr = np.clip(arr * (255.0 if arr.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        image = Image.fromarray(arr)
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image or an array, got {type(image).__name__}")
    if image.mode == "RGB":
        return image
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        arr = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if image.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        image = Image.fromarray(np.clip(arr * (255.0 / peak), 0, 255).astype(np.uint8))
    return image.convert("RGB")


def _landscape_resize(image, num_crops):
    """Steps 1-3 of the HD transform: ``(resized image in the landscape frame, top padding,
    transposed)``."""
    new_w, new_h, _, _, top, transposed = hd_transform_size(image.width, image.height, num_crops)
    if transposed:
        image = image.transpose(Image.Transpose.TRANSPOSE)
    return image.resize((new_w, new_h), Image.Resampling.BILINEAR), top, transposed


def hd_resize(image, num_crops):
    """Steps 1-3 and 5 of the HD transform (transpose, bilinear resize, transpose back),
    without the padding.

    Returns a PIL image of the resized size in the original orientation. Pillow returns a
    copy when the size is unchanged, so resizing an image this function produced is the
    identity whenever :func:`hd_transform_size` maps its size to itself.
    """
    image, _, transposed = _landscape_resize(image, num_crops)
    return image.transpose(Image.Transpose.TRANSPOSE) if transposed else image


def hd_transform(image, num_crops):
    """Resize and white-pad a PIL RGB image as in Phi-3-vision's ``HD_transform``.

    Returns a PIL RGB image whose width and height are multiples of 336.
    """
    image, top, transposed = _landscape_resize(image, num_crops)
    new_w, new_h = image.size
    target_h = int(np.ceil(new_h / CROP_SIZE) * CROP_SIZE)
    canvas = Image.new("RGB", (new_w, target_h), (255, 255, 255))
    canvas.paste(image, (0, top))
    if transposed:
        canvas = canvas.transpose(Image.Transpose.TRANSPOSE)
    return canvas


class Phi3VImageProcessor(BaseImageProcessor):
    """Phi-3-vision HD image processor (Pillow + torch, no torchvision).

    Args:
        num_crops: K, the maximum number of 336x336 sub-crops per image; the
            output always has K + 1 crops (global view first). vLLM sets it
            with ``mm_processor_kwargs={"num_crops": K}``. Default 1.
        image_mean, image_std: per-channel normalisation (CLIP's by default).
        do_convert_rgb: convert inputs to RGB first (default true).
        num_img_tokens: tokens per crop, 144 (kept for config compatibility).
    """

    model_input_names = ["pixel_values", "image_sizes"]

    def __init__(
        self,
        num_crops=1,
        image_mean=None,
        image_std=None,
        do_convert_rgb=True,
        num_img_tokens=TOKENS_PER_CROP,
        **kwargs,
    ):
        for key in ("auto_map", "image_processor_type", "processor_class"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)
        self.num_crops = int(num_crops)
        self.image_mean = list(OPENAI_CLIP_MEAN if image_mean is None else image_mean)
        self.image_std = list(OPENAI_CLIP_STD if image_std is None else image_std)
        self.do_convert_rgb = do_convert_rgb
        self.num_img_tokens = int(num_img_tokens)

    @classmethod
    def from_dict(cls, image_processor_dict, **kwargs):
        """Like the base class, but accept ``num_crops`` as a loading kwarg.

        ``AutoImageProcessor.from_pretrained(dir, num_crops=K)`` (what vLLM
        does with ``mm_processor_kwargs``) then sets K without transformers'
        "applied for backward compatibility" warning.
        """
        image_processor_dict = dict(image_processor_dict)
        if kwargs.get("num_crops") is not None:
            image_processor_dict["num_crops"] = kwargs.pop("num_crops")
        return super().from_dict(image_processor_dict, **kwargs)

    def calc_num_image_tokens_from_image_size(self, width, height, num_crops=None):
        """Number of ``<|image|>`` tokens for an image of ``width`` x ``height`` pixels.

        Formula: see :func:`num_image_tokens`; the padded size comes from
        :func:`hd_transform_size` with ``num_crops`` (default ``self.num_crops``).
        """
        k = self.num_crops if num_crops is None else num_crops
        _, _, padded_w, padded_h, _, _ = hd_transform_size(width, height, k)
        return num_image_tokens(padded_w, padded_h)

    def calc_num_image_tokens(self, images, num_crops=None):
        """Number of image tokens for each image of ``images`` (list of ints)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        sizes = [_to_rgb(im).size for im in images]
        return [self.calc_num_image_tokens_from_image_size(w, h, num_crops) for w, h in sizes]

    def _crops(self, image, num_crops, mean, std):
        """``(num_crops + 1, 3, 336, 336)`` float32 crops and the padded ``(h, w)``."""
        hd = hd_transform(image, num_crops)
        arr = torch.from_numpy(np.asarray(hd, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
        arr = (arr - mean) / std  # (3, H, W)
        _, height, width = arr.shape
        h_tiles, w_tiles = height // CROP_SIZE, width // CROP_SIZE
        global_view = torch.nn.functional.interpolate(
            arr.unsqueeze(0), size=(CROP_SIZE, CROP_SIZE), mode="bicubic"
        )
        tiles = (
            arr.reshape(3, h_tiles, CROP_SIZE, w_tiles, CROP_SIZE)
            .permute(1, 3, 0, 2, 4)
            .reshape(-1, 3, CROP_SIZE, CROP_SIZE)
        )
        crops = torch.cat([global_view, tiles], dim=0)
        if crops.shape[0] < num_crops + 1:
            pad = torch.zeros(num_crops + 1 - crops.shape[0], 3, CROP_SIZE, CROP_SIZE,
                              dtype=crops.dtype)
            crops = torch.cat([crops, pad], dim=0)
        return crops.contiguous(), (height, width)

    def preprocess(
        self,
        images,
        num_crops=None,
        image_mean=None,
        image_std=None,
        do_convert_rgb=None,
        return_tensors="pt",
        **kwargs,
    ):
        """HD-transform and normalise images.

        Args:
            images: one image or a list (PIL images or uint8 arrays).
            num_crops: overrides ``self.num_crops`` for this call.
            return_tensors: ``"pt"`` (default), ``"np"`` or ``None`` (lists).

        Returns:
            ``BatchFeature`` with ``pixel_values`` float32 (n, K + 1, 3, 336,
            336) -- global view, then the sub-crops row-major, then zero
            crops -- ``image_sizes`` int64 (n, 2) = ``[padded_height,
            padded_width]`` and ``num_img_tokens`` (n,).

        Raises:
            TypeError: for an input that is not an image.
        """
        k = int(self.num_crops if num_crops is None else num_crops)
        mean = torch.tensor(self.image_mean if image_mean is None else image_mean,
                            dtype=torch.float32)
        std = torch.tensor(self.image_std if image_std is None else image_std, dtype=torch.float32)
        convert = self.do_convert_rgb if do_convert_rgb is None else do_convert_rgb
        if not isinstance(images, (list, tuple)):
            images = [images]
        pil = [_to_rgb(im) if convert or not isinstance(im, Image.Image) else im for im in images]
        pil = [im if im.mode == "RGB" else im.convert("RGB") for im in pil]
        crops, sizes = [], []
        for im in pil:
            c, hw = self._crops(im, k, mean.view(3, 1, 1), std.view(3, 1, 1))
            crops.append(c)
            sizes.append(list(hw))
        data = {
            "pixel_values": (torch.stack(crops) if crops
                             else torch.zeros(0, k + 1, 3, CROP_SIZE, CROP_SIZE)),
            "image_sizes": torch.tensor(sizes, dtype=torch.long).reshape(-1, 2),
            "num_img_tokens": torch.tensor([num_image_tokens(w, h) for h, w in sizes],
                                           dtype=torch.long),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images, **kwargs):
        """Same as :meth:`preprocess`."""
        return self.preprocess(images, **kwargs)

    def to_dict(self):
        """Serialisable settings (written to ``preprocessor_config.json``)."""
        out = {
            "image_processor_type": type(self).__name__,
            "num_crops": self.num_crops,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_convert_rgb": self.do_convert_rgb,
            "num_img_tokens": self.num_img_tokens,
        }
        return out


class Phi3VProcessor(ProcessorMixin):
    """Phi-3-vision processor: our :class:`Phi3VImageProcessor` + the tokenizer.

    What vLLM's ``phi3v.py`` uses: ``img_tokens`` (``<|image_1|>`` ...),
    ``calc_num_image_tokens_from_image_size(width, height)`` and ``__call__``
    returning ``pixel_values`` / ``image_sizes``. vLLM replaces the
    ``<|image_N|>`` placeholders by ``<|image|>`` (id 32044) runs itself, so
    unlike Microsoft's processor this one tokenizes the text as-is.

    Args:
        image_processor: a :class:`Phi3VImageProcessor`.
        tokenizer: a transformers tokenizer.
        chat_template: optional Jinja template.
        num_crops: if given, overrides ``image_processor.num_crops`` (this is
            where ``AutoProcessor.from_pretrained(dir, num_crops=K)`` lands).
    """

    special_image_token = "<|image|>"

    def __init__(self, image_processor, tokenizer, chat_template=None, num_crops=None):
        if num_crops is not None:
            image_processor.num_crops = int(num_crops)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.img_tokens = [f"<|image_{i + 1}|>" for i in range(MAX_IMAGE_PLACEHOLDERS)]

    @property
    def num_crops(self):
        """K of the image processor (maximum sub-crops per image)."""
        return self.image_processor.num_crops

    @property
    def num_img_tokens(self):
        """Tokens per 336-px crop (144)."""
        return self.image_processor.num_img_tokens

    def calc_num_image_tokens_from_image_size(self, width, height):
        """Image tokens for a ``width`` x ``height`` image (see the module docstring)."""
        return self.image_processor.calc_num_image_tokens_from_image_size(width, height)

    def calc_num_image_tokens(self, images):
        """Image tokens for each of ``images``."""
        return self.image_processor.calc_num_image_tokens(images)

    @property
    def special_image_token_id(self):
        """Id of ``<|image|>`` (32044)."""
        return self.tokenizer.convert_tokens_to_ids(self.special_image_token)

    def __call__(
        self,
        text=None,
        images=None,
        padding=False,
        truncation=None,
        max_length=None,
        return_tensors="pt",
        num_crops=None,
        **kwargs,
    ):
        """Tokenize ``text`` (placeholders stay text) and process ``images``.

        Returns:
            ``BatchFeature`` with ``input_ids`` / ``attention_mask`` when text
            is given and ``pixel_values`` (n, K + 1, 3, 336, 336) /
            ``image_sizes`` (n, 2) = ``[padded_height, padded_width]`` when
            images are given. Other keyword arguments (vLLM's scoped
            ``*_kwargs`` dicts and the like) are accepted and ignored, except
            ``add_special_tokens``, passed to the tokenizer.
        """
        data = {}
        if images is not None:
            out = self.image_processor(images, num_crops=num_crops, return_tensors=None)
            data["pixel_values"] = out["pixel_values"]
            data["image_sizes"] = out["image_sizes"]
        if text is not None:
            tok_kwargs = {"padding": padding, "truncation": truncation, "max_length": max_length}
            if "add_special_tokens" in kwargs:
                tok_kwargs["add_special_tokens"] = kwargs["add_special_tokens"]
            enc = self.tokenizer(text, return_tensors=return_tensors, **tok_kwargs)
            data["input_ids"] = enc["input_ids"]
            if "attention_mask" in enc:
                data["attention_mask"] = enc["attention_mask"]
        return BatchFeature(data=data, tensor_type=return_tensors)

    @property
    def model_input_names(self):
        """Inputs the model consumes."""
        return ["input_ids", "attention_mask", "pixel_values", "image_sizes"]
