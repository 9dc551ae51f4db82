"""Prompt-length check: text tokens + image tokens against ``max_model_len``, before vLLM.

Counting follows vLLM 0.32's Phi-3-vision path exactly for our tokenizer (see
``serve/models/tokenizer.py``): vLLM flattens each message to ``<|image_1|>\\n...<|image_k|>\\n``
followed by the text parts joined by ``\\n``, renders the Phi-3 chat template, and replaces each
placeholder by the image's tokens; the template's BOS is dropped when there are images. Image
tokens per image come from the HD transform formula in
``serve/models/remote_code/processing_phi3_v.py`` (Microsoft's ``image_processing_phi3_v.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.intake.errors import IntakeError
from serve.intake.request import ChatRequest
from serve.models.remote_code.processing_phi3_v import hd_transform_size, num_image_tokens


def image_tokens(width: int, height: int, num_crops: int) -> int:
    """Phi-3-vision image tokens for a ``width`` x ``height`` image at ``num_crops``."""
    return num_image_tokens(*hd_transform_size(width, height, num_crops)[2:4])


@dataclass
class PromptCount:
    """Token counts of one prompt."""

    text: int
    image: int
    images: int

    @property
    def total(self) -> int:
        return self.text + self.image


class PromptBudget:
    """Counts a chat prompt's tokens and refuses what cannot fit ``max_model_len``.

    Args:
        tokenizer: a Hugging Face tokenizer with the model's chat template.
        max_model_len: context length, tokens.
        default_num_crops: the server's ``num_crops``.
    """

    def __init__(self, tokenizer, max_model_len: int, default_num_crops: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.default_num_crops = default_num_crops

    def count(self, request: ChatRequest, sizes: list[tuple[int, int]]) -> PromptCount:
        """Tokens of ``request`` whose images (in order) have pixel ``sizes``."""
        messages, k = [], 0
        for message in request.body["messages"]:
            content = message["content"]
            if isinstance(content, str):
                messages.append({"role": message["role"], "content": content})
                continue
            texts = [p["text"] for p in content if p["type"] == "text"]
            n_img = sum(1 for p in content if p["type"] == "image_url")
            placeholders = [f"<|image_{k + i + 1}|>" for i in range(n_img)]
            k += n_img
            messages.append({"role": message["role"],
                             "content": "\n".join(placeholders + texts)})
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        placeholder_ids = sum(len(self.tokenizer.encode(f"<|image_{i + 1}|>",
                                                        add_special_tokens=False))
                              for i in range(k))
        text = len(ids) - placeholder_ids - (1 if k else 0)
        crops = request.num_crops or self.default_num_crops
        image = sum(image_tokens(w, h, crops) for w, h in sizes)
        return PromptCount(text, image, k)

    def check(self, request: ChatRequest, sizes: list[tuple[int, int]]) -> PromptCount:
        """Raise a 400 with the real counts when the prompt (plus ``max_tokens``, if given)
        exceeds ``max_model_len``."""
        count = self.count(request, sizes)
        body = request.body
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        detail = (f"the prompt is {count.total} tokens ({count.text} text + {count.image} "
                  f"image tokens for {count.images} image(s))")
        if count.total >= self.max_model_len:
            raise IntakeError(400, f"{detail}; the model's context (max_model_len) is "
                              f"{self.max_model_len} tokens. Send fewer or smaller images, a "
                              "lower num_crops, or shorter text.", "messages",
                              code="context_length_exceeded")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) \
                and count.total + max_tokens > self.max_model_len:
            raise IntakeError(400, f"{detail} + max_tokens {max_tokens} = "
                              f"{count.total + max_tokens} exceeds max_model_len "
                              f"{self.max_model_len}", "max_tokens",
                              code="context_length_exceeded")
        return count
