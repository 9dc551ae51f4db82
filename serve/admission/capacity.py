"""KV-safe capacity: how many requests fit in the engine's KV cache at once (pure arithmetic).

An idle engine should take a burst up to this many requests at once (no gateway queue), and
the autotuner starts from it and returns to it when the engine goes idle. Past it, vLLM would
preempt (recompute) running requests to make room, which costs more than queueing them.

Formula::

    kv_safe_seqs = clamp(kv_tokens // tokens_per_request, 1, ceiling)
    tokens_per_request = ceil(image_share x images_per_request x max image tokens at num_crops)
                         + TEXT_TOKENS_PER_REQUEST     (at most max_model_len, when given)

``kv_tokens`` is the engine's real KV capacity (vLLM's ``num_gpu_blocks x block_size``, known
after the engine profiled its memory). The image term is the most tokens one image can take at
the server's ``num_crops`` (the Phi-3-vision HD transform formula: 313 at 1 crop, 2,653 at 16
for a 1:16 strip, 2,509 for a square). The server assumes :data:`IMAGE_CHAT`, one image per
request, the common case of image chat; a :class:`Mix` describes another workload (the
capacity planner, ``python -m serve.plan``, takes one from its flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Prompt text + answer tokens of a typical chat request: the ShareGPT means reported in the
#: vLLM paper (Kwon et al., SOSP 2023, section 6.1: 161 input and 338 output tokens), rounded
#: up to a power of two.
TEXT_TOKENS_PER_REQUEST = 512

#: Side of one Phi-3-vision crop (pixels), tokens per crop and per crop-row separator
#: (Microsoft's ``image_processing_phi3_v.py``; see ``serve/models/remote_code``).
_CROP, _PER_CROP, _PER_ROW = 336, 144, 12


def max_image_tokens(num_crops: int) -> int:
    """The most tokens one image can take at ``num_crops`` (any aspect ratio).

    Over every crop grid of ``h x w <= num_crops`` tiles: ``(h*w + 1)*144 + 1 + (h + 1)*12``.

    Raises:
        ValueError: ``num_crops`` < 1.
    """
    if num_crops < 1:
        raise ValueError(f"num_crops must be >= 1, got {num_crops}")
    return max((h * w + 1) * _PER_CROP + 1 + (h + 1) * _PER_ROW
               for h in range(1, num_crops + 1) for w in range(1, num_crops // h + 1))


@dataclass(frozen=True)
class Mix:
    """A workload's mean request, for the KV arithmetic.

    Attributes:
        image_share: fraction of requests that carry images, 0 to 1.
        images_per_request: images in each request that carries images (>= 1).
        text_tokens: prompt text + answer tokens of every request (>= 1: every answer has
            a token).

    Raises:
        ValueError: a field out of range (the message names it).
    """

    image_share: float = 1.0
    images_per_request: int = 1
    text_tokens: int = TEXT_TOKENS_PER_REQUEST

    def __post_init__(self) -> None:
        if not 0 <= self.image_share <= 1:
            raise ValueError(f"image_share must be between 0 and 1, got {self.image_share}")
        if self.images_per_request < 1:
            raise ValueError(f"images_per_request must be >= 1, got {self.images_per_request}")
        if self.text_tokens < 1:
            raise ValueError(f"text_tokens must be >= 1, got {self.text_tokens}")


#: The server's assumption: every request is an image chat with one image.
IMAGE_CHAT = Mix()


def tokens_per_request(num_crops: int, mix: Mix = IMAGE_CHAT,
                       max_model_len: int | None = None) -> int:
    """KV tokens of a mean request of ``mix`` (default: one image at ``num_crops`` plus text).

    ``ceil(image_share x images_per_request x max_image_tokens(num_crops)) + text_tokens``,
    at most ``max_model_len`` when given (no request holds more).

    Raises:
        ValueError: ``num_crops`` < 1.
    """
    image = math.ceil(mix.image_share * mix.images_per_request * max_image_tokens(num_crops))
    tokens = image + mix.text_tokens
    return tokens if max_model_len is None else min(tokens, max_model_len)


def kv_safe_seqs(kv_tokens: int, num_crops: int, ceiling: int, mix: Mix = IMAGE_CHAT,
                 max_model_len: int | None = None) -> int:
    """Requests whose KV cache fits at once, within ``[1, ceiling]``.

    Args:
        kv_tokens: the engine's KV-cache capacity, tokens.
        num_crops: the server's Phi-3-vision ``num_crops``.
        ceiling: the engine's ``max_num_seqs``.
        mix: the workload (default :data:`IMAGE_CHAT`: one image per request).
        max_model_len: the engine's context length: a request never holds more tokens.

    Raises:
        ValueError: ``kv_tokens`` < 0 or ``ceiling`` < 1.
    """
    if kv_tokens < 0 or ceiling < 1:
        raise ValueError("need kv_tokens >= 0 and ceiling >= 1")
    per = tokens_per_request(num_crops, mix, max_model_len)
    return max(1, min(ceiling, kv_tokens // per))
