"""The fits: how many requests the engine holds under each constraint, from measured signals.

Pure arithmetic (standard library only), each fit a function of what was measured and the
target it serves. The controller (:mod:`serve.admission.controller`) decides which fits
bound which move; nothing here keeps state.

- :func:`kv_fit`: the running batch extrapolated to the KV-cache threshold (bounds a probe);
- :func:`kv_size_fit`: requests of the traffic's mean size that fill the KV cache to the
  threshold (bounds the idle limit);
- :func:`prefill_budget`: prompt tokens prefilled within the TTFT target.
"""

from __future__ import annotations

import math


def kv_fit(running: int, kv_cache_usage: float, kv_high_ratio: float) -> int | None:
    """Sequences the KV cache holds below ``kv_high_ratio`` at the current mix, or None when
    unknown (nothing running, no usage reported).

    ``running x kv_high_ratio / kv_cache_usage``: the running sequences' mean share of the
    cache, extrapolated (requests; usage and ratio 0-1). Past it vLLM preempts (recompute).
    """
    if running <= 0 or kv_cache_usage <= 0:
        return None
    return math.floor(running * kv_high_ratio / kv_cache_usage)


def kv_size_fit(kv_tokens: int, kv_high_ratio: float,
                mean_request_tokens: float | None) -> int | None:
    """Requests of ``mean_request_tokens`` (prompt + generated, tokens) that fill a KV cache
    of ``kv_tokens`` to ``kv_high_ratio``, or None before any request finished."""
    if not mean_request_tokens:
        return None
    return math.floor(kv_tokens * kv_high_ratio / mean_request_tokens)


def prefill_budget(prefill_tokens_per_s: float | None, ttft_target_s: float) -> int | None:
    """Prompt tokens the engine prefills within the TTFT target at the rate it showed
    (tokens/s x seconds), or None before a rate is known."""
    if not prefill_tokens_per_s:
        return None
    return math.floor(prefill_tokens_per_s * ttft_target_s)

