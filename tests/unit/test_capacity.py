"""KV-safe capacity arithmetic (``serve.admission.capacity``), against the token formula."""

from __future__ import annotations

import json

import pytest

from serve.admission.capacity import (
    TEXT_TOKENS_PER_REQUEST,
    kv_safe_seqs,
    max_image_tokens,
    tokens_per_request,
)
from serve.intake.budget import image_tokens
from serve.settings import Settings


def test_max_image_tokens_is_the_worst_aspect_of_the_hd_transform():
    assert max_image_tokens(1) == image_tokens(4032, 3024, 1) == 313
    assert max_image_tokens(16) == image_tokens(336, 16 * 336, 16) == 2653  # a 1:16 strip
    for crops in (1, 2, 4, 9, 16):
        sizes = [(w, h) for w in range(100, 6000, 97) for h in (50, 336, 1000, 3000, 5376)]
        assert max(image_tokens(w, h, crops) for w, h in sizes) <= max_image_tokens(crops)
    with pytest.raises(ValueError):
        max_image_tokens(0)


def test_kv_safe_seqs_divides_and_clamps():
    per = tokens_per_request(16)
    assert per == 2653 + TEXT_TOKENS_PER_REQUEST
    assert kv_safe_seqs(10 * per + per // 2, 16, 256) == 10
    assert kv_safe_seqs(10**9, 1, 32) == 32  # the CPU tiny model: the ceiling binds
    assert kv_safe_seqs(0, 16, 256) == 1


def test_auto_starts_at_the_kv_safe_capacity_unless_a_limit_is_set():
    from serve.admission.service import Admission
    from serve.settings import Settings

    per = tokens_per_request(1)
    auto = Admission.from_settings(Settings(device="cpu"))
    assert auto.limiter.limit == 32  # the ceiling until the engine reports its KV cache
    assert auto.apply_kv_capacity(Settings(device="cpu"), 5 * per) == 5
    assert auto.limiter.limit == auto.loop.controller.start == 5
    assert auto.apply_kv_capacity(Settings(device="cpu"), None) is None  # unknown: unchanged
    explicit = Settings(device="cpu", admission_limit=3)
    pinned = Admission.from_settings(explicit)
    assert pinned.apply_kv_capacity(explicit, 5 * per) == 5 and pinned.limiter.limit == 3
    static = Settings(device="cpu", autotune="static")
    fixed = Admission.from_settings(static)
    assert fixed.apply_kv_capacity(static, 5 * per) == 5 and fixed.limiter.limit == 32


def test_settings_are_resolved_once_and_remember_an_explicit_limit():
    resolved = Settings(device="cpu").resolved()
    assert resolved.resolved() is resolved and resolved.admission_limit == 32
    assert not resolved.admission_limit_explicit
    pinned = Settings(device="cpu", admission_limit=4).resolved()
    assert pinned.admission_limit_explicit and pinned.resolved().admission_limit == 4


def test_autotuner_state_reports_the_limiter():
    """``GET /admin/autotuner``'s body, built without an engine."""
    from serve.admission.service import Admission

    state = Admission.from_settings(Settings(device="cpu")).loop.state()
    # No completion rate yet: the engine queue (32 at most) holds none.
    assert state["limit"] == state["capacity"] == state["engine_queue"] == 32
    assert state["in_flight"] == state["pending"] == 0 and state["mode"] == "auto"
    json.dumps(state)  # serialisable as the route returns it


def test_the_boot_figure_is_kept_for_the_autotuner_route():
    """``apply_kv_capacity`` records what ``GET /admin/autotuner`` shows as ``kv_capacity``."""
    from serve.admission.service import Admission

    admission = Admission.from_settings(Settings(device="cpu"))
    assert admission.kv_capacity is None  # until the engine reports its KV cache
    engine_kv = {"num_gpu_blocks": 1024, "block_size": 128, "kv_cache_tokens": 131072,
                 "kv_cache_memory_bytes": 256 * 2**20}
    assert admission.apply_kv_capacity(Settings(device="cpu"), 131072, engine_kv) == 32
    kv = admission.kv_capacity
    assert kv == {**engine_kv, "source": kv["source"], "num_crops": 1,
                  "tokens_per_request": 313 + TEXT_TOKENS_PER_REQUEST, "max_num_seqs": 32,
                  "kv_safe_seqs": 32}
    assert "kv_cache_memory_bytes" in kv["source"]
    json.dumps(kv)
