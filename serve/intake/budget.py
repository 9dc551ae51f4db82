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
from serve.intake.request import GenerationRequest, is_token_ids
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

    Exact counting renders the chat template and tokenizes (milliseconds of CPU, the same work
    vLLM then does again), so :meth:`check` first tries a cheap upper bound and counts only
    when the bound does not already prove the prompt fits. The bound: a text token never
    covers less than one byte (byte-level BPE, and SentencePiece with byte fallback, as Phi-3's
    tokenizer; user text cannot form special tokens once neutralised), plus two tokens per
    text segment (a SentencePiece dummy prefix, the newline joining segments), plus the
    template's own tokens measured once at start (:attr:`fixed_tokens` per prompt,
    :attr:`message_tokens` per message, with a margin).

    Args:
        tokenizer: a Hugging Face tokenizer with the model's chat template.
        max_model_len: context length, tokens.
        default_num_crops: the server's ``num_crops``.
    """

    #: Extra tokens per message added to the measured template overhead (a safety margin for
    #: templates whose markup depends on the content).
    MESSAGE_MARGIN = 8
    #: English prose whose UTF-8 bytes per token (:attr:`bytes_per_token`) scale a prompt's
    #: text for :meth:`estimate` (the opening of the Universal Declaration of Human Rights,
    #: public text: a fixed sample measured once per tokenizer).
    SAMPLE_TEXT = ("Whereas recognition of the inherent dignity and of the equal and inalienable "
                   "rights of all members of the human family is the foundation of freedom, "
                   "justice and peace in the world, whereas disregard and contempt for human "
                   "rights have resulted in barbarous acts which have outraged the conscience "
                   "of mankind, and the advent of a world in which human beings shall enjoy "
                   "freedom of speech and belief and freedom from fear and want has been "
                   "proclaimed as the highest aspiration of the common people.")

    def __init__(self, tokenizer, max_model_len: int, default_num_crops: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.default_num_crops = default_num_crops
        empty = self._template_tokens([{"role": "user", "content": ""}])
        self.fixed_tokens = empty
        self.message_tokens = self.MESSAGE_MARGIN + max(
            self._template_tokens([{"role": "user", "content": ""},
                                   {"role": role, "content": ""}]) - empty
            for role in ("system", "user", "assistant"))
        sample = tokenizer.encode(self.SAMPLE_TEXT, add_special_tokens=False)
        self.bytes_per_token = len(self.SAMPLE_TEXT.encode()) / max(1, len(sample))

    def _template_tokens(self, messages: list[dict]) -> int:
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))

    def text_token_bound(self, request: GenerationRequest) -> int:
        """An upper bound of the text tokens of ``request`` (see the class docstring)."""
        total = self.fixed_tokens
        for message in request.messages:
            content = message["content"]
            texts = [content] if isinstance(content, str) else [
                p["text"] if p["type"] == "text" else "<|image_1000|>\n" for p in content]
            total += self.message_tokens + sum(len(t.encode()) + 2 for t in texts)
        return total

    def estimate(self, request: GenerationRequest, sizes: list[tuple[int, int]] = ()) -> int:
        """About how many prompt tokens ``request`` brings to the engine, for the admission
        of a burst by prefill budget (``serve.admission.limiter.SlotCounter.admits``);
        microseconds, no tokenizing (vLLM tokenizes the prompt once, itself).

        Images exact (the HD transform formula at the request's ``num_crops``, for the pixel
        ``sizes`` of its images in order); text as its UTF-8 bytes over
        :attr:`bytes_per_token` (this tokenizer's on English prose), plus the template's
        tokens as in the upper bound. A raw completions prompt: its token ids as given, or
        its text likewise. 0 when the prompt is neither (unknown: admitted by count).
        """
        crops = request.num_crops or self.default_num_crops
        image = sum(image_tokens(w, h, crops) for w, h in sizes)
        if request.messages is None:
            prompt = request.body.get(request.prompt_field)
            if isinstance(prompt, list) and len(prompt) == 1 and not is_token_ids(prompt):
                prompt = prompt[0]  # a batch of one (check_one_prompt refuses more)
            if isinstance(prompt, str):
                return round(len(prompt.encode()) / self.bytes_per_token) + 1
            if is_token_ids(prompt):
                return len(prompt)
            return 0
        total, text_bytes = self.fixed_tokens, 0
        for message in request.messages:
            content = message["content"]
            total += self.message_tokens
            if isinstance(content, str):
                text_bytes += len(content.encode())
            else:
                text_bytes += sum(len(p["text"].encode()) for p in content if p["type"] == "text")
        return total + round(text_bytes / self.bytes_per_token) + image

    def count(self, request: GenerationRequest, sizes: list[tuple[int, int]]) -> PromptCount:
        """Tokens of ``request`` whose images (in order) have pixel ``sizes``."""
        messages, k = [], 0
        for message in request.messages:
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

    def fits(self, request: GenerationRequest, sizes: list[tuple[int, int]] = ()) -> bool:
        """True when the upper bound (class docstring) of the prompt plus ``max_tokens`` (at
        least one answer token) is within ``max_model_len``: no exact count needed."""
        answer = request.answer_tokens()[1] or 0
        crops = request.num_crops or self.default_num_crops
        bound = self.text_token_bound(request) + sum(image_tokens(w, h, crops)
                                                     for w, h in sizes)
        return bound + max(answer, 1) <= self.max_model_len

    def check(self, request: GenerationRequest, sizes: list[tuple[int, int]]) -> PromptCount | None:
        """Raise a 400 with the real counts when the prompt (plus ``max_tokens``, if given)
        exceeds ``max_model_len``.

        Returns:
            the exact count, or None when the upper bound already proved that it fits.
        """
        if self.fits(request, sizes):
            return None
        field, max_tokens = request.answer_tokens()
        count = self.count(request, sizes)
        detail = (f"the prompt is {count.total} tokens ({count.text} text + {count.image} "
                  f"image tokens for {count.images} image(s))")
        if count.total >= self.max_model_len:
            raise IntakeError(400, f"{detail}; the model's context (max_model_len) is "
                              f"{self.max_model_len} tokens. Send fewer or smaller images, a "
                              "lower num_crops, or shorter text.", request.prompt_field,
                              code="context_length_exceeded")
        if max_tokens is not None and count.total + max_tokens > self.max_model_len:
            if request.default_max_tokens:  # the server's default: fit it to the context
                request.body[field] = self.max_model_len - count.total
                return count
            raise IntakeError(400, f"{detail} + {field} {max_tokens} = "
                              f"{count.total + max_tokens} exceeds max_model_len "
                              f"{self.max_model_len}", field,
                              code="context_length_exceeded")
        return count
