"""Measure the engine's prefill costs at boot (:class:`serve.admission.prefill.PrefillCosts`).

Three kinds of prompt are prefilled alone on the idle engine, each with ``max_tokens=1``:
a short text, a long text and an image (a photo-sized image of noise and a short question),
twice each; the shortest time to the first token of each kind goes into
:meth:`PrefillCosts.from_probes`. Every probe prompt is new to the engine (random token ids,
a fresh random image), so neither the prefix cache nor the multimodal cache shortens it. The
probes run before the server reports ready; they cost a few prefills (well under a second
on a GPU, a few seconds on a CPU).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import TYPE_CHECKING

from serve.admission.prefill import PrefillCosts

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("serve.admission.probe")

#: Prompt lengths of the text probes, tokens (the long one at most one engine step's
#: ``max_num_batched_tokens``, so that each probe is one step).
SHORT_TOKENS, LONG_TOKENS = 16, 1024
#: The image probe's size, pixels: Phi-3-vision's 336-pixel crop, one crop and the global
#: view (``serve.intake.budget.image_tokens``).
IMAGE_SIDE = 336
#: Token ids of the random text prompts are drawn from this range (ordinary vocabulary of
#: the Llama/Phi-3 tokenizer, away from its special tokens at the ends).
TOKEN_IDS = (1_000, 20_000)
#: Runs of each probe; the shortest counts (the first of a kind may pay one-off warm-ups).
RUNS = 2
#: Phi-3-vision's chat format with one image (the model card's).
IMAGE_PROMPT = "<|user|>\n<|image_1|>\nWhat is shown?<|end|>\n<|assistant|>\n"


async def _first_token_s(engine: "AsyncLLM", prompt: dict) -> tuple[float, int]:
    """Seconds from submitting ``prompt`` to its first token, and its prompt tokens as the
    engine counted them."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    async for output in engine.generate(prompt, params, request_id=f"probe-{uuid.uuid4().hex}"):
        return time.perf_counter() - start, len(output.prompt_token_ids or ())
    raise RuntimeError("the engine returned no output for a probe")


async def measure(engine: "AsyncLLM", num_crops: int, step_tokens: int) -> PrefillCosts:
    """The engine's :class:`PrefillCosts`, from probes (module docstring).

    Args:
        engine: the started vLLM engine, idle.
        num_crops: the image processor's ``num_crops`` (the image probe's image tokens).
        step_tokens: the engine's ``max_num_batched_tokens`` (bounds the long probe).

    Raises:
        whatever the engine raises for a probe; ValueError from
        :meth:`PrefillCosts.from_probes` when the probes cannot be told apart.
    """
    import numpy as np
    from PIL import Image

    from serve.intake.budget import image_tokens

    rng = random.Random()
    long_tokens = max(SHORT_TOKENS + 1, min(LONG_TOKENS, step_tokens or LONG_TOKENS))

    def text(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(*TOKEN_IDS) for _ in range(n)]}

    def image() -> dict:
        pixels = np.random.default_rng(rng.randrange(2**32)).integers(
            0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
        return {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": Image.fromarray(pixels)}}

    best: dict[str, tuple[float, int]] = {}
    for _ in range(RUNS):
        for kind, make in (("short", lambda: text(SHORT_TOKENS)),
                           ("long", lambda: text(long_tokens)), ("image", image)):
            seconds, tokens = await _first_token_s(engine, make())
            if kind not in best or seconds < best[kind][0]:
                best[kind] = (seconds, tokens)
    image_toks = image_tokens(IMAGE_SIDE, IMAGE_SIDE, num_crops)
    costs = PrefillCosts.from_probes(
        (SHORT_TOKENS, best["short"][0]), (long_tokens, best["long"][0]),
        (max(best["image"][1], image_toks), image_toks, best["image"][0]))
    log.info("prefill costs: %.1f ms a step, %.3f ms a prompt token, %.3f ms more an image "
             "token (probes: %d, %d and %d-token prompts, %.3f / %.3f / %.3f s)",
             costs.step_s * 1e3, costs.token_s * 1e3, costs.image_token_s * 1e3,
             SHORT_TOKENS, long_tokens, best["image"][1], best["short"][0], best["long"][0],
             best["image"][0])
    return costs
